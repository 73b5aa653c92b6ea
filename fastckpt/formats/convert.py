"""Copy every tensor between TensorFlow checkpoints, safetensors and NPZ (the ``fastckpt convert`` command).

The source is whatever :func:`fastckpt.open` opens (a TensorFlow prefix,
``.index`` file or directory; an NPZ or safetensors file, by its bytes; a
training-checkpoint directory, its tensors named ``<file stem>/<name>``). The destination
format is stated, never guessed (:func:`destination_format`): a known suffix
(``.safetensors``, ``.npz``, ``.index`` for TensorFlow) or ``--to``; a
TensorFlow prefix such as ``out/ckpt-1`` only with ``--to tf``. An unknown
suffix, a directory, another tool's suffix (``.pt``, ``.h5``) or a suffix
that contradicts ``--to`` is a :class:`~fastckpt.errors.DestinationError`
listing the choices, raised before anything is written. Values are copied bit
for bit, dtypes are kept (bfloat16, float8 and TensorFlow's quantized types
included) or refused, never changed; names are kept.

What cannot be carried is refused rather than lost, with the option that
allows it:

- string tensors have no safetensors/NPZ form, and every other dtype the
  destination lacks (complex128 or fixed-width text in safetensors) is
  refused with the destination writer's words: the error lists them and
  ``--skip-unsupported`` leaves them out. TensorFlow's
  ``_CHECKPOINTABLE_OBJECT_GRAPH`` is bookkeeping, not a value: it is always
  left out of safetensors/NPZ (and said so); converting back with
  ``--object-graph`` rebuilds one from the ``.../.ATTRIBUTES/...`` keys;
- TensorFlow's quantized types (qint8, quint8, qint16, quint16, qint32) are
  kept by TensorFlow checkpoints and NPZ (as TensorFlow's numpy form, a
  one-field structured dtype); safetensors has no such types, so they are
  refused unless ``--quantized-as-ints`` stores the integers and records each
  type in the metadata key ``fastckpt.tf_quantized`` (JSON, name -> type),
  from which a conversion to TensorFlow or NPZ restores them;
- opaque TensorFlow entries (a ``tf.data`` iterator's DT_VARIANT) are listed
  as skipped, never carried and never a reason to refuse;
- a destination that exists needs ``--overwrite`` (``overwrite=True``).

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
from pathlib import Path

from fastckpt.formats.reader import mappings_of
from fastckpt.progress import Progress, part_of_a_save, progress_from

__all__ = ["convert", "destination_format", "cannot_hold", "QUANTIZED_KEY"]

_log = logging.getLogger(__name__)

FORMATS = ("tf", "safetensors", "npz")
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# safetensors metadata key: JSON {tensor name: "qint8" ...} for TensorFlow quantized tensors stored as plain integers.
QUANTIZED_KEY = "fastckpt.tf_quantized"


# The suffixes that name a destination format; ``.index`` is the file a TensorFlow checkpoint is opened by.
SUFFIXES = {".safetensors": "safetensors", ".npz": "npz", ".index": "tf"}
# Suffixes of other tools' files: writing one of fastckpt's formats under such a name would mislead whoever
# opens it next, whatever ``to`` says.
FOREIGN_SUFFIXES = {
    ".pt": "names a torch pickle", ".pth": "names a torch pickle",
    ".bin": "names a torch pickle (Hugging Face's pytorch_model.bin)", ".pkl": "names a pickle",
    ".pickle": "names a pickle", ".h5": "names an HDF5/Keras file", ".hdf5": "names an HDF5 file",
    ".keras": "names a Keras archive", ".onnx": "names an ONNX model", ".gguf": "names a GGUF file",
    ".msgpack": "names a Flax msgpack file", ".json": "names a JSON file", ".npy": "names a single .npy array",
    ".safetensor": "is not .safetensors (one letter short)",
}
# Messages name the Python keywords (overwrite=True, to='tf'); the command prints them as its flags
# (fastckpt.words.command_line_wording), so that each side reads its own spelling.
_CHOICES = "name a .safetensors or .npz file, or a TensorFlow checkpoint prefix such as out/ckpt-1 with to='tf'"


def destination_format(dst, to: str | None = None) -> str:
    """The format ``convert`` writes to ``dst``: named by its suffix, or by ``to``; never guessed.

    The rule: a known suffix (``.safetensors``, ``.npz``, ``.index`` for a
    TensorFlow checkpoint) names the format, and ``to``, if given, must agree
    with it. Without a known suffix the format is ``to`` (a TensorFlow prefix
    such as ``out/ckpt-1`` is written only when asked, ``to="tf"``). A
    directory (an existing one, or a path ending in ``/``), another tool's
    suffix (``.pt``, ``.h5``, ...), or an unknown suffix without ``to`` raise
    :class:`~fastckpt.errors.DestinationError` listing the choices.

    >>> destination_format("model.safetensors"), destination_format("out/ckpt-3", "tf"), destination_format("a.npz")
    ('safetensors', 'tf', 'npz')
    >>> destination_format("model.pt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fastckpt.errors.DestinationError: model.pt: .pt names a torch pickle, not a format convert writes; name a ...
    """
    from fastckpt.errors import DestinationError

    if to is not None and to not in FORMATS:
        raise DestinationError(f"unknown destination format {to!r}; choose one of {', '.join(FORMATS)}")
    text = os.fspath(dst)
    if text.endswith(("/", os.sep)) or os.path.isdir(text):
        raise DestinationError(f"{text}: is a directory; inside it, {_CHOICES}")
    suffix = Path(text).suffix.lower()
    named = SUFFIXES.get(suffix)
    if named is not None:
        if to is not None and to != named:
            raise DestinationError(f"{text}: the suffix {suffix} names {named}, not {to} (to={to!r}); rename the "
                                   f"destination or leave to= out")
        return named
    if suffix in FOREIGN_SUFFIXES:
        raise DestinationError(f"{text}: {suffix} {FOREIGN_SUFFIXES[suffix]}, not a format convert writes; "
                               f"{_CHOICES}")
    if to is not None:
        return to
    what = f"unknown suffix {suffix!r}" if suffix else "no suffix"
    raise DestinationError(f"{text}: {what}, so the destination format is not known; {_CHOICES}")


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


def cannot_hold(fmt: str, dtype) -> str | None:
    """Why format ``fmt`` cannot store ``dtype`` (its writer's own words), or None when it can.

    >>> import numpy as np
    >>> cannot_hold("npz", np.dtype("<U3")), cannot_hold("safetensors", np.dtype("<U3"))[:39]
    (None, 'dtype <U3 has no safetensors equivalent')
    """
    import numpy as np

    dtype = np.dtype(dtype)
    try:
        if fmt == "safetensors":
            from fastckpt.formats.safetensors import dtype_to_safetensors

            dtype_to_safetensors(dtype)
        elif fmt == "npz":
            from fastckpt.formats.npz import npy_header

            npy_header(dtype, (), False)
        else:
            from fastckpt.formats.tf.dtypes import tf_dtype

            tf_dtype(dtype)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def _quantized_of(metadata: dict, path: str) -> dict:
    """``{tensor name: "qint8" ...}`` recorded by an earlier ``quantized_as_ints`` conversion, else ``{}``."""
    import json

    text = metadata.get(QUANTIZED_KEY)
    if text is None:
        return {}
    try:
        table = json.loads(text)
    except ValueError:
        table = None
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        from fastckpt.errors import FormatError

        raise FormatError(f"{path}: metadata {QUANTIZED_KEY!r} must be a JSON object of tensor name -> TensorFlow "
                          f"quantized type name, got {text[:200]!r}")
    return table


def convert(src, dst, *, to: str | None = None, object_graph: bool = False, skip_unsupported: bool = False,
            quantized_as_ints: bool = False, overwrite: bool = False, num_shards: int = 1, data_alignment: int = 1,
            fsync: bool = True, progress=False) -> dict:
    """Copy every tensor of ``src`` into a new file or checkpoint ``dst``; returns a summary dict.

    The destination's format follows :func:`destination_format` (a known
    suffix, or ``to``; never a guess); nothing is written when it is not
    stated. The summary has ``source`` / ``destination`` (formats), ``path``
    (what was written: the prefix for TensorFlow), ``tensors`` (how many),
    ``skipped`` (names left out: tensors the destination cannot hold, with
    ``skip_unsupported``, and opaque TensorFlow entries, always), ``reasons``
    (name -> why, for each skipped name), ``dropped`` (bookkeeping left out:
    the object graph, or metadata a TensorFlow checkpoint cannot hold),
    ``quantized`` (name -> TensorFlow quantized type, for the tensors stored
    as plain integers with ``quantized_as_ints`` or restored from them) and
    ``needs_object_graph`` (object-based keys were written without a graph,
    which ``tf.train.Checkpoint.restore`` needs). ``object_graph``,
    ``num_shards`` and ``data_alignment`` apply to TensorFlow destinations.
    ``progress`` (``True`` for a bar, or ``callback(done, total, item)``:
    :mod:`fastckpt.progress`) counts the tensors' bytes as they are written.
    An existing ``dst`` is replaced only with ``overwrite=True``; no writer's
    file committed meanwhile is replaced without it.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.tf import write_checkpoint
    >>> d = tempfile.mkdtemp()
    >>> q = np.arange(3, dtype=np.int8).view([("qint8", "i1")])  # TensorFlow's numpy form of qint8
    >>> write_checkpoint(os.path.join(d, "ckpt-1"), {"q": q})
    >>> convert(os.path.join(d, "ckpt-1"), os.path.join(d, "q.safetensors"), quantized_as_ints=True)["quantized"]
    {'q': 'qint8'}
    >>> convert(os.path.join(d, "q.safetensors"), os.path.join(d, "back"), to="tf")["quantized"]
    {'q': 'qint8'}
    """
    from fastckpt.errors import DestinationError
    from fastckpt.formats.tf.dtypes import quantized_dtype, quantized_name

    started = time.perf_counter()
    fmt = destination_format(dst, to)
    dst = os.fspath(dst)
    if fmt == "tf" and dst.endswith(".index"):
        dst = dst[: -len(".index")]
    if _exists(dst, fmt) and not overwrite:
        raise FileExistsError(f"{dst}{'.index' if fmt == 'tf' else ''} already exists; pass overwrite=True to "
                              "replace it")
    source = _Source(src)
    try:
        # Opaque entries (a tf.data iterator's DT_VARIANT) are no tensor: listed, never a reason to refuse.
        reasons = dict(getattr(source.reader, "skipped", None) or {})
        skipped = list(reasons)
        dropped, names, strings, quantized_refused, unsupported = [], [], [], {}, {}
        recorded = _quantized_of(source.metadata, source.path)
        quantized = {}  # name -> type, for the tensors whose type travels as metadata, or comes back from it
        for name in source.names:
            if fmt == "tf" and object_graph and name == OBJECT_GRAPH_KEY:
                continue  # the writer builds a new one from the keys
            if fmt != "tf" and source.is_string(name):
                if name == OBJECT_GRAPH_KEY:
                    dropped.append(name)
                elif skip_unsupported:
                    skipped.append(name)
                    reasons[name] = "a string tensor"
                else:
                    strings.append(name)
                continue
            dtype = source.reader.info(name).dtype
            qname = quantized_name(dtype)
            if qname is not None and fmt == "safetensors":
                if quantized_as_ints:
                    quantized[name] = qname
                    names.append(name)
                elif skip_unsupported:
                    skipped.append(name)
                    reasons[name] = f"TensorFlow {qname}, which safetensors has not"
                else:
                    quantized_refused[name] = qname
                continue
            if name in recorded and fmt != "safetensors":
                quantized[name] = recorded[name]
                names.append(name)
                continue
            packed = getattr(source.reader.info(name), "packed", None)
            why = cannot_hold(fmt, dtype) if packed is None or fmt == "safetensors" else (
                f"packed {packed} (elements narrower than a byte), which only safetensors holds")
            if why is None:
                names.append(name)
            elif skip_unsupported:
                skipped.append(name)
                reasons[name] = why
            else:
                unsupported[name] = why
        if strings:
            raise DestinationError(f"{source.path}: {len(strings)} string tensor(s) cannot be stored in {fmt}: "
                                   f"{', '.join(map(repr, strings[:8]))}; pass skip_unsupported=True "
                                   "to leave them out, or convert to a TensorFlow "
                                   "checkpoint")
        if quantized_refused:
            listed = ", ".join(f"{n!r} ({q})" for n, q in list(quantized_refused.items())[:8])
            raise DestinationError(
                f"{source.path}: {len(quantized_refused)} tensor(s) of TensorFlow quantized types cannot be stored in "
                f"safetensors without losing the type: {listed}; pass quantized_as_ints=True "
                f"to store the integers with each type recorded in the file's metadata ({QUANTIZED_KEY!r}, which a "
                "conversion back to tf restores), skip_unsupported=True to leave them out, or convert to npz, which "
                "keeps them")
        if unsupported:
            listed = "; ".join(f"{n!r}: {why}" for n, why in list(unsupported.items())[:8])
            raise DestinationError(f"{source.path}: {len(unsupported)} tensor(s) cannot be stored in {fmt}: {listed}; "
                                   "pass skip_unsupported=True to leave them out")

        def array(name):
            value = source.array(name)
            if name not in quantized:
                return value
            if fmt == "safetensors":
                return value.view(value.dtype.fields[quantized[name]][0])  # the plain integers
            want = quantized_dtype(quantized[name])
            if value.dtype.newbyteorder("=") != want.fields[quantized[name]][0].newbyteorder("="):
                from fastckpt.errors import FormatError

                raise FormatError(f"{source.path}: tensor {name!r} is recorded as {quantized[name]} in metadata "
                                  f"{QUANTIZED_KEY!r} but is stored as {value.dtype}, not "
                                  f"{want.fields[quantized[name]][0]}")
            return value.view(want)

        metadata = dict(source.metadata)
        if fmt != "safetensors":
            metadata.pop(QUANTIZED_KEY, None)  # carried by the dtypes themselves now
        elif quantized:
            import json

            metadata[QUANTIZED_KEY] = json.dumps({**{n: q for n, q in _quantized_of(metadata, source.path).items()
                                                     if n in names}, **quantized}, sort_keys=True)
        sizes = {name: _payload_nbytes(source.reader.info(name)) for name in names}
        user_report = progress_from(progress, sum(sizes.values()), f"convert to {fmt}")
        # The writers copy the source's views: a source file truncated under them is a FormatError, not SIGBUS
        # (MappedFile.guard), and polled after every tensor written, so that no file made of the zeros the
        # missing pages read as is ever committed.
        report = _Checked(sum(sizes.values()), user_report)
        if fmt == "tf":
            from fastckpt.formats.tf.writer import CheckpointWriter

            if metadata:
                dropped.append("metadata")
            with reading(source.reader, "its tensors to convert them") as guards, report.checking(guards), \
                    CheckpointWriter(dst, num_shards=num_shards, data_alignment=data_alignment,
                                     object_graph=object_graph, fsync=fsync, overwrite=overwrite) as writer, \
                    user_report:
                for name in names:
                    writer.add(name, array(name))
                    report.advance(sizes[name], name)
        else:
            import fastckpt

            tensors = {name: array(name) for name in names}  # zero-copy views of the source
            with reading(source.reader, "its tensors to convert them") as guards, report.checking(guards), \
                    user_report, part_of_a_save():  # the conversion logs its own line
                if fmt == "safetensors":
                    fastckpt.save_safetensors(dst, tensors, metadata=metadata or None, fsync=fsync,
                                              progress=report, overwrite=overwrite)
                else:
                    if metadata:
                        dropped.append("metadata")
                    fastckpt.save_npz(dst, tensors, fsync=fsync, progress=report, overwrite=overwrite)
        # Object-style keys without a graph restore nothing in tf.train.Checkpoint.restore, silently.
        needs_graph = (fmt == "tf" and not object_graph and OBJECT_GRAPH_KEY not in names
                       and any("/.ATTRIBUTES/" in n for n in names))
        _log.info("converted %s (%s) to %s (%s): %d tensors, %d bytes in %.3f s%s", source.path, source.format, dst,
                  fmt, len(names), sum(sizes.values()), time.perf_counter() - started,
                  f", left out: {', '.join(skipped + dropped)}" if skipped or dropped else "")
        return {"source": source.format, "destination": fmt, "path": dst, "tensors": len(names),
                "skipped": skipped, "reasons": reasons, "dropped": dropped, "quantized": quantized,
                "needs_object_graph": needs_graph}
    finally:
        source.close()
