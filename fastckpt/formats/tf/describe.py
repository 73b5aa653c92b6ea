"""What ``fastckpt inspect`` shows for a TensorFlow checkpoint: a plain, JSON-ready dict.

>>> import numpy as np, tempfile, os
>>> from fastckpt.tf import write_checkpoint
>>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
>>> write_checkpoint(prefix, {"w": np.zeros((2, 3), np.float32)})
>>> is_tf_checkpoint(prefix), is_tf_checkpoint(prefix + ".data-00000-of-00001")
(True, True)
>>> d = describe(prefix)
>>> d["format"], d["tensors"][0]["name"], d["tensors"][0]["shape"], d["tensors"][0]["nbytes"]
('tensorflow', 'w', [2, 3], 24)
"""

from __future__ import annotations

import os

from fastckpt.errors import CheckpointNotFoundError
from fastckpt.formats.tf import dtypes as _dt
from fastckpt.formats.tf.reader import CheckpointReader, data_filename, resolve_prefix

__all__ = ["describe", "is_tf_checkpoint"]

_LISTED_SHARDS = 4096


def is_tf_checkpoint(path) -> bool:
    """True if ``path`` names a TensorFlow checkpoint: a prefix with an ``.index``, the ``.index`` or a
    data shard itself, or a directory whose ``checkpoint`` file names one. Reads no tensor data."""
    try:
        prefix = resolve_prefix(path)
    except (CheckpointNotFoundError, ValueError, OSError):
        return False
    try:
        with open(prefix + ".index", "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < 48:
                return False
            f.seek(-8, os.SEEK_END)
            return f.read(8) == bytes.fromhex("57fb808b247547db")
    except OSError:
        return False


def describe(path, *, verify: bool = False) -> dict:
    """Everything the index says about a checkpoint, as plain Python values.

    Keys: ``path`` (as given), ``format`` (``"tensorflow"``), ``prefix``, ``index`` (path),
    ``files`` (data shard paths; only those tensors use when the header claims
    more than 4096 shards), ``header`` (``num_shards``, ``endianness``,
    ``version``), ``data_blocks`` (index table blocks), ``object_graph``
    (whether ``_CHECKPOINTABLE_OBJECT_GRAPH`` is present), ``tensors`` (a list
    of dicts with ``name``, ``dtype`` (numpy), ``tf_dtype``, ``shape``,
    ``shard``, ``file``, ``offset``, ``nbytes``, ``alignment`` (largest power
    of two up to 4096 dividing the offset), ``crc32c`` (masked, as stored) and,
    for partitioned variables, ``slices``; a quantized tensor's ``dtype`` is
    its TensorFlow name, ``qint8`` ...), ``skipped`` (name -> why, for the
    opaque entries left out: a ``tf.data`` iterator's DT_VARIANT ...) and
    ``total_bytes``.
    ``verify=True`` also reads every tensor and checks its checksum.
    """
    with CheckpointReader(resolve_prefix(path), verify=verify) as reader:
        header = reader.header
        infos = list(reader.infos.values())
        # A damaged header can claim two billion shards; past a few thousand, list only the ones in use.
        shards = (range(header.num_shards) if header.num_shards <= _LISTED_SHARDS
                  else sorted({i.shard for i in infos if not i.slices}))
        files = [data_filename(reader.prefix, i, header.num_shards) for i in shards]
        tensors = []
        total = 0
        for info in infos:
            entry = {
                "name": info.name,
                "dtype": "object" if info.dtype.kind == "O" else _dt.quantized_name(info.dtype) or str(info.dtype),
                "tf_dtype": info.tf_dtype_name,
                "shape": list(info.shape),
                "shard": info.shard,
                "file": data_filename(reader.prefix, info.shard, header.num_shards),
                "offset": info.offset,
                "nbytes": info.nbytes,
                "alignment": info.alignment,
                "crc32c": info.crc32c,
            }
            if info.slices:
                entry["slices"] = [list(map(list, e)) for e in info.slices]
                entry["file"] = None
            tensors.append(entry)
            total += info.nbytes
            if verify:
                reader.read_tensor(info.name, copy=bool(info.slices))
        return {
            "path": os.fspath(path),
            "format": "tensorflow",
            "prefix": reader.prefix,
            "index": reader.index_path,
            "files": files,
            "header": {
                "num_shards": header.num_shards,
                "endianness": "big" if header.big_endian else "little",
                "version": {"producer": header.producer, "min_consumer": header.min_consumer,
                            "bad_consumers": list(header.bad_consumers)},
            },
            "data_blocks": reader.num_data_blocks,
            "object_graph": reader.has_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"),
            "tensors": tensors,
            "skipped": dict(reader.skipped),
            "total_bytes": total,
        }
