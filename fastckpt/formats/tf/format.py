"""TensorFlow v2 checkpoint (tensor bundle) format, as fastckpt reads and writes it.

This is the byte-level specification. The key words MUST, MUST NOT, SHOULD and
MAY are used as in RFC 2119. "Reader" and "writer" mean fastckpt's
:class:`~fastckpt.tf.CheckpointReader` and :class:`~fastckpt.tf.CheckpointWriter`;
where TensorFlow behaves differently it is said. Layouts were checked against
files written by TensorFlow 2.21 and TF 1.x; fastckpt's writer reproduces
TensorFlow's index bytes exactly for the same entries.

1. Files
--------

A checkpoint is named by a *prefix* ``P`` (``dir/ckpt-1``):

- ``P.index``: a table (section 2) mapping tensor names to entries (section 3);
- ``P.data-SSSSS-of-NNNNN`` for shard ``S`` in ``0 .. N-1`` (five decimal
  digits each): raw tensor bytes with no header, footer or padding other than
  that of section 4.1;
- optionally ``dir/checkpoint``, a text-format ``CheckpointState``::

      model_checkpoint_path: "ckpt-2"
      all_model_checkpoint_paths: "ckpt-1"
      all_model_checkpoint_paths: "ckpt-2"

  Relative paths resolve against ``dir``. A directory given to the reader
  MUST have this file; its ``model_checkpoint_path`` names the prefix.
  Strings use C escapes (``\\"``, ``\\\\``, octal ``\\NNN`` for non-ASCII
  bytes). Other fields (timestamps) are ignored.

A writer MUST finish (write, fsync, rename) every data file before it
creates the index, and MUST write each file to a temporary name and rename it
into place, so that an index never names data that is not there.

2. The index table (tensorflow::table, a LevelDB SSTable)
---------------------------------------------------------

2.1 Primitives. ``varint32``/``varint64``: little-endian base-128 (7 bits a
byte, high bit = more follows); a varint32 is at most 5 bytes and MUST NOT
exceed 2**32-1, a varint64 at most 10 bytes. ``fixed32``/``fixed64``:
little-endian. CRC32C is the Castagnoli CRC (reflected polynomial 0x82F63B78,
init and final XOR 0xFFFFFFFF; ``crc32c(b"123456789") == 0xE3069283``).
Every stored CRC is *masked*: ``mask(c) = ((c >> 15 | c << 17) + 0xA282EAD8)
mod 2**32``.

2.2 Layout::

    data block 0 | trailer | ... | data block K-1 | trailer
    metaindex block | trailer | index block | trailer | footer (48 bytes)

A *BlockHandle* is ``varint64 offset, varint64 size`` (size excludes the
trailer). The 5-byte *trailer* is one compression-type byte (0 = none,
1 = raw Snappy, no framing) and ``fixed32 mask(crc32c(stored block bytes +
type byte))``. The reader MUST verify every trailer it reads and MUST reject
other type bytes; the writer MUST write type 0 (TensorFlow's bundle writer
does too; type 1 appears in TF 1.x files). A Snappy block's declared length
MUST NOT exceed what Snappy can produce from its size (22 bytes per input
byte); overlapping back-references MUST be copied byte by byte.

2.3 Footer: the last 48 bytes: metaindex handle, index handle, zero padding
to byte 40, then ``fixed64 0xDB4775248B80FB57`` (bytes ``57 FB 80 8B 24 75
47 DB``). A file shorter than 48 bytes or with another magic is not a table.
The padding is not read. Both handles MUST lie before the footer.

2.4 Block contents::

    entry*: varint32 shared | varint32 non_shared | varint32 value_len
            | key[shared:] (non_shared bytes) | value (value_len bytes)
    fixed32 restart_offset[num_restarts] | fixed32 num_restarts

An entry's key is the first ``shared`` bytes of the previous key plus its own
``non_shared`` bytes; ``shared`` MUST NOT exceed the previous key's length
and every length MUST fit before the restart array. Every
``restart_interval``-th entry (16 in data blocks, 1 in the index block) is a
*restart*: it MUST have ``shared == 0`` and its offset is listed; the first
restart is offset 0. TensorFlow's point lookup binary-searches the restarts
(a restart with ``shared != 0`` is "bad entry in block"). The empty block is
``00000000 01000000``. The metaindex block is always empty
(``00000000 01000000 00 c0f2a1b0`` with its trailer); TensorFlow never reads
it, the reader checks its trailer.

Because a key is stored as what it adds to the one before, an index whose
keys each extend the previous one is linear in size but quadratic when
decoded. fastckpt's reader refuses (``FormatError``, naming the entry) an
index whose keys decode to more than 64 times its size plus 1 MiB
(``fastckpt._native.tftable.max_key_bytes``), index and data blocks
together. TensorFlow's writer stores a whole key every 16 entries, which
keeps its indexes under 16 times (the reference indexes: at most 2 times).

2.5 Keys are compared as unsigned bytes (memcmp, then length) and MUST be
strictly increasing across the whole table. A data block is closed once its
size estimate ``len(entries) + 4 * len(restarts) + 4`` reaches 262144 bytes.

2.6 Index block: one entry per data block whose value is that block's handle
and whose key ``k_i`` MUST satisfy ``last key of block i <= k_i < first key
of block i+1`` (any key >= the last key for the final block); a smaller key
hides the block's tensors from TensorFlow's ``get_tensor`` (iteration still
sees them). The writer uses TensorFlow's choices:
``FindShortestSeparator(last, next)`` between blocks (at the first differing
byte ``i``, ``last[:i] + (last[i]+1)`` when ``last[i] < 0xFF`` and
``last[i]+1 < next[i]``, else ``last``) and ``FindShortSuccessor(last)``
(the first byte that is not 0xFF, incremented, and the key cut after it) for
the last block.

3. Bundle entries
-----------------

3.1 The first key MUST be the empty string; its value is a
``BundleHeaderProto``: ``num_shards`` (field 1, varint), ``endianness``
(field 2, varint: 0 little, 1 big), ``version`` (field 3, message:
``producer`` 1, ``min_consumer`` 2, repeated ``bad_consumers`` 3).
TensorFlow writes ``08 01 1a 02 08 01``. The reader MUST refuse
``min_consumer > 1``, ``producer < 0`` or 1 in ``bad_consumers``, and
``num_shards`` outside ``1 .. 2**31-1`` (the field is an int32; 0 is
accepted only for a bundle without tensors). A reader SHOULD NOT allocate
per shard before a tensor names the shard.

3.2 Every other value is a ``BundleEntryProto`` (proto3: absent scalars are
0, fields MAY come in any order, unknown fields MUST be skipped)::

    #  wire     meaning
    1  varint   dtype (DataType enum, section 3.4)
    2  message  shape: TensorShapeProto, repeated dim (field 2), each
                Dim{size: int64 = 1}; a 0-size dimension is an empty Dim
                (12 00); unknown_rank (3) MUST be false
    3  varint   shard_id (< num_shards)
    4  varint   offset in the shard
    5  varint   size in bytes; for fixed-size dtypes it MUST equal
                elements x item size
    6  fixed32  crc32c: masked checksum of the payload (section 4.2)
    7  message  repeated TensorSliceProto slices (partitioned variables)

The writer emits fields 1-6 in this order, always emits ``shape`` (``12 00``
for a scalar), and omits zero values of 3-5.

3.3 Names. Tensor names are the keys, UTF-8. Keys starting with byte 0x00
are slices of partitioned variables: ``OrderedCode`` of (0, name, rank,
(start, length) per dimension, length -1 for a full dimension). They are
hidden from listings; the variable's own entry carries only ``dtype``,
``shape`` and ``slices`` (each ``extent{start = 1, length = 2}``), and the
reader assembles the full tensor from the slice entries, which MUST cover it
exactly once; no two slice entries may point at the same data bytes (the
reader refuses such an index before allocating the full tensor).
Object-based checkpoints (``tf.train.Checkpoint``) use keys
``<path>/.ATTRIBUTES/VARIABLE_VALUE`` where each path component is escaped
(``.`` -> ``..``, then ``/`` -> ``.S``), a ``save_counter`` int64 scalar and
``_CHECKPOINTABLE_OBJECT_GRAPH``, a scalar string holding a serialized
``TrackableObjectGraph`` (nodes with ``children{node_id, local_name}`` and
``attributes{name, full_name, checkpoint_key}``; node 0 is the root).
``tf.train.Checkpoint.restore`` needs that graph for object-based keys.

3.4 DataType values and element encodings: 1 float32, 2 float64, 3 int32,
4 uint8, 5 int16, 6 int8, 7 string (section 4.3), 8 complex64, 9 int64,
10 bool (one byte, 0 or 1), 11 qint8, 12 quint8, 13 qint32, 14 bfloat16,
15 qint16, 16 quint16, 17 uint16, 18 complex128, 19 float16, 22 uint32,
23 uint64, 24 float8_e5m2, 25 float8_e4m3fn, 26 float8_e4m3fnuz,
27 float8_e4m3b11fnuz, 28 float8_e5m2fnuz, 29 int4, 30 uint4, 31 int2,
32 uint2, 33 float4_e2m1fn (24-33: one byte per element, from the enum;
not checked against TensorFlow-written files). Quantized types (11, 12, 13,
15, 16) are stored as their integer type's bytes and read as TensorFlow's numpy
form, a one-field structured dtype named for the type (``[("qint8", "i1")]``);
a writer MUST store such a dtype under its quantized DataType and a plain
integer under the plain one. 20 (resource) and 21 (variant: a ``tf.data``
iterator's state ...) are opaque: the reader lists them as skipped (name and
why) and never reads their bytes; values >= 100 (references) are refused.

4. Data shards
--------------

4.1 A tensor's bytes are its elements in C (row-major) order, little-endian
unless the header says big-endian (then the reader byte-swaps into a native
copy). Tensors MAY be stored in any order and MUST NOT be assumed packed;
with ``data_alignment`` A > 1 the writer pads each tensor with zero bytes to
a multiple of A (``size`` excludes the padding). A zero-element tensor of a
fixed-size dtype has size 0 and crc ``mask(0)``; a zero-element string
tensor is the 4 bytes of its length checksum.

4.2 The entry's ``crc32c`` is ``mask(crc32c(payload))`` over the exact stored
bytes (before any byte swap). The reader verifies it on every read unless
opened with ``verify=False``.

4.3 DT_STRING payload: ``varint64 len[i]`` for each element, then ``fixed32
mask(c1)`` where ``c1`` is the CRC32C of each length as uint32 little-endian
(uint64 when it exceeds 0xFFFFFFFF), then the element bytes. The entry's
``crc32c`` is ``mask`` of the CRC continued from ``c1`` over the four stored
bytes of ``mask(c1)`` and then every element's bytes. ``size`` is the whole
payload; the lengths MUST add up to what follows the length checksum.
"""

__all__: list = []
