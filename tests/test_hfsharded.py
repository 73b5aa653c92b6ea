"""Hugging Face sharded safetensors: the writer's split and files, the reader, interop with the safetensors
library, the errors, the atomic save, and the one-arena device load."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from _writing import record_staged_writes
import fastckpt
from fastckpt.errors import CheckpointNotFoundError, FastCkptWarning, FormatError, TensorNotFoundError
from fastckpt.formats import hfsharded
from fastckpt.formats.contract import TensorReader
from fastckpt.formats.hfsharded import (
    INDEX_NAME,
    HFShardedDirectory,
    parse_size,
    plan_shards,
    read_index,
    save_sharded,
    shard_names,
)
from fastckpt.formats.safetensors import save_safetensors
from fastckpt.store import commit as _atomic
from fastckpt.store.commit import _owner

safetensors_numpy = pytest.importorskip("safetensors.numpy")
from safetensors import safe_open  # noqa: E402


def model(seed: int = 0) -> dict[str, np.ndarray]:
    """A small model of mixed dtypes and shapes, in a deliberate (not sorted) order."""
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((64, 16)).astype(np.float32),
        "model.layers.0.attn.q.weight": rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16),
        "model.layers.0.attn.q.bias": rng.standard_normal(16).astype(np.float16),
        "model.layers.0.mlp.up.weight": rng.standard_normal((32, 16)).astype(np.float32),
        "model.layers.0.norm.steps": np.arange(3, dtype=np.int64),
        "model.layers.1.mask": rng.random(7) > 0.5,
        "model.layers.1.scale": np.array(2.5, np.float64),
        "model.layers.1.empty": np.zeros((0, 4), np.float32),
        "lm_head.weight": rng.standard_normal((64, 16)).astype(np.float32),
    }


def assert_exact(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def write_like_transformers(directory: Path, shards: list[dict[str, np.ndarray]], prefix: str = "model") -> dict:
    """What transformers' save_pretrained writes, made with the safetensors library: each shard with
    {"format": "pt"} metadata, the index with sort_keys=True, indent=2 and a final newline."""
    names = shard_names(len(shards), prefix)
    weight_map, total = {}, 0
    for shard, file in zip(shards, names):
        safetensors_numpy.save_file(shard, str(directory / file), metadata={"format": "pt"})
        for name, arr in shard.items():
            weight_map[name] = file
            total += arr.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if len(shards) > 1:
        (directory / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index


# -- sizes and the split -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("5GB", 5 * 10**9), ("5GiB", 5 * 2**30), ("500MB", 500 * 10**6), ("10MiB", 10 * 2**20), ("1KB", 1000),
    ("1kB", 1000), ("2KiB", 2048), ("3kiB", 3072), ("1TB", 10**12), ("1TiB", 2**40), ("64B", 64), (" 2 GB ", 2 * 10**9),
    ("1.5GB", 1_500_000_000), ("0.5KiB", 512), (".5KB", 500), (123, 123), (np.int64(7), 7),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad, error", [
    ("5Gb", ValueError), ("5 mb", ValueError), ("5", ValueError), ("GB", ValueError), ("5XB", ValueError),
    ("-5GB", ValueError), ("0B", ValueError), (0, ValueError), (-1, ValueError), ("1e3MB", ValueError),
    (1.5, TypeError), (True, TypeError), (None, TypeError), (np.float32(3), TypeError),
])
def test_parse_size_refuses(bad, error):
    with pytest.raises(error):
        parse_size(bad)


def test_split_is_greedy_in_the_order_given_and_an_oversized_tensor_is_alone():
    sizes = {"a": 4, "b": 4, "c": 3, "huge": 50, "d": 2, "e": 8, "f": 1}
    tensors = {name: np.zeros(n, np.uint8) for name, n in sizes.items()}
    assert plan_shards(tensors, 10) == [["a", "b"], ["c"], ["huge"], ["d", "e"], ["f"]]
    assert plan_shards(tensors, 10**6) == [list(sizes)]
    assert plan_shards({}, 10) == [[]]
    # Exactly the limit fits; one byte over starts a new shard.
    assert plan_shards({"x": np.zeros(6, np.uint8), "y": np.zeros(4, np.uint8)}, 10) == [["x", "y"]]
    assert plan_shards({"x": np.zeros(6, np.uint8), "y": np.zeros(5, np.uint8)}, 10) == [["x"], ["y"]]


def test_shard_names_follow_the_hugging_face_pattern():
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(3) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert shard_names(100001)[-1] == "model-100001-of-100001.safetensors"
    for prefix in ("", ".", "..", "a/b", "a\\b", "a\x00"):
        with pytest.raises(ValueError, match="prefix"):
            shard_names(2, prefix)


# -- the writer and the reader ---------------------------------------------------------------------------------------

def test_round_trip_exact_with_the_index_and_order_of_the_spec(tmp_path):
    tensors = model()
    files = save_sharded(tmp_path, tensors, max_shard_size=3000, metadata={"format": "pt", "step": "7"})
    shards = [f for f in files if f != INDEX_NAME]
    assert files[-1] == INDEX_NAME and len(shards) > 2
    assert sorted(os.listdir(tmp_path)) == sorted(files)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert list(index) == ["metadata", "weight_map"]
    assert index["metadata"] == {"total_size": sum(a.nbytes for a in tensors.values()), "format": "pt", "step": "7"}
    assert list(index["weight_map"]) == list(tensors)  # the order given
    assert (tmp_path / INDEX_NAME).read_text().endswith("}\n")
    # Every shard holds at most max_shard_size tensor bytes, and the split is plan_shards'.
    expected = plan_shards(tensors, 3000)
    for shard, file in zip(expected, shards):
        assert [n for n, f in index["weight_map"].items() if f == file] == shard
        assert sum(tensors[n].nbytes for n in shard) <= 3000 or len(shard) == 1

    with fastckpt.open(tmp_path) as r:
        assert isinstance(r, HFShardedDirectory) and isinstance(r, TensorReader)
        assert r.format == "hf-sharded" and r.path == str(tmp_path)
        assert list(r.keys()) == list(tensors)
        assert list(r.infos) == list(tensors)
        assert list(r.files) == shards
        assert r.metadata == {"total_size": str(index["metadata"]["total_size"]), "format": "pt", "step": "7"}
        assert r.total_size == index["metadata"]["total_size"]
        assert dict(r.weight_map) == index["weight_map"]
        assert r.unlisted == {} and r.index_path == str(tmp_path / INDEX_NAME)
        for name, want in tensors.items():
            assert_exact(r.host(name), want)
            assert_exact(r[name], want)
            info = r.info(name)
            assert info.dtype == want.dtype and info.shape == want.shape and info.nbytes == want.nbytes
            # offset within its own shard: the bytes there are the tensor's
            shard = tmp_path / index["weight_map"][name]
            assert shard.read_bytes()[info.offset:info.offset + info.nbytes] == want.tobytes()
        assert r.nbytes == index["metadata"]["total_size"]
        # zero-copy, read-only views of the shards' mappings
        view = r.host("lm_head.weight")
        assert not view.flags.writeable and not view.flags.owndata
        assert [(f.path, names) for f, names in r.parts()] == [
            (str(tmp_path / file), tuple(n for n in tensors if index["weight_map"][n] == file)) for file in shards]
        with pytest.raises(TensorNotFoundError, match="did you mean 'lm_head.weight'"):
            r.info("lm_head.wieght")
        with pytest.raises(TensorNotFoundError):
            r.host("nope")
    assert r.closed
    r.close()  # idempotent
    assert_exact(view, tensors["lm_head.weight"])  # views outlive close()


def test_each_shard_is_a_fastckpt_safetensors_file_with_the_metadata(tmp_path):
    tensors = model()
    save_sharded(tmp_path, tensors, max_shard_size="2KiB", metadata={"format": "pt"}, alignment=64)
    for file in sorted(tmp_path.glob("model-*.safetensors")):
        with fastckpt.open(file) as f:
            assert f.format == "safetensors" and f.metadata == {"format": "pt"}
            assert f.data_region[0] % 64 == 0


def test_shards_and_the_index_are_written_in_place_in_the_staging_directory(tmp_path, monkeypatch):
    """Every file of a save is opened once under its own name in the staging directory and never renamed
    there: the only renames are the publish's, into the directory, the index last. Each file is fsynced once
    (by the publish), then the directory. The shards' bytes are those of each shard saved on its own."""
    tensors = {"a": np.arange(8, dtype=np.float32), "b": np.ones(8, np.float32)}
    seen = record_staged_writes(monkeypatch)
    names = save_sharded(tmp_path / "out", tensors, max_shard_size="32B", metadata={"format": "pt"})
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_NAME]
    assert sorted(seen.opened) == sorted(names)
    assert [dst for _src, dst in seen.renamed] == [os.fspath(tmp_path / "out" / name) for name in names]
    assert sorted(seen.synced[:3]) == sorted(names) and seen.synced[-1] == "out", seen.synced
    assert all(seen.synced.count(name) == 1 for name in names), seen.synced
    monkeypatch.undo()
    for name, shard in zip(names, ({"a": tensors["a"]}, {"b": tensors["b"]})):
        save_safetensors(tmp_path / name, shard, {"format": "pt"})
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / name).read_bytes()


def test_one_shard_is_model_safetensors_without_an_index(tmp_path):
    tensors = model()
    assert save_sharded(tmp_path, tensors, metadata={"format": "pt"}) == ["model.safetensors"]
    assert os.listdir(tmp_path) == ["model.safetensors"]
    with fastckpt.open(tmp_path) as r:
        assert isinstance(r, HFShardedDirectory)
        assert sorted(r.keys()) == sorted(tensors)
        assert r.metadata == {"format": "pt"} and r.index_path is None and r.total_size is None
        assert list(r.files) == ["model.safetensors"]
        for name, want in tensors.items():
            assert_exact(r.host(name), want)
    # no metadata: no __metadata__ in the file
    save_sharded(tmp_path, tensors, overwrite=True)
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert f.metadata() is None


def test_an_empty_mapping_is_one_empty_file(tmp_path):
    assert save_sharded(tmp_path, {}) == ["model.safetensors"]
    with fastckpt.open(tmp_path) as r:
        assert list(r) == [] and r.nbytes == 0


def test_another_prefix_is_read_through_its_index_path(tmp_path):
    tensors = model()
    files = save_sharded(tmp_path, tensors, max_shard_size=4000, prefix="diffusion_pytorch_model")
    assert files[-1] == "diffusion_pytorch_model.safetensors.index.json"
    assert all(f.startswith("diffusion_pytorch_model-") for f in files[:-1])
    with HFShardedDirectory(tmp_path / files[-1]) as r:
        assert list(r) == list(tensors)
        assert_exact(r.host("lm_head.weight"), tensors["lm_head.weight"])


def test_writer_refuses_before_writing_anything(tmp_path):
    with pytest.raises(ValueError, match="total_size"):
        save_sharded(tmp_path, model(), metadata={"total_size": "1"})
    with pytest.raises(TypeError, match="str to str"):
        save_sharded(tmp_path, model(), metadata={"step": 1})
    with pytest.raises(TypeError, match="'s'.*no safetensors equivalent"):
        save_sharded(tmp_path, {"a": np.zeros(2), "s": np.array(["x"])})
    with pytest.raises(TypeError, match="mapping"):
        save_sharded(tmp_path, [("a", np.zeros(2))])
    with pytest.raises(ValueError, match="__metadata__"):
        save_sharded(tmp_path, {"__metadata__": np.zeros(2)})
    with pytest.raises(ValueError, match="max_shard_size"):
        save_sharded(tmp_path, model(), max_shard_size="lots")
    assert os.listdir(tmp_path) == []


def test_array_likes_and_big_endian_arrays_are_written_as_safetensors_does(tmp_path):
    tensors = {"list": [[1.5, 2.5], [3.5, 4.5]], "be": np.arange(4, dtype=">i4"), "t": np.arange(6.0).reshape(2, 3).T}
    save_sharded(tmp_path, tensors, max_shard_size=16)
    with fastckpt.open(tmp_path) as r:
        assert_exact(r.host("list"), np.array([[1.5, 2.5], [3.5, 4.5]]))
        assert_exact(r.host("be"), np.arange(4, dtype="<i4"))
        assert_exact(r.host("t"), np.ascontiguousarray(np.arange(6.0).reshape(2, 3).T))


# -- interop with the safetensors library and transformers' layout ---------------------------------------------------

def test_a_directory_written_like_transformers_is_read_exactly(tmp_path):
    tensors = model()
    names = list(tensors)
    shards = [{n: tensors[n] for n in names[:3]}, {n: tensors[n] for n in names[3:6]}, {n: tensors[n] for n in names[6:]}]
    index = write_like_transformers(tmp_path, shards)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a faithful total_size, nothing unlisted: no warning
        r = fastckpt.open(tmp_path)
    with r:
        weight_map = index["weight_map"]
        sorted_map = sorted(weight_map)  # the index was written with sort_keys=True
        files = list(dict.fromkeys(weight_map[n] for n in sorted_map))
        assert list(r.files) == files
        assert list(r.keys()) == [n for f in files for n in sorted_map if weight_map[n] == f]
        assert r.metadata == {"total_size": str(index["metadata"]["total_size"])}
        for name, want in tensors.items():
            assert_exact(r.host(name), want)
        assert r.info("model.layers.0.attn.q.weight").dtype == np.dtype(ml_dtypes.bfloat16)


def test_fastckpt_directory_is_read_exactly_by_the_safetensors_library_and_plain_json(tmp_path):
    tensors = model()
    files = save_sharded(tmp_path, tensors, max_shard_size="3KB", metadata={"format": "pt"})
    index = json.loads((tmp_path / INDEX_NAME).read_text(encoding="utf-8"))
    shard_files = files[:-1]
    assert set(index["weight_map"].values()) == set(shard_files)
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in shard_files)
    seen: dict[str, str] = {}
    for file in shard_files:
        with safe_open(str(tmp_path / file), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert name not in seen  # every tensor in exactly one file
                seen[name] = file
                assert_exact(f.get_tensor(name), tensors[name])
        assert set(safetensors_numpy.load_file(str(tmp_path / file))) == {
            n for n, f in index["weight_map"].items() if f == file}
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(tensors[n].nbytes for n in seen)
    assert json.loads((tmp_path / INDEX_NAME).read_bytes()) == index  # plain ASCII JSON
    (tmp_path / INDEX_NAME).read_bytes().decode("ascii")


def test_non_ascii_names_survive_the_index(tmp_path):
    tensors = {"é.weight": np.ones(4, np.float32), "😀": np.zeros(4, np.float32), 'q"\\': np.ones(1, np.int8)}
    save_sharded(tmp_path, tensors, max_shard_size=4)
    raw = (tmp_path / INDEX_NAME).read_bytes()
    raw.decode("ascii")
    assert list(json.loads(raw)["weight_map"]) == list(tensors)
    with fastckpt.open(tmp_path) as r:
        assert list(r) == list(tensors)
        for name, want in tensors.items():
            assert_exact(r.host(name), want)


def test_bf16_directory_from_the_safetensors_library(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {f"layers.{i}.weight": rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16) for i in range(5)}
    tensors["layers.0.scale"] = rng.standard_normal(8).astype(ml_dtypes.bfloat16)
    names = list(tensors)
    write_like_transformers(tmp_path, [{n: tensors[n] for n in names[k:k + 2]} for k in range(0, 6, 2)])
    with fastckpt.open(tmp_path) as r:
        for name, want in tensors.items():
            assert r.info(name).dtype == np.dtype(ml_dtypes.bfloat16)
            assert_exact(r.host(name), want)
    # and fastckpt's own bf16 directory, read back by the library
    out = tmp_path / "ours"
    save_sharded(out, tensors, max_shard_size=200)
    for file in json.loads((out / INDEX_NAME).read_text())["weight_map"].values():
        for name, arr in safetensors_numpy.load_file(str(out / file)).items():
            assert_exact(arr, tensors[name])


def test_a_single_file_written_by_the_library_is_a_directory_too(tmp_path):
    tensors = model()
    write_like_transformers(tmp_path, [tensors])
    with fastckpt.open(tmp_path) as r:
        assert r.metadata == {"format": "pt"}
        for name, want in tensors.items():
            assert_exact(r.host(name), want)


def test_model_safetensors_wins_over_an_index_as_in_transformers(tmp_path):
    save_sharded(tmp_path, {"sharded": np.zeros(4, np.uint8), "b": np.zeros(4, np.uint8)}, max_shard_size=4)
    safetensors_numpy.save_file({"single": np.ones(2, np.uint8)}, str(tmp_path / "model.safetensors"))
    with fastckpt.open(tmp_path) as r:
        assert list(r) == ["single"]
    with HFShardedDirectory(tmp_path / INDEX_NAME) as r:
        assert list(r) == ["sharded", "b"]


def test_shards_that_are_symbolic_links_as_in_the_hub_cache(tmp_path):
    tensors = model()
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    files = save_sharded(blobs, tensors, max_shard_size=4000)
    snapshot.mkdir(parents=True)
    for file in files:
        (snapshot / file).symlink_to(Path("..", "..", "blobs", file))
    with fastckpt.open(snapshot) as r:
        for name, want in tensors.items():
            assert_exact(r.host(name), want)


# -- errors ------------------------------------------------------------------------------------------------------

@pytest.fixture
def sharded(tmp_path):
    tensors = model()
    save_sharded(tmp_path, tensors, max_shard_size=3000)
    return tmp_path, tensors, json.loads((tmp_path / INDEX_NAME).read_text())


def write_index(directory: Path, index) -> None:
    (directory / INDEX_NAME).write_text(index if isinstance(index, str) else json.dumps(index))


@pytest.mark.parametrize("text, pattern", [
    ("", "not JSON"),
    ("{", "not JSON.*line 1"),
    ('{"weight_map": {}} trailing', "not JSON"),
    ('{"weight_map": {"a": "x"}, "weight_map": {}}', "repeats the key 'weight_map'"),
    ('{"weight_map": {"a": "f", "a": "f"}}', "repeats the key 'a'"),
    ('{"metadata": {"total_size": NaN}, "weight_map": {}}', "not JSON"),
    ("[]", "must be a JSON object"),
    ("{}", "needs a 'weight_map'.*no 'weight_map'"),
    ('{"weight_map": []}', "needs a 'weight_map'.*list"),
    ('{"weight_map": {"a": 3}}', "not a file name"),
    ('{"metadata": [], "weight_map": {}}', "'metadata' must be an object"),
])
def test_bad_index_is_a_format_error_naming_it(sharded, text, pattern):
    directory, _, _ = sharded
    write_index(directory, text)
    with pytest.raises(FormatError, match=pattern) as info:
        fastckpt.open(directory)
    assert str(directory / INDEX_NAME) in str(info.value)


def test_index_that_is_not_utf8(sharded):
    directory, _, _ = sharded
    (directory / INDEX_NAME).write_bytes(b'{"weight_map": {"\xff": "x"}}')
    with pytest.raises(FormatError, match="not UTF-8"):
        fastckpt.open(directory)


@pytest.mark.parametrize("file", ["../model-00001-of-00004.safetensors", "sub/x.safetensors", "/etc/passwd", "..", ".",
                                  "", "a\\b.safetensors", "a\x00b"])
def test_shard_names_that_could_leave_the_directory_are_refused(sharded, file):
    directory, _, index = sharded
    index["weight_map"]["lm_head.weight"] = file
    write_index(directory, index)
    with pytest.raises(FormatError, match="not a plain file name"):
        fastckpt.open(directory)


def test_missing_shard_is_a_checkpoint_not_found_error(sharded):
    directory, _, index = sharded
    file = index["weight_map"]["lm_head.weight"]
    (directory / file).unlink()
    with pytest.raises(CheckpointNotFoundError, match=re.escape(f"in '{file}', which does not exist")) as info:
        fastckpt.open(directory)
    assert isinstance(info.value, FileNotFoundError) and info.value.filename == str(directory / file)


def test_tensor_listed_but_absent_from_its_shard(sharded):
    directory, _, index = sharded
    index["weight_map"]["lm_head.bias"] = index["weight_map"]["lm_head.weight"]
    write_index(directory, index)
    with pytest.raises(FormatError, match="puts tensor 'lm_head.bias' in .* which holds no such tensor.*lm_head.weight"):
        fastckpt.open(directory)


def test_tensor_in_a_shard_but_not_in_the_index_is_left_out_with_a_warning(sharded):
    directory, tensors, index = sharded
    name = "model.layers.0.norm.steps"  # in a shard with other tensors
    file = index["weight_map"].pop(name)
    index["metadata"]["total_size"] -= tensors[name].nbytes
    write_index(directory, index)
    with pytest.warns(FastCkptWarning, match=rf"1 tensor\(s\) stored in the shards are not in the index.*{name}"):
        r = fastckpt.open(directory)
    with r:
        assert name not in r and r.unlisted == {file: [name]}
        assert list(r) == [n for n in tensors if n != name]
        with pytest.raises(TensorNotFoundError):
            r.host(name)
    # a file the index does not name at all is not opened: a shard of its own dropped from the index
    index["weight_map"].pop("lm_head.weight")
    index["metadata"]["total_size"] -= tensors["lm_head.weight"].nbytes
    write_index(directory, index)
    with pytest.warns(FastCkptWarning) as caught:
        r = fastckpt.open(directory)
    with r:
        assert "lm_head.weight" not in r and len(r.files) == 2
    assert len(caught) == 1 and name in str(caught[0].message)


@pytest.mark.parametrize("total", [1, "12", None, True, 1.5])
def test_total_size_mismatch_is_a_warning(sharded, total):
    directory, tensors, index = sharded
    index["metadata"]["total_size"] = total
    write_index(directory, index)
    with pytest.warns(FastCkptWarning, match="total_size is"):
        r = fastckpt.open(directory)
    with r:
        assert_exact(r.host("lm_head.weight"), tensors["lm_head.weight"])
        assert r.total_size == (1 if type(total) is int else None)


def test_index_without_metadata_is_read(sharded):
    directory, tensors, index = sharded
    del index["metadata"]
    write_index(directory, index)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastckpt.open(directory) as r:
            assert r.metadata is None and r.total_size is None and list(r) == list(tensors)
    index["metadata"] = {"total_size": sum(a.nbytes for a in tensors.values()), "total_parameters": 5,
                         "note": "x", "nested": {"a": [1, 2]}, "flag": None}
    write_index(directory, index)
    with fastckpt.open(directory) as r:
        assert r.metadata == {"total_size": str(index["metadata"]["total_size"]), "total_parameters": "5",
                              "note": "x", "nested": '{"a":[1,2]}', "flag": "null"}


@pytest.mark.parametrize("cut", [4, 8 + 20, -1])
def test_truncated_shard_is_a_format_error_naming_the_shard(sharded, cut):
    directory, _, index = sharded
    shard = directory / index["weight_map"]["model.layers.0.mlp.up.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[:cut])
    with pytest.raises(FormatError) as info:
        fastckpt.open(directory)
    assert str(shard) in str(info.value)


def test_corrupted_shard_header(sharded):
    directory, _, index = sharded
    shard = directory / index["weight_map"]["lm_head.weight"]
    data = bytearray(shard.read_bytes())
    data[8:9] = b"["
    shard.write_bytes(bytes(data))
    with pytest.raises(FormatError) as info:
        fastckpt.open(directory)
    assert str(shard) in str(info.value)


def test_shard_that_is_not_safetensors(sharded):
    directory, _, index = sharded
    shard = directory / index["weight_map"]["lm_head.weight"]
    shard.unlink()
    fastckpt.save_npz(shard, {"lm_head.weight": np.zeros(2)})
    with pytest.raises(FormatError, match="must be a safetensors file, this one is npz"):
        fastckpt.open(directory)


def test_no_checkpoint_in_the_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="model.safetensors, model.safetensors.index.json or one PREFIX.safetensors.index.json"):
        HFShardedDirectory(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="Hugging Face"):
        fastckpt.open(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        HFShardedDirectory(tmp_path / "nope.safetensors.index.json")


def test_read_index_directly(sharded):
    directory, _, index = sharded
    weight_map, metadata = read_index(directory / INDEX_NAME)
    assert weight_map == index["weight_map"] and metadata == index["metadata"]


# -- atomicity ---------------------------------------------------------------------------------------------------

def entry_state(directory: Path):
    """What a reader sees now: the tensors of the checkpoint, or None when there is none."""
    try:
        with fastckpt.open(directory) as r:
            return {name: r.host(name).copy() for name in r}
    except CheckpointNotFoundError:
        return None


def test_index_is_written_last_after_every_shard_is_in_place(tmp_path, monkeypatch):
    replaced = []
    real_replace = os.replace

    def spy(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if os.path.dirname(os.fspath(dst)) == str(tmp_path):
            replaced.append(os.path.basename(os.fspath(dst)))
            # at every step, what a reader sees is a complete checkpoint or none
            state = entry_state(tmp_path)
            assert state is None or set(state) == set(tensors)

    tensors = model()
    monkeypatch.setattr(os, "replace", spy)
    # Every save commits by no-replace renames into the directory (the one commit's).
    monkeypatch.setattr(_atomic, "rename_noreplace", spy)
    files = save_sharded(tmp_path, tensors, max_shard_size=3000, fsync=False)
    assert replaced == files  # the shards in order, then the index
    replaced.clear()
    files = save_sharded(tmp_path, model(1), max_shard_size=3000, fsync=False, overwrite=True)
    assert replaced == files  # a replacement: the same order


def test_failed_save_leaves_the_previous_checkpoint_untouched(tmp_path, monkeypatch):
    old = model(1)
    save_sharded(tmp_path, old, max_shard_size=3000)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    calls = []
    real = hfsharded.save_safetensors

    def failing(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(hfsharded, "save_safetensors", failing)
    with pytest.raises(OSError, match="No space"):
        save_sharded(tmp_path, model(2), max_shard_size=3000, overwrite=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # staging folder gone too
    state = entry_state(tmp_path)
    assert set(state) == set(old) and all(np.array_equal(state[n], old[n]) for n in old)


def test_failure_during_the_commit_puts_the_previous_checkpoint_back(tmp_path, monkeypatch):
    old = model(1)
    save_sharded(tmp_path, old, max_shard_size=3000)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = _atomic.rename_noreplace
    count = []

    def failing(src, dst, *args, **kwargs):
        if os.path.dirname(os.fspath(dst)) == str(tmp_path):
            count.append(dst)
            if len(count) == 2:  # the second shard renamed in: the previous save is aside, one new shard is in
                raise OSError(5, "Input/output error")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(_atomic, "rename_noreplace", failing)
    with pytest.raises(OSError, match="Input/output") as failure:
        save_sharded(tmp_path, model(2), max_shard_size=3000, overwrite=True)
    monkeypatch.undo()
    assert failure.value.filename.startswith(str(tmp_path) + os.sep)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # exactly as it was, nothing left
    state = entry_state(tmp_path)
    assert set(state) == set(old) and all(np.array_equal(state[n], old[n]) for n in old)
    tensors = model(3)
    save_sharded(tmp_path, tensors, max_shard_size=3000, overwrite=True)
    assert set(entry_state(tmp_path)) == set(tensors)


def test_saving_over_a_previous_save_removes_its_files_and_keeps_others(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    big = model(1)
    files3 = save_sharded(tmp_path, big, max_shard_size=2000)
    assert len(files3) > 4
    # fewer shards: the old extra shards go
    files2 = save_sharded(tmp_path, big, max_shard_size=6000, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == sorted(files2 + ["config.json"])
    # one shard: the index and every numbered shard go
    assert save_sharded(tmp_path, big, max_shard_size=10**9, overwrite=True) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    # sharded again: model.safetensors goes (it would win over the index)
    files = save_sharded(tmp_path, big, max_shard_size=3000, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == sorted(files + ["config.json"])
    # another prefix is another checkpoint: left alone
    save_sharded(tmp_path, {"x": np.zeros(2)}, prefix="other")
    assert sorted(os.listdir(tmp_path)) == sorted(files + ["config.json", "other.safetensors"])
    state = entry_state(tmp_path)
    assert all(np.array_equal(state[n], big[n]) for n in big)


def test_a_dead_writers_staging_folder_is_removed(tmp_path):
    stale = tmp_path / f".model.{_owner()}.999999999.0badf00d.partial"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half")
    save_sharded(tmp_path, model(), max_shard_size=3000)
    assert not stale.exists()


# -- the docs page -------------------------------------------------------------------------------------------------

def test_docs_page_has_the_same_text_as_the_module_docstring():
    page = (Path(__file__).parent.parent / "docs" / "formats" / "hf-sharded.md").read_text(encoding="utf-8")
    page = re.sub(r"<!--.*?-->", "", page, flags=re.S)
    docstring = re.sub(r":(?:class|func|mod):`~?[\w.]*?(\w+)`", r"\1", hfsharded.__doc__)
    words = lambda text: re.findall(r"\w+", text)  # noqa: E731
    assert words(page) == words(docstring)


# -- device loads ----------------------------------------------------------------------------------------------------

def device_model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {f"layers.{i}.weight": rng.standard_normal((40, 30)).astype(np.float32) for i in range(6)}
    tensors["layers.0.bias"] = rng.standard_normal(30).astype(ml_dtypes.bfloat16)
    tensors["embed.int8"] = rng.integers(-100, 100, 77).astype(np.int8)
    tensors["embed.mask"] = rng.random(13) > 0.5
    tensors["empty"] = np.zeros((0, 5), np.float16)
    tensors["scalar"] = np.array(3.25, np.float64)
    return tensors


def test_load_all_shards_into_one_pooled_arena(tmp_path, queue, pool):
    from fastckpt.device.load import load_file

    tensors = device_model()
    files = save_sharded(tmp_path, tensors, max_shard_size=10_000)
    shards = len(files) - 1
    assert shards >= 3
    first = load_file(tmp_path, queue, pool=pool)
    report = first.report
    assert report.format == "hf-sharded" and report.mode == "pool"
    assert report.regions == shards and report.copies == shards  # one copy per shard region
    assert report.pool_misses == 1 and report.pool_hits == 0
    assert set(report.paths.values()) == {"arena", "empty"} and report.paths["empty"] == "empty"
    assert list(first) == list(tensors)
    with fastckpt.open(tmp_path) as r:
        for name, want in tensors.items():
            assert_exact(first[name].to_host(), r.host(name))
            assert_exact(first[name].to_host(), want)
    buffers = {first[name].buffer.int_ptr for name in tensors if tensors[name].nbytes}
    assert len(buffers) == 1  # one lease for every shard
    assert pool.stats.buffers_in_use == 1
    # each tensor keeps the alignment it had in its file
    assert all(first[n].offset % 4096 == r.info(n).offset % 4096 for n in tensors if tensors[n].nbytes)
    first.release()
    second = load_file(tmp_path, queue, pool=pool)
    assert second.report.pool_misses == 0 and second.report.pool_hits == 1
    assert pool.stats.allocations == 1 and pool.stats.misses == 1
    for name, want in tensors.items():
        assert_exact(second[name].to_host(), want)


def test_load_an_open_reader_non_blocking_and_a_selection(tmp_path, queue, pool):
    from fastckpt.device.load import load_file

    tensors = device_model(1)
    save_sharded(tmp_path, tensors, max_shard_size=10_000)
    with fastckpt.open(tmp_path) as r:
        loaded = load_file(r, queue, pool=pool, blocking=False)
        assert not r.closed  # readers passed in are not closed
        for name, want in tensors.items():
            assert_exact(loaded[name].to_host(), want)
        picked = load_file(r, queue, pool=pool, names=["layers.0.weight", "embed.int8"])  # two shards
        assert list(picked) == ["layers.0.weight", "embed.int8"] and picked.report.regions == 2
        assert_exact(picked["embed.int8"].to_host(), tensors["embed.int8"])
        with pytest.raises(TensorNotFoundError):
            load_file(r, queue, pool=pool, names=["nope"])


def test_load_without_a_pool_gives_a_buffer_per_tensor(tmp_path, queue):
    from fastckpt.device.load import load_file

    tensors = device_model(2)
    save_sharded(tmp_path, tensors, max_shard_size=10_000)
    loaded = load_file(tmp_path, queue)
    assert loaded.report.mode == "per-tensor"
    assert {loaded.report.paths[n] for n in tensors if tensors[n].nbytes} == {"buffer"}
    assert loaded.report.copies == sum(1 for a in tensors.values() if a.nbytes)
    for name, want in tensors.items():
        assert_exact(loaded[name].to_host(), want)


def test_load_splits_the_arena_only_where_one_allocation_cannot_hold_more(tmp_path, queue):
    from fastckpt.device.load import load_file
    from fastckpt.device.pool import PersistentBufferPool

    tensors = {f"w{i}": np.full(2000, i, np.float32) for i in range(6)}  # 8000 bytes each, one per shard
    save_sharded(tmp_path, tensors, max_shard_size=8000)
    pool = PersistentBufferPool(queue.context, queue, max_alloc_size=20_000)
    loaded = load_file(tmp_path, queue, pool=pool)
    # 8000 bytes per slice, each at a multiple of 4096: two slices per 20 000-byte allocation
    assert loaded.report.regions == 6 and loaded.report.pool_misses == 3
    assert len({loaded[n].buffer.int_ptr for n in tensors}) == 3
    for name, want in tensors.items():
        assert_exact(loaded[name].to_host(), want)


def test_zero_copy_falls_back_to_a_copy_with_a_warning(tmp_path, queue, pool):
    from fastckpt.device.load import load_file
    from fastckpt.errors import NotZeroCopyWarning

    tensors = device_model(4)
    save_sharded(tmp_path, tensors, max_shard_size=10_000)
    with pytest.warns(NotZeroCopyWarning, match="one mapped file"):
        loaded = load_file(tmp_path, queue, pool=pool, zero_copy=True)
    assert loaded.report.mode == "pool"
    for name, want in tensors.items():
        assert_exact(loaded[name].to_host(), want)


def test_load_a_transformers_directory(tmp_path, queue, pool):
    from fastckpt.device.load import load_file

    tensors = device_model(5)
    names = [n for n in tensors if tensors[n].nbytes]
    write_like_transformers(tmp_path, [{n: tensors[n] for n in names[k:k + 3]} for k in range(0, len(names), 3)])
    loaded = load_file(tmp_path, queue, pool=pool)
    assert loaded.report.copies == loaded.report.regions == -(-len(names) // 3)
    assert loaded.report.pool_misses == 1
    for name in names:
        assert_exact(loaded[name].to_host(), tensors[name])
