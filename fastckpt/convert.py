"""``fastckpt convert SRC DST``: copy every tensor between TensorFlow checkpoints, safetensors and NPZ.

The source format is detected (a TensorFlow prefix, ``.index`` file or
directory; otherwise the bytes of an NPZ or safetensors file). The destination
format is ``--to`` or else the destination's suffix: ``.safetensors``,
``.npz``, anything else a TensorFlow checkpoint prefix (a trailing ``.index``
is dropped). Values are copied bit for bit; names are kept.

What cannot be carried is refused rather than lost, with the option that
allows it:

- string tensors have no safetensors/NPZ form: the error lists them and
  ``--skip-unsupported`` leaves them out. TensorFlow's
  ``_CHECKPOINTABLE_OBJECT_GRAPH`` is bookkeeping, not a value: it is always
  left out of safetensors/NPZ (and said so); converting back with
  ``--object-graph`` rebuilds one from the ``.../.ATTRIBUTES/...`` keys;
- a destination that exists needs ``--force``;
- dtypes the destination lacks (complex128 in safetensors, bfloat16 in NPZ)
  fail with the destination writer's message.

>>> import numpy as np, tempfile, os
>>> from fastckpt.tf import write_checkpoint
>>> d = tempfile.mkdtemp()
>>> write_checkpoint(os.path.join(d, "ckpt-1"), {"w": np.arange(3, dtype=np.float32)})
>>> convert(os.path.join(d, "ckpt-1"), os.path.join(d, "w.safetensors"))["tensors"]
1
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["convert", "configure", "run", "destination_format"]

FORMATS = ("tf", "safetensors", "npz")
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def destination_format(dst, to: str | None = None) -> str:
    """``to`` if given, else the format named by the destination's suffix (TensorFlow by default).

    >>> destination_format("model.safetensors"), destination_format("out/ckpt-3"), destination_format("a.npz")
    ('safetensors', 'tf', 'npz')
    """
    if to is not None:
        if to not in FORMATS:
            raise ValueError(f"unknown destination format {to!r}; choose one of {', '.join(FORMATS)}")
        return to
    suffix = Path(os.fspath(dst)).suffix.lower()
    return {".safetensors": "safetensors", ".npz": "npz"}.get(suffix, "tf")


class _Source:
    """Names, arrays, string-ness and metadata of the source, whatever its format."""

    def __init__(self, path):
        from fastckpt.tf import CheckpointReader, is_tf_checkpoint

        self.path = os.fspath(path)
        if is_tf_checkpoint(path):
            self.format = "tf"
            self.reader = CheckpointReader(path)
            self.names = self.reader.tensor_names()
            self.metadata = {}
        else:
            import fastckpt

            self.reader = fastckpt.open(path)
            self.format = self.reader.format
            self.names = list(self.reader.keys())
            self.metadata = dict(self.reader.metadata or {})

    def is_string(self, name: str) -> bool:
        if self.format != "tf":
            return False
        return self.reader.info(name).tf_dtype == 7

    def array(self, name: str):
        if self.format == "tf":
            info = self.reader.info(name)
            # partitioned and big-endian tensors are copies anyway: ask for one and skip the warning
            return self.reader.read_tensor(name, copy=bool(info.slices) or self.reader.header.big_endian)
        return self.reader.host(name)

    def close(self):
        self.reader.close()


def _exists(dst: str, fmt: str) -> bool:
    if fmt == "tf":
        return os.path.exists(dst + ".index")
    return os.path.exists(dst)


def convert(src, dst, *, to: str | None = None, object_graph: bool = False, skip_unsupported: bool = False,
            force: bool = False, num_shards: int = 1, data_alignment: int = 1, fsync: bool = True) -> dict:
    """Copy every tensor of ``src`` into a new file or checkpoint ``dst``; returns a summary dict.

    The summary has ``source`` / ``destination`` (formats), ``path`` (what was
    written: the prefix for TensorFlow), ``tensors`` (how many), ``skipped``
    (string tensors left out with ``skip_unsupported``) and ``dropped``
    (bookkeeping left out: the object graph, or metadata a TensorFlow
    checkpoint cannot hold) and ``needs_object_graph`` (object-based keys were
    written without a graph, which ``tf.train.Checkpoint.restore`` needs).
    ``object_graph``, ``num_shards`` and
    ``data_alignment`` apply to TensorFlow destinations.
    """
    fmt = destination_format(dst, to)
    dst = os.fspath(dst)
    if fmt == "tf" and dst.endswith(".index"):
        dst = dst[: -len(".index")]
    if _exists(dst, fmt) and not force:
        raise FileExistsError(f"{dst}{'.index' if fmt == 'tf' else ''} already exists; pass --force (force=True) "
                              "to replace it")
    source = _Source(src)
    try:
        dropped, skipped, names = [], [], []
        for name in source.names:
            if fmt == "tf" and object_graph and name == OBJECT_GRAPH_KEY:
                continue  # the writer builds a new one from the keys
            if fmt != "tf" and source.is_string(name):
                if name == OBJECT_GRAPH_KEY:
                    dropped.append(name)
                elif skip_unsupported:
                    skipped.append(name)
                else:
                    strings = [n for n in source.names if source.is_string(n) and n != OBJECT_GRAPH_KEY]
                    raise ValueError(f"{source.path}: {len(strings)} string tensor(s) cannot be stored in {fmt}: "
                                     f"{', '.join(map(repr, strings[:8]))}; pass --skip-unsupported "
                                     "(skip_unsupported=True) to leave them out, or convert to a TensorFlow "
                                     "checkpoint")
            else:
                names.append(name)
        if fmt == "tf":
            from fastckpt.tf import CheckpointWriter

            if source.metadata:
                dropped.append("metadata")
            with CheckpointWriter(dst, num_shards=num_shards, data_alignment=data_alignment,
                                  object_graph=object_graph, fsync=fsync) as writer:
                for name in names:
                    writer.add(name, source.array(name))
        else:
            import fastckpt

            tensors = {name: source.array(name) for name in names}  # zero-copy views of the source
            if fmt == "safetensors":
                fastckpt.save_safetensors(dst, tensors, metadata=source.metadata or None, fsync=fsync)
            else:
                if source.metadata:
                    dropped.append("metadata")
                fastckpt.save_npz(dst, tensors, fsync=fsync)
        # Object-style keys without a graph restore nothing in tf.train.Checkpoint.restore, silently.
        needs_graph = (fmt == "tf" and not object_graph and OBJECT_GRAPH_KEY not in names
                       and any("/.ATTRIBUTES/" in n for n in names))
        return {"source": source.format, "destination": fmt, "path": dst, "tensors": len(names),
                "skipped": skipped, "dropped": dropped, "needs_object_graph": needs_graph}
    finally:
        source.close()


def configure(parser) -> None:
    parser.add_argument("src", help="a TensorFlow checkpoint (prefix, .index or directory), .safetensors or .npz file")
    parser.add_argument("dst", help="the file to write, or a TensorFlow checkpoint prefix such as out/ckpt-1")
    parser.add_argument("--to", choices=FORMATS, help="destination format (default: from DST's suffix, else tf)")
    parser.add_argument("--object-graph", action="store_true",
                        help="TensorFlow destination: store object-based keys and a _CHECKPOINTABLE_OBJECT_GRAPH so "
                             "that tf.train.Checkpoint.restore works")
    parser.add_argument("--skip-unsupported", action="store_true",
                        help="leave out string tensors the destination cannot hold (instead of failing)")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument("--shards", type=int, default=1, help="TensorFlow destination: number of data files")
    parser.add_argument("--alignment", type=int, default=1,
                        help="TensorFlow destination: start every tensor at a multiple of this many bytes")


def run(args) -> int:
    from fastckpt.errors import FastCkptError

    try:
        summary = convert(args.src, args.dst, to=args.to, object_graph=args.object_graph,
                          skip_unsupported=args.skip_unsupported, force=args.force, num_shards=args.shards,
                          data_alignment=args.alignment)
    except (FastCkptError, OSError, TypeError, ValueError) as exc:
        print(f"fastckpt convert: {exc}", file=sys.stderr)
        return 1
    print(f"{args.src} ({summary['source']}) -> {summary['path']} ({summary['destination']}): "
          f"{summary['tensors']} tensors")
    for name in summary["dropped"]:
        what = "metadata (a TensorFlow checkpoint/NPZ has no place for it)" if name == "metadata" else \
            f"{name} (bookkeeping; --object-graph rebuilds it when converting back to tf)"
        print(f"  left out: {what}", file=sys.stderr)
    for name in summary["skipped"]:
        print(f"  skipped string tensor: {name}", file=sys.stderr)
    if summary["needs_object_graph"]:
        print("  note: the keys are object-based (.../.ATTRIBUTES/...) but no object graph was written; "
              "tf.train.Checkpoint.restore needs one: convert again with --object-graph", file=sys.stderr)
    return 0
