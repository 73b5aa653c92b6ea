"""Compact storage of sharded hashtables: lossless compression (ids delta-coded, bytes shuffled, zstd / lz4) and
row-wise quantization for serving, with its recorded error bound."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from fastckpt.errors import ChecksumMismatchError, FormatError
from fastckpt.sharded import CheckpointReader, HashTable, Loader, Saver
from fastckpt.sharded.codec import check_options, decode, encode_ids, encode_values
from fastckpt.sharded.engine import ThreadEngine
from fastckpt.sharded.loader import owner_mod

I64 = [-(2**63), -(2**63) + 1, -1, 0, 1, 2**62, 2**63 - 2, 2**63 - 1]


def tables(ranks: int, dtype=np.float32, seed: int = 0) -> list[HashTable]:
    rng = np.random.default_rng(seed)
    ids = np.unique(np.concatenate([I64, rng.integers(-(2**40), 2**40, 3000)]))
    out = []
    for r in range(ranks):
        mine = rng.permutation(ids[owner_mod(ids, ranks) == r])
        t = HashTable(6, dtype=dtype, slots=("m", "v"), name="emb")
        values, m = rng.standard_normal((len(mine), 6)) * 100, rng.random((len(mine), 6)) * 100
        t.insert(mine, values.astype(dtype), slots={"m": m.astype(dtype)})
        out.append(t)
    return out


def save(path, parts: list[HashTable], **options) -> list[Saver]:
    engines = ThreadEngine.group(len(parts))
    savers = [Saver(shard_index=r, shard_num=len(parts), parallel=2, path=str(path), hashtables={"emb": t},
                    tensors={"w": np.arange(6.0)}, engine=engines[r], timeout=30, **options)
              for r, t in enumerate(parts)]
    errors = []

    def run(s):
        try:
            s.save()
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in savers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return savers


def merged(parts: list[HashTable]) -> HashTable:
    out = HashTable(parts[0].dim, dtype=parts[0].dtype, slots=parts[0].slots)
    for t in parts:
        out.import_(*t.export())
    return out


def load(path, shards: int, **options) -> tuple[HashTable, list[Loader]]:
    loaders = [Loader(str(path), shard_index=r, shard_num=shards, **options) for r in range(shards)]
    return merged([ld.load()[0]["emb"] for ld in loaders]), loaders


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int32])
def test_lossless_compression_restores_every_bit(tmp_path, compression, dtype):
    parts = tables(2, dtype)
    save(tmp_path / "c", parts, compression=compression)
    with CheckpointReader(tmp_path / "c") as r:
        assert r.manifest["format_version"] == 4 and "lossy" not in r.manifest
        assert r.manifest["hashtables"]["emb"]["encoding"] == {"compression": compression, "quantize": None,
                                                               "max_abs_error": 0.0}
        d = r.descriptions["emb.id/part_0_2"]
        assert d["dtype"] == "uint8" and d["encoding"]["transform"] == "delta" and d["encoding"]["shape"] == [
            len(parts[0])]
        assert r.tensor_shape("emb.embedding") == (sum(map(len, parts)), 6)
        assert r.tensor_dtype("emb.m") == np.dtype(dtype)
        ids = r.read_tensor("emb.id/part_1_2")
        assert ids.tolist() == sorted(parts[1].ids().tolist())  # stored in id order
        assert r.read_tensor("emb.embedding/part_1_2").tobytes() == parts[1].lookup(ids).tobytes()
        assert r.read_tensor("w").tolist() == list(range(6))
    for shards in (1, 3):
        got, _ = load(tmp_path / "c", shards)
        assert got == merged(parts)


def test_a_compressed_chain_restores_exactly(tmp_path):
    parts = tables(2)
    save(tmp_path / "s0", parts, compression="zstd", incremental=True)
    rng = np.random.default_rng(1)
    for k in (1, 2):
        for t in parts:
            held = t.ids()
            t.update(held[:20], rng.random((20, 6)))
            t.delete(held[-5:])
        assert [s.kind for s in save(tmp_path / f"s{k}", parts, compression="zstd", incremental=True)] == ["delta"] * 2
    with CheckpointReader(tmp_path / "s2") as r:
        assert r.descriptions["emb.deleted/part_0_2"]["encoding"]["transform"] == "delta"
    got, _ = load(tmp_path / "s2", 3)
    assert got == merged(parts)


def test_quantized_rows_load_only_when_asked_and_within_the_recorded_bound(tmp_path):
    parts = tables(2)
    for t in parts:
        t.mark_clean(None)
        t.update(t.ids()[:3], np.zeros((3, 6)))  # rows of zeros quantize exactly
    before = [t.changes()[0].copy() for t in parts]
    savers = save(tmp_path / "q", parts, quantize="int8", incremental=True)
    assert [s.kind for s in savers] == ["full", "full"]  # never a delta, never a base
    assert [t.changes()[0].tolist() for t in parts] == [b.tolist() for b in before]  # changes kept
    with CheckpointReader(tmp_path / "q") as r:
        assert r.manifest["lossy"] is True
        bound = r.manifest["hashtables"]["emb"]["encoding"]["max_abs_error"]
    with pytest.raises(FormatError, match=r"quantized \(int8, values off by up to .*\): a checkpoint for serving, "
                                          r"not for resuming training; pass allow_lossy=True"):
        Loader(str(tmp_path / "q")).load()
    got, loaders = load(tmp_path / "q", 2, allow_lossy=True)
    assert all(ld.error_bounds == {"emb": bound} for ld in loaders)
    want = merged(parts)
    ids = want.ids()
    errors = [np.abs(got.lookup(ids) - want.lookup(ids)).max()]
    errors += [np.abs(got.lookup_slot(s, ids) - want.lookup_slot(s, ids)).max() for s in ("m", "v")]
    assert max(errors) == pytest.approx(bound, abs=0) and 0 < bound <= np.abs(want.lookup(ids)).max() / 254 * 1.0001
    assert got.lookup(parts[0].ids()[:3]).tolist() == np.zeros((3, 6)).tolist()


def test_int16_is_finer_than_int8(tmp_path):
    parts = tables(1)
    bounds = {}
    for q in ("int8", "int16"):
        save(tmp_path / q, parts, quantize=q, compression="zstd")
        bounds[q] = load(tmp_path / q, 1, allow_lossy=True)[1][0].error_bounds["emb"]
    assert 0 < bounds["int16"] < bounds["int8"] / 200


def test_bad_values_and_options_are_named(tmp_path):
    t = HashTable(2, name="emb")
    t.insert([1, 2], [[np.nan, 0.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="hashtable 'emb': quantize needs finite values"):
        Saver(path=str(tmp_path / "n"), parallel=1, hashtables={"emb": t}, quantize="int8").save()
    assert not (tmp_path / "n").exists()
    with pytest.raises(ValueError, match="compression must be None, 'zstd' or 'lz4', got 'gzip'"):
        Saver(path=str(tmp_path / "x"), compression="gzip")
    with pytest.raises(ValueError, match="quantize must be None, 'int8' or 'int16'"):
        check_options(None, "fp8")


def test_damaged_compressed_data_is_named(tmp_path):
    save(tmp_path / "c", tables(1), compression="zstd")
    with CheckpointReader(tmp_path / "c") as r:
        f = r.file_of("emb.embedding/part_0_1")
        offset = f.infos["emb.embedding/part_0_1"].offset
        path = f.path
    with open(path, "r+b") as fh:
        fh.seek(offset + 40)
        fh.write(b"\xff" * 64)
    with pytest.raises(ChecksumMismatchError, match=r"model-00000-00\d\.safetensors: BLAKE3 .*'emb.embedding/part_0_1'"):
        Loader(str(tmp_path / "c")).load()
    with pytest.raises(FormatError, match=r"model-00000-00\d\.safetensors: tensor 'emb.embedding/part_0_1': .*"):
        Loader(str(tmp_path / "c"), verify=False).load()


def test_the_codec_round_trips_and_checks_sizes():
    ids = np.array(I64)
    for codec in (None, "zstd", "lz4"):
        stored, encoding = encode_ids(ids, codec)
        assert decode(stored, encoding).tolist() == I64
        values = np.arange(12, dtype=np.float64).reshape(3, 4)
        stored, encoding, error = encode_values(values, codec, None)
        assert decode(stored, encoding).tobytes() == values.tobytes() and error == 0.0
    stored, encoding = encode_ids(ids, None)
    with pytest.raises(FormatError, match="holds 56 payload bytes, its encoding says 64"):
        decode(stored[:56], encoding, "here")
    with pytest.raises(FormatError, match="unknown encoding"):
        decode(stored, {**encoding, "codec": "brotli"})
