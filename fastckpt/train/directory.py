"""A training-checkpoint directory as one tensor reader of the contract: ``fastckpt.open(directory)``.

:func:`fastckpt.open` finds this reader through
:data:`fastckpt.formats.reader.DIRECTORY_READERS` (a directory with a
``manifest.json``); the directory format is :mod:`fastckpt.train.format`.

>>> import fastckpt, tempfile, os
>>> from fastckpt.train import TinyLM, save_checkpoint
>>> out = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=3)
>>> type(fastckpt.open(out)).__name__
'CheckpointDirectory'
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Mapping

import numpy as np

from fastckpt.errors import IntegrityError
from fastckpt.formats.contract import MultiFileReader, tensor_not_found
from fastckpt.formats.reader import TensorFile, open_file
from fastckpt.info import TensorInfo, from_checked_fields
from fastckpt.train.format import read_manifest

__all__ = ["CheckpointDirectory"]


class CheckpointDirectory(MultiFileReader):
    """A :mod:`fastckpt.train` checkpoint directory as one reader: the tensors of all its tensor files.

    Obtain one with :func:`fastckpt.open` (or construct it with the options of
    :func:`open`). It implements the reader contract
    (:class:`~fastckpt.formats.contract.TensorReader`) over the NPZ and safetensors
    files its ``manifest.json`` lists (``weights.safetensors``, and
    ``optim.safetensors`` when an optimizer was saved), each opened once as a
    :class:`TensorFile` (``files``: file stem -> file):

    - tensor names are ``"<file stem>/<tensor name>"`` (``"weights/fc1.weight"``,
      ``"optim/state.0.m"``), file after file in the manifest's order, each
      file's tensors in its own order; ``info`` gives the file's
      :class:`~fastckpt.TensorInfo` under that name (``offset`` within its file);
    - ``metadata`` holds every file's metadata the same way
      (``"weights/fastckpt.tree"``); tied weights are stored once, the other
      names being ``ALIAS(<target>)`` metadata entries, not tensors;
    - ``manifest`` is the parsed ``manifest.json``;
    - ``close()`` closes every file.

    Every file's size and hash are checked against the manifest first
    (:func:`fastckpt.train.verify_checkpoint`), as every loader of a checkpoint
    with a manifest does by default: a mismatch raises
    :class:`~fastckpt.errors.IntegrityError` naming the file; ``verify=False``
    skips the check for speed. Only the tensors are read: the optimizer,
    scheduler, data and RNG states are restored by
    :func:`fastckpt.train.load_checkpoint`.

    >>> import fastckpt, tempfile, os
    >>> from fastckpt.train import TinyLM, save_checkpoint
    >>> out = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=3)
    >>> with fastckpt.open(out) as r:
    ...     r.format, list(r.files), r.info("weights/embed.weight").shape, r.manifest["step"]
    ('fastckpt.train.checkpoint', ['weights'], (8, 4), 3)
    """

    format = "fastckpt.train.checkpoint"

    def __init__(self, path: str | os.PathLike, *, backend: str = "mmap", copy_on_write: bool = False,
                 max_header_size: int | None = None, verify: bool = True):
        self.path = os.fspath(path)
        self.manifest = read_manifest(self.path)
        if verify:
            from fastckpt.train.checkpoint import verify_checkpoint

            problems = verify_checkpoint(self.path)
            if problems:
                raise IntegrityError.of(self.path, problems)
        self.files: dict[str, TensorFile] = {}
        infos: dict[str, TensorInfo] = {}
        where: dict[str, tuple] = {}
        metadata: dict[str, str] = {}
        try:
            for file_name in self.manifest["files"]:
                stem, suffix = os.path.splitext(file_name)
                if suffix not in (".safetensors", ".npz"):
                    continue
                f = self.files[stem] = open_file(os.path.join(self.path, file_name), backend=backend,
                                                 copy_on_write=copy_on_write, max_header_size=max_header_size)
                for inner, info in f.infos.items():
                    name = f"{stem}/{inner}"
                    infos[name] = from_checked_fields(type(info), {**info.__dict__, "name": name})
                    where[name] = (f, inner)
                for key, value in (f.metadata or {}).items():
                    metadata[f"{stem}/{key}"] = value
        except BaseException:
            self.close()
            raise
        self.infos: Mapping[str, TensorInfo] = MappingProxyType(infos)
        self.metadata: dict[str, str] | None = metadata or None
        self._where = where
        self._closed = False

    def host(self, name: str) -> np.ndarray:
        """The tensor as its file's :meth:`TensorFile.host` gives it (a zero-copy read-only view where stored)."""
        try:
            f, inner = self._where[name]
        except KeyError:
            raise tensor_not_found(self.path, name, self.infos) from None
        return f.host(inner)

    def __repr__(self) -> str:
        if self._closed:
            return "<Closed fastckpt.CheckpointDirectory>"
        return f"<fastckpt.CheckpointDirectory {self.path!r} files={list(self.files)} tensors={len(self)}>"
