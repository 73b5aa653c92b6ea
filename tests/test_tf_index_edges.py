"""Edge cases of the columnar TensorFlow bundle index (read_bundle_index / BundleIndex).

Each test compares the columnar reader with the per-entry path of tests/test_tf_index.py (``check_same``) or
checks one property the change claims: the CRC32C routine (hardware and table paths) against the crc32c package,
``verify=True`` detecting a flipped data byte through every read path, shards viewed from the right file by
concurrent threads, and no crash when the reader is closed under a running ``hosts()``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import crc32c
import numpy as np
import pytest
from _threads import run_in_threads
from fastckpt._native.mapped import MappedFile
from fastckpt._native.tftable import crc32c_of
from test_tf_index import _bundle, _crc, _fix_checksums, _old_host, _old_open, _outcome, check_same

from fastckpt.errors import ChecksumMismatchError, FormatError
from fastckpt.formats.tf.proto import BundleHeader, encode_entry, encode_header
from fastckpt.formats.tf.reader import CheckpointReader, encode_tensor_name_slice
from fastckpt.formats.tf.table import IndexTable, TableBuilder
from fastckpt.tf import write_checkpoint

TFTABLE_PYX = Path(__file__).resolve().parents[1] / "fastckpt" / "_native" / "tftable.pyx"


# -- CRC32C ---------------------------------------------------------------------------------------------------------


def test_crc32c_of_every_length_to_300_at_every_alignment():
    rng = np.random.default_rng(3)
    buf = bytearray(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    view = memoryview(buf)
    for length in range(301):
        for align in range(16):
            piece = view[align:align + length]
            start = int(rng.integers(0, 2**32))
            assert crc32c_of(piece) == crc32c.crc32c(bytes(piece)), (length, align)
            assert crc32c_of(piece, start) == crc32c.crc32c(bytes(piece), start), (length, align)


def _compiled_crc_routines(tmp_path):
    """The C routines of tftable.pyx compiled on their own, so that the table path can be called directly."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = TFTABLE_PYX.read_text()
    start = src.index('    """\n    #include <stdint.h>') + len('    """\n')
    body = src[start:src.index('    """\n    void fastckpt_crc32c_init')]
    body = "\n".join(line[4:] if line.startswith("    ") else line for line in body.splitlines())
    body += ("\nuint32_t table_crc(uint32_t c, const uint8_t* p, size_t n) { return fastckpt_crc32c_sw(c, p, n); }"
             "\nvoid init(void) { fastckpt_crc32c_init(); }\n")
    (tmp_path / "crc.c").write_text(body)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp_path / "crc.so"), str(tmp_path / "crc.c")],
                   check=True)
    lib = ctypes.CDLL(str(tmp_path / "crc.so"))
    lib.init()
    lib.table_crc.restype = ctypes.c_uint32
    lib.table_crc.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return lib


def test_crc32c_table_path_every_length_to_300_at_every_alignment(tmp_path):
    lib = _compiled_crc_routines(tmp_path)
    rng = random.Random(5)
    raw = bytes(rng.randrange(256) for _ in range(4096))
    buf = ctypes.create_string_buffer(raw, len(raw))
    for length in range(301):
        for align in range(16):
            start = rng.randrange(2**32)
            got = lib.table_crc(start, ctypes.addressof(buf) + align, length)
            assert got == crc32c.crc32c(raw[align:align + length], start), (length, align)


# -- verify=True on every read path ---------------------------------------------------------------------------------


def _three_shards(tmp_path, n=12, length=5, dtype=np.int32):
    """A 3-shard checkpoint whose shards have the same layout (same offsets): a tensor read from the wrong shard
    gives wrong values."""
    tensors = {f"t{i:03d}": np.full(length, i, dtype) for i in range(n)}
    prefix = str(tmp_path / "s3")
    write_checkpoint(prefix, tensors, num_shards=3, fsync=False)
    return prefix, tensors


@pytest.mark.parametrize("length", [5, 70000])  # checked here, and by the crc32c package (64 KiB and more)
@pytest.mark.parametrize("where", ["first", "last"])
def test_verify_detects_a_flipped_data_byte_on_every_read_path(tmp_path, length, where):
    prefix, tensors = _three_shards(tmp_path, length=length)
    with CheckpointReader(prefix) as reader:
        infos = {n: reader.info(n) for n in tensors}
    for shard in range(3):
        name = next(n for n in tensors if infos[n].shard == shard)
        info = infos[name]
        path = Path(f"{prefix}.data-{shard:05d}-of-00003")
        raw = bytearray(path.read_bytes())
        at = info.offset + (0 if where == "first" else info.nbytes - 1)
        raw[at] ^= 0x10
        path.write_bytes(bytes(raw))
        with CheckpointReader(prefix) as reader:
            reader.hosts([n for n in tensors if n != name])  # warms the shard cache
            paths = {
                "host": lambda: reader.host(name),
                "hosts": lambda: reader.hosts(),
                "hosts(names)": lambda: reader.hosts([name]),
                "read_tensor": lambda: reader.read_tensor(name),
                "read_tensor(copy)": lambda: reader.read_tensor(name, copy=True),
                "getitem": lambda: reader[name],
                "get": lambda: reader.get(name),
                "values": lambda: list(reader.values()),
            }
            for label, read in paths.items():
                with pytest.raises(ChecksumMismatchError, match=f"tensor {name!r} at offset {info.offset}"):
                    read()
                    pytest.fail(label)
            assert reader.infos.view(name) is None
        import fastckpt

        with fastckpt.open(prefix) as reader:  # the reader contract's entry point
            with pytest.raises(ChecksumMismatchError, match=f"tensor {name!r} at offset {info.offset}"):
                reader.hosts()
        with CheckpointReader(prefix, verify=False) as reader:
            got = reader.host(name)
            assert got.tobytes() == bytes(raw[info.offset:info.offset + info.nbytes])
            assert reader.hosts()[name].tobytes() == got.tobytes()
        raw[at] ^= 0x10
        path.write_bytes(bytes(raw))


# -- threads and lifetime ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [5, 20000])  # 80 KB tensors: the crc32c package's path, which drops the GIL
@pytest.mark.parametrize("verify", [True, False])
def test_two_threads_hosts_on_three_shards(tmp_path, verify, length):
    prefix, tensors = _three_shards(tmp_path, n=60 if length < 100 else 12, length=length)
    errors = []
    with CheckpointReader(prefix, verify=verify) as reader:
        names = reader.tensor_names()
        offsets = {}
        for n in names:
            offsets.setdefault(reader.info(n).offset, set()).add(reader.info(n).shard)
        assert any(len(s) == 3 for s in offsets.values())  # the same offsets in every shard
        barrier = threading.Barrier(2)

        def run(k):
            barrier.wait()
            for rep in range(300 if length < 100 else 40):
                order = names if (rep + k) % 2 else names[::-1]
                got = reader.hosts() if rep % 3 else reader.hosts(order)
                for n in order:
                    if not np.array_equal(got[n], tensors[n]):
                        errors.append((k, rep, n, got[n][:3].tolist()))
                        return

        old_interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            errors += run_in_threads(run, 2)
        finally:
            sys.setswitchinterval(old_interval)
    assert errors == []


def test_close_while_another_thread_runs_hosts(tmp_path):
    prefix, tensors = _three_shards(tmp_path, n=90, length=20000)  # 80 KB each: the crc32c package's path too
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(20):
            reader = CheckpointReader(prefix)
            results = []

            def run():
                try:
                    for _ in range(20):
                        results.append(reader.hosts())
                except ValueError as exc:
                    results.append(exc)

            t = threading.Thread(target=run)
            t.start()
            reader.close()
            t.join()
            for r in results:
                if isinstance(r, ValueError):
                    assert "closed" in str(r)
                else:
                    assert all(v.tolist() == tensors[n].tolist() for n, v in r.items())
    finally:
        sys.setswitchinterval(old_interval)


def test_views_outlive_close_and_the_reader(tmp_path):
    prefix, tensors = _three_shards(tmp_path)
    reader = CheckpointReader(prefix)
    index = reader.infos
    views = reader.hosts()
    one = reader.host("t001")
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.host("t001")
    with pytest.raises(ValueError, match="closed"):
        reader.hosts()
    with pytest.raises(ValueError, match="closed"):
        index.view("t001")
    ref = weakref.ref(reader)
    del reader
    gc.collect()
    assert ref() is None
    assert index.view("t001") is None  # the reader is gone: nothing to read through
    assert index["t001"].shape == (5,)
    gc.collect()
    assert one.tolist() == [1] * 5
    assert all(v.tolist() == tensors[n].tolist() for n, v in views.items())


def test_index_outliving_an_unclosed_reader(tmp_path):
    prefix, tensors = _three_shards(tmp_path)
    reader = CheckpointReader(prefix)
    index = reader.infos
    reader.host("t000")
    del reader
    gc.collect()
    for name in tensors:  # None, or the right values (a shard kept by the cache): never the wrong shard
        got = index.view(name)
        assert got is None or got.tolist() == tensors[name].tolist()


# -- equivalence with the per-entry path ----------------------------------------------------------------------------


class _AnyOrderBuilder(TableBuilder):
    """A TableBuilder that takes keys in any order (duplicates too), as a damaged or hostile file may hold them."""

    def add(self, key: bytes, value: bytes) -> None:
        if self.pending_handle is not None:
            self._add_index_entry(key + b"\xff")
        self.data_block.add(key, value)
        self.last_key = key
        self.num_entries += 1
        if self.data_block.size_estimate() >= self.block_size:
            self._flush()


def _raw_bundle(path, items, data=b"", num_shards=1, block_size=262144):
    prefix = str(path)
    for i in range(num_shards):
        Path(f"{prefix}.data-{i:05d}-of-{num_shards:05d}").write_bytes(data if i == 0 else b"")
    with open(prefix + ".index", "wb") as f:
        builder = _AnyOrderBuilder(f, block_size=block_size, restart_interval=2)
        for key, value in items:
            builder.add(key, value)
        builder.finish()
    return prefix


GOOD = encode_entry(1, (1,), size=4, crc32c=_crc(bytes(4)))
HEADER = encode_header(BundleHeader())


@pytest.mark.parametrize("block_size", [16, 262144])
@pytest.mark.parametrize("items", [
    [(b"", HEADER), (b"a", GOOD), (b"a", GOOD)],
    [(b"", HEADER), (b"b", GOOD), (b"a", GOOD)],
    [(b"", HEADER), (b"a", GOOD), (b"b", GOOD), (b"ab", GOOD)],
    [(b"a", GOOD), (b"b", GOOD)],
    [(b"", HEADER), (b"", HEADER), (b"a", GOOD)],
    [(b"a", GOOD), (b"", HEADER)],
    [(b"", b"\x08\x01\x12"), (b"a", GOOD)],
    [(b"", HEADER), (b"\x00p\x00", GOOD), (b"\x00p\x00", GOOD)],
], ids=["dup", "unsorted", "unsorted-later", "no-header", "two-headers", "header-last", "bad-header", "dup-hidden"])
def test_tables_with_keys_out_of_order(tmp_path, items, block_size):
    prefix = _raw_bundle(tmp_path / "o", items, bytes(16), block_size=block_size)
    old = _outcome(lambda: _old_open(prefix))
    assert old[0] is FormatError, old
    assert _outcome(lambda: CheckpointReader(prefix)) == old


def test_names_that_are_not_utf8_and_look_alike(tmp_path):
    data = np.arange(16, dtype="<i4").tobytes()
    keys = [b"\xff", b"\xed\xb3\xbf", b"\xc3", b"\xc3\xa9", "é".encode(), b"a\x00b", b"\xf0\x9f\x98\x80",
            b"\xf4\x90\x80\x80", b"\x80x", b"\xe2\x82"]
    entries = {k: encode_entry(3, (1,), offset=4 * i, size=4, crc32c=_crc(data[4 * i:4 * i + 4]))
               for i, k in enumerate(dict.fromkeys(keys))}
    listed = check_same(_bundle(tmp_path / "u", BundleHeader(), entries, data))
    assert len(listed) == len(entries)
    with CheckpointReader(str(tmp_path / "u")) as reader:
        for i, key in enumerate(entries):
            name = key.decode("utf-8", "surrogateescape")
            assert reader.host(name).tolist() == [i]
            assert reader.hosts([name])[name].tolist() == [i]


@pytest.mark.parametrize("tf_dtype", [11, 12, 13, 15, 16, 6, 4, 3, 5, 17, 19, 14, 26, 27, 28, 30, 31, 32, 33])
def test_dtype_codes_that_share_a_numpy_dtype(tmp_path, tf_dtype):
    data = bytes(range(64))
    itemsize = {3: 4, 13: 4, 5: 2, 15: 2, 16: 2, 17: 2, 19: 2, 14: 2}.get(tf_dtype, 1)
    entries = {b"w": encode_entry(tf_dtype, (4,), size=4 * itemsize, crc32c=_crc(data[:4 * itemsize])),
               b"x": encode_entry(tf_dtype, (2,), offset=8, size=2 * itemsize,
                                  crc32c=_crc(data[8:8 + 2 * itemsize]))}
    listed = check_same(_bundle(tmp_path / "d", BundleHeader(), entries, data))
    if listed is not None:
        assert listed["w"].tf_dtype == tf_dtype


@pytest.mark.parametrize("entry", [
    encode_entry(7, (2,), size=10, crc32c=0),  # DT_STRING with a payload too short
    encode_entry(7, (), size=0),
    encode_entry(20, (), size=0, crc32c=_crc(b"")),  # DT_RESOURCE
    encode_entry(21, (1,), size=8, crc32c=_crc(bytes(8))),  # DT_VARIANT
    encode_entry(1, (0,), offset=10**6, crc32c=_crc(b"")),  # zero-size, offset past the shard end
    encode_entry(1, (0, 3), offset=64, crc32c=_crc(b"")),  # zero-size, offset at the shard end
    encode_entry(1, (0, 2**40, 2**40), crc32c=_crc(b"")),  # zero-size, numpy says too big
    encode_entry(1, (2**40, 0, 2**40), crc32c=_crc(b"")),
    encode_entry(1, (4,), offset=2**63 - 1, size=16, crc32c=0),  # offset + size past 2**63
    encode_entry(1, (2**61,), offset=2**62, size=2**63 - 4, crc32c=0),
    encode_entry(1, (4,), offset=2**64 - 16, size=16, crc32c=0),
    encode_entry(1, (32,), offset=0, size=128, crc32c=0),  # longer than the shard
    encode_entry(1, (4,), offset=56, size=16, crc32c=0),  # ends past the shard
    encode_entry(1, (1,), shard_id=2**31, size=4, crc32c=_crc(bytes(4))),
    encode_entry(1, (1,), shard_id=1, size=4, crc32c=_crc(bytes(4))),  # a shard the header has not
    encode_entry(1, (1,) * 32, size=4, crc32c=_crc(bytes(4))),
    encode_entry(1, (1,) * 33, size=4, crc32c=_crc(bytes(4))),
    encode_entry(1, (2, 2), size=16, crc32c=_crc(bytes(16))) + b"\x38\x00",  # one odd field: slices as a varint
    encode_entry(1, (2, 2), size=16, crc32c=_crc(bytes(16))) + b"\x3a\x00",  # one empty slice
    encode_entry(1, (2, 2), size=16, crc32c=_crc(bytes(16))) + b"\x12\x02\x18\x01",  # a second shape: unknown
    encode_entry(1, (2, 2), size=16, crc32c=_crc(bytes(16))) + b"\x12\x00",  # a second shape: scalar
    b"\x12\x04\x18\x01\x18\x00" + encode_entry(1, (), size=4, crc32c=_crc(bytes(4)))[2:] + b"\x08\x01",
])
@pytest.mark.parametrize("verify", [True, False])
def test_entries_at_the_edge_of_the_native_decoder(tmp_path, entry, verify):
    prefix = _bundle(tmp_path / "e", BundleHeader(), {b"w": entry, b"a": GOOD}, bytes(64))
    check_same(prefix, verify=verify)


def test_hidden_slices_and_an_unhidden_name_that_looks_like_one(tmp_path):
    full = np.arange(8, dtype="<f4")
    key = encode_tensor_name_slice(b"p", [(0, 8)])
    entries = {b"p": encode_entry(1, (8,), slices=[[(0, 8)]]),
               key: encode_entry(1, (8,), size=32, crc32c=_crc(full.tobytes())),
               key[1:]: encode_entry(1, (8,), size=32, crc32c=_crc(full.tobytes()))}
    listed = check_same(_bundle(tmp_path / "p", BundleHeader(), entries, full.tobytes()))
    assert sorted(listed) == sorted(["p", key[1:].decode("utf-8", "surrogateescape")])


def test_big_endian_views_and_copies(tmp_path):
    value = np.arange(6, dtype=">i4")
    data = value.tobytes() + bytes(range(6))
    entries = {b"w": encode_entry(3, (6,), size=24, crc32c=_crc(data[:24])),
               b"b": encode_entry(4, (6,), offset=24, size=6, crc32c=_crc(data[24:]))}
    prefix = _bundle(tmp_path / "be", BundleHeader(big_endian=True), entries, data)
    check_same(prefix)
    with CheckpointReader(prefix) as reader:
        assert reader.host("w").tolist() == list(range(6)) and reader.host("w").flags.writeable  # a copy
        assert not reader.host("b").flags.owndata and not reader.host("b").flags.writeable  # a view
        assert reader.hosts()["w"].tolist() == list(range(6))


def test_old_path_reference_is_what_the_reader_gives_for_every_tensor(tmp_path):
    """A written checkpoint of every dtype: per tensor, host() equals the per-entry path byte for byte."""
    rng = np.random.default_rng(1)
    tensors = {f"x{i}": rng.integers(0, 100, (i % 4 + 1, 3)).astype(dt)
               for i, dt in enumerate(["<f4", "<f8", "<i2", "u1", "<c8", "<u8", "?", "<f2"])}
    prefix = str(tmp_path / "w")
    write_checkpoint(prefix, tensors, num_shards=2, fsync=False)
    listed, _, old = _old_open(prefix)
    with CheckpointReader(prefix) as reader:
        for name, info in listed.items():
            assert reader.host(name).tobytes() == _old_host(old, info).tobytes()
    for shard in old._shards.values():
        shard.close()


def test_fuzz_random_damage_to_index_and_data_files(tmp_path):
    """Random bytes of the index (block checksums then fixed) and of the data file: the same result both ways."""
    payload = np.arange(64, dtype="<f4").tobytes()
    entries = {f"m/{i:02d}".encode(): encode_entry(1, (1,), offset=4 * i, size=4, crc32c=_crc(payload[4 * i:4 * i + 4]))
               for i in range(20)}
    entries[b"z"] = encode_entry(1, (0, 2), offset=256, crc32c=_crc(b""))
    entries[b"s"] = encode_entry(7, (1,), offset=0, size=5, crc32c=0)
    seed = _bundle(tmp_path / "seed", BundleHeader(), entries, payload, block_size=100, restart_interval=3)
    index = Path(seed + ".index").read_bytes()
    with MappedFile(seed + ".index") as mapped:
        blocks = IndexTable(mapped).block_handles
    data_end = max(off + size for off, size in blocks)
    target = str(tmp_path / "t")
    rng = random.Random(11)
    for _ in range(300):
        raw, draw = bytearray(index), bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(data_end)] = rng.randrange(256)
        _fix_checksums(raw, blocks)
        if rng.random() < 0.5:
            draw[rng.randrange(len(draw))] ^= 1 << rng.randrange(8)
        Path(target + ".index").write_bytes(bytes(raw))
        Path(target + ".data-00000-of-00001").write_bytes(bytes(draw))
        check_same(target)
        check_same(target, verify=False)
    os.remove(target + ".index")
