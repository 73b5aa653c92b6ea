"""Model files: ``save_model`` / ``load_model`` for netcl's ``.netcl`` format (version 2) and its legacy pair.

The ``.netcl`` model file format, version 2
===========================================

The key words MUST, MUST NOT, SHOULD and MAY are to be read as in RFC 2119.
A "reader" is any program loading a model file (fastckpt, netcl 0.4.4); a
"writer" is any program producing one.

Container
---------
- A model file MUST be a ZIP archive readable by ``numpy.load`` as an NPZ: one
  member per entry, named ``<key>.npy``, each holding a complete ``.npy`` file
  (format 1.0, 2.0 or 3.0) of a C- or Fortran-ordered array.
- Readers MUST accept STORED members and SHOULD accept DEFLATE members
  (``np.savez_compressed``). Readers MUST accept zip64 local headers (numpy writes
  every local header with 32-bit sizes 0xFFFFFFFF and a zip64 extra field, id
  0x0001) and MUST NOT rely on the member order.
- Readers MUST NOT assume any payload alignment: files written by ``np.savez``
  (netcl) put payloads at arbitrary offsets (2 or 3 mod 4 are common). A reader
  that maps the file MUST copy such payloads (or read them with unaligned-safe
  copies) before treating them as typed memory.
- fastckpt writes every member STORED, with its ``.npy`` payload starting at a
  multiple of 4096 bytes from the start of the file (the padding lives in the
  ZIP local-header extra field, see ``docs/formats/npz.md``), so readers that map
  the file can view every payload in place. netcl 0.4.4 reads such files.
- The file name is exactly the path given: no suffix is appended. ``.netcl`` is
  the conventional suffix.
- Writers SHOULD replace the file atomically (fastckpt writes a temporary file in
  the same directory, fsyncs it and renames it over the target).

Entries
-------
- ``__netcl_meta__`` (REQUIRED): a 0-d array of dtype ``<U{n}`` (UTF-32LE code
  units, as numpy stores ``np.str_``) holding one JSON document. Readers MUST
  also accept a 0-d (or size-1) ``|S{n}`` array holding UTF-8 JSON, and MUST
  accept trailing NUL characters having been stripped (numpy strips them).
  Writers SHOULD write ``np.array(json.dumps(meta))``: ``json.dumps`` with
  default settings (ASCII only, ``", "`` and ``": "`` separators), so that the
  same model always gives the same bytes.
- Weight entries: one per array-valued state key of each layer, named
  ``"{layer_index}:{state_key}"`` (a colon, not a dot). ``layer_index`` is the
  position in the Sequential and counts parameter-free layers (ReLU, Flatten,
  ...). Non-array state (ints, floats, ``None``) is never stored: it lives in the
  config. Writers SHOULD write weight entries in layer order, then state-key
  order, and ``__netcl_meta__`` last.
- Any other entry MAY be present. netcl ignores unknown entries; fastckpt's
  ``load_model`` rejects them (``KeyError``) unless ``strict=False``.
- Weight dtypes: netcl writes float32 (``<f4``) only and casts whatever it reads
  to float32. fastckpt writes each tensor's dtype as held and keeps the stored
  dtype when loading.

Metadata document
-----------------
``{"type": "Sequential", "config": [<entry>, ...], "version": 2, "format": "netcl.single-file"}``

- ``type`` MUST be ``"Sequential"``.
- ``version`` SHOULD be present; it is 2 for this layout (1 for the legacy pair
  below). A reader MUST refuse a version newer than it knows (fastckpt: 2) and
  say which version the file needs. A missing version is read as 2.
- ``format`` SHOULD be ``"netcl.single-file"``; a reader MAY refuse other
  values (fastckpt does).
- ``config`` is a list with one entry per layer: ``{"type": name, "args": {...}}``.
  Readers MUST also accept entries without ``args`` (``{"type": "ReLU"}``) and,
  when ``config`` is absent, the oldest form: a ``layers`` list of flat entries
  whose arguments sit next to ``type``.
- Extra metadata keys MAY be present and MUST be ignored by readers.

Layer types and their ``args`` (the keys netcl 0.4.4 writes, in this order) and
weight entries (shapes; C is the channel count):

| type | args (in this order) | weight entries |
|---|---|---|
| Conv2d | in_channels, out_channels, kernel_size (one int), stride, pad, bias (bool), dilation, groups | weight (out, in/groups, k, k), bias (out) |
| Linear | in_features, out_features, bias (bool) | weight (in, out): transposed against PyTorch; bias (out) |
| BatchNorm2d | num_features, momentum, eps | gamma, beta, running_mean, running_var, each (C) |
| ReLU, Sigmoid, Tanh, Flatten | none: ``"args": {}`` | none |
| LeakyReLU | negative_slope | none |
| Dropout | p, seed (may be null) | none |
| MaxPool2d | kernel_size, stride | none |
| Embedding (fastckpt only) | num_embeddings, embedding_dim | weight (num_embeddings, embedding_dim) |

Types registered by the user (:func:`fastckpt.nn.register_layer`) are written
with the args their ``to_config`` returns. netcl 0.4.4 knows only the first
ten types: it refuses a file with any other type while validating the config
(``ValueError: Unknown layer type ...``), before building anything.

Loading weights
---------------
- A reader rebuilds the Sequential from ``config`` (fresh initial values), then
  fills each state key ``k`` of layer ``i`` from entry ``"{i}:{k}"``.
- A weight missing from the file keeps its freshly built value. netcl does this
  silently; fastckpt warns (:class:`MissingWeightsWarning`) and lists the keys
  in ``model.load_report``.
- Shapes MUST match up to size-1 dimensions: (1, C) is accepted for (C,)
  (netcl's tolerance). Any other mismatch MUST be an error naming the key and
  both shapes, and nothing is loaded.

Legacy layout, version 1 (read only)
------------------------------------
Two files: ``<path>.json`` holding ``{"type": "Sequential", "config": [...],
"version": 1}`` and ``<path>.npz`` holding the same ``"{i}:{k}"`` entries and no
``__netcl_meta__``. Version-1 configs lack Conv2d ``bias``/``dilation``/``groups``
and BatchNorm2d ``momentum``/``eps``; the constructors' defaults apply.

Path resolution
---------------
``load_model(path)`` tries, in order: ``path`` itself; the pair
``path + ".json"`` and ``path + ".npz"``; ``path + ".netcl"``. When none exists
it raises :class:`~fastckpt.errors.CheckpointNotFoundError` listing every path
tried.

>>> import numpy as np, tempfile, os                                     # doctest: +SKIP
>>> from fastckpt.nn import Sequential, Linear, ReLU                     # doctest: +SKIP
>>> model = Sequential(Linear(None, 784, 256), ReLU(), Linear(None, 256, 10))  # doctest: +SKIP
>>> save_model(model, "mnist_mlp.netcl")                                 # doctest: +SKIP
>>> again = load_model("mnist_mlp.netcl", pool=pool)                     # doctest: +SKIP
>>> again.load_report.missing_keys                                       # doctest: +SKIP
[]
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fastckpt.errors import CheckpointNotFoundError, FastCkptWarning, FormatError
from fastckpt.formats.reader import guard
from fastckpt.formats.remote import is_url
from fastckpt.progress import part_of_a_save, progress_from, requested

if TYPE_CHECKING:
    from fastckpt.nn import Sequential

_log = logging.getLogger(__name__)

__all__ = [
    "save_model",
    "load_model",
    "model_metadata",
    "resolve_model_path",
    "verify_members",
    "ModelLoadReport",
    "MissingWeightsWarning",
    "META_KEY",
    "FORMAT_VERSION",
    "FORMAT_NAME",
]

META_KEY = "__netcl_meta__"
FORMAT_VERSION = 2
FORMAT_NAME = "netcl.single-file"
_KNOWN_FORMATS = (FORMAT_NAME,)


class MissingWeightsWarning(FastCkptWarning):
    """A model file lacks weights the model has: those layers keep their freshly built values.

    >>> import warnings
    >>> warnings.simplefilter("error", MissingWeightsWarning)   # make a partial file an error
    >>> warnings.resetwarnings()
    """


@dataclass
class ModelLoadReport:
    """What :func:`load_model` did: where it read from, and which keys did not match.

    ``missing_keys`` kept their freshly built (seeded) values; ``unexpected_keys`` were
    in the file but not in the model (only possible with ``strict=False``);
    ``file_report`` is the device loader's :class:`~fastckpt.device.load.LoadReport` (copies,
    pool hits and misses, bytes allocated).

    >>> load_model("m.netcl", pool=pool).load_report.missing_keys   # doctest: +SKIP
    []
    """

    path: str
    layout: str  # "single-file" or "legacy"
    version: int
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    pooled: bool = False
    realigned_keys: list[str] = field(default_factory=list)
    file_report: Any = None
    seconds: float = 0.0


if TYPE_CHECKING:
    class LoadedModel(Sequential):
        """What :func:`load_model` returns, to type checkers: a :class:`fastckpt.nn.Sequential` whose
        ``load_report`` says what the load did. (At run time it is a Sequential with that attribute set:
        fastckpt.nn is imported only when a model is loaded.)"""

        load_report: ModelLoadReport


# -- saving ---------------------------------------------------------------------------------------
def model_metadata(model) -> dict:
    """The ``__netcl_meta__`` document of ``model`` (a :class:`fastckpt.nn.Sequential`).

    >>> model_metadata(Sequential(ReLU()))                                 # doctest: +SKIP
    {'type': 'Sequential', 'config': [{'type': 'ReLU', 'args': {}}], 'version': 2, 'format': 'netcl.single-file'}
    """
    from fastckpt.nn import Sequential, layer_to_config

    if not isinstance(model, Sequential):
        raise TypeError(
            f"save_model stores a fastckpt.nn.Sequential, got {type(model).__name__}; "
            "wrap a single layer as Sequential(layer)"
        )
    config = []
    for i, layer in enumerate(model.layers):
        try:
            config.append(layer_to_config(layer))
        except ValueError as exc:
            raise ValueError(f"layer {i}: {exc}") from None
    return {"type": "Sequential", "config": config, "version": FORMAT_VERSION, "format": FORMAT_NAME}


def save_model(model, path: str | os.PathLike, *, fsync: bool = True, progress=False,
               storage_options: dict | None = None, overwrite: bool = False) -> None:
    """Write ``model`` to one ``.netcl`` file at exactly ``path`` (atomic; parents created).

    Payloads are 4096-byte aligned; the same model always gives the same bytes.
    Layer types netcl cannot build (Embedding, user types) are saved with their own
    config entries; netcl then refuses the file cleanly. ``progress`` (``True``
    for a bar, or ``callback(done, total, item)``: :mod:`fastckpt.progress`)
    counts the weights' bytes as each is written. ``path`` may be a URL
    (``s3://bucket/model.netcl``, any fsspec URL, with ``storage_options``):
    the same bytes, uploaded in one atomic upload (:mod:`fastckpt.formats.remote`).
    An existing file at ``path`` is replaced only with ``overwrite=True``
    (docs/overwrite.md).

    >>> save_model(Sequential(Linear(None, 4, 2), ReLU()), "out/tiny.netcl")   # doctest: +SKIP
    """
    from fastckpt.store.commit import overwrite_flag
    from fastckpt.formats.npz import save_npz

    overwrite = overwrite_flag(overwrite)

    meta = model_metadata(model)
    try:  # before anything is written: a config that JSON cannot hold leaves no file
        text = json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"model config is not JSON-serialisable ({exc}); config args must be plain "
                        "str/int/float/bool/None/list/dict values") from None
    named = model.named_tensors()
    if META_KEY in named:  # cannot happen with "{i}:{k}" keys; guards user-built state names
        raise ValueError(f"a state key collides with {META_KEY!r}")

    started = time.perf_counter()
    total = None
    if requested(progress):  # known up front where every state tensor says its size (fastckpt Tensors do)
        sizes = [getattr(tensor, "nbytes", None) for tensor in named.values()]
        total = sum(sizes) if all(isinstance(n, int) for n in sizes) else None
    written = [0]

    def entries(report):
        for key, tensor in named.items():
            host = tensor.to_host()  # one tensor on the host at a time
            yield key, host
            written[0] += host.nbytes
            report.advance(host.nbytes, key)  # asked for the next: this one is written
        yield META_KEY, np.array(text)

    with progress_from(progress, total, "save model") as report, part_of_a_save():  # this save logs its own line
        save_npz(os.fspath(path), entries(report), alignment=4096, fsync=fsync, storage_options=storage_options,
                 overwrite=overwrite)
    _log.info("saved model %s: %d weights, %d bytes in %.3f s", os.fspath(path), len(named), written[0],
              time.perf_counter() - started)


# -- loading --------------------------------------------------------------------------------------
def resolve_model_path(path: str | os.PathLike) -> tuple[str, str, str | None]:
    """``(layout, weights_path, json_path)`` for ``path``, resolved as netcl does.

    ``layout`` is ``"single-file"`` or ``"legacy"``; ``json_path`` is set for legacy pairs.
    Raises :class:`~fastckpt.errors.CheckpointNotFoundError` listing the paths tried.

    >>> resolve_model_path("mnist_mlp")          # doctest: +SKIP
    ('single-file', 'mnist_mlp.netcl', None)
    """
    p = os.fspath(path)
    if os.path.isfile(p):
        return "single-file", p, None
    if os.path.isfile(p + ".json") and os.path.isfile(p + ".npz"):
        return "legacy", p + ".npz", p + ".json"
    if os.path.isfile(p + ".netcl"):
        return "single-file", p + ".netcl", None
    tried = [p, f"{p}.json + {p}.npz", f"{p}.netcl"]
    hint = " (it is a directory)" if os.path.isdir(p) else ""
    raise CheckpointNotFoundError(
        f"no model file at {p!r}{hint}; tried: " + "; ".join(tried)
        + ". save_model writes a single file at exactly the path given"
    )


def _decode_meta(path: str, array: np.ndarray) -> dict:
    # "O": a TensorFlow string tensor, read as an object array of bytes.
    value = array.reshape(()).item() if array.size == 1 else None
    if array.size != 1 or array.dtype.kind not in "USO" or not isinstance(value, (str, bytes)):
        raise FormatError(
            f"{path}: {META_KEY!r} must be a 0-d string array holding JSON, got {array.dtype}{array.shape}"
        )
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{path}: {META_KEY!r} is not UTF-8 ({exc})") from None
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nesting deeper than json can parse
        raise FormatError(f"{path}: {META_KEY!r} is not valid JSON ({exc}); first bytes: {value[:60]!r}") from None


def _check_meta(path: str, meta, layout: str) -> tuple[int, list]:
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: model metadata must be a JSON object, got {type(meta).__name__}")
    kind = meta.get("type")
    if kind != "Sequential":
        raise FormatError(f"{path}: model type {kind!r} is not supported; only 'Sequential' models can be loaded")
    default_version = 1 if layout == "legacy" else FORMAT_VERSION
    version = meta.get("version", default_version)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise FormatError(f"{path}: metadata 'version' must be a positive int, got {version!r}")
    if version > FORMAT_VERSION:
        raise FormatError(
            f"{path}: model file version {version} is newer than this fastckpt supports "
            f"(versions 1 to {FORMAT_VERSION}); reading it needs a fastckpt that supports version {version}: "
            "upgrade fastckpt"
        )
    fmt = meta.get("format")
    if fmt is not None and fmt not in _KNOWN_FORMATS:
        raise FormatError(f"{path}: metadata 'format' is {fmt!r}; expected {FORMAT_NAME!r}")
    if "config" in meta and meta["config"] is not None:
        config = meta["config"]
    elif "layers" in meta:
        config = meta["layers"]
    else:
        raise FormatError(f"{path}: model metadata has neither a 'config' nor a 'layers' list")
    if not isinstance(config, list):
        raise FormatError(f"{path}: metadata 'config' must be a list, got {type(config).__name__}")
    return version, config


def _read_metadata(layout: str, weights, json_path: str | None) -> tuple[str, dict]:
    if layout == "legacy":
        try:
            with open(json_path, "rb") as f:
                return json_path, json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise FormatError(f"{json_path}: legacy model metadata is not valid JSON ({exc})") from None
    if META_KEY not in weights.infos:
        raise FormatError(
            f"{weights.path}: model file is missing NetCL metadata (no {META_KEY!r} entry; "
            f"{len(weights.infos)} entries). A raw parameter NPZ is read with fastckpt.io.checkpoint.load_params; "
            "a legacy export is the pair X.json + X.npz, loaded by passing X"
        )
    with guard(weights, "its metadata"):
        return weights.path, _decode_meta(weights.path, weights.host(META_KEY))


def verify_members(reader) -> None:
    """Check the CRC-32 of every member of an open NPZ reader; ``load_model(verify=True)`` runs it first.

    Raises :class:`~fastckpt.errors.ChecksumMismatchError` naming the file and
    the first tensor whose bytes do not match the CRC-32 the archive's central
    directory records, and ``ValueError`` for a reader that is not an NPZ file
    (its format keeps no such checksums).

    >>> import tempfile, os, numpy as np, fastckpt
    >>> p = os.path.join(tempfile.mkdtemp(), "m.npz"); fastckpt.save_npz(p, {"w": np.ones(3)})
    >>> with fastckpt.open(p) as f:
    ...     verify_members(f)
    """
    from fastckpt.errors import ChecksumMismatchError, IntegrityError
    from fastckpt.formats.npz import NpzTensorInfo, verify_member

    mapped = getattr(reader, "mapped", None)
    infos = list(reader.infos.values())
    if mapped is None or not all(isinstance(i, NpzTensorInfo) for i in infos):
        kind = getattr(reader, "format", type(reader).__name__)
        raise ValueError(f"{reader.path}: verify=True checks the CRC-32 of NPZ members, and this {kind} file keeps "
                         "none; load it with verify=False")
    with mapped.guard("its members for their CRC-32"):
        for info in infos:
            try:
                verify_member(mapped, info)
            except IntegrityError as exc:
                raise ChecksumMismatchError(f"{exc} (tensor {info.name!r}); restore the file from a copy, or pass "
                                            "verify=False to load it anyway") from None


def _materialize_missing(queue, model, entries, indices) -> None:
    """Give weights the file lacked their seeded initial values: rebuild those layers (``indices``) normally."""
    from fastckpt.nn import build_layer

    for i in indices:
        layer = model.layers[i]
        placeholders = [k for k, t in layer.named_tensors().items() if t.buffer is None]
        if placeholders:
            fresh = build_layer(queue, entries[i], index=i)
            for key in placeholders:
                setattr(layer, key, getattr(fresh, key))


class _Recipe:
    """What :func:`load_model` works out from a file before reading its weights: kept per open file and reused.

    ``writes`` is ``[(layer index, state key, tensor name, shape or None)]``: where each loaded tensor goes, with
    the model's shape where the stored one differs by size-1 dimensions (bound as a view of that shape).
    """

    __slots__ = ("meta_path", "version", "entries", "blueprint", "writes", "missing", "unexpected", "wanted",
                 "missing_layers")

    def __init__(self, meta_path, version, entries, blueprint, model, tf, path):
        from fastckpt.nn.module import TensorSpec

        self.meta_path, self.version, self.entries, self.blueprint = meta_path, version, entries, blueprint
        # Validate against the index only (shapes from the file's headers): nothing is read or copied yet.
        infos = {name: info for name, info in tf.infos.items() if name != META_KEY}
        plan = model._plan_load({name: TensorSpec(tuple(info.shape), info.dtype) for name, info in infos.items()})
        if plan.errors:
            raise ValueError(f"{path}: state_dict shape mismatch (nothing was loaded): " + "; ".join(plan.errors))
        self.writes = []
        for module, key, spec, full_key in plan.writes:
            shape = getattr(module, key).shape
            self.writes.append((int(full_key.partition(":")[0]), key, full_key,
                                None if tuple(spec.shape) == shape else shape))
        self.missing = list(plan.missing)
        self.unexpected = list(plan.unexpected)
        unexpected = set(plan.unexpected)
        self.wanted = tuple(name for name in infos if name not in unexpected)
        self.missing_layers = sorted({int(key.partition(":")[0]) for key in plan.missing})


# Recipes of open files, keyed by id(file); an entry is dropped with its file (a pool keeps a file open only
# while os.stat shows it unchanged, see fastckpt.device.pool.OpenFiles, so a recipe is never older than its file).
_recipes: dict[int, tuple] = {}
_recipes_lock = threading.Lock()


def _cached_recipe(tf, queue) -> _Recipe | None:
    entry = _recipes.get(id(tf))
    if entry is None or entry[0]() is not tf or entry[1] is not queue or not entry[2].blueprint.current:
        return None
    return entry[2]


def _keep_recipe(tf, queue, recipe: _Recipe) -> None:
    """Keep ``recipe`` for later loads of the read-only mapped file ``tf`` into the same queue."""
    from fastckpt.formats.reader import TensorFile

    # A copy-on-write mapping may have been written through (a zero-copy load): its metadata is not the file's.
    if not isinstance(tf, TensorFile) or tf.mapped.copy_on_write or not recipe.blueprint.reusable:
        return
    key = id(tf)

    def forget(ref, key=key):
        with _recipes_lock:
            if _recipes.get(key, (None,))[0] is ref:
                del _recipes[key]

    with _recipes_lock:
        _recipes[key] = (weakref.ref(tf, forget), queue, recipe)


def _bind(model, writes, tensors) -> bool:
    """Make each loaded tensor (every copy finished) the parameter ``writes`` names; True when a view starts
    mid-element (it needs :func:`~fastckpt.device.load.realign`)."""
    from fastckpt.device.tensor import Tensor

    layers = model.layers
    odd = False
    for index, key, name, shape in writes:
        value = tensors[name]
        if value.offset % value.dtype.itemsize:
            odd = True
        if shape is not None:
            # SAFETY: the view shares value's buffer; owner keeps value (and its arena lease) alive.
            value = Tensor(value.buffer, shape, value.dtype, offset=value.offset, queue=value.queue, owner=value)
        setattr(layers[index], key, value)
    return odd


def load_model(path, queue=None, pool=None, *, strict: bool = True, verify: bool = False, progress=False,
               storage_options: dict | None = None) -> LoadedModel:
    """Load a Sequential from a ``.netcl`` file (or a legacy ``X.json`` + ``X.npz`` pair), or from an open reader.

    ``path`` is resolved as in :func:`resolve_model_path`; it may also be an open
    reader of the contract (:class:`~fastckpt.formats.contract.TensorReader`: a
    :class:`fastckpt.TensorFile`, a :class:`fastckpt.tf.CheckpointReader`, ...)
    holding the ``__netcl_meta__`` entry and the weights, read as a single-file
    model (layout ``"single-file"``, the reader's ``path`` in the report) and
    left open. Its weights load as :func:`~fastckpt.device.load.load_file` loads that
    reader: one copy for a mapped file, through ``host(name)`` otherwise.

    ``queue`` defaults to ``pool.queue``, else :func:`fastckpt.device.default`'s. With
    ``pool`` (a :class:`fastckpt.device.pool.PersistentBufferPool`) all weights land in one
    pooled arena with one copy and become the parameters directly; loading again through
    the same pool allocates nothing. The pool also keeps the file open while ``os.stat``
    shows it unchanged (:class:`~fastckpt.device.pool.OpenFiles`), and with it what was
    worked out from the file: the validated config, the layers' blueprint
    (:class:`fastckpt.nn.LayerBlueprint`) and where each weight goes; a reload then only
    copies the layers and binds each weight to its view of the arena (a changed file, or a
    layer type registered since, is read and planned anew). Without a pool, each weight
    gets its own exact-size buffer, copied from the mapped file.

    Missing weights keep their freshly built values and are reported (a
    :class:`MissingWeightsWarning` and ``model.load_report.missing_keys``). Entries the
    model does not have raise ``KeyError`` unless ``strict=False``. A shape mismatch
    raises ``ValueError`` naming the key and both shapes. The stored dtype is kept.
    ``verify=True`` first checks every NPZ member's CRC-32 against the ZIP
    central directory (reading every byte once; stored members are otherwise
    viewed without it) and raises :class:`~fastckpt.errors.ChecksumMismatchError`
    naming the file and the tensor that fails, before anything reaches the
    device; a reader without such checksums (safetensors, TensorFlow) is a
    ``ValueError``. ``progress`` (``True`` for a bar, or ``callback(done, total, item)``:
    :mod:`fastckpt.progress`) counts the weights' bytes as they reach the device.
    A URL (``s3://bucket/model.netcl``, with ``storage_options``) names one
    ``.netcl`` file: its index is fetched, then its weights stream with parallel
    ranged reads straight into the arena or their buffers
    (:mod:`fastckpt.formats.stream`: at most ``THREADS x CHUNK`` bytes held);
    with ``verify=True`` each member's CRC-32 is checked from the pieces as
    they pass to the device (every byte fetched once; members the model does
    not load are fetched through the check only), and a mismatch is a
    :class:`~fastckpt.errors.ChecksumMismatchError` naming the URL and the
    member, raised before anything is returned.

    >>> model = load_model("mnist_mlp.netcl", pool=pool)       # doctest: +SKIP
    >>> model.load_report.file_report.copies                   # doctest: +SKIP
    1
    """
    import fastckpt
    from fastckpt.formats.contract import TensorReader
    from fastckpt.formats.reader import TensorFile
    from fastckpt.nn import LayerBlueprint, Sequential, normalize_config

    t0 = time.perf_counter()
    if is_url(path):  # one .netcl file in object storage (fastckpt.formats.remote)
        layout, weights_path, json_path, source = "single-file", path, None, None
    elif isinstance(path, (str, os.PathLike)):
        layout, weights_path, json_path = resolve_model_path(path)
        source = None
    elif isinstance(path, TensorReader):
        layout, weights_path, json_path, source = "single-file", path.path, None, path
    else:
        raise TypeError(f"load_model needs a path or an open reader of the contract fastckpt.formats.contract.TensorReader, "
                        f"got {type(path).__name__}")
    if queue is None and pool is not None:
        queue = getattr(pool, "queue", None)
    if queue is None:
        from fastckpt.device import default

        queue = default().queue

    # A pool keeps the files loaded through it open (mapped, index parsed) while os.stat shows them unchanged;
    # a model reloaded from one then reuses its recipe (_Recipe) too.
    files = getattr(pool, "files", None) if source is None and storage_options is None and not is_url(path) else None
    reused = False
    if source is not None:
        opened = contextlib.nullcontext(source)
    elif files is not None:
        source = files.get(weights_path)
        reused = source is not None
        if source is None:  # a cold file is read with O_DIRECT (load_file), not through its first window
            source = fastckpt.open(weights_path, first_window=False)
        if reused or (isinstance(source, TensorFile) and files.put(weights_path, source)):
            opened = contextlib.nullcontext(source)  # the pool's now: left open for the next load
        else:
            opened = source  # closed after this load
    elif is_url(weights_path):
        # The index only: the weights stream from the store into the arena or their buffers (load_file), their
        # CRC-32s (verify=True) checked from the pieces as they pass.
        from fastckpt.formats.remote import open_streamed

        opened = open_streamed(weights_path, storage_options=storage_options)
    else:
        opened = fastckpt.open(weights_path, storage_options=storage_options)
    with opened as tf:
        streamed = hasattr(tf, "check_as_read")
        if verify and streamed:
            tf.check_as_read()
        elif verify:
            verify_members(tf)
        recipe = _cached_recipe(tf, queue) if layout == "single-file" else None
        if recipe is None:
            meta_path, meta = _read_metadata(layout, tf, json_path)
            version, config = _check_meta(meta_path, meta, layout)
            try:
                entries = normalize_config(config)
                # Built-in layers get placeholders (no random init, no allocation), equal entries built once.
                blueprint = LayerBlueprint(queue, entries)
                model = Sequential(blueprint.make())
            except ValueError as exc:
                raise FormatError(f"{meta_path}: cannot rebuild the model: {exc}") from None
            recipe = _Recipe(meta_path, version, entries, blueprint, model, tf, weights_path)
            if layout == "single-file":
                _keep_recipe(tf, queue, recipe)
        else:
            model = Sequential(recipe.blueprint.make())
        report = ModelLoadReport(path=weights_path, layout=layout, version=recipe.version, pooled=pool is not None)
        if recipe.unexpected and strict:
            shown = recipe.unexpected[:10] + (["..."] if len(recipe.unexpected) > 10 else [])
            raise KeyError(
                f"{weights_path}: {len(recipe.unexpected)} entries match no model weight: {shown}; "
                "pass strict=False to ignore them"
            )
        report.missing_keys = list(recipe.missing)
        report.unexpected_keys = list(recipe.unexpected)

        from fastckpt.device.load import load_file, realign

        # With a pool: one copy into one arena. Without: one exact-size buffer per weight, the copies
        # queued back to back and waited for once.
        loaded = load_file(tf, queue, pool=pool, names=recipe.wanted, progress=progress)
        if verify and streamed:
            try:
                tf.check_the_rest()  # the members this load did not read (entries the model does not have)
            except BaseException:
                loaded.release()
                raise
        if reused:
            loaded.report.file_reused = True
        report.file_report = loaded.report
        loaded.wait()  # a no-op after this blocking load; the views made now carry no pending copy
        # The plan was validated against the index; the loaded tensors have exactly those shapes.
        if _bind(model, recipe.writes, loaded) and pool is not None:
            # Views starting mid-element (np.savez files): kernels index elements, so they move to an aligned arena.
            state = dict(loaded)
            report.realigned_keys = realign(state, queue, pool, loaded.report)
            moved = set(report.realigned_keys)
            _bind(model, [w for w in recipe.writes if w[2] in moved], state)
        if recipe.missing_layers:
            _materialize_missing(queue, model, recipe.entries, recipe.missing_layers)

    if report.missing_keys:
        shown = report.missing_keys[:10] + (["..."] if len(report.missing_keys) > 10 else [])
        warnings.warn(MissingWeightsWarning(
            f"{weights_path}: {len(report.missing_keys)} weights are not in the file and keep their freshly "
            f"built (seeded) values: {shown}; see model.load_report"), stacklevel=2)
    report.seconds = time.perf_counter() - t0
    model.load_report = report
    _log.info("loaded model %s (%s): %d weights, %d bytes in %.3f s, %d missing, %d unexpected", weights_path, layout,
              len(recipe.wanted), report.file_report.bytes_copied, report.seconds, len(report.missing_keys),
              len(report.unexpected_keys))
    return cast("LoadedModel", model)  # load_report is set above
