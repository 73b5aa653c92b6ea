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

from fastckpt.errors import CheckpointChangedError, FormatError, IntegrityError
from fastckpt.formats.contract import MultiFileReader, tensor_not_found
from fastckpt.formats.reader import TensorFile, open_file
from fastckpt.info import TensorInfo, from_checked_fields
from fastckpt.store.snapshot import Snapshot
from fastckpt.train.format import MANIFEST_FILE, read_manifest

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
        self.files: dict[str, TensorFile] = {}
        # One commit: the manifest through the pinned directory, each file it lists pinned; the hashes checked by
        # path, then the directory and every file found unchanged; each file mapped and checked against its pin.
        self.snapshot = Snapshot(self.path, record=MANIFEST_FILE, what="training checkpoint")
        infos: dict[str, TensorInfo] = {}
        where: dict[str, tuple] = {}
        metadata: dict[str, str] = {}
        try:
            self.manifest = read_manifest(self.path, snapshot=self.snapshot)
            for file_name in self.manifest["files"]:
                try:
                    self.snapshot.pin(file_name)
                except FormatError as exc:  # missing or not a plain file: the check below names it
                    if isinstance(exc, CheckpointChangedError) or not verify:
                        raise
            if verify:  # every size and hash before any file opens; then the files hashed must be those pinned
                from fastckpt.train.checkpoint import verify_checkpoint

                problems = verify_checkpoint(self.path)
                change = self.snapshot.changed()
                if change is not None:
                    raise CheckpointChangedError(f"{self.path}: {change}; the checkpoint changed while it was opened "
                                                 "(replaced by a save with overwrite=True): open it again")
                if problems:
                    raise IntegrityError.of(self.path, problems)
                for file_name in self.manifest["files"]:
                    self.snapshot.recheck(file_name)
            for file_name in self.manifest["files"]:
                stem, suffix = os.path.splitext(file_name)
                if suffix not in (".safetensors", ".npz"):
                    continue
                f = self.files[stem] = open_file(os.path.join(self.path, file_name), backend=backend,
                                                 copy_on_write=copy_on_write, max_header_size=max_header_size)
                self.snapshot.check(file_name, f.mapped.identity)
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

    def close(self) -> None:
        """Close every file and the pinned directory (idempotent); views already made stay valid."""
        snapshot = getattr(self, "snapshot", None)
        if snapshot is not None:
            snapshot.close()
        super().close()

    def __repr__(self) -> str:
        if self._closed:
            return "<Closed fastckpt.CheckpointDirectory>"
        return f"<fastckpt.CheckpointDirectory {self.path!r} files={list(self.files)} tensors={len(self)}>"
