"""The few protobuf messages a TensorFlow checkpoint holds, encoded and decoded by hand.

A checkpoint needs five small messages (``BundleHeaderProto``,
``BundleEntryProto``, ``TensorShapeProto``, ``TensorSliceProto`` and the
``TrackableObjectGraph``) plus the text-format ``CheckpointState``. Their wire
format is a handful of varints and length-delimited fields, so it is written
here directly instead of depending on the ``protobuf`` package and generated
code. Decoding of the hot message (``BundleEntryProto``) lives in the Cython
module :mod:`fastckpt._native.tftable`; this module encodes everything and decodes
the rest.

Encoders follow protobuf's canonical serialization for proto3 (fields in
number order, default scalars omitted), which is also what TensorFlow emits, so
the bytes match TensorFlow's for the same values.

>>> encode_shape((0, 4)).hex()
'120012020804'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fastckpt._native.tftable import decode_varint, encode_plain_entry, iter_fields
from fastckpt.errors import FormatError

__all__ = [
    "encode_varint",
    "encode_shape",
    "encode_slice",
    "encode_entry",
    "encode_header",
    "decode_header",
    "BundleHeader",
    "ObjectGraph",
    "GraphNode",
    "encode_object_graph",
    "decode_object_graph",
    "encode_checkpoint_state",
    "decode_checkpoint_state",
]

_U64 = (1 << 64) - 1


def encode_varint(value: int) -> bytes:
    """LEB128; negative numbers as their 64-bit two's complement (10 bytes), as protobuf does.

    >>> encode_varint(300).hex()
    'ac02'
    """
    value &= _U64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(number: int, wire: int) -> bytes:
    return encode_varint((number << 3) | wire)


def _len_field(number: int, payload: bytes) -> bytes:
    return _tag(number, 2) + encode_varint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:
    return b"" if value == 0 else _tag(number, 0) + encode_varint(value)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# -- tensor bundle --------------------------------------------------------------------------------


def encode_shape(shape) -> bytes:
    """TensorShapeProto: one ``dim`` submessage per dimension (an empty one for size 0)."""
    return b"".join(_len_field(2, _int_field(1, int(d))) for d in shape)


def encode_slice(extents) -> bytes:
    """TensorSliceProto from ``[(start, length)]``; ``length < 0`` means the full dimension."""
    out = bytearray()
    for start, length in extents:
        body = _int_field(1, start)
        if length >= 0:  # oneof: present even when 0
            body += _tag(2, 0) + encode_varint(length)
        out += _len_field(1, body)
    return bytes(out)


def encode_entry(dtype: int, shape, *, shard_id: int = 0, offset: int = 0, size: int = 0, crc32c: int | None = None,
                 slices=()) -> bytes:
    """BundleEntryProto in TensorFlow's field order; ``shape`` is always emitted, zeros are omitted.

    >>> encode_entry(1, (2, 3), offset=195, size=24, crc32c=0x173DDBC0).hex(" ")
    '08 01 12 08 12 02 08 02 12 02 08 03 20 c3 01 28 18 35 c0 db 3d 17'
    """
    if not slices and crc32c is not None:  # the common entry, built in C (the same bytes)
        try:
            return encode_plain_entry(dtype, shape, shard_id, offset, size, crc32c)
        except (OverflowError, ValueError, TypeError):
            pass  # negative values (two's complement), many dimensions: below
    out = bytearray(_int_field(1, dtype))
    out += _len_field(2, encode_shape(shape))
    out += _int_field(3, shard_id) + _int_field(4, offset) + _int_field(5, size)
    if crc32c is not None:
        out += _tag(6, 5) + int(crc32c).to_bytes(4, "little")
    for extents in slices:
        out += _len_field(7, encode_slice(extents))
    return bytes(out)


@dataclass(frozen=True)
class BundleHeader:
    """The ``BundleHeaderProto`` stored under the empty key."""

    num_shards: int = 1
    big_endian: bool = False
    producer: int = 1
    min_consumer: int = 0
    bad_consumers: tuple = ()


def encode_header(header: BundleHeader) -> bytes:
    """BundleHeaderProto; the default header is TensorFlow's ``08 01 1a 02 08 01``.

    >>> encode_header(BundleHeader()).hex()
    '08011a020801'
    """
    version = _int_field(1, header.producer) + _int_field(2, header.min_consumer)
    for bad in header.bad_consumers:
        version += _tag(3, 0) + encode_varint(bad)
    return _int_field(1, header.num_shards) + _int_field(2, int(header.big_endian)) + _len_field(3, version)


def decode_header(data: bytes, what: str = "bundle header") -> BundleHeader:
    """Decode a BundleHeaderProto (unknown fields are ignored)."""
    num_shards, endianness = 0, 0
    producer, min_consumer, bad = 0, 0, []
    for number, wire, value in iter_fields(data, what):
        if number == 1 and wire == 0:
            num_shards = _signed(value)
        elif number == 2 and wire == 0:
            endianness = value
        elif number == 3 and wire == 2:
            for vnum, vwire, vval in iter_fields(value, what + " version"):
                if vnum == 1 and vwire == 0:
                    producer = _signed(vval)
                elif vnum == 2 and vwire == 0:
                    min_consumer = _signed(vval)
                elif vnum == 3 and vwire == 0:
                    bad.append(_signed(vval))
                elif vnum == 3 and vwire == 2:  # packed repeated int32
                    pos = 0
                    while pos < len(vval):
                        v, pos = decode_varint(vval, pos, what)
                        bad.append(_signed(v))
    if endianness not in (0, 1):
        raise FormatError(f"{what}: unknown endianness {endianness} (0 = little, 1 = big)")
    return BundleHeader(num_shards, endianness == 1, producer, min_consumer, tuple(bad))


# -- object graph ---------------------------------------------------------------------------------


@dataclass
class GraphNode:
    """One ``TrackableObject``: named children (node ids) and serialized tensors.

    ``attributes`` holds ``(name, full_name, checkpoint_key)`` triples.
    ``slot_variables`` holds ``(original_variable_node_id, slot_name,
    slot_variable_node_id)``; unknown fields are kept as raw bytes so that a
    decoded graph re-encodes unchanged.
    """

    children: list = field(default_factory=list)  # [(node_id, local_name)]
    attributes: list = field(default_factory=list)  # [(name, full_name, checkpoint_key)]
    slot_variables: list = field(default_factory=list)
    has_checkpoint_values: bool | None = None
    extra: bytes = b""


@dataclass
class ObjectGraph:
    """A ``TrackableObjectGraph``: node 0 is the root."""

    nodes: list = field(default_factory=list)

    def paths(self) -> dict:
        """``{node_id: [local names from the root]}`` for every node reachable from node 0."""
        out = {0: []}
        stack = [0]
        while stack:
            nid = stack.pop()
            for child, name in self.nodes[nid].children:
                if child not in out and 0 <= child < len(self.nodes):
                    out[child] = out[nid] + [name]
                    stack.append(child)
        return out


def encode_object_graph(graph: ObjectGraph) -> bytes:
    """Serialize a TrackableObjectGraph."""
    out = bytearray()
    for node in graph.nodes:
        body = bytearray()
        for node_id, name in node.children:
            body += _len_field(1, _int_field(1, node_id) + _len_field(2, name.encode()))
        for name, full_name, key in node.attributes:
            body += _len_field(2, _len_field(1, name.encode()) + _len_field(2, full_name.encode())
                               + _len_field(3, key.encode()))
        for original, slot_name, slot in node.slot_variables:
            body += _len_field(3, _int_field(1, original) + _len_field(2, slot_name.encode()) + _int_field(3, slot))
        if node.has_checkpoint_values is not None:
            body += _len_field(5, _int_field(1, int(node.has_checkpoint_values)))
        body += node.extra
        out += _len_field(1, bytes(body))
    return bytes(out)


def _text(value: bytes, what: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{what}: invalid UTF-8 ({exc})") from None


def decode_object_graph(data: bytes, what: str = "object graph") -> ObjectGraph:
    """Parse a TrackableObjectGraph (children, attributes, slot variables; the rest kept raw)."""
    graph = ObjectGraph()
    for number, wire, value in iter_fields(data, what):
        if number != 1 or wire != 2:
            continue
        node = GraphNode()
        extra = bytearray()
        for n, w, v in iter_fields(value, what):
            if n == 1 and w == 2:
                node_id, name = 0, ""
                for cn, cw, cv in iter_fields(v, what):
                    if cn == 1 and cw == 0:
                        node_id = _signed(cv)
                    elif cn == 2 and cw == 2:
                        name = _text(cv, what)
                node.children.append((node_id, name))
            elif n == 2 and w == 2:
                parts = {1: "", 2: "", 3: ""}
                for an, aw, av in iter_fields(v, what):
                    if an in parts and aw == 2:
                        parts[an] = _text(av, what)
                node.attributes.append((parts[1], parts[2], parts[3]))
            elif n == 3 and w == 2:
                original, slot_name, slot = 0, "", 0
                for sn, sw, sv in iter_fields(v, what):
                    if sn == 1 and sw == 0:
                        original = _signed(sv)
                    elif sn == 2 and sw == 2:
                        slot_name = _text(sv, what)
                    elif sn == 3 and sw == 0:
                        slot = _signed(sv)
                node.slot_variables.append((original, slot_name, slot))
            elif n == 5 and w == 2:
                node.has_checkpoint_values = any(bn == 1 and bv for bn, _bw, bv in iter_fields(v, what))
            else:
                extra += _reencode(n, w, v)
        node.extra = bytes(extra)
        graph.nodes.append(node)
    return graph


def _reencode(number: int, wire: int, value) -> bytes:
    if wire == 0:
        return _tag(number, 0) + encode_varint(value)
    if wire == 2:
        return _len_field(number, value)
    if wire == 5:
        return _tag(number, 5) + value.to_bytes(4, "little")
    return _tag(number, 1) + value.to_bytes(8, "little")


# -- CheckpointState (text format) ----------------------------------------------------------------

_STATE_LINE = re.compile(r'\s*([a-z_]+)\s*:\s*(.*?)\s*')  # fullmatch: '$' would accept a final newline


def _quote(text: str) -> str:
    out = []
    for byte in text.encode("utf-8"):
        ch = chr(byte)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= byte < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _unquote(token: str, what: str) -> str:
    if len(token) < 2 or token[0] not in "\"'" or token[-1] != token[0]:
        raise FormatError(f"{what}: expected a quoted string, got {token!r}")
    body = token[1:-1]
    out = bytearray()
    i = 0
    simple = {"n": 10, "t": 9, "r": 13, "\\": 92, '"': 34, "'": 39, "a": 7, "b": 8, "f": 12, "v": 11, "?": 63}
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out += ch.encode("utf-8")
            i += 1
            continue
        if i + 1 >= len(body):
            raise FormatError(f"{what}: dangling backslash in {token!r}")
        nxt = body[i + 1]
        if nxt in simple:
            out.append(simple[nxt])
            i += 2
        elif nxt in "01234567":
            j = i + 1
            while j < len(body) and j < i + 4 and body[j] in "01234567":
                j += 1
            out.append(int(body[i + 1 : j], 8) & 0xFF)
            i = j
        elif nxt == "x":
            j = i + 2
            while j < len(body) and j < i + 4 and body[j] in "0123456789abcdefABCDEF":
                j += 1
            if j == i + 2:
                raise FormatError(f"{what}: bad \\x escape in {token!r}")
            out.append(int(body[i + 2 : j], 16))
            i = j
        else:
            raise FormatError(f"{what}: unknown escape \\{nxt} in {token!r}")
    return _text(bytes(out), what)


def encode_checkpoint_state(latest: str, all_paths) -> str:
    """The ``checkpoint`` file TensorFlow writes: text-format CheckpointState.

    >>> print(encode_checkpoint_state("ckpt-2", ["ckpt-1", "ckpt-2"]), end="")
    model_checkpoint_path: "ckpt-2"
    all_model_checkpoint_paths: "ckpt-1"
    all_model_checkpoint_paths: "ckpt-2"
    """
    lines = [f"model_checkpoint_path: {_quote(latest)}"]
    lines += [f"all_model_checkpoint_paths: {_quote(p)}" for p in all_paths]
    return "\n".join(lines) + "\n"


def decode_checkpoint_state(text: str, what: str = "checkpoint state") -> tuple[str | None, list]:
    """Parse a ``checkpoint`` file; returns ``(model_checkpoint_path, all_model_checkpoint_paths)``.

    Timestamp fields and unknown scalar fields are ignored.
    """
    latest = None
    paths = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _STATE_LINE.fullmatch(line)
        if not match:
            raise FormatError(f"{what}, line {number}: cannot parse {line!r} (expected 'field: value')")
        name, value = match.groups()
        if name == "model_checkpoint_path":
            latest = _unquote(value, f"{what}, line {number}")
        elif name == "all_model_checkpoint_paths":
            paths.append(_unquote(value, f"{what}, line {number}"))
    return latest, paths
