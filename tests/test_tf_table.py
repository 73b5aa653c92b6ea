"""The tensorflow::table layer: primitives, byte-identical writing, corrupt input, fuzzing."""

from __future__ import annotations

import io
import json
from pathlib import Path

import crc32c
import pytest
from fastckpt._native.mapped import MappedFile
from fastckpt._native.tftable import (
    block_seek,
    decode_block,
    decode_entry,
    decode_footer,
    decode_string_tensor,
    decode_varint,
    decompress_snappy,
    iter_fields,
    mask_crc,
    unmask_crc,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt.errors import FormatError
from fastckpt.formats.tf.proto import (
    BundleHeader,
    decode_checkpoint_state,
    decode_header,
    encode_checkpoint_state,
    encode_entry,
    encode_header,
    encode_varint,
)
from fastckpt.formats.tf.table import IndexTable, TableBuilder, short_successor, shortest_separator
from fastckpt.tf import CheckpointReader

DATA = Path(__file__).parent / "data" / "tf"
EXPECTED = json.loads((DATA / "expected.json").read_text())
SWIFT_INDEX_DIR = Path(__file__).resolve().parents[2] / "shared" / "reference" / "tf-index-files"
INDEX_FILES = [DATA / (EXPECTED[f]["prefix"] + ".index") for f in ("object_based", "name_based", "sharded")]
SMALL_INDEX = DATA / (EXPECTED["sharded"]["prefix"] + ".index")


def test_crc32c_is_castagnoli():
    assert crc32c.crc32c(b"123456789") == 0xE3069283


@pytest.mark.parametrize("value", [0, 1, 0xA282EAD8, 0xFFFFFFFF, 0x12345678])
def test_mask_round_trip(value):
    assert unmask_crc(mask_crc(value)) == value


def test_mask_of_zero():
    assert mask_crc(0) == 0xA282EAD8


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**32 - 1, 2**63, 2**64 - 1])
def test_varint_round_trip(value):
    encoded = encode_varint(value)
    assert decode_varint(encoded) == (value, len(encoded))


@pytest.mark.parametrize("data,match", [(b"", "truncated"), (b"\x80", "truncated"), (b"\x80" * 10 + b"\x00", "longer than"),
                                        (b"\xff" * 9 + b"\x02", "overflows")])
def test_bad_varints(data, match):
    with pytest.raises(FormatError, match=match):
        decode_varint(data)


@pytest.mark.parametrize("start,limit,expected", [
    (b"abc", b"abe", b"abd"), (b"abc", b"abd", b"abc"), (b"ab", b"abc", b"ab"), (b"a\xff", b"b", b"a\xff"),
    (b"model/a", b"model/c", b"model/b"), (b"", b"a", b""),
])
def test_shortest_separator(start, limit, expected):
    sep = shortest_separator(start, limit)
    assert sep == expected
    assert start <= sep < limit


@pytest.mark.parametrize("key,expected", [(b"model/wte", b"n"), (b"\xff\xffa", b"\xff\xffb"), (b"\xff\xff", b"\xff\xff"),
                                          (b"", b"")])
def test_short_successor(key, expected):
    assert short_successor(key) == expected


@pytest.mark.parametrize("path", INDEX_FILES + [SWIFT_INDEX_DIR / f"{n}.index" for n in ("style", "transformer")],
                         ids=lambda p: p.name if isinstance(p, Path) else str(p))
def test_builder_reproduces_tensorflow_bytes(path):
    if not path.exists():
        pytest.skip(f"{path} is not available")
    with MappedFile(path) as mapped:
        items = IndexTable(mapped).items()
        original = mapped.read(0, mapped.size)
    out = io.BytesIO()
    builder = TableBuilder(out)
    for key, value in items:
        builder.add(key, value)
    builder.finish()
    assert out.getvalue() == original


@pytest.mark.parametrize("path", INDEX_FILES, ids=lambda p: p.parent.name)
def test_entry_encoding_reproduces_tensorflow_bytes(path):
    with MappedFile(path) as mapped:
        items = IndexTable(mapped).items()
    assert encode_header(decode_header(items[0][1])) == items[0][1]
    for key, value in items[1:]:
        dtype, shape, shard, offset, size, crc, slices = decode_entry(value)
        assert encode_entry(dtype, shape, shard_id=shard, offset=offset, size=size, crc32c=crc,
                            slices=slices) == value, key


def test_metaindex_bytes_are_tensorflows():
    raw = INDEX_FILES[0].read_bytes()
    assert bytes.fromhex("00000000010000" "0000c0f2a1b0") in raw


def test_footer_magic():
    raw = SMALL_INDEX.read_bytes()
    assert raw[-8:] == bytes.fromhex("57fb808b247547db")
    with pytest.raises(FormatError, match="bad magic"):
        decode_footer(raw[-48:-8] + bytes(8))


def test_tf_lookup_path_finds_every_key():
    """``seek`` follows TensorFlow's Table::InternalGet: index binary search, then restart points."""
    with MappedFile(INDEX_FILES[0]) as mapped:
        table = IndexTable(mapped)
        for key, value in table.items():
            assert table.get(key) == value
        assert table.get(b"zzz") is None
        assert table.get(b"model/dense/kernel") is None


def _build(items, block_size=64, restart_interval=16):
    out = io.BytesIO()
    builder = TableBuilder(out, block_size=block_size, restart_interval=restart_interval)
    for key, value in items:
        builder.add(key, value)
    builder.finish()
    return out.getvalue(), builder.num_data_blocks


@pytest.mark.parametrize("count", [1, 15, 16, 17, 31, 100])
def test_small_blocks_keep_point_lookups_working(tmp_path, count):
    # Counts of 15 (mod 16) broke the Swift writer's index key; every count must look up.
    items = [(f"layer{i:03d}/w\u00e9ight".encode(), bytes([i % 256]) * (i % 7)) for i in range(count)]
    raw, blocks = _build(items)
    path = tmp_path / "t.index"
    path.write_bytes(raw)
    with MappedFile(path) as mapped:
        table = IndexTable(mapped)
        assert table.items() == items
        assert len(table.block_handles) == blocks
        _assert_index_invariant(table)
        for key, value in items:
            assert table.get(key) == value
        assert table.get(b"layer") is None


def _assert_index_invariant(table):
    """The spec's section 2.6: last key of block i <= index key i < first key of block i+1."""
    for i, index_key in enumerate(table.index_keys):
        assert table.block_entries(i)[0][-1] <= index_key
        if i + 1 < len(table.index_keys):
            assert index_key < table.block_entries(i + 1)[0][0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=st.sets(st.lists(st.sampled_from(b"\x00\x01\xfe\xffab"), min_size=1, max_size=6).map(bytes),
                    min_size=1, max_size=60),
       block_size=st.integers(1, 96))
def test_index_keys_separate_blocks_for_any_keys(tmp_path, keys, block_size):
    # 0xFF and adjacent bytes are where FindShortestSeparator / FindShortSuccessor have to give up
    items = [(key, key[::-1]) for key in sorted(keys)]
    raw, blocks = _build(items, block_size=block_size)
    path = tmp_path / "t.index"
    path.write_bytes(raw)
    with MappedFile(path) as mapped:
        table = IndexTable(mapped)
        assert table.items() == items and len(table.block_handles) == blocks
        _assert_index_invariant(table)
        for key, value in items:
            assert table.get(key) == value


def test_builder_refuses_unsorted_keys():
    builder = TableBuilder(io.BytesIO())
    builder.add(b"b", b"")
    with pytest.raises(ValueError, match="increasing"):
        builder.add(b"a", b"")
    with pytest.raises(ValueError, match="increasing"):
        builder.add(b"b", b"")


def test_index_key_below_its_block_breaks_lookup_but_not_iteration(tmp_path):
    """The invariant of the spec: an index key smaller than its block's keys hides them from lookups."""
    items = [(b"a", b"1"), (b"b", b"2")]
    block = bytearray()
    for key, value in items:
        block += encode_varint(0) + encode_varint(len(key)) + encode_varint(len(value)) + key + value
    block += (0).to_bytes(4, "little") + (1).to_bytes(4, "little")
    out = bytearray()

    def put(contents):
        handle = (len(out), len(contents))
        out.extend(contents + b"\x00" + mask_crc(crc32c.crc32c(bytes(contents) + b"\x00")).to_bytes(4, "little"))
        return handle

    data = put(bytes(block))
    meta = put(bytes.fromhex("0000000001000000"))
    index_block = encode_varint(0) + encode_varint(0) + encode_varint(2) + encode_varint(data[0]) + \
        encode_varint(data[1]) + bytes.fromhex("0000000001000000")  # index key "" (the Swift bug)
    index = put(index_block)
    footer = b"".join(encode_varint(v) for v in (*meta, *index))
    out += footer + bytes(40 - len(footer)) + bytes.fromhex("57fb808b247547db")
    path = tmp_path / "swiftbug.index"
    path.write_bytes(bytes(out))
    with MappedFile(path) as mapped:
        table = IndexTable(mapped)
        assert table.items() == items
        assert table.get(b"a") is None


# -- corrupt input -----------------------------------------------------------------------------------


def _write_index(tmp_path, raw: bytes) -> str:
    prefix = tmp_path / "model"
    (tmp_path / "model.index").write_bytes(raw)
    return str(prefix)


SMALL_RAW = SMALL_INDEX.read_bytes()


@pytest.mark.parametrize("length", range(len(SMALL_RAW)))
def test_every_truncation_is_a_format_error(tmp_path, length):
    prefix = _write_index(tmp_path, SMALL_RAW[:length])
    with pytest.raises(FormatError):
        CheckpointReader(prefix)


def _footer_padding():
    pos = len(SMALL_RAW) - 48
    for _ in range(4):
        _, pos = decode_varint(SMALL_RAW, pos)
    return set(range(pos, len(SMALL_RAW) - 8))


# The footer's zero padding is never read (TensorFlow ignores it too); every other byte is checked.
CHECKED_BYTES = [i for i in range(len(SMALL_RAW)) if i not in _footer_padding()]


def _same_footer(footer: bytes) -> bool:
    try:
        return decode_footer(footer) == decode_footer(SMALL_RAW[-48:])
    except FormatError:
        return False


@pytest.mark.parametrize("flip", [0x01, 0x80, 0xFF])
@pytest.mark.parametrize("offset", CHECKED_BYTES)
def test_every_corrupted_byte_is_a_format_error(tmp_path, offset, flip):
    raw = bytearray(SMALL_RAW)
    raw[offset] ^= flip
    prefix = _write_index(tmp_path, bytes(raw))
    if offset >= len(raw) - 48 and _same_footer(bytes(raw[-48:])):
        # e.g. 0e -> 8e 00: a longer varint of the same handle; the file still means the same
        assert CheckpointReader(prefix).variable_to_shape_map() == {"a": [4], "b": [5]}
        return
    with pytest.raises(FormatError):
        CheckpointReader(prefix)


def test_corrupt_block_message_names_file_and_block(tmp_path):
    raw = bytearray(SMALL_RAW)
    raw[3] ^= 1
    prefix = _write_index(tmp_path, bytes(raw))
    with pytest.raises(FormatError, match=r"model\.index: data block 0 at offset 0: block checksum mismatch"):
        CheckpointReader(prefix)


@pytest.mark.parametrize("data,match", [
    (b"\x00\x00", "at least 4 bytes"),
    ((5).to_bytes(4, "little"), "restart count 5"),
    (b"\x05\x00\x00" + (0).to_bytes(4, "little") + (1).to_bytes(4, "little"), "shares 5 bytes"),
    (b"\x00\x09\x00ab" + (0).to_bytes(4, "little") + (1).to_bytes(4, "little"), "needs 9 bytes"),
])
def test_bad_blocks(data, match):
    with pytest.raises(FormatError, match=match):
        decode_block(data)


def test_block_seek_rejects_a_restart_with_shared_prefix():
    block = b"\x00\x01\x00a" + b"\x01\x01\x00b" + (0).to_bytes(4, "little") + (4).to_bytes(4, "little") + \
        (2).to_bytes(4, "little")
    assert decode_block(block)[0] == [b"a", b"ab"]
    with pytest.raises(FormatError, match="bad entry in block"):
        block_seek(block, b"ab")


def test_snappy_preamble_bomb_is_refused():
    with pytest.raises(FormatError, match="more than Snappy can encode"):
        decompress_snappy(encode_varint(2**31) + b"\x00")


def test_snappy_overlapping_copy():
    # literal "ab" then a copy-1 tag: offset 2, length 8 -> overlapping copy "abababab"
    compressed = encode_varint(10) + bytes([1 << 2]) + b"ab" + bytes([((8 - 4) << 2) | 1, 2])
    assert decompress_snappy(compressed) == b"ababababab"


def test_string_tensor_layout_from_the_spec():
    payload = bytes.fromhex("02009601dc561d91") + b"ab" + b"xyz" * 50
    values, crc = decode_string_tensor(payload, 3)
    assert values == [b"ab", b"", b"xyz" * 50]
    with pytest.raises(FormatError, match="add up to"):
        decode_string_tensor(payload + b"!", 3)
    with pytest.raises(FormatError, match="length checksum"):
        decode_string_tensor(payload[:4] + b"\x00" + payload[5:], 3)


def test_checkpoint_state_round_trip():
    text = encode_checkpoint_state("ckpt-\u00e9 \"2\"", ["ckpt-1", "ckpt-\u00e9 \"2\""])
    assert decode_checkpoint_state(text) == ("ckpt-\u00e9 \"2\"", ["ckpt-1", "ckpt-\u00e9 \"2\""])
    assert decode_checkpoint_state('model_checkpoint_path: "a"\nall_model_checkpoint_timestamps: 1.5\n') == ("a", [])
    with pytest.raises(FormatError, match="line 1"):
        decode_checkpoint_state("model_checkpoint_path ckpt")


def test_header_defaults_match_tensorflow():
    assert encode_header(BundleHeader()) == bytes.fromhex("08011a020801")
    assert decode_header(bytes.fromhex("08011a020801")) == BundleHeader()
    assert decode_header(encode_header(BundleHeader(3, True, 1, 0, (2, 5)))) == BundleHeader(3, True, 1, 0, (2, 5))


# -- fuzzing -----------------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_SLOW = settings(max_examples=30000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_SLOW_FILES = settings(max_examples=20000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parse_everything(data: bytes):
    for fn in (decode_block, decode_entry, iter_fields, decode_header, decompress_snappy):
        try:
            fn(data)
        except FormatError:
            pass
    try:
        decode_footer(data[:48].ljust(48, b"\x00"))
    except FormatError:
        pass
    for count in (0, 1, 3):
        try:
            decode_string_tensor(data, count)
        except FormatError:
            pass


def _mutate_table(seed_file: bytes, edits) -> bytes:
    raw = bytearray(seed_file)
    for pos, value in edits:
        raw[pos % len(raw)] = value
    return bytes(raw)


_FUZZ_DIRS: dict = {}


def _open_unverified(tmp_path_factory, raw: bytes):
    if "dir" not in _FUZZ_DIRS:  # one directory for all examples, not one per example
        _FUZZ_DIRS["dir"] = tmp_path_factory.mktemp("fuzz")
    path = _FUZZ_DIRS["dir"] / "f.index"
    path.write_bytes(raw)
    with MappedFile(path) as mapped:
        try:
            table = IndexTable(mapped, verify=False)  # past the checksums, into the parsers
            for key, value in table.items():
                table.get(key)
                decode_entry(value)
        except FormatError:
            pass


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_parsers_never_crash(data):
    _parse_everything(data)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_mutated_index_never_crashes(tmp_path_factory, edits):
    _open_unverified(tmp_path_factory, _mutate_table(INDEX_FILES[0].read_bytes(), edits))


@pytest.mark.slow
@FUZZ_SLOW
@given(st.binary(max_size=2000))
def test_fuzz_parsers_never_crash_long(data):
    _parse_everything(data)


@pytest.mark.slow
@FUZZ_SLOW_FILES
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=20))
def test_fuzz_mutated_index_never_crashes_long(tmp_path_factory, edits):
    _open_unverified(tmp_path_factory, _mutate_table(INDEX_FILES[0].read_bytes(), edits))


def test_docs_page_is_the_format_docstring():
    import fastckpt.formats.tf.format as spec

    page = (Path(__file__).resolve().parents[1] / "docs" / "formats" / "tf-checkpoint.md").read_text()
    assert spec.__doc__.strip() in page
