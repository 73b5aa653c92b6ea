"""The ``tf`` suite's headline case: every tensor of a TensorFlow checkpoint read, CRC32C checked (the default) and
not, through :class:`fastckpt.tf.CheckpointReader` (views, and copies as TensorFlow hands them out).

The checkpoint is :func:`fastckpt.bench.tf.make_checkpoint`'s at 32 MiB in 64
tensors (the suite's default: 512 MiB); page cache warm.
"""

from __future__ import annotations

import os

from fastckpt.bench.tf import make_checkpoint, read_all

from .common import CPU, counts


class TFRead(CPU):
    """Open the checkpoint and read every tensor (:func:`fastckpt.bench.tf.read_all`)."""

    params = ([True, False], [False, True])
    param_names = ["verify", "copy"]
    MIB, TENSORS = 32, 64

    def setup_cache(self):
        return make_checkpoint(os.path.abspath("."), "tf-ckpt", self.MIB, self.TENSORS)

    def setup(self, prefix, verify, copy):
        read_all(prefix, verify=verify, copy=copy)  # page cache warm

    def time_read(self, prefix, verify, copy):
        read_all(prefix, verify=verify, copy=copy)

    def track_bytes_read(self, prefix, verify, copy):
        """The tensors' bytes one read hands out (the checkpoint's payload, exactly)."""
        return read_all(prefix, verify=verify, copy=copy)

    track_bytes_read.unit = "bytes"

    def track_allocated(self, prefix, verify, copy):
        """Bytes one read allocates at its peak (the copies, with copy=True, and nothing near them without)."""
        return counts(lambda: read_all(prefix, verify=verify, copy=copy))["allocated"]

    track_allocated.unit = "bytes"
