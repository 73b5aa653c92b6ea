"""Chains of delta checkpoints: following ``base`` links, and retention that keeps what is needed.

A delta checkpoint (format version 2, :mod:`fastckpt.sharded.format`) holds
what changed since its base; the base may be a delta too, down to a full
checkpoint. :func:`resolve_chain` follows the links from a head and checks
each one; :func:`prune` removes old checkpoints of a directory but never one that a kept
checkpoint's chain needs. Folding a chain into one full checkpoint
(:func:`fastckpt.sharded.reshard.compact`) sits above the loader and the saver it
uses, which both use this module.

>>> import numpy as np, tempfile, os
>>> from fastckpt.sharded import HashTable, Saver
>>> d = tempfile.mkdtemp(); t = HashTable(dim=1); t.insert(np.arange(4), np.zeros((4, 1), np.float32))
>>> _ = Saver(path=os.path.join(d, "step-1"), parallel=1, hashtables={"emb": t}).save()
>>> t.update([2], [[5.0]])
>>> _ = Saver(path=os.path.join(d, "step-2"), parallel=1, hashtables={"emb": t}, incremental=True).save()
>>> [os.path.basename(p) for p, _ in resolve_chain(os.path.join(d, "step-2"))]
['step-1', 'step-2']
>>> [os.path.basename(p) for p in prune(d, keep_last=1)]  # step-1 stays: step-2 needs it
[]
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import blake3

from fastckpt.errors import BrokenChainError, CheckpointNotFoundError, FormatError
from fastckpt.store.commit import fsync_directory
from fastckpt.sharded.format import FORMAT, MANIFEST_FILE, read_metadata

__all__ = ["BrokenChainError", "manifest_digest", "resolve_chain", "checkpoints", "needed", "prune"]

_MAX_LINKS = 100_000





def manifest_digest(directory: str | os.PathLike) -> str:
    """The BLAKE3 (hex) of a checkpoint's ``manifest.json`` bytes: what a delta records of its base.

    >>> manifest_digest("/nonexistent")
    Traceback (most recent call last):
    FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/manifest.json'
    """
    with open(os.path.join(os.fspath(directory), MANIFEST_FILE), "rb") as f:
        return blake3.blake3(f.read()).hexdigest()


def base_directory(directory: str | os.PathLike, manifest: dict) -> str:
    """The absolute base directory a delta's manifest names (relative to the delta's own directory)."""
    return os.path.normpath(os.path.join(os.path.abspath(os.fspath(directory)), *manifest["base"]["path"].split("/")))


def relative_base(delta: str | os.PathLike, base: str | os.PathLike) -> str:
    """The ``base.path`` a delta at ``delta`` stores for ``base``: relative, ``/``-separated.

    >>> relative_base("/c/step-2", "/c/step-1")
    '../step-1'
    """
    return Path(os.path.relpath(os.path.abspath(base), os.path.abspath(delta))).as_posix()


def resolve_chain(path: str | os.PathLike, *, opening: bool = False) -> list[tuple[str, dict]]:
    """``[(directory, manifest), ...]`` from the full checkpoint to ``path``, every link checked.

    A full checkpoint is a chain of one. A missing, uncommitted or altered base raises
    :class:`BrokenChainError` naming the link and the base. ``opening=True``: the caller opens the head next
    with a reader, which reads and checks its metadata files; where this process checked the head's manifest
    bytes before, only its ``manifest.json`` is read here (:func:`~fastckpt.sharded.format.read_metadata`'s
    ``manifest_only``), rather than its four files once here and again by the reader.
    """
    head = os.path.abspath(os.fspath(path))
    chain = [(head, read_metadata(head, manifest_only=opening)["manifest"])]
    seen = {head}
    while chain[-1][1].get("kind") == "delta":
        link, manifest = chain[-1]
        base = base_directory(link, manifest)
        where = f"{link}: its base {base} (link {len(chain)} of the chain of {head})"
        if base in seen or len(chain) > _MAX_LINKS:
            raise BrokenChainError(f"{where} loops back into the chain", link, base)
        try:
            base_manifest = read_metadata(base)["manifest"]
            digest = manifest_digest(base)
        except CheckpointNotFoundError:
            raise BrokenChainError(f"{where} is missing or was never committed; restore it, or load a full "
                                   f"checkpoint saved before it", link, base) from None
        except FormatError as exc:
            raise BrokenChainError(f"{where} is damaged: {exc}", link, base) from None
        if digest != manifest["base"]["manifest_blake3"]:
            raise BrokenChainError(f"{where} has a manifest.json with BLAKE3 {digest[:16]}..., the delta was saved "
                                   f"on {manifest['base']['manifest_blake3'][:16]}...: the base was replaced or "
                                   f"altered after the delta was saved", link, base)
        expected = manifest["chain_length"] - 1
        if base_manifest.get("chain_length", 0) != expected:
            raise BrokenChainError(f"{where} has chain_length {base_manifest.get('chain_length', 0)}, expected "
                                   f"{expected}", link, base)
        seen.add(base)
        chain.append((base, base_manifest))
    return chain[::-1]


def checkpoints(directory: str | os.PathLike) -> list[str]:
    """The committed sharded checkpoints directly in ``directory``, oldest commit first (``manifest.json``'s
    modification time, then the name). A symbolic link to a checkpoint elsewhere is not one of them.

    >>> import tempfile; checkpoints(tempfile.mkdtemp())
    []
    """
    found = []
    with os.scandir(os.fspath(directory)) as it:
        for entry in it:
            manifest = os.path.join(entry.path, MANIFEST_FILE)
            if entry.is_dir(follow_symlinks=False) and not entry.name.startswith(".") and os.path.isfile(manifest):
                try:
                    if read_metadata(entry.path)["manifest"]["format"] == FORMAT:
                        found.append((os.stat(manifest).st_mtime_ns, entry.name, os.path.abspath(entry.path)))
                except FormatError:
                    continue
    return [path for *_, path in sorted(found)]


def needed(heads: list[str | os.PathLike]) -> set[str]:
    """Every directory the checkpoints ``heads`` need: themselves and their chains' bases (absolute paths)."""
    out: set[str] = set()
    for head in heads:
        out.update(path for path, _ in resolve_chain(head))
    return out


def prune(directory: str | os.PathLike, keep_last: int) -> list[str]:
    """Remove the committed sharded checkpoints of ``directory`` except the newest ``keep_last`` and every base
    their chains need; returns the removed paths, oldest first.

    A checkpoint is uncommitted first (its ``manifest.json`` removed and the directory synced), then deleted,
    so a crash part-way never leaves something that reads as a checkpoint. A kept checkpoint whose chain is
    broken raises :class:`BrokenChainError` and nothing is removed. Symbolic links are never followed: a link
    in ``directory`` is no checkpoint of it (what it points to is never touched), and a checkpoint a kept chain
    reaches through a link is kept.

    >>> import tempfile; prune(tempfile.mkdtemp(), keep_last=1)
    []
    """
    if type(keep_last) is not int or keep_last < 1:
        raise ValueError(f"keep_last must be a positive int, got {keep_last!r}")
    found = checkpoints(directory)
    keep = {os.path.realpath(path) for path in needed(found[-keep_last:])}
    removed = []
    for path in found:
        if os.path.realpath(path) in keep or os.path.islink(path):  # a link swapped in since the listing: never
            continue
        os.unlink(os.path.join(path, MANIFEST_FILE))
        fsync_directory(path)
        shutil.rmtree(path)
        removed.append(path)
    if removed:
        fsync_directory(os.fspath(directory))
    return removed
