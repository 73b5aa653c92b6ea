"""The ``s3`` suite's headline cases: a safetensors file saved to S3 and opened from it (every tensor read).

The server is moto's on loopback (:func:`fastckpt.bench.s3.start_server`,
started once per benchmark process; nothing leaves the machine), the file
:func:`fastckpt.bench.s3.make_tensors`' at 8 MiB (the suite's default: 512 MiB).
Without moto or s3fs (the ``test`` extra) the benchmarks are skipped.
"""

from __future__ import annotations

import atexit
import functools

import fastckpt
from fastckpt.bench.s3 import make_tensors, start_server, storage_options

MIB = 8
URL = "s3://asv/model.safetensors"


@functools.lru_cache(maxsize=1)
def _server() -> dict:
    try:
        import s3fs  # noqa: F401 - the client fastckpt's remote calls use

        server, endpoint = start_server("asv")
    except ImportError as e:
        raise NotImplementedError(f"the s3 benchmarks need moto's server and s3fs: {e}") from None
    atexit.register(server.stop)
    return storage_options(endpoint)


class S3:
    """``save_safetensors("s3://...")`` (a local write, then one atomic upload) and ``fastckpt.open("s3://...")``
    + every tensor's host view (the index, then parallel ranged reads into anonymous memory)."""

    def setup(self):
        self.options = _server()
        self.tensors = make_tensors(MIB)
        fastckpt.save_safetensors(URL, self.tensors, storage_options=self.options, overwrite=True)  # what loads read

    def time_save(self):  # asv calls it again on one key: each upload replaces the last
        fastckpt.save_safetensors(URL, self.tensors, storage_options=self.options, overwrite=True)

    def time_load(self):
        with fastckpt.open(URL, storage_options=self.options) as f:
            for name in f.keys():
                f.host(name)

    def track_bytes_loaded(self):
        """The tensors' bytes a load hands out (exactly the file's payload)."""
        with fastckpt.open(URL, storage_options=self.options) as f:
            return sum(f.host(name).nbytes for name in f.keys())

    track_bytes_loaded.unit = "bytes"
