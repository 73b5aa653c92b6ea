"""Golden bytes: every on-disk format fastckpt writes, made from fixed inputs, equals the files in tests/data/golden/.

Each case below writes one format (or one directory layout) from inputs that
never change and compares every file it produced with the committed copy,
byte for byte. A failure means a writer now puts different bytes on disk: a
format change. If that is deliberate, bump the format's version, keep the old
files readable (keep the old golden file and a test that reads it), say so in
the format's spec, and only then regenerate::

    FASTCKPT_REGENERATE_GOLDEN=1 python -m pytest tests/test_golden.py

The inputs reach into every corner of the encoders: every dtype the formats
carry, 0-d, empty, Fortran-ordered and big-endian arrays, tied weights, and
state trees holding tuples, big integers, non-finite floats, bytes, numpy
scalars and non-string keys, so that a change to a shared codec shows here.

Files of earlier format versions are kept: ``train-schema-1.0`` holds
training checkpoints with sha256 manifests, which the tests below load and
verify; ``sharded-0.2.0`` the sharded checkpoints of format versions 1 and 2
(no checksum of the manifest), which load and verify with what they carry;
``sharded`` those of version 3 (fastckpt 0.3; ``sharded-v4`` is what saves of tables of ``[dim]`` rows write now, ``sharded-v5`` what saves of tables with shaped rows or slots of their own write, ``sharded-v6`` what saves of names holding '/' write); ``npz/tensors-align4096.npz`` is the NPZ file of writer 1 (every
payload on a page, the default before the ``"auto"`` alignment policy),
still written byte for byte by ``alignment=4096`` and read back below.

Two kinds of values are facts about the machine or the moment, not about the
inputs: a training manifest's ``created_utc``, ``versions``, ``git_commit`` and
``hardware``. For ``manifest.json`` the test checks that the file is exactly
``json.dumps(parsed, indent=1, ensure_ascii=False)`` of its own content (the
layout, the key order and every other value are compared), with those four
values replaced by placeholders.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "data" / "golden"
REGENERATE = os.environ.get("FASTCKPT_REGENERATE_GOLDEN") == "1"
VOLATILE_MANIFEST_KEYS = ("created_utc", "versions", "git_commit", "hardware")


def _arange(dtype, shape, start=1):
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(start, start + n) % 97).astype(dtype).reshape(shape)


def ml_dtypes_set() -> dict[str, np.ndarray]:
    """The ml_dtypes types fastckpt's NPZ names in the .npy header."""
    return {"bf16": _arange(ml_dtypes.bfloat16, (2, 3)), "f8": _arange(ml_dtypes.float8_e4m3fn, (4,)),
            "i4": (_arange(np.int8, (5,)) % 8).astype(ml_dtypes.int4)}


def quantized_set() -> dict[str, np.ndarray]:
    """TensorFlow's quantized types in their numpy form, a one-field structured dtype."""
    return {name: _arange(np.dtype(base), (2, 2)).view([(name, base)])
            for name, base in (("qint8", "i1"), ("quint8", "u1"), ("qint16", "<i2"), ("quint16", "<u2"),
                               ("qint32", "<i4"))}


def tensor_set() -> dict[str, np.ndarray]:
    """Arrays of every layout the tensor-file writers handle, with fixed values."""
    return {
        "f32": _arange(np.float32, (2, 3)) / 8,
        "f64": _arange(np.float64, (5,)) / 3,
        "f16": _arange(np.float16, (3, 2)),
        "bf16": _arange(np.float32, (4,)).astype(ml_dtypes.bfloat16),
        "i8": _arange(np.int8, (7,)) - 40,
        "u8": _arange(np.uint8, (3,)),
        "i16": _arange(np.int16, (2, 2)),
        "i32": _arange(np.int32, (1, 1, 3)),
        "i64": np.array(-(2**40) - 7, np.int64),  # 0-d
        "u64": np.array([2**63 + 5, 1], np.uint64),
        "bool": np.array([True, False, True]),
        "empty": np.zeros((0, 4), np.float32),
        "step": np.array(7, np.int64),
    }


def npz_only_set() -> dict[str, np.ndarray]:
    """What .npy can hold and safetensors cannot."""
    return {
        **{k: v for k, v in tensor_set().items() if k != "bf16"},
        "c64": (_arange(np.float32, (3,)) + 1j * _arange(np.float32, (3,), 5)).astype(np.complex64),
        "fortran": np.asfortranarray(_arange(np.float32, (2, 3))),
        "big_endian": _arange(">u2", (4,)),
        "text": np.array(["a", "héllo", "ok"]),
        "raw": np.array([b"ab", b"c"]),
    }


def mixed_size_set() -> dict[str, np.ndarray]:
    """Payloads on both sides of the "auto" policy's 64 KiB line: 4096-aligned from 65536 bytes, 64 below."""
    return {
        "small": _arange(np.float32, (3,)),
        "below": _arange(np.uint8, (65535,)),
        "at": _arange(np.float32, (128, 128)),  # 65536 bytes
        "after": _arange(np.int16, (5,)),
    }


def _write_npz(out: Path) -> None:
    import fastckpt

    fastckpt.save_npz(out / "tensors.npz", npz_only_set())  # alignment="auto"
    fastckpt.save_npz(out / "tensors-align64.npz", npz_only_set(), alignment=64)
    # The default layout of writer 1 (before "auto"): every payload on a page.
    fastckpt.save_npz(out / "tensors-align4096.npz", npz_only_set(), alignment=4096)
    fastckpt.save_npz(out / "mixed-sizes.npz", mixed_size_set())  # alignment="auto", both sides of 64 KiB
    fastckpt.save_npz(out / "ml-dtypes.npz", ml_dtypes_set())  # descr: the ml_dtypes name


def _write_safetensors(out: Path) -> None:
    import fastckpt

    fastckpt.save_safetensors(out / "tensors.safetensors", tensor_set(), metadata={"arch": "mlp", "note": "ünï"})
    fastckpt.save_safetensors(out / "tensors-align8.safetensors", tensor_set(), alignment=8)


def _write_netcl_model(out: Path, queue) -> None:
    from fastckpt.io import save_model
    from fastckpt.nn import BatchNorm2d, Conv2d, Dropout, Embedding, Flatten, Linear, ReLU, Sequential

    model = Sequential(Conv2d(queue, 2, 3, 3, pad=1), BatchNorm2d(queue, 3), ReLU(), Flatten(),
                       Linear(queue, 12, 4), Dropout(0.25, seed=3), Linear(queue, 4, 2, bias=False),
                       Embedding(5, 2, queue=queue))
    state = {k: _arange(v.dtype, v.shape) / 16 for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    save_model(model, out / "model.netcl")


def _write_netcl_params(out: Path) -> None:
    from fastckpt.io.checkpoint import save_netcl_checkpoint, save_params

    params = [_arange(np.float32, (3, 2)), _arange(np.float16, (2,)), np.array(1.5, np.float64)]
    save_params(params, out / "params.npz")
    save_params(params, out / "named", names=["w", "b", "scale"])
    optim_state = {
        "t": 10,
        "lr": 1e-3,
        "betas": (0.9, np.float32(0.999)),
        "moments": [(_arange(np.float32, (3, 2)), _arange(np.float32, (3, 2), 9)), {"m": np.zeros(2, np.float16)}],
        "count": np.int64(3),
        "flag": np.bool_(True),
        "name": "adam",
        "nothing": None,
    }
    config = {"step": 1000, "sizes": [3, 2], "table": _arange(np.int32, (2, 2)), "nan": float("nan")}
    save_netcl_checkpoint(params, out / "ckpt" / "run.v1", optim_state=optim_state, config=config)


class TrainCorner:
    """A model whose state dict reaches every value kind of the training tree encoding."""

    __module__ = "golden"

    def __init__(self):
        w = _arange(np.float32, (4, 3)) / 4
        self.state = {
            "embed": {"weight": w},
            "head": {"weight": w},  # tied: stored once, ALIAS(...) in the metadata
            "half": w[:2],  # overlaps, but a different view: stored separately
            "bias": _arange(ml_dtypes.bfloat16, (3,)),
            "cplx": np.array([1 + 2j, -3.5j], np.complex64),
            "groups": [{"lr": 0.1, "ids": (1, 2, 3)}, {"lr": float("inf"), "ids": ()}],
            "counter": 2**70,
            "neg": -(2**53),
            "small": 2**53 - 1,
            "scalars": {"f32": np.float32(0.1), "i64": np.int64(-5), "b": np.bool_(False), "u8": np.uint8(200),
                        "f16": np.float16(np.inf)},
            "by_id": {0: "zero", 1: (np.float64(-0.0), float("nan"))},
            "__private": 1,
            "text": "naïve ✓",
            "none": None,
            "flag": True,
        }

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def _train_objects():
    from fastckpt.stateful import RNG
    from fastckpt.train import AdamW, CosineWarmupLR, GradScaler, ShuffledTokenBatches, TinyLM, train_step

    tokens = (np.arange(2000) * 7 % 31).astype(np.int32)
    lm = TinyLM(vocab=31, dim=8, hidden=16, seed=0)
    opt = AdamW(lm.parameters(), lr=1e-2)
    sched = CosineWarmupLR(opt, warmup_steps=2, total_steps=20)
    data = ShuffledTokenBatches(tokens, batch_size=4, seq_len=8, seed=1)
    rng = np.random.default_rng(5)
    scaler = GradScaler(init_scale=2.0**8)
    for _ in range(3):
        train_step(lm, opt, sched, data, rng, scaler)
    # Three steps give every buffer its shape and every counter a value; the float results of those steps depend
    # on the CPU's vector units (summation order), so the golden values are set here, exactly, in place.
    for i, p in enumerate(lm.parameters()):
        p.data[...] = _arange(p.data.dtype, p.data.shape, start=i) / 64
    for i, buffers in enumerate(opt.state):
        for j, name in enumerate(sorted(buffers)):
            buffers[name][...] = _arange(buffers[name].dtype, buffers[name].shape, start=i + 10 * j) / 1024
    return lm, opt, sched, data, rng, scaler, RNG(seed=9, bit_generator="Philox")


def _write_train_dir(out: Path) -> None:
    from fastckpt.train import CheckpointManager, save_checkpoint

    lm, opt, sched, data, rng, scaler, _ = _train_objects()
    save_checkpoint(lm, opt, sched, data, rng, out / "tinylm", step=3, epoch=1, extra_metrics={"loss": np.float32(2.5)},
                    scaler=scaler, seed=0)
    # A get_state()/set_state() object (a stateful RNG) as the training RNG, a given config, corner values.
    _, _, _, _, _, _, philox = _train_objects()
    save_checkpoint(TrainCorner(), None, None, None, philox, out / "corners", step=2**40, epoch=0,
                    extra_metrics={"acc": 0.5, "ok": True}, config={"layers": (2, 3), "name": "corner"},
                    data_manifest={"files": ["a", "b"]})
    mgr = CheckpointManager(out / "managed", max_to_keep=1)
    for step in (1, 2):
        mgr.save(step, lm, opt, sched, data, rng, epoch=0, metrics={"loss": 1.0 / step}, scaler=scaler,
                 blocking=step == 1)  # the second save goes through the asynchronous path
    mgr.close()


class StateCorner:
    """A get_state() / set_state() op whose state reaches every value kind of the stateful JSON encoding."""

    __module__ = "golden"  # the type name is written into the file: keep it independent of how tests import

    def __init__(self):
        self.value = {
            "bytes": b"\x00\xffab",
            "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"),
            "big": 2**100, "neg": -(2**64),
            "tuple": (1, "two", [3.0]),
            "np": [np.float32(0.1), np.int64(-7), np.bool_(True), np.float64(1e300)],
            "arrays": [_arange(np.float32, (2, 2)), _arange(">i4", (3,)), _arange(ml_dtypes.bfloat16, (2,)),
                       np.array(["ab", "c"]), np.array([b"x", b"yz"]), np.array(1 + 2j, np.complex64),
                       np.array([True, False]), np.zeros((0, 2), np.uint16)],
            "text": "naïve ✓ \u2028",
            "nested": {"a": {"b": [None, False]}},
        }

    def get_state(self):
        return self.value

    def set_state(self, value):
        self.value = value


class StateDicty:
    """An op with the state_dict() / load_state_dict() protocol."""

    __module__ = "golden"

    def __init__(self):
        self.state = {"step": 12, "lr": 0.5}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def _write_stateful(out: Path) -> None:
    from fastckpt.stateful import RNG, ArrayReader, Checkpoint

    reader = ArrayReader(np.arange(20), shuffle=True, seed=4, enable_checkpointing=True)
    it = reader.next_epoch(batch_size=3)
    next(it), next(it)
    rng, philox = RNG(seed=42), RNG(seed=7, bit_generator="Philox")
    rng.random(3)
    ckpt = Checkpoint()
    ckpt.register(reader, "reader")
    ckpt.register(rng, "rng")
    ckpt.register(philox)
    ckpt.register(StateCorner(), "corner")
    ckpt.register(StateDicty(), "dicty")
    ckpt.collect()
    ckpt.save(out / "state-{seq:04d}.json")


def _write_tf(out: Path) -> None:
    from fastckpt.tf import CheckpointWriter, save, save_object, write_checkpoint

    tensors = {
        "dense/kernel": _arange(np.float32, (3, 2)) / 4,
        "dense/bias": _arange(np.float64, (2,)),
        "global_step": np.int64(1234),
        "half": _arange(np.float16, (2, 2)),
        "bf16": _arange(ml_dtypes.bfloat16, (3,)),
        "flags": np.array([True, False]),
        "ids": _arange(np.int8, (4,)),
        "u16": _arange(np.uint16, (2,)),
        "c64": np.array([1 + 1j], np.complex64),
        "words": np.array([b"alpha", b"", "βeta".encode()], dtype=object),
        "scalar_text": "a single string",
        "empty": np.zeros((0, 3), np.float32),
    }
    write_checkpoint(out / "names" / "model", tensors)
    write_checkpoint(out / "objects" / "ckpt-1", {"model/dense/kernel": tensors["dense/kernel"],
                                                  "model/dense/bias": tensors["dense/bias"],
                                                  "optimizer/iter": np.int64(3)}, object_graph=True)
    write_checkpoint(out / "sharded" / "model", tensors, num_shards=2, data_alignment=64)
    write_checkpoint(out / "quantized" / "model", quantized_set())
    with CheckpointWriter(out / "writer" / "model", data_alignment=8) as w:
        w.add("b", _arange(np.int32, (3,)))
        w.add("a", "text", shard=0)
    save(out / "saved", {"w": _arange(np.float32, (2,))}, object_graph=True)
    save(out / "saved", {"w": _arange(np.float32, (2,), 3)}, object_graph=True, max_to_keep=1)

    class Layer:
        def __init__(self, scale):
            self.kernel = _arange(np.float32, (2, 2)) * scale
            self.bias = np.zeros(2, np.float32)

    class Net:
        def __init__(self):
            self.layers = [Layer(1), Layer(2)]
            self.step = np.int64(5)

    save_object(Net(), out / "checkpointable", "net")


def _sharded_tables(rank: int):
    from fastckpt.sharded import HashTable

    table = HashTable(3, slots=("m", "v"), name="emb")
    ids = np.array([-(2**63), -5, 7, 2**63 - 1, 10, 12], np.int64)[rank::2]
    table.insert(ids, _arange(np.float32, (len(ids), 3), 1 + rank) / 8,
                 slots={"m": _arange(np.float32, (len(ids), 3), 50 + rank), "v": np.full((len(ids), 3), 0.5)})
    small = HashTable(2, dtype=ml_dtypes.bfloat16, name="small")
    if rank == 0:
        small.insert([3], [[1.5, -2.0]])
    return {"emb": table, "small": small}


def _save_sharded(path: Path, tables: list[dict], tensors: dict, parallel: int, **options) -> None:
    from _sharded_edit import save_threads

    save_threads(path, tables, tensors, parallel, **options)


SHARDED_TENSORS = {"w": _arange(np.float32, (5, 2)) / 4, "step": np.array(9, np.int64), "b": _arange(ml_dtypes.bfloat16, (3,))}


def _write_sharded(out: Path, make=None, change=None, tensors=SHARDED_TENSORS) -> None:
    """A full checkpoint of ``make(rank)``'s tables and ``tensors`` on 2 ranks, ``change`` them, a delta, a quantized
    one."""
    tables = [(make or _sharded_tables)(0), (make or _sharded_tables)(1)]
    _save_sharded(out / "full", tables, tensors, parallel=2)
    (change or _change_sharded)(tables)
    from fastckpt.sharded import DeltaPolicy

    _save_sharded(out / "delta", tables, tensors, parallel=2, incremental=DeltaPolicy(max_fraction=1.0))
    _save_sharded(out / "quantized", tables, tensors, parallel=1, quantize="int8")  # no codec: fixed bytes


def _slice_group_tables(rank: int):
    """A table of 1,100 ids over two ranks (550 a rank: 3 slice groups of a version-4 part) with ids in every
    slice of 65536 and negative ones."""
    from fastckpt.sharded import HashTable

    ids = (np.arange(1100, dtype=np.int64) * 60013 - 7_000_000)[rank::2]
    table = HashTable(2, slots=("m",), name="groups")
    table.insert(ids, _arange(np.float32, (len(ids), 2), 3 + rank), slots={"m": _arange(np.float32, (len(ids), 2))})
    return {"groups": table}


def _write_sharded_v4(out: Path) -> None:
    """Format version 4: the cases of version 3, and a checkpoint whose parts hold several slice groups."""
    _write_sharded(out)
    _save_sharded(out / "groups", [_slice_group_tables(0), _slice_group_tables(1)], {}, parallel=1)


def _shaped_tables(rank: int):
    """Format version 5: a table of [2, 3] rows with a step filter's int64 [1] slot and Adam's m, beside a table of
    plain rows (recorded with its row shapes too)."""
    from fastckpt.sharded import HashTable

    ids = np.array([-(2**63), -5, 7, 2**63 - 1, 10, 12, 70000, 1001], np.int64)[rank::2]
    table = HashTable((2, 3), slots=(("step_filter", 1, np.int64), "m"), name="user")
    table.insert(ids, _arange(np.float32, (len(ids), 2, 3), 1 + rank) / 8,
                 slots={"step_filter": _arange(np.int64, (len(ids), 1), 40 + rank) - 50,
                        "m": _arange(np.float32, (len(ids), 2, 3), 60 + rank) / 4})
    small = HashTable(2, dtype=ml_dtypes.bfloat16, slots=("m",), name="small")
    if rank == 1:
        small.insert([3, -3], [[1.5, -2.0], [0.25, 4.0]], slots={"m": [[1.0, 2.0], [3.0, 4.0]]})
    return {"user": table, "small": small}


def _change_shaped(tables: list[dict]) -> None:
    """Between the version-5 full checkpoint and its delta: an update of a slot, a delete, an insert."""
    tables[1]["user"].update([-5], np.full((1, 2, 3), 0.5), slots={"step_filter": [[99]]})
    tables[0]["user"].delete([10])
    tables[0]["user"].insert([123456], np.ones((1, 2, 3)), slots={"step_filter": [[-1]]})


def _write_sharded_v5(out: Path) -> None:
    """Format version 5: tables whose rows have shapes and slots of their own, full, delta and quantized."""
    _write_sharded(out, _shaped_tables, _change_shaped)


# Format version 6: dense tensors, a table and a slot named with '/' (RecIS's ``tower/dense/kernel``).
SLASHED_TENSORS = {"tower/dense/kernel": _arange(np.float32, (5, 2)) / 4, "tower/dense/bias": _arange(ml_dtypes.bfloat16, (3,)),
                   "global/step": np.array(9, np.int64), "plain": _arange(np.int32, (2,))}


def _slashed_tables(rank: int):
    """Format version 6: a table ``tower/user`` with a slot ``adam/m`` and one of a plain name (both recorded with
    their row shapes, as in version 5)."""
    from fastckpt.sharded import HashTable

    ids = np.array([-(2**63), -5, 7, 2**63 - 1, 10, 12, 70000, 1001], np.int64)[rank::2]
    table = HashTable(3, slots=("adam/m", "v"), name="tower/user")
    table.insert(ids, _arange(np.float32, (len(ids), 3), 1 + rank) / 8,
                 slots={"adam/m": _arange(np.float32, (len(ids), 3), 50 + rank), "v": np.full((len(ids), 3), 0.5)})
    small = HashTable(2, dtype=ml_dtypes.bfloat16, slots=("m",), name="small")
    if rank == 1:
        small.insert([3, -3], [[1.5, -2.0], [0.25, 4.0]], slots={"m": [[1.0, 2.0], [3.0, 4.0]]})
    return {"tower/user": table, "small": small}


def _change_slashed(tables: list[dict]) -> None:
    """Between the version-6 full checkpoint and its delta: an update of the slot named with '/', a delete, an
    insert."""
    tables[1]["tower/user"].update([-5], np.full((1, 3), 0.5), slots={"adam/m": [[9.0, 8.0, 7.0]]})
    tables[0]["tower/user"].delete([10])
    tables[0]["tower/user"].insert([123456], np.ones((1, 3)))


def _write_sharded_v6(out: Path) -> None:
    """Format version 6: names with '/', full, delta and quantized."""
    _write_sharded(out, _slashed_tables, _change_slashed, SLASHED_TENSORS)


def _change_sharded(tables: list[dict]) -> None:
    """What happens between the full checkpoint and the delta: an update, a delete, an insert, a re-insert."""
    tables[0]["emb"].update([7], [[0.25, 0.5, 0.75]], slots={"m": [[1.0, 2.0, 3.0]]})
    tables[1]["emb"].delete([-5, 2**63 - 1])
    tables[1]["emb"].insert([-5, 99], [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    tables[0]["small"].delete([3])


CASES = {
    "npz": _write_npz,
    "safetensors": _write_safetensors,
    "netcl-model": _write_netcl_model,
    "netcl-params": _write_netcl_params,
    "train": _write_train_dir,
    "stateful": _write_stateful,
    "tf": _write_tf,
    "sharded-v4": _write_sharded_v4,  # "sharded" (version 3) and "sharded-0.2.0" (1 and 2) are kept, read below
    "sharded-v5": _write_sharded_v5,  # tables of shaped rows; tables of [dim] rows are still written as version 4
    "sharded-v6": _write_sharded_v6,  # names with '/'; other names are still written as version 4 or 5
}
DEVICE_CASES = {"netcl-model"}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _normalized_manifest(raw: bytes, where: str) -> bytes:
    parsed = json.loads(raw.decode("utf-8"))
    relaid = json.dumps(parsed, indent=1, ensure_ascii=False, allow_nan=False).encode("utf-8")
    assert relaid == raw, f"{where}: not laid out as json.dumps(indent=1, ensure_ascii=False)"
    assert isinstance(parsed["created_utc"], str) and parsed["created_utc"].endswith("+00:00"), where
    assert set(parsed["versions"]) >= {"python", "numpy", "fastckpt"}, where
    assert set(parsed["hardware"]) == {"machine", "system", "processor", "cpu_count"}, where
    for key in VOLATILE_MANIFEST_KEYS:
        parsed[key] = f"<{key}>"
    return json.dumps(parsed, indent=1, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _training_manifest(path: Path) -> bool:
    return path.name == "manifest.json" and b'"created_utc"' in path.read_bytes()


def _comparable(path: Path, where: str) -> bytes:
    raw = path.read_bytes()
    return _normalized_manifest(raw, where) if _training_manifest(path) else raw


def _first_difference(a: bytes, b: bytes) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"sizes {len(a)} (written) and {len(b)} (golden); first difference at byte {n}: "
            f"written {a[max(0, n - 16):n + 16]!r}, golden {b[max(0, n - 16):n + 16]!r}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_written_bytes_equal_the_golden_files(case, tmp_path, monkeypatch, request):
    monkeypatch.setenv("FASTCKPT_GIT_COMMIT", "0" * 40)
    out = tmp_path / case
    out.mkdir()
    if case in DEVICE_CASES:
        CASES[case](out, request.getfixturevalue("queue"))
    else:
        CASES[case](out)
    golden = GOLDEN / case
    if REGENERATE:
        shutil.rmtree(golden, ignore_errors=True)
        shutil.copytree(out, golden)
        for path in filter(_training_manifest, golden.rglob("manifest.json")):  # with the placeholders in place
            path.write_bytes(_normalized_manifest(path.read_bytes(), str(path)))
        pytest.skip(f"regenerated {golden}")
    written = _files(out)
    assert written == _files(golden), f"{case}: the set of files written changed"
    for name in written:
        where = f"{case}/{name}"
        got = _comparable(out / name, where)
        want = (golden / name).read_bytes()
        assert got == want, f"{where}: {_first_difference(got, want)}"


# -- the golden files read back to the inputs they were made from ------------------------------------
# These keep the committed files readable by every later version, whatever its writers do.


@pytest.mark.parametrize("name, expected", [("tensors.npz", npz_only_set), ("tensors-align64.npz", npz_only_set),
                                            ("tensors-align4096.npz", npz_only_set),
                                            ("mixed-sizes.npz", mixed_size_set), ("ml-dtypes.npz", ml_dtypes_set),
                                            ("tensors.safetensors", tensor_set),
                                            ("tensors-align8.safetensors", tensor_set)])
def test_golden_tensor_files_read_back(name, expected):
    import fastckpt

    folder = "npz" if name.endswith(".npz") else "safetensors"
    with fastckpt.open(GOLDEN / folder / name) as f:
        want = expected()
        assert sorted(f.keys()) == sorted(want)
        for key, value in want.items():
            got = f.host(key)
            assert got.dtype == value.dtype.newbyteorder("=") or got.dtype == value.dtype, key
            assert got.shape == value.shape and got.tobytes(order="A") == value.astype(got.dtype).tobytes(order="A"), key


@pytest.mark.parametrize("folder", ["train", "train-schema-1.0"])
def test_golden_training_checkpoints_load(folder):
    from fastckpt.train import load_checkpoint

    state = load_checkpoint(GOLDEN / folder / "corners", verify=True)
    w = state.model_weights
    assert w["head"]["weight"] is w["embed"]["weight"]
    assert w["counter"] == 2**70 and w["groups"][0]["ids"] == (1, 2, 3) and w["groups"][1]["lr"] == float("inf")
    assert type(w["scalars"]["f32"]) is np.float32 and w["scalars"]["f32"] == np.float32(0.1)
    assert w["by_id"][0] == "zero" and np.isnan(w["by_id"][1][1]) and np.signbit(w["by_id"][1][0])
    assert w["bias"].dtype == ml_dtypes.bfloat16 and w["__private"] == 1
    assert state.step == 2**40 and state.metrics == {"acc": 0.5, "ok": True}
    tiny = load_checkpoint(GOLDEN / folder / "tinylm", verify=True)
    assert tiny.step == 3 and set(tiny.optim_state) >= {"state", "param_groups"} or tiny.optim_state is not None


@pytest.mark.parametrize("name", ["corners", "tinylm"])
def test_golden_schema_1_0_training_checkpoints_still_verify(name, tmp_path):
    # Schema 1.0 (sha256 entries, weights_sha256): written by earlier releases, verified with sha256.
    import hashlib

    from fastckpt.train import read_manifest, verify_checkpoint, weights_digest

    old = GOLDEN / "train-schema-1.0" / name
    m = read_manifest(old)
    weights = (old / "weights.safetensors").read_bytes()
    assert m["schema_version"] == "1.0" and all(set(e) == {"sha256", "bytes"} for e in m["files"].values())
    assert weights_digest(m) == "sha256:" + hashlib.sha256(weights).hexdigest()
    assert verify_checkpoint(old) == []
    # The tensor files did not change with schema 2.0: the same bytes as the current golden checkpoint.
    assert weights == (GOLDEN / "train" / name / "weights.safetensors").read_bytes()
    damaged = tmp_path / name
    shutil.copytree(old, damaged)
    data = bytearray(weights)
    data[-1] ^= 1
    (damaged / "weights.safetensors").write_bytes(bytes(data))
    [problem] = verify_checkpoint(damaged)
    assert problem == (f"{damaged / 'weights.safetensors'}: sha256 mismatch: the manifest expects "
                       f"{m['weights_sha256']}, the file has {hashlib.sha256(bytes(data)).hexdigest()}")


def test_golden_stateful_file_loads():
    from fastckpt.stateful import RNG, ArrayReader, Checkpoint

    ckpt = Checkpoint()
    ckpt.load(GOLDEN / "stateful" / "state-{seq:04d}.json")
    corner, dicty = StateCorner(), StateDicty()
    corner.value = dicty.state = None
    for op, name in ((ArrayReader(np.arange(20), shuffle=True, seed=4), "reader"), (RNG(), "rng"),
                     (RNG(bit_generator="Philox"), None), (corner, "corner"), (dicty, "dicty")):
        ckpt.register(op, name)
    state = corner.value
    assert state["bytes"] == b"\x00\xffab" and state["big"] == 2**100 and np.isnan(state["nan"])
    assert state["arrays"][1].dtype == np.dtype(">i4") and state["arrays"][2].dtype == ml_dtypes.bfloat16
    assert state["arrays"][1].tolist() == [1, 2, 3] and dicty.state == {"step": 12, "lr": 0.5}


def test_golden_tf_checkpoints_read_back():
    from fastckpt.tf import CheckpointReader

    with CheckpointReader(GOLDEN / "tf" / "sharded" / "model") as r:
        assert r.read_tensor("dense/kernel").tolist() == (_arange(np.float32, (3, 2)) / 4).tolist()
        assert r.read_tensor("words").tolist() == [b"alpha", b"", "βeta".encode()]
    with CheckpointReader(GOLDEN / "tf" / "objects" / "ckpt-1") as r:
        assert r.object_graph() is not None
    with CheckpointReader(GOLDEN / "tf" / "quantized" / "model") as r:
        for name, value in quantized_set().items():
            assert r.info(name).tf_dtype_name == name
            assert r.read_tensor(name).dtype == value.dtype and r.read_tensor(name).tobytes() == value.tobytes()


@pytest.mark.parametrize("folder", ["sharded-v4", "sharded", "sharded-0.2.0"])
@pytest.mark.parametrize("checkpoint", ["full", "delta"])
def test_golden_sharded_checkpoint_loads_on_one_and_three_ranks(folder, checkpoint):
    from fastckpt.sharded import HashTable, Loader

    saved = [_sharded_tables(0), _sharded_tables(1)]
    if checkpoint == "delta":
        _change_sharded(saved)
    for shards in (1, 3):
        got = [Loader(str(GOLDEN / folder / checkpoint), shard_index=r, shard_num=shards).load()
               for r in range(shards)]
        for name in ("emb", "small"):
            merged = HashTable(saved[0][name].dim, saved[0][name].dtype, slots=saved[0][name].slots)
            for tables, _ in got:
                merged.import_(*tables[name].export())
            want = HashTable(saved[0][name].dim, saved[0][name].dtype, slots=saved[0][name].slots)
            for tables in saved:
                want.import_(*tables[name].export())
            assert merged == want, (shards, name)
        for _, tensors in got:
            for name, value in SHARDED_TENSORS.items():
                assert tensors[name].dtype == value.dtype and tensors[name].tobytes() == value.tobytes()


@pytest.mark.parametrize("folder", ["sharded-v4", "sharded", "sharded-0.2.0"])
def test_golden_quantized_sharded_checkpoint_loads_within_its_bound(folder):
    from fastckpt.sharded import CheckpointReader, Loader

    saved = [_sharded_tables(0), _sharded_tables(1)]
    _change_sharded(saved)
    path = GOLDEN / folder / "quantized"
    bound = CheckpointReader(path).manifest["hashtables"]["emb"]["encoding"]["max_abs_error"]
    loader = Loader(str(path), allow_lossy=True)
    tables, _ = loader.load()
    assert loader.error_bounds["emb"] == bound > 0
    for part in saved:
        ids = part["emb"].ids()
        for got, want in ((tables["emb"].lookup(ids), part["emb"].lookup(ids)),
                          *((tables["emb"].lookup_slot(s, ids), part["emb"].lookup_slot(s, ids)) for s in ("m", "v"))):
            assert np.abs(got - want).max() <= bound


@pytest.mark.parametrize("checkpoint, version", [("full", 1), ("delta", 2), ("quantized", 2)])
def test_sharded_checkpoints_of_0_2_0_verify_with_what_they_carry(checkpoint, version):
    """Format versions 1 and 2 carry no checksum of the manifest: their files are verified, and the reader and
    ``fastckpt verify`` say what could not be checked."""
    import io
    from argparse import Namespace

    from fastckpt.cli.verify import run
    from fastckpt.sharded import CheckpointReader

    path = GOLDEN / "sharded-0.2.0" / checkpoint
    with CheckpointReader(path) as r:
        assert r.manifest["format_version"] == version and r.verify() == []
        assert r.unchecked == [f"manifest.json: format version {version} carries no checksum of its own (version 3 "
                               "does); its values were checked against the other files only"]
    with CheckpointReader(GOLDEN / "sharded" / checkpoint) as r:
        assert r.manifest["format_version"] == 3 and r.unchecked == [] and "checksum" in r.manifest
    out = io.StringIO()
    assert run(Namespace(directory=str(path), no_hash=False, quiet=False), out) == 0
    assert "not checked: manifest.json: format version" in out.getvalue()


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_golden_sharded_v4_slice_groups_load_by_the_slice_rule(shards):
    """Format version 4: every id on the rank of its key-space slice, its rows and slot exact, each rank reading
    only the slice groups that meet its slice; versions 1-3 keep id mod M (their golden files load above)."""
    from fastckpt.sharded import CheckpointReader, Loader
    from fastckpt.sharded.format import SLICE_SIZE, slice_of, slice_positions

    path = GOLDEN / "sharded-v4" / "groups"
    with CheckpointReader(path) as r:
        assert r.manifest["format_version"] == 4 and r.unchecked == []
        assert r.descriptions["groups.id/part_1_2"]["slices"]["groups"] == 3
    saved = [_slice_group_tables(0)["groups"], _slice_group_tables(1)["groups"]]
    seen = []
    for j in range(shards):
        table = Loader(str(path), shard_index=j, shard_num=shards).load()[0]["groups"]
        ids = table.ids()
        begin, end = slice_of(j, shards)
        assert np.all((slice_positions(ids, SLICE_SIZE) >= begin) & (slice_positions(ids, SLICE_SIZE) < end))
        for part in saved:
            mine = part.ids()[np.isin(part.ids(), ids)]
            assert table.lookup(mine).tobytes() == part.lookup(mine).tobytes()
            assert table.lookup_slot("m", mine).tobytes() == part.lookup_slot("m", mine).tobytes()
        seen.append(ids)
    assert sorted(np.concatenate(seen).tolist()) == sorted(np.concatenate([t.ids() for t in saved]).tolist())


@pytest.mark.parametrize("checkpoint", ["full", "delta", "quantized"])
def test_golden_sharded_v5_tables_of_shaped_rows_load_on_one_and_three_ranks(checkpoint):
    """Format version 5: each table as saved, its row shapes and slot dtypes rebuilt from the manifest, every row
    exact (the quantized checkpoint's float rows within its bound; its int64 slot exact)."""
    from fastckpt.sharded import CheckpointReader

    saved = [_shaped_tables(0), _shaped_tables(1)]
    if checkpoint != "full":
        _change_shaped(saved)
    path = GOLDEN / "sharded-v5" / checkpoint
    with CheckpointReader(path) as r:
        assert r.manifest["format_version"] == 5 and r.verify() == []
        entry = r.manifest["hashtables"]["user"]
        assert entry["shape"] == [2, 3] and entry["slot_specs"]["step_filter"] == {"shape": [1], "dtype": "int64"}
        bound = entry.get("encoding", {}).get("max_abs_error", 0.0)
    _check_golden_tables(path, saved, bound, SHARDED_TENSORS)


@pytest.mark.parametrize("checkpoint", ["full", "delta", "quantized"])
def test_golden_sharded_v6_names_with_a_slash_load_on_one_and_three_ranks(checkpoint):
    """Format version 6: the dense tensors, the table and the slot named with '/' as saved, every row exact (the
    quantized checkpoint's rows within its bound)."""
    from fastckpt.sharded import CheckpointReader

    saved = [_slashed_tables(0), _slashed_tables(1)]
    if checkpoint != "full":
        _change_slashed(saved)
    path = GOLDEN / "sharded-v6" / checkpoint
    with CheckpointReader(path) as r:
        assert r.manifest["format_version"] == 6 and r.verify() == []
        assert sorted(r.manifest["hashtables"]) == ["small", "tower/user"]
        assert r.manifest["hashtables"]["tower/user"]["slots"] == ["adam/m", "v"]
        assert sorted(r.manifest["tensors"]) == sorted(SLASHED_TENSORS)
        bound = r.manifest["hashtables"]["tower/user"].get("encoding", {}).get("max_abs_error", 0.0)
    _check_golden_tables(path, saved, bound, SLASHED_TENSORS)


def _check_golden_tables(path: Path, saved: list[dict], bound: float, dense: dict) -> None:
    """The golden sharded checkpoint ``path`` loaded on 1 and 3 ranks holds the tables ``saved`` (one dict a rank):
    each with its row shape, dtype and slots, every row exact (a quantized one's float rows within ``bound``, its
    integer slots exact: never quantized), and ``dense`` exact on every rank."""
    from fastckpt.sharded import HashTable, Loader

    for shards in (1, 3):
        got = [Loader(str(path), shard_index=j, shard_num=shards, allow_lossy=True).load() for j in range(shards)]
        for name, table in saved[0].items():
            merged, want = (HashTable(table.shape, table.dtype, slots=table._slot_params()) for _ in range(2))
            for tables, _ in got:
                assert tables[name].slot_specs == table.slot_specs
                merged.import_(*tables[name].export())
            for tables in saved:
                want.import_(*tables[name].export())
            if not bound or not len(want):
                assert merged == want, (shards, name)
                continue
            ids, values, slots = merged.export()
            w_ids, w_values, w_slots = want.export()
            assert ids.tolist() == w_ids.tolist()
            assert np.abs(values.astype(np.float32) - w_values.astype(np.float32)).max() <= bound
            for slot, (_, dtype) in table.slot_specs.items():
                if dtype.kind in "iub":
                    assert slots[slot].tobytes() == w_slots[slot].tobytes(), slot  # never quantized
                else:
                    assert np.abs(slots[slot].astype(np.float32) - w_slots[slot].astype(np.float32)).max() <= bound
        for _, tensors in got:
            assert list(tensors) == sorted(dense)
            for name, value in dense.items():
                assert tensors[name].dtype == value.dtype and tensors[name].tobytes() == value.tobytes()
