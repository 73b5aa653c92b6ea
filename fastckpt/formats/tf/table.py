"""tensorflow::table files (TF's ``.index``): a sorted string->string table, read and written.

Reading goes footer -> index block -> data blocks (never a linear scan of the
file), checking every block trailer's masked CRC32C; writing follows
``table_builder.cc`` so that, for the same entries, the bytes equal
TensorFlow's. The byte layout is specified in :mod:`fastckpt.formats.tf.format`.

>>> import io
>>> out = io.BytesIO()
>>> builder = TableBuilder(out)
>>> builder.add(b"", b"header"); builder.add(b"w", b"entry")
>>> builder.finish()
>>> len(out.getvalue())  # 1 data block, empty metaindex, index, footer
111
"""

from __future__ import annotations

import bisect

import crc32c as _crc32c

from fastckpt._native.tftable import (
    BLOCK_TRAILER_SIZE,
    FOOTER_SIZE,
    TABLE_MAGIC,
    block_seek,
    decode_block,
    decode_footer,
    decode_handle,
    mask_crc,
    max_key_bytes,
    read_block,
)
from fastckpt.errors import FormatError
from fastckpt.formats.tf.proto import encode_varint

__all__ = ["IndexTable", "TableBuilder", "shortest_separator", "short_successor"]

BLOCK_SIZE = 262144
DATA_RESTART_INTERVAL = 16
INDEX_RESTART_INTERVAL = 1


class IndexTable:
    """An opened table: its index block, and its data blocks on demand.

    ``mapped`` is a :class:`fastckpt._native.mapped.MappedFile` of the whole file.
    ``verify=False`` skips the block trailer checksums (for fuzzing the block
    parser behind them; TensorFlow always checks them).
    """

    def __init__(self, mapped, *, verify: bool = True):
        self.mapped = mapped
        self.path = mapped.path
        self.verify = verify
        if mapped.size < FOOTER_SIZE:
            raise FormatError(f"{self.path}: {mapped.size} bytes is too short for a TensorFlow index "
                              f"(the footer alone is {FOOTER_SIZE} bytes; file truncated?)")
        footer_at = mapped.size - FOOTER_SIZE
        meta_off, meta_size, index_off, index_size = decode_footer(
            mapped.read(footer_at, FOOTER_SIZE, "footer"), f"{self.path}: footer at offset {footer_at}")
        self.metaindex_handle = (meta_off, meta_size)
        self.index_handle = (index_off, index_size)
        for what, (off, size) in (("metaindex block", self.metaindex_handle), ("index block", self.index_handle)):
            if off + size + BLOCK_TRAILER_SIZE > footer_at:
                raise FormatError(f"{self.path}: the footer places the {what} at [{off}, {off + size + 5}), "
                                  f"past the start of the footer ({footer_at})")
        # TensorFlow never reads the (always empty) metaindex; checking its trailer costs 13 bytes and
        # means no byte of the file goes unchecked.
        read_block(mapped, meta_off, meta_size, "metaindex block", verify)
        index = read_block(mapped, index_off, index_size, "index block", verify)
        # Keys decode to at most max_key_bytes(size) in all, index and data blocks together: keys that each
        # repeat the one before are stored in linear space but would decode to quadratic memory.
        self.key_budget = max_key_bytes(mapped.size)
        keys, values, _ = decode_block(index, f"{self.path}: index block at offset {index_off}", self.key_budget)
        self.index_keys = keys
        self.block_handles = []
        for i, (key, value) in enumerate(zip(keys, values)):
            what = f"{self.path}: index entry {i} ({key!r})"
            off, size = decode_handle(value, what)
            if off + size + BLOCK_TRAILER_SIZE > footer_at:
                raise FormatError(f"{what}: data block [{off}, {off + size + 5}) runs past the footer ({footer_at})")
            self.block_handles.append((off, size))

    def block(self, i: int) -> bytes:
        """The uncompressed contents of data block ``i``."""
        off, size = self.block_handles[i]
        return read_block(self.mapped, off, size, f"data block {i}", self.verify)

    def block_entries(self, i: int):
        """``(keys, values)`` of data block ``i``."""
        off, _ = self.block_handles[i]
        keys, values, _ = decode_block(self.block(i), f"{self.path}: data block {i} at offset {off}")
        return keys, values

    def items(self) -> list:
        """Every ``(key, value)`` in table order; keys must be strictly increasing across the table, and decode to
        at most ``max_key_bytes`` of the index's size in all."""
        out = []
        prev = None
        budget = self.key_budget
        for i in range(len(self.block_handles)):
            off, _ = self.block_handles[i]
            keys, values, _ = decode_block(self.block(i), f"{self.path}: data block {i} at offset {off}", budget)
            budget -= sum(map(len, keys))
            for key, value in zip(keys, values):
                if prev is not None and key <= prev:
                    raise FormatError(f"{self.path}: data block {i}: key {key!r} does not sort after {prev!r} "
                                      "(keys must be strictly increasing)")
                out.append((key, value))
                prev = key
        return out

    def seek(self, key: bytes):
        """TensorFlow's ``Table::InternalGet``: the first entry at or after ``key`` via the index, or None.

        This is the lookup path ``get_tensor`` uses: binary search of the index
        keys, then of the block's restart points. A table whose index keys are
        smaller than keys of their block (the Swift writer's bug) fails here
        even though :meth:`items` reads it.
        """
        i = bisect.bisect_left(self.index_keys, key)
        if i >= len(self.block_handles):
            return None
        off, _ = self.block_handles[i]
        return block_seek(self.block(i), key, f"{self.path}: data block {i} at offset {off}")

    def get(self, key: bytes):
        """The value stored under exactly ``key`` (found the way TensorFlow finds it), or None."""
        found = self.seek(key)
        if found is None or found[0] != key:
            return None
        return found[1]


# -- writing ----------------------------------------------------------------------------------------


def _shared_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shortest_separator(start: bytes, limit: bytes) -> bytes:
    """LevelDB's ``FindShortestSeparator``: a short key in ``[start, limit)``.

    >>> shortest_separator(b"model/a", b"model/c")
    b'model/b'
    >>> shortest_separator(b"ab", b"ac")
    b'ab'
    """
    i = _shared_prefix(start, limit)
    if i < min(len(start), len(limit)):
        byte = start[i]
        if byte < 0xFF and byte + 1 < limit[i]:
            return start[:i] + bytes([byte + 1])
    return start


def short_successor(key: bytes) -> bytes:
    """LevelDB's ``FindShortSuccessor``: a short key ``>= key``.

    >>> short_successor(b"save_counter/.ATTRIBUTES/VARIABLE_VALUE")
    b't'
    """
    for i, byte in enumerate(key):
        if byte != 0xFF:
            return key[:i] + bytes([byte + 1])
    return key


class _BlockBuilder:
    def __init__(self, restart_interval: int):
        self.restart_interval = restart_interval
        self.reset()

    def reset(self):
        self.buf = bytearray()
        self.restarts = [0]
        self.counter = 0
        self.last_key = b""
        self.empty = True

    def add(self, key: bytes, value: bytes):
        shared = 0
        if self.counter < self.restart_interval:
            shared = _shared_prefix(self.last_key, key)
        else:
            self.restarts.append(len(self.buf))
            self.counter = 0
        self.buf += encode_varint(shared) + encode_varint(len(key) - shared) + encode_varint(len(value))
        self.buf += key[shared:]
        self.buf += value
        self.last_key = key
        self.counter += 1
        self.empty = False

    def size_estimate(self) -> int:
        return len(self.buf) + 4 * len(self.restarts) + 4

    def finish(self) -> bytes:
        out = self.buf
        for r in self.restarts:
            out += r.to_bytes(4, "little")
        out += len(self.restarts).to_bytes(4, "little")
        return bytes(out)


class TableBuilder:
    """Write a tensorflow::table to a binary file object, exactly as ``table_builder.cc`` does.

    Keys must be added in strictly increasing byte order. Blocks are stored
    uncompressed (type 0), as TensorFlow's bundle writer stores them.
    """

    def __init__(self, f, *, block_size: int = BLOCK_SIZE, restart_interval: int = DATA_RESTART_INTERVAL):
        self.f = f
        self.offset = 0
        self.block_size = block_size
        self.data_block = _BlockBuilder(restart_interval)
        self.index_block = _BlockBuilder(INDEX_RESTART_INTERVAL)
        self.last_key = None
        self.pending_handle = None  # handle of the last flushed block, awaiting its index key
        self.num_entries = 0
        self.num_data_blocks = 0

    def add(self, key: bytes, value: bytes) -> None:
        if self.last_key is not None and key <= self.last_key:
            raise ValueError(f"table keys must be added in strictly increasing order: {key!r} after {self.last_key!r}")
        if self.pending_handle is not None:
            self._add_index_entry(shortest_separator(self.last_key, key))
        elif len(key) + len(value) >= 2 * self.block_size and not self.data_block.empty:
            self._flush()
            self._add_index_entry(shortest_separator(self.last_key, key))
        self.data_block.add(key, value)
        self.last_key = key
        self.num_entries += 1
        if self.data_block.size_estimate() >= self.block_size:
            self._flush()

    def _add_index_entry(self, key: bytes) -> None:
        off, size = self.pending_handle
        self.index_block.add(key, encode_varint(off) + encode_varint(size))
        self.pending_handle = None

    def _write_block(self, contents: bytes) -> tuple:
        handle = (self.offset, len(contents))
        trailer_type = b"\x00"
        crc = mask_crc(_crc32c.crc32c(trailer_type, _crc32c.crc32c(contents)))
        self.f.write(contents)
        self.f.write(trailer_type + crc.to_bytes(4, "little"))
        self.offset += len(contents) + BLOCK_TRAILER_SIZE
        return handle

    def _flush(self) -> None:
        if self.data_block.empty:
            return
        self.pending_handle = self._write_block(self.data_block.finish())
        self.data_block.reset()
        self.num_data_blocks += 1

    def finish(self) -> None:
        """Flush the last block, then write the metaindex, the index and the footer."""
        self._flush()
        metaindex = self._write_block(_BlockBuilder(DATA_RESTART_INTERVAL).finish())
        if self.pending_handle is not None:
            self._add_index_entry(short_successor(self.last_key))
        index = self._write_block(self.index_block.finish())
        footer = bytearray()
        for off, size in (metaindex, index):
            footer += encode_varint(off) + encode_varint(size)
        footer += bytes(FOOTER_SIZE - 8 - len(footer))
        footer += TABLE_MAGIC.to_bytes(8, "little")
        self.f.write(bytes(footer))
        self.offset += FOOTER_SIZE
