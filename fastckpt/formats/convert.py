"""Copy every tensor between TensorFlow checkpoints, safetensors and NPZ (the ``fastckpt convert`` command).

The source is whatever :func:`fastckpt.open` opens (a TensorFlow prefix,
``.index`` file or directory; an NPZ or safetensors file, by its bytes; a
training-checkpoint directory, its tensors named ``<file stem>/<name>``). The destination
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
- a destination that exists needs ``--overwrite`` (``overwrite=True``;
  ``--force``/``force=`` are its deprecated spellings);
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

import contextlib
import logging
import os
import time
import warnings
from pathlib import Path

from fastckpt.formats.reader import mappings_of
from fastckpt.progress import Progress, part_of_a_save, progress_from

__all__ = ["convert", "destination_format"]

_log = logging.getLogger(__name__)

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
    """Names, arrays, string-ness and metadata of the source: any reader :func:`fastckpt.open` returns."""

    def __init__(self, path):
        import fastckpt

        self.path = os.fspath(path)
        self.reader = fastckpt.open(path)
        self.format = {"tensorflow": "tf"}.get(self.reader.format, self.reader.format)
        self.names = list(self.reader.keys())
        self.metadata = dict(self.reader.metadata or {})

    def is_string(self, name: str) -> bool:
        return self.reader.info(name).dtype.kind == "O"  # TensorFlow strings: object arrays of bytes

    def array(self, name: str):
        return self.reader.host(name)  # zero-copy where the source allows, copies (no warning) elsewhere

    def close(self):
        self.reader.close()


class _Checked(Progress):
    """A progress report that first polls the source's guards (``MappedFile.guard``), then counts into ``user``."""

    __slots__ = ("_user", "_forwarded", "_guards")

    def __init__(self, total: int, user: Progress) -> None:
        super().__init__(total, callback=self._check)
        self._user = user
        self._forwarded = 0
        self._guards: list = []

    @contextlib.contextmanager
    def checking(self, guards: list):
        self._guards = guards
        try:
            yield self
        finally:
            self._guards = []

    def _check(self, done: int, total, item) -> None:
        for guard in self._guards:
            guard.check()
        self._user.advance(done - self._forwarded, item)
        self._forwarded = done


@contextlib.contextmanager
def reading(reader, what: str):
    """Every mapping of ``reader`` under ``MappedFile.guard``; yields the guards (their ``check()`` polls them)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(m.guard(what)) for m in mappings_of(reader)]


def _payload_nbytes(info) -> int:
    """A tensor's bytes as a writer counts them (``info.nbytes`` is the stored, maybe compressed, length)."""
    return info.size * info.dtype.itemsize


def _exists(dst: str, fmt: str) -> bool:
    if fmt == "tf":
        return os.path.exists(dst + ".index")
    return os.path.exists(dst)


def convert(src, dst, *, to: str | None = None, object_graph: bool = False, skip_unsupported: bool = False,
            overwrite: bool = False, num_shards: int = 1, data_alignment: int = 1, fsync: bool = True,
            progress=False, force: bool | None = None) -> dict:
    """Copy every tensor of ``src`` into a new file or checkpoint ``dst``; returns a summary dict.

    The summary has ``source`` / ``destination`` (formats), ``path`` (what was
    written: the prefix for TensorFlow), ``tensors`` (how many), ``skipped``
    (string tensors left out with ``skip_unsupported``) and ``dropped``
    (bookkeeping left out: the object graph, or metadata a TensorFlow
    checkpoint cannot hold) and ``needs_object_graph`` (object-based keys were
    written without a graph, which ``tf.train.Checkpoint.restore`` needs).
    ``object_graph``, ``num_shards`` and
    ``data_alignment`` apply to TensorFlow destinations. ``progress`` (``True``
    for a bar, or ``callback(done, total, item)``: :mod:`fastckpt.progress`)
    counts the tensors' bytes as they are written. An existing ``dst`` is
    replaced only with ``overwrite=True`` (``force=`` is its deprecated
    spelling); no writer's file committed meanwhile is replaced without it.
    """
    if force is not None:
        warnings.warn("convert(force=...) is deprecated: pass overwrite=... (the one keyword of every writer)",
                      DeprecationWarning, stacklevel=2)
        overwrite = overwrite or bool(force)
    started = time.perf_counter()
    fmt = destination_format(dst, to)
    dst = os.fspath(dst)
    if fmt == "tf" and dst.endswith(".index"):
        dst = dst[: -len(".index")]
    if _exists(dst, fmt) and not overwrite:
        raise FileExistsError(f"{dst}{'.index' if fmt == 'tf' else ''} already exists; pass --overwrite "
                              "(overwrite=True) to replace it")
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
        sizes = {name: _payload_nbytes(source.reader.info(name)) for name in names}
        user_report = progress_from(progress, sum(sizes.values()), f"convert to {fmt}")
        # The writers copy the source's views: a source file truncated under them is a FormatError, not SIGBUS
        # (MappedFile.guard), and polled after every tensor written, so that no file made of the zeros the
        # missing pages read as is ever committed.
        report = _Checked(sum(sizes.values()), user_report)
        if fmt == "tf":
            from fastckpt.formats.tf.writer import CheckpointWriter

            if source.metadata:
                dropped.append("metadata")
            with reading(source.reader, "its tensors to convert them") as guards, report.checking(guards), \
                    CheckpointWriter(dst, num_shards=num_shards, data_alignment=data_alignment,
                                     object_graph=object_graph, fsync=fsync, overwrite=overwrite) as writer, \
                    user_report:
                for name in names:
                    writer.add(name, source.array(name))
                    report.advance(sizes[name], name)
        else:
            import fastckpt

            tensors = {name: source.array(name) for name in names}  # zero-copy views of the source
            with reading(source.reader, "its tensors to convert them") as guards, report.checking(guards), \
                    user_report, part_of_a_save():  # the conversion logs its own line
                if fmt == "safetensors":
                    fastckpt.save_safetensors(dst, tensors, metadata=source.metadata or None, fsync=fsync,
                                              progress=report, overwrite=overwrite)
                else:
                    if source.metadata:
                        dropped.append("metadata")
                    fastckpt.save_npz(dst, tensors, fsync=fsync, progress=report, overwrite=overwrite)
        # Object-style keys without a graph restore nothing in tf.train.Checkpoint.restore, silently.
        needs_graph = (fmt == "tf" and not object_graph and OBJECT_GRAPH_KEY not in names
                       and any("/.ATTRIBUTES/" in n for n in names))
        _log.info("converted %s (%s) to %s (%s): %d tensors, %d bytes in %.3f s%s", source.path, source.format, dst,
                  fmt, len(names), sum(sizes.values()), time.perf_counter() - started,
                  f", left out: {', '.join(skipped + dropped)}" if skipped or dropped else "")
        return {"source": source.format, "destination": fmt, "path": dst, "tensors": len(names),
                "skipped": skipped, "dropped": dropped, "needs_object_graph": needs_graph}
    finally:
        source.close()
