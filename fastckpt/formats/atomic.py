"""Atomic, durable writes: kept importable for 0.2's users; the one commit is :mod:`fastckpt.store.commit`.

>>> from fastckpt.formats.atomic import atomic_write
>>> atomic_write is __import__("fastckpt.store.commit", fromlist=["atomic_write"]).atomic_write
True
"""

from fastckpt.store.commit import (  # noqa: F401
    STALE_AFTER,
    atomic_directory,
    atomic_write,
    fsync_directory,
    remove_stale_partials,
    remove_stale_partials_in,
    rename_noreplace,
    overwrite_flag,
)

__all__ = ["atomic_write", "atomic_directory", "fsync_directory", "remove_stale_partials", "remove_stale_partials_in",
           "rename_noreplace", "overwrite_flag", "STALE_AFTER"]
