"""RecIS's serializer, ported line by line for the tests: the directories RecIS writes, and RecIS's own checks.

RecIS itself needs CUDA to install, so the tests build its directories with this port of its C++ save path
(github.com/alibaba/RecIS, commit b004c56, ``csrc/serialize/``): ``Saver::MakeWriteBlocks`` and
``Saver::Save`` (saver.cc), ``SaveBundle`` (save_bundle.cc: ``Make``, ``AddBlock``, ``SaveMeta``,
``SaveTables``, ``MergeMetaInfo``, ``MergeTorchRankJson``, ``MergeTensorKeyJson``), ``TableWriter``
(table_writer.cc), the ``WriteMeta`` / ``WriteData`` of the write blocks (write_block.cc), ``IndexInfo``
(index_info.cc), the names (name.cc) and ``SliceInfo::ToString`` (embedding/slice_info.cc). Each function
names the C++ it follows. It keeps RecIS's temporary files and merges (per-rank ``ckpt-%07d.index``,
``{rank}tensorkey.json``, ``ckpt-%07d-%07d.json.tmp``), so that what is left is what RecIS leaves.

``check_json`` is ``TestCase._check_json`` of RecIS's ``tests/serialize/save_load_test.py``, copied with
only ``self`` removed; ``check_load_bundle`` is what ``LoadBundle::Build``, ``TableReader::LoadMeta``,
``BlockInfo::DecodeFromJson`` and ``IndexInfo`` (load_bundle.cc, table_reader.cc, block_info.cc,
dtype_serialize.cc) require of a directory before RecIS reads a byte of data.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

# SerializeDtype (dtype_serialize.cc); bool is written "bool" there.
_SERIALIZE = {"bool": "bool", "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64",
              "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
# DeserializeDtype
_DESERIALIZE = {"BOOL", "I8", "U8", "I16", "I32", "I64", "F16", "F32", "F64", "BF16"}
# SaveBundle::InitTypeMap
_TYPE_MAP = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "U64": "uint64", "I32": "int32", "U32": "uint32", "I16": "int16", "U16": "uint16", "I8": "int8",
             "U8": "uint8", "BOOL": "bool"}


def slice_to_string(begin: int, end: int, size: int) -> str:
    """SliceInfo::ToString: begin and end zero-padded to the width of size, joined by '@'."""
    s = str(size)
    e = str(end)
    e = "0" * (len(s) - len(e)) + e
    b = str(begin)
    b = "0" * (len(s) - len(b)) + b
    return f"{b}@{e}@{s}"


def gen_slice(shard_index: int = 0, shard_num: int = 1, slice_size: int = 65536):
    """recis/nn/modules/hashtable.py gen_slice, as (begin, end, size)."""
    shard_slice_size = slice_size // shard_num
    sizes = [shard_slice_size] * shard_num
    remain = slice_size % shard_num
    sizes = [size + 1 if i < remain else size for i, size in enumerate(sizes)]
    infos, beg = [], 0
    for size in sizes:
        infos.append((beg, beg + size))
        beg += size
    return (*infos[shard_index], slice_size)


def _replace_first(text: str, src: str, dst: str) -> str:
    """util::string::Replace: the first occurrence only."""
    return text.replace(src, dst, 1)


class _Block:
    """WriteBlock: tensor_name_, slice_info_, is_dense_, and the bytes and header fields it writes."""

    def __init__(self, tensor_name, slice_info, is_dense, array):
        self.tensor_name, self.slice_info, self.is_dense = tensor_name, slice_info, is_dense
        self.array = np.array(array, order="C")  # np.ascontiguousarray would make a 0-d tensor 1-d

    def write_meta(self, meta: dict, offset: int) -> int:
        # TensorWriteBlock / HTIdWriteBlock / HTSlotWriteBlock::WriteMeta
        nbytes = self.array.nbytes
        block_meta = {"dtype": _SERIALIZE[self.array.dtype.name], "shape": list(self.array.shape),
                      "data_offsets": [offset, offset + nbytes], "dense": self.is_dense}
        if "/part_" in self.tensor_name:
            meta[self.tensor_name] = block_meta  # BlockNameEncode(tensor_name_, "", "")
        else:
            meta[f"{self.tensor_name}^{self.slice_info}"] = block_meta
        return offset + nbytes


def make_write_blocks(shard_index: int, hashtables: dict, tensors: dict) -> list[_Block]:
    """Saver::MakeWriteBlocks: every table's blocks (WriteBlock::MakeHTWriteBlock), then rank 0's tensors.

    ``hashtables``: {child name: (ids, [(slot name, rows)], (begin, end, size))}, slots in SlotGroup order
    (the embedding first)."""
    blocks = []
    for child, (ids, slots, piece) in hashtables.items():
        slice_info = slice_to_string(*piece)
        blocks.append(_Block(f"{child}@id", slice_info, False, np.asarray(ids, np.int64)))  # HTSlotNameEncode
        for slot_name, rows in slots:
            blocks.append(_Block(f"{child}@{slot_name}", slice_info, False, rows))
    if shard_index == 0:
        for name, tensor in tensors.items():
            blocks.append(_Block(name, " ", True, tensor))  # TensorWriteBlock: slice_info_ = " "
    return blocks


class _IndexInfo:
    def __init__(self):
        self.file_index, self.block_index = {}, {}

    def append(self, tensor_name, slice_info, sep, file_name):
        if file_name not in self.file_index:
            self.file_index[file_name] = len(self.file_index)
        self.block_index[f"{tensor_name}{sep}{slice_info}"] = self.file_index[file_name]

    def merge_from(self, other):
        n = len(self.file_index)
        for k, v in other.file_index.items():
            self.file_index[k] = n + v
        for k, v in other.block_index.items():
            self.block_index[k] = v + n

    def serialize(self) -> str:
        # nlohmann::json objects are std::map: keys sorted; dump() is compact
        return json.dumps({"file_index": self.file_index, "block_index": self.block_index},
                          separators=(",", ":"), sort_keys=True, ensure_ascii=False)

    @classmethod
    def deserialize(cls, text: str):
        obj, data = cls(), json.loads(text)
        obj.file_index, obj.block_index = dict(data["file_index"]), dict(data["block_index"])
        return obj


def _dump4(obj) -> str:
    """nlohmann::json::dump(4) of a (sorted) json object."""
    return json.dumps(obj, indent=4, sort_keys=True, ensure_ascii=False)


def save_rank(path: str, shard_index: int, shard_num: int, parallel: int, blocks: list[_Block]) -> None:
    """SaveBundle::Make, AddBlock for each block, Save (SaveMeta, SaveTables); MergeJsonInfo and MergeMetaInfo
    are run by ``merge`` once every rank has saved (rank 0 waits for the others' files in RecIS)."""
    writers = [[] for _ in range(parallel)]
    file_names = [f"model-{shard_index * parallel + i:06d}-of-{parallel * shard_num:06d}.safetensors"
                  for i in range(parallel)]
    index_info, tensor_name_map, table_index = _IndexInfo(), {}, 0
    for block in blocks:  # AddBlock
        new_tensor_name = _replace_first(block.tensor_name, "@", ".")
        k = table_index
        table_index = (table_index + 1) % parallel
        writers[k].append(block)
        if not block.is_dense:
            new_tensor_name += f"/part_{shard_index}_{shard_num}"
            if new_tensor_name not in tensor_name_map:
                tensor_name_map[new_tensor_name] = f"{block.tensor_name}^{block.slice_info}"
            block.tensor_name = new_tensor_name  # SetTensorName
            index_info.append(block.tensor_name, "", "", file_names[k])
        else:
            index_info.append(block.tensor_name, block.slice_info, "^", file_names[k])
    # SaveMeta
    with open(os.path.join(path, f"ckpt-{shard_index:07d}.index"), "w", encoding="utf-8") as f:
        f.write(index_info.serialize())
    with open(os.path.join(path, f"{shard_index}tensorkey.json"), "w", encoding="utf-8") as f:
        f.write(_dump4(tensor_name_map))
    # SaveTables: TableWriter::SequentialWrite per writer, then rename the non-empty ones
    for i, blocks_i in enumerate(writers):
        if not blocks_i:
            continue
        meta, offset = {}, 0
        for block in blocks_i:
            offset = block.write_meta(meta, offset)
        tmp = os.path.join(path, f"ckpt-{shard_index:07d}-{i:07d}.data.tmp")
        with open(os.path.join(path, f"ckpt-{shard_index:07d}-{i:07d}.json.tmp"), "w", encoding="utf-8") as f:
            f.write(json.dumps(meta, separators=(",", ":"), ensure_ascii=False))  # ordered_json: block order
        for v in meta.values():
            del v["dense"]
        meta_str = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        meta_str += b" " * (8 - len(meta_str) % 8)
        with open(tmp, "wb") as f:
            f.write(struct.pack("<q", len(meta_str)))
            f.write(meta_str)
            for block in blocks_i:
                f.write(block.array.tobytes())
        os.rename(tmp, os.path.join(path, file_names[i]))


def merge(path: str, shard_num: int, parallel: int) -> None:
    """Rank 0's MergeJsonInfo (MergeTorchRankJson, MergeTensorKeyJson) and MergeMetaInfo."""
    combine = {}
    for i in range(shard_num):
        for j in range(parallel):
            sub = os.path.join(path, f"ckpt-{i:07d}-{j:07d}.json.tmp")
            if not os.path.exists(sub):
                # RecIS's GetSubFileData waits (100 s at a time) for every writer's json: a writer given no block
                # writes none, and rank 0 waits for ever. Such saves never finish in RecIS.
                raise RuntimeError(f"RecIS would wait for ever for {sub}")
            with open(sub, encoding="utf-8") as f:
                combine.update(json.load(f))  # merge_patch of disjoint keys
            os.remove(sub)
    rank = {}
    for k, v in combine.items():
        if v["dense"]:
            del v["data_offsets"]
            v["name"] = k
            v["dtype"] = _TYPE_MAP.get(v["dtype"], "")
            v["dimension"] = 0
            v["is_hashmap"] = False
        elif ".embedding" in k:
            del v["data_offsets"]
            v["name"] = k
            v["dtype"] = _TYPE_MAP.get(v["dtype"], "")
            v["dimension"] = v["shape"][-1]
            v["hashmap_key"] = _replace_first(k, ".embedding", ".id")
            v["hashmap_key_dtype"] = "int64"
            v["hashmap_value"] = k
            v["is_hashmap"] = True
        rank[k] = v
    with open(os.path.join(path, "torch_rank_weights_embs_table_multi_shard.json"), "w", encoding="utf-8") as f:
        f.write(_dump4(rank))
    tensorkey = {}
    for i in range(shard_num):
        sub = os.path.join(path, f"{i}tensorkey.json")
        with open(sub, encoding="utf-8") as f:
            tensorkey.update(json.load(f))
        os.remove(sub)
    with open(os.path.join(path, "tensorkey.json"), "w", encoding="utf-8") as f:
        f.write(_dump4(tensorkey))
    index = _IndexInfo()
    for i in range(shard_num):  # std::set of the per-rank files: rank order once all are there
        sub = os.path.join(path, f"ckpt-{i:07d}.index")
        with open(sub, encoding="utf-8") as f:
            index.merge_from(_IndexInfo.deserialize(f.read()))
        os.remove(sub)
    with open(os.path.join(path, "index.tmp"), "w", encoding="utf-8") as f:
        f.write(index.serialize())
    os.rename(os.path.join(path, "index.tmp"), os.path.join(path, "index"))


def write_checkpoint(path: str, ranks: list[dict], tensors: dict, parallel: int) -> str:
    """A whole RecIS save: ``ranks[i]`` is rank i's hashtables (as for :func:`make_write_blocks`)."""
    os.makedirs(path, exist_ok=True)
    for i, tables in enumerate(ranks):
        save_rank(path, i, len(ranks), parallel, make_write_blocks(i, tables, tensors))
    merge(path, len(ranks), parallel)
    return path


# -- RecIS's checks ---------------------------------------------------------------------------------------------

def check_json(path: str, num_dense: int, num_sparse: int) -> bool:
    """tests/serialize/save_load_test.py TestCase._check_json, verbatim but for ``self``."""
    _tensor_map_json = "tensorkey.json"
    _rank_json = "torch_rank_weights_embs_table_multi_shard.json"
    _index_file = "index"
    with open(os.path.join(path, _tensor_map_json)) as f:
        tensor_name_data = json.load(f)
    with open(os.path.join(path, _rank_json)) as f:
        rank_data = json.load(f)

    if len(tensor_name_data) != num_sparse:
        print(_tensor_map_json, f" keys not equal to {num_sparse}")
        return False

    if len(rank_data) != num_sparse + num_dense:
        print(_rank_json, f" keys not equal to {num_sparse + num_dense}")
        return False

    for k in tensor_name_data.keys():
        if k not in rank_data.keys():
            return False

    for key, val in rank_data.items():
        if "embedding" in key:
            for subkey in ["dimension", "dtype", "name", "dense", "dimension", "dtype", "hashmap_key",
                           "hashmap_key_dtype", "hashmap_value", "is_hashmap"]:
                if subkey not in val:
                    return False
            if not val["is_hashmap"]:
                return False
            if "id" not in val["hashmap_key"]:
                return False
        else:
            if val["dense"]:
                for subkey in ["name", "dense", "dimension", "is_hashmap", "dtype"]:
                    if subkey not in val:
                        return False
                if val["dimension"] != 0:
                    return False
                if val["is_hashmap"]:
                    return False

    with open(os.path.join(path, _index_file)) as f:
        data = json.load(f)
        index_data, file_data = data["block_index"], data["file_index"]
        if len(index_data) != len(rank_data):
            return False

        for val in index_data.values():
            if val < 0 or val >= len(file_data):
                return False

    return True


def check_load_bundle(path: str) -> dict:
    """What RecIS's LoadBundle and TableReader need before reading data; raises AssertionError naming the
    first unmet requirement. Returns {block name (tensor^slice): (file name, absolute begin, end)}."""
    return {name: where[:3] for name, where in _load_bundle(path).items()}


def _load_bundle(path: str) -> dict:
    """check_load_bundle's work; each block also with its header entry (BlockInfo: dtype, shape)."""
    index_path = os.path.join(path, "index")
    assert os.path.exists(index_path), f"[{index_path}] not found"  # LoadBundle::BuildIndexInfo
    with open(os.path.join(path, "tensorkey.json"), "rb") as f:  # GetTensorNameMap: NewRandomAccessFile
        tensor_name_map = json.loads(f.read())
    with open(index_path, "rb") as f:
        info = json.loads(f.read())
    file_index, block_index = info["file_index"], info["block_index"]
    index_file = {v: k for k, v in file_index.items()}  # FileNameByIndex
    blocks = {}
    for key, number in block_index.items():  # IndexInfo::Deserialize maps through the tensor name map
        name = tensor_name_map.get(key, key)
        tokens = [t for t in name.split("^") if t]  # TensorNameFromBlockName: StrSplit(char) drops empties
        assert len(tokens) == 2, f"block_name: {name}, type error"
        blocks[name] = number
    readers = {}
    for number in set(blocks.values()):
        file_name = index_file[number]
        file_path = os.path.join(path, file_name)
        with open(file_path, "rb") as f:  # TableReader::LoadMeta
            meta_size = struct.unpack("<Q", f.read(8))[0]
            meta = json.loads(f.read(meta_size))
        size = os.path.getsize(file_path)
        infos = {}
        for block_name, obj in meta.items():
            block_name = tensor_name_map.get(block_name, block_name)
            assert "dtype" in obj, f"BlockInfo::DecodeFromJson dtype failed, json: {obj}"
            assert obj["dtype"] in _DESERIALIZE, f"dtype: {obj['dtype']} is invalid"
            assert "shape" in obj, f"BlockInfo::DecodeFromJson shape failed, json: {obj}"
            assert "data_offsets" in obj, f"BlockInfo::DecodeFromJson offset failed, json: {obj}"
            assert len(obj["data_offsets"]) == 2, f"offset shape must be 2d, json: {obj}"
            begin, end = (8 + meta_size + o for o in obj["data_offsets"])
            assert end <= size, f"{file_name}: {block_name} ends at {end}, past the file's {size} bytes"
            infos[block_name] = (file_name, begin, end, obj)
        readers[number] = infos
    for name, number in blocks.items():
        assert name in readers[number], f"{name} not in {index_file[number]}"  # BlockInfoOfBlock: .at()
    return {name: readers[number][name] for name, number in blocks.items()}


# -- RecIS's hashtables: slot groups, the step filter, slices (the state its save path writes) -----------------

class Slot:
    """embedding::Slot (slot_group.cc): a name, a dtype and a partial shape ``[block_size, ...]``."""

    def __init__(self, name: str, dtype, partial_shape: list):
        self.name, self.dtype, self.partial_shape = name, np.dtype(dtype), list(partial_shape)

    def full_shape(self, block_size: int) -> list:
        """Slot::FullShape: the partial shape with its first entry made ``block_size``."""
        shape = list(self.partial_shape)
        shape[0] = block_size
        return shape


class SlotGroup:
    """embedding::SlotGroup: its slots in the order appended (the embedding first: Hashtable's constructor
    appends it, hashtable.cc)."""

    def __init__(self, block_size: int = 1024):
        self.block_size, self.slots = block_size, []

    def append_slot(self, name: str, dtype, partial_shape: list) -> Slot:
        """SlotGroup::AppendSlot."""
        self.slots.append(Slot(name, dtype, partial_shape))
        return self.slots[-1]

    def append_emb_slot(self, dtype, partial_shape: list) -> None:
        """SlotGroup::AppendEmbSlot: the slot named EmbSlotName(), "embedding"."""
        self.append_slot("embedding", dtype, partial_shape)

    def append_step_filter_slot(self, name: str) -> None:
        """SlotGroup::AppendStepFilterSlot: ``full_shape{block_size_, 1}``, torch::kInt64."""
        self.append_slot(name, np.int64, [self.block_size, 1])

    def emb_slot(self) -> Slot:
        return self.slots[0]


class Table:
    """One RecIS ``HashTable`` (recis/nn/modules/hashtable.py, csrc/embedding/hashtable.cc) as its save path sees
    it: its slot group, its slice, and the rows it holds (``ids`` in ``ids_map()`` order, ``values[slot]`` the
    rows of every slot for those ids).

    ``filter_hook``: the name of a GlobalStepFilterHookImpl (``"step_filter"``, its default), which appends its
    slot when the table is made (hashtable_hook_impl.py: ``append_step_filter_slot``); ``optimizer="adam"``:
    SparseAdam(W)'s slots, appended by the optimizer afterwards (adam.cc: ``sparse_adam_exp_avg`` and
    ``sparse_adam_exp_avg_sq``, each ``emb_slot->FullShape(1)`` of the embedding's dtype)."""

    def __init__(self, embedding_shape: list, dtype=np.float32, slice_=(0, 65536, 65536), filter_hook=None,
                 optimizer=None, block_size: int = 1024):
        self.slot_group = SlotGroup(block_size)
        # Hashtable::Hashtable: partial_shape = embedding_shape with block_size inserted first
        self.slot_group.append_emb_slot(dtype, [block_size, *embedding_shape])
        if filter_hook is not None:
            self.slot_group.append_step_filter_slot(filter_hook)
        if optimizer == "adam":
            emb = self.slot_group.emb_slot()
            self.slot_group.append_slot("sparse_adam_exp_avg", emb.dtype, emb.full_shape(1))
            self.slot_group.append_slot("sparse_adam_exp_avg_sq", emb.dtype, emb.full_shape(1))
        self.slice = tuple(slice_)
        self.ids = np.empty(0, np.int64)
        self.values = {slot.name: np.empty(slot.full_shape(0), slot.dtype) for slot in self.slot_group.slots}

    def insert(self, ids, rows: dict) -> None:
        """Hold ``ids`` with ``rows[slot]`` for every slot (rows of each slot's full shape)."""
        self.ids = np.asarray(ids, np.int64)
        for slot in self.slot_group.slots:
            array = np.asarray(rows[slot.name], slot.dtype)
            assert list(array.shape) == slot.full_shape(len(self.ids)), (slot.name, array.shape)
            self.values[slot.name] = array

    def write_tables(self, child: str) -> dict:
        """WriteBlock::MakeHTWriteBlock's blocks of this (uncoalesced) table, as :func:`make_write_blocks` takes
        them: the ids, then one HTSlotWriteBlock per slot in slot group order, each of ``FullShape(ids)``."""
        slots = [(slot.name, self.values[slot.name].reshape(slot.full_shape(len(self.ids))))
                 for slot in self.slot_group.slots]
        return {child: (self.ids, slots, self.slice)}


def load_table(path: str, child: str, table: Table) -> dict:
    """RecIS's Loader for one table: LoadInfo::Append (the id and every slot of the target table),
    LoaderInternal::BuildHTLoadCollection (the parts whose slice has the target's size, ``IsEqualRange``, and
    meets its slice, ``IsIntersect``), HTIdReadBlock::Read (``MarkIdAcceptable``) and HTSlotReadBlock::Read's
    checks. Returns ``{id: {slot: row}}`` of the ids the table accepts; a check RecIS makes raises
    AssertionError with RecIS's message ("shape not match", "dtype not match")."""
    blocks = _load_bundle(path)
    begin, end, size = table.slice
    got: dict = {}
    parts: dict = {}
    for block_name, where in blocks.items():
        tensor, slice_info = [t for t in block_name.split("^") if t]
        if not tensor.startswith(f"{child}@") or slice_info == " ":
            continue
        b, e, s = (int(x) for x in slice_info.split("@"))
        intersect = (b <= begin < e or b < end <= e) or (begin <= b < end or begin < e <= end)
        if s == size and intersect:
            parts.setdefault(slice_info, {})[tensor[len(child) + 1:]] = where
    for slice_info, found in parts.items():
        assert "id" in found and len(found) > 1, f"{child}, invalid"  # HTReadCollection::Valid
        file_name, id_begin, id_end, _ = found["id"]
        with open(os.path.join(path, file_name), "rb") as f:
            f.seek(id_begin)
            ids = np.frombuffer(f.read(id_end - id_begin), np.int64)
        accept = (ids.view(np.uint64) % np.uint64(size) >= begin) & (ids.view(np.uint64) % np.uint64(size) < end)
        for slot in table.slot_group.slots:
            if slot.name not in found:
                continue  # "Sparse tensor [...] not found in safetensors": a warning only
            file_name, s_begin, s_end, block_info = found[slot.name]
            shape = list(block_info["shape"])
            assert slot.full_shape(shape[0]) == shape, "shape not match"  # HTSlotReadBlock::Read
            assert _SERIALIZE[slot.dtype.name] == block_info["dtype"], "dtype not match"
            with open(os.path.join(path, file_name), "rb") as f:
                f.seek(s_begin)
                rows = np.frombuffer(f.read(s_end - s_begin), slot.dtype).reshape(shape)
            for k in np.flatnonzero(accept):
                got.setdefault(int(ids[k]), {})[slot.name] = rows[k]
    return got

