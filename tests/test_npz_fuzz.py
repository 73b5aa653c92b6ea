"""Fuzzing the NPZ parser: damaged or random bytes give a FormatError, or a parse that stays inside the file.

The default run is bounded (a few hundred examples per property); ``-m slow``
runs the same properties with many more examples.
"""

import io
import os
import struct
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from fastckpt._native.mapped import MappedFile
from fastckpt._native.npz import _read_npz_checking, _read_npz_fast_only, read_npz_table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastckpt.formats.npz as npz
from fastckpt import FormatError, IntegrityError
from fastckpt.formats.npz import parse_npy_header, read_member, read_npz_index, save_npz

DEFAULT_EXAMPLES = 200
SLOW_EXAMPLES = 5000

ARRAYS = {
    "w": np.arange(6, dtype="<f4").reshape(2, 3),
    "b": np.array([True, False]),
    "f": np.asfortranarray(np.arange(6, dtype=">i2").reshape(3, 2)),
    "s": np.array([(1, b"ab")], dtype=[("x", "<u2"), ("y", "|S2")]),
    "__netcl_meta__": np.array('{"type": "Sequential"}'),
}


def _zip_of(path, arrays: dict, raw_names: dict = {}) -> None:
    """A stored ZIP of .npy members written by zipfile; ``raw_names`` then replaces ASCII names' bytes in place
    with others of the same length (e.g. cp437 bytes, which zipfile would not write unflagged)."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.save(buf, arr)
            z.writestr(name, buf.getvalue())
    data = Path(path).read_bytes()
    for name, raw in raw_names.items():
        assert len(name) == len(raw) and name.isascii()
        data = data.replace(name.encode(), raw)
    Path(path).write_bytes(data)


def _corpus() -> dict[str, bytes]:
    """Small valid archives of every kind the reader meets."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        def build(name, write):
            path = Path(d) / f"{name}.npz"  # np.savez appends .npz to other names
            write(path)
            out[name] = path.read_bytes()

        build("fastckpt-1", lambda p: save_npz(p, ARRAYS, alignment=1))
        build("fastckpt-64", lambda p: save_npz(p, ARRAYS, alignment=64))
        build("savez", lambda p: np.savez(p, **ARRAYS))
        build("savez_compressed", lambda p: np.savez_compressed(p, **ARRAYS))
        # names the fast path reads (UTF-8, a ':' past the drive-letter place), and a cp437 name it leaves to the
        # checking parser
        build("utf8-names", lambda p: np.savez(p, **{"é/ü": ARRAYS["w"], "a/b:c": ARRAYS["b"]}))
        build("cp437-name", lambda p: _zip_of(p, {"Ex.npy": ARRAYS["w"]}, {"Ex.npy": b"\x82x.npy"}))
        limits = npz._ZIP64_LIMIT, npz._ZIP_FILECOUNT_LIMIT
        npz._ZIP64_LIMIT = npz._ZIP_FILECOUNT_LIMIT = 0  # every zip64 structure, in a small file
        try:
            build("fastckpt-zip64", lambda p: save_npz(p, ARRAYS, alignment=16))
        finally:
            npz._ZIP64_LIMIT, npz._ZIP_FILECOUNT_LIMIT = limits
    return out


CORPUS = _corpus()
INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1]


@st.composite
def mutated_archive(draw):
    data = bytearray(CORPUS[draw(st.sampled_from(sorted(CORPUS)))])
    for _ in range(draw(st.integers(1, 3))):
        # Mostly in-place damage: a shifted file fails at its end record, in-place damage reaches deeper checks.
        op = draw(st.sampled_from(["flip"] * 4 + ["field"] * 4 + ["insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
        elif op == "field" and data:
            width = draw(st.sampled_from([2, 4, 8]))
            value = draw(st.sampled_from(INTERESTING)) & ((1 << (8 * width)) - 1)
            data[pos:pos + width] = value.to_bytes(width, "little")[: len(data) - pos]
    return bytes(data)


@st.composite
def random_archive(draw):
    """Random bytes, sometimes ending in a plausible end record so that deeper code runs."""
    body = draw(st.binary(max_size=600))
    if draw(st.booleans()):
        count = draw(st.integers(0, 3))
        cd_size = draw(st.integers(0, len(body)))
        cd_offset = draw(st.sampled_from([len(body) - cd_size, draw(st.integers(0, 2**32 - 1))]))
        body += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, max(0, cd_offset), 0)
    return body


def _outcome(read, m):
    try:
        return "parsed", read(m)
    except FormatError as e:
        return "refused", str(e)


class Checker:
    """Writes each example to a fresh inode (so views of an earlier mapping never see a truncated file) and
    checks the outcome."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="npz-fuzz-"))
        self.path = self.dir / "x.npz"
        self.parsed = 0
        self.refused = 0
        self.fast = 0  # archives the fast path parsed (equal to the checking parser's infos)

    def __call__(self, data: bytes, backend: str) -> None:
        tmp = self.dir / "x.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with MappedFile(self.path, backend=backend) as m:
                checking = _outcome(_read_npz_checking, m)
                try:
                    infos = read_npz_index(m)
                except FormatError as e:
                    assert checking == ("refused", str(e))  # the fast path leaves every refusal to the checking parser
                    self.refused += 1
                    return
                assert checking == ("parsed", infos)
                fast = _outcome(_read_npz_fast_only, m)
                if fast[0] == "parsed" and fast[1] is not None:
                    assert fast[1] == infos
                    self.fast += 1
                self.parsed += 1
                table = read_npz_table(m)  # the columnar index: the same infos, in payload-offset order
                assert table.info_list() == sorted(infos, key=lambda i: i.offset)
                for info in infos:
                    assert 0 <= info.offset and info.offset + info.nbytes <= len(data), info
                    assert info.nbytes >= 0 and not info.dtype.hasobject
                    view = table.view(info.name)
                    assert view is None if backend == "pread" or info.compression else view is not None
                    try:
                        arr = read_member(m, info)
                    except (FormatError, IntegrityError):
                        continue
                    assert arr.shape == info.shape and arr.dtype == info.dtype
                    if view is not None:
                        assert view.shape == arr.shape and view.dtype == arr.dtype and view.tobytes() == arr.tobytes()


CHECK = Checker()
BACKEND = st.sampled_from(["mmap", "pread"])
FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@settings(max_examples=DEFAULT_EXAMPLES, **FUZZ)
@given(data=mutated_archive(), backend=BACKEND)
def test_mutated_archives(data, backend):
    CHECK(data, backend)


@settings(max_examples=DEFAULT_EXAMPLES, **FUZZ)
@given(data=random_archive(), backend=BACKEND)
def test_random_bytes(data, backend):
    CHECK(data, backend)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, **FUZZ)
@given(data=mutated_archive(), backend=BACKEND)
def test_mutated_archives_long(data, backend):
    CHECK(data, backend)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, **FUZZ)
@given(data=random_archive(), backend=BACKEND)
def test_random_bytes_long(data, backend):
    CHECK(data, backend)


# -- the .npy header parser on its own ------------------------------------------------------------

HEADER_TEXTS = [
    "{'descr': [('a', '<f4'), (('t', 'n'), '>i2', (2,))], 'fortran_order': False, 'shape': (3, 4), }",
    "{'descr': '<f4', 'fortran_order': True, 'shape': (3, 4), }" + " " * 19 + "\n",  # numpy's plain-dtype form
]
HEADER_ALPHABET = st.sampled_from(list("{}()[]',:\"\\ -0123456789TrueFalsNonxu<>|fiUSOV" + "é\n"))


@st.composite
def mutated_header(draw):
    text = list(draw(st.sampled_from(HEADER_TEXTS)))
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["replace", "insert", "delete"]))
        if op == "insert" or pos == len(text):
            text[pos:pos] = draw(st.lists(HEADER_ALPHABET, min_size=1, max_size=8))
        elif op == "replace":
            text[pos] = draw(HEADER_ALPHABET)
        else:
            del text[pos:pos + draw(st.integers(1, 8))]
    body = "".join(text).encode("utf-8")
    version = draw(st.sampled_from([(1, 0), (2, 0), (3, 0)]))
    length = struct.pack("<H" if version == (1, 0) else "<I", len(body))
    return b"\x93NUMPY" + bytes(version) + length + body


def check_header(data: bytes) -> None:
    try:
        dtype, shape, fortran, n = parse_npy_header(data)
    except FormatError:
        return
    assert isinstance(dtype, np.dtype) and not dtype.hasobject
    assert type(shape) is tuple and all(type(d) is int and d >= 0 for d in shape)
    assert type(fortran) is bool and n <= len(data)


@settings(max_examples=DEFAULT_EXAMPLES, **FUZZ)
@given(data=mutated_header())
def test_mutated_npy_headers(data):
    check_header(data)


@settings(max_examples=DEFAULT_EXAMPLES, **FUZZ)
@given(data=st.binary(max_size=300).map(lambda b: b"\x93NUMPY\x01\x00" + b))
def test_random_npy_headers(data):
    check_header(data)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, **FUZZ)
@given(data=mutated_header())
def test_mutated_npy_headers_long(data):
    check_header(data)


def test_corpus_parses_before_mutation():
    # The properties above only mean something if the unmutated corpus parses.
    for name, data in CORPUS.items():
        before, fast = CHECK.parsed, CHECK.fast
        CHECK(data, "mmap")
        assert CHECK.parsed == before + 1, name
        # the fast path takes every stored archive with plain names, and leaves the rest to the checking parser
        assert CHECK.fast == fast + (name not in ("savez_compressed", "cp437-name")), name
    buf = io.BytesIO()
    np.save(buf, np.zeros((3, 4), [("a", "<f4"), (("t", "n"), ">i2", (2,))]))
    assert parse_npy_header(buf.getvalue())[1] == (3, 4)
    with MappedFile(_write(CORPUS["cp437-name"])) as m:
        assert [i.name for i in read_npz_index(m)] == ["éx"]


@pytest.mark.parametrize("name", ["é:x.npy", "a/../b.npy", "C:x.npy", "/x.npy", "x.npz", "a\\b.npy"])
def test_names_the_checking_parser_refuses_are_refused_alike(tmp_path, name):
    path = tmp_path / "n.npz"
    _zip_of(path, {name: ARRAYS["w"]})
    with MappedFile(path) as m:
        assert _read_npz_fast_only(m) is None
        refused = _outcome(read_npz_index, m)
        assert refused[0] == "refused" and refused == _outcome(_read_npz_checking, m)


def _write(data: bytes) -> Path:
    path = Path(tempfile.mkdtemp(prefix="npz-fuzz-")) / "x.npz"
    path.write_bytes(data)
    return path
