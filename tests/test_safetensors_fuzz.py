"""Fuzzing the safetensors parser: for any bytes, either a FormatError or a parse that is consistent
with the file's bytes and with the reference reader. Bounded by default; ``-m slow`` runs long."""

import itertools
import json
import os
import struct
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as st_numpy
from fastckpt._native.mapped import MappedFile
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fastckpt import FormatError
from fastckpt.formats.safetensors import dtype_to_safetensors, read_safetensors_index, read_tensor, save_safetensors
from test_packed_dtypes import hand_built  # a file laid out as safetensors' own writer lays it out

BACKENDS = ["mmap", "pread"]
# A short fuzz in the default run; the *_long tests (-m slow) run 5000 inputs each.
DEFAULT = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPE_NAMES = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16",
               "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
            "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8,
            "F64": 8, "I64": 8, "U64": 8}

# Packed sub-byte types: bits per element; a tensor is stored in count * bits / 8 bytes, which must be whole.
PACKED_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _stored_nbytes(dtype_name: str, shape) -> int:
    count = int(np.prod(shape, dtype=np.int64))
    if dtype_name in PACKED_BITS:
        return count * PACKED_BITS[dtype_name] // 8
    return count * ITEMSIZE[dtype_name]


def _whole_bytes(dtype_name: str, shape) -> bool:
    return dtype_name not in PACKED_BITS or int(np.prod(shape, dtype=np.int64)) * PACKED_BITS[dtype_name] % 8 == 0


_COUNTER = itertools.count()
_DIR = Path(tempfile.mkdtemp(prefix="fastckpt-st-fuzz-"))


def _seed_files() -> list[bytes]:
    seeds = []
    rng = np.random.default_rng(0)
    for i, (alignment, tensors, metadata) in enumerate([
        (8, {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": np.array(1.5, np.float32)}, {"k": "v"}),
        (8, {"w": rng.standard_normal((3, 2)).astype(ml_dtypes.bfloat16), "e": np.zeros((0, 2), np.int64),
             "f8": np.arange(5).astype(ml_dtypes.float8_e4m3fn), "m": np.array([True, False])}, None),
        (64, {"c": np.ones(2, np.complex64), "u": np.arange(3, dtype=np.uint64)}, {"a": "1", "b": "ü"}),
    ]):
        p = _DIR / f"seed{i}.safetensors"
        save_safetensors(p, tensors, metadata, alignment=alignment, fsync=False)
        seeds.append(p.read_bytes())
    ref = _DIR / "seed-ref.safetensors"
    st_numpy.save_file({"x": np.arange(4, dtype=np.float64), "y": np.arange(3, dtype=np.uint8)}, ref,
                       metadata={"framework": "np"})
    seeds.append(ref.read_bytes())
    # Packed types, laid out as the reference writer lays them out (its Python API writes no F6).
    seeds.append(hand_built([("f", "F32", [1], bytes(4)), ("t", "F6_E3M2", [2, 4], bytes(range(6))),
                             ("s", "F6_E2M3", [4], b"\1\2\3"), ("q", "F4", [2, 3], b"\x21\x43\xf5"),
                             ("z", "F4", [0, 3], b"")]))
    return seeds


SEEDS = _seed_files()


def check(blob: bytes, backend: str) -> str:
    """Parse ``blob``; return "refused" on FormatError, else check the parse and return "parsed".

    Any other exception fails the test."""
    path = _DIR / f"f{next(_COUNTER)}.safetensors"
    path.write_bytes(blob)
    try:
        try:
            with MappedFile(path, backend=backend) as m:
                infos, metadata, data_start = read_safetensors_index(m)
                payloads = [read_tensor(m, info).tobytes() for info in infos]
        except FormatError as e:
            assert str(path) in str(e)
            event("refused")
            return "refused"
    finally:
        path.unlink()

    # Consistent with the bytes: the layout tiles the file exactly.
    (n,) = struct.unpack("<Q", blob[:8])
    assert data_start == 8 + n <= len(blob)
    header = blob[8:data_start]
    assert header[:1] == b"{" and header.rstrip(b" ").endswith(b"}")
    position = data_start
    for info, payload in zip(infos, payloads):
        assert info.offset == position
        if info.packed is not None:
            assert info.nbytes * 8 == int(np.prod(info.shape, dtype=object)) * PACKED_BITS[info.packed]
        else:
            assert info.nbytes == int(np.prod(info.shape, dtype=object)) * info.dtype.itemsize
        assert payload == blob[info.offset : info.offset + info.nbytes]
        position += info.nbytes
    assert position == len(blob)
    assert metadata is None or all(type(k) is str and type(v) is str for k, v in metadata.items())

    # Consistent with the reference reader: whatever fastckpt accepts, it accepts with the same content.
    reference = dict(safetensors.deserialize(blob))
    assert sorted(reference) == sorted(i.name for i in infos)
    for info, payload in zip(infos, payloads):
        entry = reference[info.name]
        assert entry["dtype"] == (info.packed or dtype_to_safetensors(info.dtype))
        assert tuple(entry["shape"]) == info.shape
        assert bytes(entry["data"]) == payload
    event("parsed")
    return "parsed"


# -- strategies ------------------------------------------------------------------------------

_mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("xor"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 10_000), st.integers(1, 8)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("length"), st.integers(0, 2**64 - 1), st.just(0)),
    st.tuples(st.just("length_delta"), st.integers(-16, 16), st.just(0)),
    st.tuples(st.just("digit"), st.integers(0, 10_000), st.sampled_from(b"0123456789-.e")),
)


def _mutate(blob: bytes, mutations) -> bytes:
    data = bytearray(blob)
    for kind, a, b in mutations:
        if kind == "length":
            data[:8] = struct.pack("<Q", a)
        elif kind == "length_delta":
            (n,) = struct.unpack("<Q", bytes(data[:8]).ljust(8, b"\0"))
            data[:8] = struct.pack("<Q", min(max(0, n + a), 2**64 - 1))
        elif not data:
            continue
        elif kind == "set":
            data[a % len(data)] = b
        elif kind == "xor":
            data[a % len(data)] ^= b
        elif kind == "insert":
            i = a % (len(data) + 1)
            data[i:i] = b
        elif kind == "delete":
            i = a % len(data)
            del data[i : i + b]
        elif kind == "truncate":
            del data[a % len(data) :]
        elif kind == "digit":
            digits = [i for i, c in enumerate(data) if 0x30 <= c <= 0x39]
            if digits:
                data[digits[a % len(digits)]] = b
    return bytes(data)


_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                         st.text(max_size=6))
_json = st.recursive(_json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                     max_leaves=6)
_dim = st.one_of(st.integers(0, 4), st.integers(-3, 2**65), st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, 2**63]))
_entry = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from(DTYPE_NAMES + ["F4", "F6_E2M3", "X", "f32"]), _json_scalar),
     "shape": st.one_of(st.lists(_dim, max_size=4), _json),
     "data_offsets": st.one_of(st.lists(st.integers(-2, 64), min_size=2, max_size=2), _json)},
    optional={"extra": _json},
)
_header = st.dictionaries(
    st.text(min_size=0, max_size=5),
    st.one_of(_entry, _json),
    max_size=4,
).flatmap(lambda d: st.one_of(
    st.just(d),
    st.dictionaries(st.text(max_size=4), st.one_of(st.text(max_size=6), _json_scalar), max_size=3).map(
        lambda meta: {"__metadata__": meta, **d}),
))


@st.composite
def _structured_file(draw):
    header = draw(_header)
    text = json.dumps(header, ensure_ascii=draw(st.booleans()), separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])))
    raw = text.encode("utf-8", "surrogatepass")
    pad = b" " * draw(st.integers(0, 9))
    data = draw(st.binary(max_size=80))
    return struct.pack("<Q", len(raw) + len(pad)) + raw + pad + data


@st.composite
def _valid_layout(draw):
    """A valid file built by hand (not by fastckpt's writer), with the tensors it must yield."""
    names = draw(st.lists(st.text(max_size=6).filter(lambda s: s != "__metadata__"), max_size=5, unique=True))
    specs = [(name, draw(st.sampled_from(DTYPE_NAMES + list(PACKED_BITS))),
              tuple(draw(st.lists(st.integers(0, 4), max_size=3)))) for name in names]
    specs = [(name, dtype_name, shape if _whole_bytes(dtype_name, shape) else shape[:-1] + (8,))
             for name, dtype_name, shape in specs]
    data_order = draw(st.permutations(range(len(specs))))
    header, chunks, offset = {}, [], 0
    for index in data_order:
        name, dtype_name, shape = specs[index]
        nbytes = _stored_nbytes(dtype_name, shape)
        header[name] = {"dtype": dtype_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        chunks.append(draw(st.binary(min_size=nbytes, max_size=nbytes)))
        offset += nbytes
    keys = draw(st.permutations(list(header)))
    header = {k: header[k] for k in keys}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=6), max_size=3))
    raw = json.dumps(header, ensure_ascii=draw(st.booleans())).encode("utf-8")
    raw += b" " * draw(st.integers(0, 9))
    expected = [(*header[name]["data_offsets"], name, header[name]["dtype"], tuple(header[name]["shape"]))
                for name in header if name != "__metadata__"]
    return struct.pack("<Q", len(raw)) + raw + b"".join(chunks), sorted(expected)


# -- properties ------------------------------------------------------------------------------


def _mutations_property(seed_index, mutations, backend):
    check(_mutate(SEEDS[seed_index], mutations), backend)


def _random_bytes_property(body, declared_length, backend):
    length = len(body) if declared_length is None else declared_length
    check(struct.pack("<Q", length) + body, backend)
    check(body, backend)


def _valid_layout_property(layout, backend):
    blob, expected = layout
    assert check(blob, backend) == "parsed"
    path = _DIR / f"v{next(_COUNTER)}.safetensors"
    path.write_bytes(blob)
    try:
        with MappedFile(path, backend=backend) as m:
            infos, _, data_start = read_safetensors_index(m)
        got = [(i.offset - data_start, i.offset - data_start + i.nbytes, i.name,
                i.packed or dtype_to_safetensors(i.dtype), i.shape) for i in infos]
        assert got == expected
    finally:
        path.unlink()


_seed = st.integers(0, len(SEEDS) - 1)
_mutations = st.lists(_mutation, min_size=1, max_size=4)
_body = st.binary(max_size=300)
_declared = st.one_of(st.none(), st.integers(0, 400))


@pytest.mark.parametrize("backend", BACKENDS)
@DEFAULT
@given(seed_index=_seed, mutations=_mutations)
def test_mutated_valid_files(backend, seed_index, mutations):
    _mutations_property(seed_index, mutations, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@DEFAULT
@given(body=_body, declared_length=_declared)
def test_random_bytes(backend, body, declared_length):
    _random_bytes_property(body, declared_length, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@DEFAULT
@given(blob=_structured_file())
def test_random_json_headers(backend, blob):
    check(blob, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@DEFAULT
@given(layout=_valid_layout())
def test_valid_hand_made_layouts_parse_exactly(backend, layout):
    _valid_layout_property(layout, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@LONG
@given(seed_index=_seed, mutations=_mutations)
def test_mutated_valid_files_long(backend, seed_index, mutations):
    _mutations_property(seed_index, mutations, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@LONG
@given(body=_body, declared_length=_declared)
def test_random_bytes_long(backend, body, declared_length):
    _random_bytes_property(body, declared_length, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@LONG
@given(blob=_structured_file())
def test_random_json_headers_long(backend, blob):
    check(blob, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@LONG
@given(layout=_valid_layout())
def test_valid_hand_made_layouts_parse_exactly_long(backend, layout):
    _valid_layout_property(layout, backend)


# -- the fast path against the checking parser -------------------------------------------------
# read_safetensors_index first tries a parser of headers in the common shape (no escapes, short
# integers, exactly dtype/shape/data_offsets); on anything else the checking parser runs. Both must
# give the same result, or the same error, for any bytes.

_WS = st.text(alphabet=" \t\n\r", max_size=2)
_number = st.one_of(
    st.integers(0, 70).map(str),
    st.sampled_from(["0", "00", "01", "-0", "-1", "1.0", "1e1", "4E0", "999999999999999999", "1000000000000000000",
                     "9223372036854775807", "9223372036854775808", "18446744073709551616", "true", "null", '"4"']),
)


def _one_in(n: int):
    """True about once in ``n`` draws (hypothesis favours the ends of a range, so not ``integers(0, n - 1) == 0``)."""
    return st.integers(0, n - 1).map(lambda v: v == n // 2)


@st.composite
def _common_shape_file(draw):
    """Headers written token by token: the common shape, with whitespace, orders and tokens the fast path
    must either parse exactly as the checking parser does, or leave to it."""
    count = draw(st.integers(0, 4))
    names = draw(st.lists(st.text(max_size=4), min_size=count, max_size=count, unique=True))
    if names and draw(_one_in(10)):  # a name the fast path leaves alone, or a repeated one
        names[-1] = draw(st.sampled_from(["__metadata__", names[0], "\\u0061", "\\", '"', "\n"]))
    offset, entries, chunks = 0, [], []
    for name in names:
        dtype_name = draw(st.sampled_from(DTYPE_NAMES) if not draw(_one_in(10))
                          else st.sampled_from(["F4", "F6_E2M3", "F6_E3M2", "X"]))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        known = dtype_name in ITEMSIZE or (dtype_name in PACKED_BITS and _whole_bytes(dtype_name, shape))
        # an unknown type, or packed bits that are not whole bytes: refused whatever the size
        nbytes = _stored_nbytes(dtype_name, shape) if known else int(np.prod(shape, dtype=np.int64))
        begin, end = offset, offset + nbytes
        if draw(_one_in(30)):
            begin, end = draw(st.integers(0, 40)), draw(st.integers(0, 40))
        offset += nbytes
        chunks.append(b"\xab" * nbytes)
        fields = [("dtype", f'"{dtype_name}"'),
                  ("shape", "[" + ",".join(draw(_WS) + (draw(_number) if draw(_one_in(20)) else str(d)) + draw(_WS)
                                           for d in shape) + "]"),
                  ("data_offsets", f"[{draw(_WS)}{draw(_number) if draw(_one_in(20)) else begin}{draw(_WS)},"
                                   f"{draw(_WS)}{end}{draw(_WS)}]")]
        fields = draw(st.permutations(fields))
        if draw(_one_in(30)):
            fields = fields + [draw(st.sampled_from(fields))]  # a repeated key
        if draw(_one_in(30)):
            fields = fields[:-1]
        body = ",".join(f'{draw(_WS)}"{k}"{draw(_WS)}:{draw(_WS)}{v}{draw(_WS)}' for k, v in fields)
        quoted = json.dumps(name, ensure_ascii=draw(_one_in(5)))[1:-1]
        entries.append(f'"{quoted}"{draw(_WS)}:{draw(_WS)}{{{body}}}')
    if draw(st.booleans()):
        pairs = draw(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))
        meta = draw(st.sampled_from(["null", "{}", "[]", '{"k":1}', '{"k":"v","k":"w"}']
                                    + [json.dumps(pairs, ensure_ascii=False)] * 5))
        entries.insert(draw(st.integers(0, len(entries))), f'"__metadata__"{draw(_WS)}:{draw(_WS)}{meta}')
    if entries and draw(_one_in(10)):
        entries.append(draw(st.sampled_from(entries)))  # a repeated tensor
    order = draw(st.permutations(range(len(entries))))
    text = "{" + draw(_WS) + ("," + draw(_WS)).join(entries[i] for i in order) + draw(_WS) + "}"
    if draw(_one_in(30)):
        text = text[:-1] + draw(st.sampled_from(["}}", ",}", "} }", "]"]))
    raw = text.encode("utf-8", "surrogatepass") + b" " * draw(st.integers(0, 3))
    data = b"".join(chunks)
    if draw(_one_in(10)):
        data = data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=3))
    return struct.pack("<Q", len(raw)) + raw + data


def _outcome(reader, path, backend):
    try:
        with MappedFile(path, backend=backend) as m:
            return "parsed", reader(m)
    except FormatError as e:
        return "refused", str(e)


def _array_or_error(call, *args):
    try:
        return call(*args)
    except ValueError as e:
        return str(e)


def _fast_and_checking_agree(blob: bytes, backend: str) -> None:
    """The fast path and the checking parser give equal results or the same message; the columnar
    index holds the same infos and its views the same bytes."""
    from fastckpt._native.safetensors import _read_index_checking, _read_table_fast_only, read_safetensors_table

    path = _DIR / f"a{next(_COUNTER)}.safetensors"
    path.write_bytes(blob)
    try:
        fast = _outcome(read_safetensors_index, path, backend)
        checking = _outcome(_read_index_checking, path, backend)
        assert fast == checking
        event(fast[0])
        only_fast = _outcome(_read_table_fast_only, path, backend)[1]  # an error of the fixed part, or None
        only_fast = None if isinstance(only_fast, str) else only_fast
        if only_fast is not None:
            event("parsed by the fast path")
            assert fast[0] == "parsed" and only_fast[0].info_list() == fast[1][0]
        if fast[0] == "parsed":
            infos, metadata, data_start = fast[1]
            with MappedFile(path, backend=backend) as m:
                index, table_metadata, table_start = read_safetensors_table(m)
                assert (index.info_list(), table_metadata, table_start) == (infos, metadata, data_start)
                assert list(index) == [i.name for i in infos]
                for info in infos:
                    view, general = _array_or_error(index.view, info.name), _array_or_error(read_tensor, m, info)
                    if info.packed is not None:  # never a view: the stored bytes, typed by a PackedArray
                        assert view is None and general.packed == info.packed and general.logical_shape == info.shape
                        assert general.tobytes() == blob[info.offset: info.offset + info.nbytes]
                        continue
                    if backend == "pread":
                        assert view is None  # no view of a mapping: the general path reads a copy
                        continue
                    assert type(view) is type(general)
                    if isinstance(view, str):  # numpy refuses some shapes (a 10**18 dimension beside a 0) alike
                        assert view == general
                        continue
                    assert view.dtype == info.dtype and view.shape == info.shape and view.flags.c_contiguous
                    assert view.tobytes() == general.tobytes() == blob[info.offset: info.offset + info.nbytes]
    finally:
        path.unlink()


@pytest.mark.parametrize("backend", BACKENDS)
@DEFAULT
@given(blob=_common_shape_file())
def test_fast_path_agrees_on_common_shape_headers(backend, blob):
    _fast_and_checking_agree(blob, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@DEFAULT
@given(seed_index=_seed, mutations=_mutations)
def test_fast_path_agrees_on_mutated_files(backend, seed_index, mutations):
    _fast_and_checking_agree(_mutate(SEEDS[seed_index], mutations), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@DEFAULT
@given(blob=_structured_file())
def test_fast_path_agrees_on_random_json_headers(backend, blob):
    _fast_and_checking_agree(blob, backend)


@pytest.mark.slow
@LONG
@given(blob=_common_shape_file())
def test_fast_path_agrees_on_common_shape_headers_long(blob):
    _fast_and_checking_agree(blob, "mmap")


def teardown_module(module):
    for p in _DIR.iterdir():
        p.unlink()
    os.rmdir(_DIR)
