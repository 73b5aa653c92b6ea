"""File hashes for manifests: hashers fed while writing, and hashes of a read-only mapping, in one call.

Writers hash a file from its bytes as they go out (``new_hasher`` given to
``GatherWriter`` or ``save_safetensors(hasher=)``); verification hashes a
mapping of the file. BLAKE3 (the default of training and sharded
checkpoints), through the ``blake3`` package on every core, runs at about
7 GB/s here; sha256 (training checkpoints of schema 1.0, and
``hash="sha256"``) at about 1.8 GB/s on one core.

>>> import tempfile, os
>>> p = os.path.join(tempfile.mkdtemp(), "x.bin")
>>> _ = open(p, "wb").write(b"abc")
>>> sha256_file(p)
('ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad', 3)
>>> blake3_file(p)
('6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85', 3)
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["HASH_ALGORITHMS", "new_hasher", "blake3_hasher", "hash_buffer", "hash_file", "sha256_file",
           "blake3_file", "blake3_mapped", "HASH_PIECE"]

# The file hashes a manifest may name, the default first.
HASH_ALGORITHMS = ("blake3", "sha256")

# BLAKE3 on several threads runs on a thread pool (Rust's rayon) that does not survive fork(): in a child forked after
# the parent's pool started, a hash on it waits forever (a verified load in a worker forked after a load in the
# parent hung). Every multi-threaded BLAKE3 hasher is made by blake3_hasher, which knows whether this process is such
# a child, and hashes on one thread there.
_pool_started = False
_pool_lost = False


def _forked() -> None:
    global _pool_lost
    _pool_lost = _pool_lost or _pool_started


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def blake3_hasher(data=b"", *, threads: int | None = None):
    """A BLAKE3 hasher fed ``data``, hashing on ``threads`` threads (None: every core, ``blake3.AUTO``), or on one in
    a child forked after this process's hashing threads started, where they are gone.

    >>> blake3_hasher(b"abc", threads=4).hexdigest()[:16]
    '6437b3ac38465133'
    """
    global _pool_started
    import blake3

    if _pool_lost or threads == 1:
        return blake3.blake3(data, max_threads=1)
    _pool_started = True
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO if threads is None else max(1, int(threads)))


def new_hasher(algorithm: str, *, spare_cores: int = 0):
    """A fresh hasher (``update(buffer)``, ``hexdigest()``) for ``"blake3"`` (on every core) or ``"sha256"``.

    ``spare_cores`` leaves that many cores to other work (a reader copying
    tensors out while the file is hashed): BLAKE3 then uses the others, at
    least one.

    >>> h = new_hasher("blake3"); _ = h.update(b"abc"); h.hexdigest()[:16]
    '6437b3ac38465133'
    >>> new_hasher("md5")
    Traceback (most recent call last):
    ...
    ValueError: unknown hash algorithm 'md5'; choose one of 'blake3', 'sha256'
    """
    if algorithm == "blake3":
        return blake3_hasher(threads=None if spare_cores <= 0 else max(1, _usable_cores() - spare_cores))
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash algorithm {algorithm!r}; choose one of "
                     + ", ".join(repr(a) for a in HASH_ALGORITHMS))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def hash_buffer(data, algorithm: str, *, spare_cores: int = 0) -> str:
    """The hex hash of a buffer (bytes, memoryview, a mapping's view) in one call; BLAKE3 uses every core.

    ``spare_cores`` as for :func:`new_hasher`.

    >>> hash_buffer(b"abc", "sha256")[:16]
    'ba7816bf8f01cfea'
    >>> hash_buffer(b"abc", "blake3", spare_cores=1) == hash_buffer(b"abc", "blake3")
    True
    """
    hasher = new_hasher(algorithm, spare_cores=spare_cores)
    hasher.update(data)
    return hasher.hexdigest()


def hash_file(path: str | os.PathLike, algorithm: str) -> tuple[str, int]:
    """``(hex hash, size)`` of a file, hashed from a read-only mapping; ``algorithm`` as for :func:`new_hasher`.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x.bin"); _ = open(p, "wb").write(b"abc")
    >>> hash_file(p, "blake3") == blake3_file(p)
    True
    """
    if algorithm == "sha256":
        return sha256_file(path)
    if algorithm == "blake3":
        return blake3_file(path)
    new_hasher(algorithm)  # raises, naming the algorithms there are
    raise AssertionError(algorithm)


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """``(hex sha256, size)`` of a file (e.g. ``sha256_file("ckpt/weights.safetensors")``).

    Hashes a read-only mapping in one call (hashlib releases the GIL), which
    saves the copy a ``read()`` into a buffer would make; right after a save
    the pages are in the page cache. A file truncated meanwhile is a
    :class:`~fastckpt.errors.FormatError` (``MappedFile.guard``), not SIGBUS.
    """
    from fastckpt._native.mapped import MappedFile

    size = os.path.getsize(path)
    if size == 0:
        return hashlib.sha256(b"").hexdigest(), 0
    with MappedFile(path) as m, m.guard("it for its sha256"):
        return hashlib.sha256(m.view(0, m.size)).hexdigest(), m.size


# A mapping is hashed in pieces of this size: ``drop`` lets go of each piece's pages once hashed, so no whole file is
# resident in the process.
HASH_PIECE = 64 << 20


def blake3_mapped(mapped, *, drop: bool = False) -> str:
    """The hex BLAKE3 of open file ``mapped`` (a :class:`~fastckpt._native.mapped.MappedFile`), on every core, in
    pieces of ``HASH_PIECE``; a file truncated meanwhile is a :class:`~fastckpt.errors.FormatError`, not SIGBUS.
    ``drop``: let go of each piece's pages once hashed (for a mapping that is not copy-on-write: they stay in the
    page cache, out of this process's resident set; a verified sharded load's peak RSS counted every byte of every
    file it hashed on top of the rows it loaded)."""
    hasher = blake3_hasher()
    with mapped.guard("it for its BLAKE3"):
        for offset in range(0, mapped.size, HASH_PIECE):
            length = min(HASH_PIECE, mapped.size - offset)
            hasher.update(mapped.view(offset, length))
            if drop:
                mapped.advise("dontneed", offset, length)
    return hasher.hexdigest()


def blake3_file(path: str | os.PathLike) -> tuple[str, int]:
    """``(hex BLAKE3, size)`` of a file, hashed from a read-only mapping on every core.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "empty"); _ = open(p, "wb").close()
    >>> blake3_file(p)[1]
    0
    """
    import blake3

    from fastckpt._native.mapped import MappedFile

    size = os.path.getsize(path)
    if size == 0:
        return blake3.blake3(b"").hexdigest(), 0
    with MappedFile(path) as m:
        return blake3_mapped(m), m.size
