"""File hashes for manifests: computed from a read-only mapping of the file, in one call.

sha256 (training checkpoints, format 1.0) runs at about 1.8 GB/s on one core;
BLAKE3 (sharded checkpoints), through the ``blake3`` package on every core, at
about 7 GB/s here.

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

__all__ = ["sha256_file", "blake3_file"]


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """``(hex sha256, size)`` of a file (e.g. ``sha256_file("ckpt/weights.safetensors")``).

    Hashes a read-only mapping in one call (hashlib releases the GIL), which
    saves the copy a ``read()`` into a buffer would make; right after a save
    the pages are in the page cache.
    """
    from fastckpt._native.mapped import MappedFile

    size = os.path.getsize(path)
    if size == 0:
        return hashlib.sha256(b"").hexdigest(), 0
    with MappedFile(path) as m:
        return hashlib.sha256(m.view(0, m.size)).hexdigest(), m.size


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
        return blake3.blake3(m.view(0, m.size), max_threads=blake3.blake3.AUTO).hexdigest(), m.size
