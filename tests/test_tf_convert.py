"""``fastckpt convert`` between TensorFlow checkpoints, safetensors and NPZ."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fastckpt
from fastckpt.cli import main
from fastckpt.formats.convert import convert, destination_format
from fastckpt.tf import CheckpointReader, write_checkpoint

DATA = Path(__file__).parent / "data" / "tf"
EXPECTED = json.loads((DATA / "expected.json").read_text())

NUMERIC = {
    "dense/kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
    "dense/bias": np.array([0.5, -1.0], np.float64),
    "step": np.int64(12),
    "mask": np.array([True, False]),
    "empty": np.zeros((0, 3), np.int16),
    "c": np.array([1 - 2j], np.complex64),
    "\u00e9t\u00e9": np.array([7], np.uint8),
}


def _values(path):
    if os.path.exists(str(path) + ".index") or str(path).endswith(".index"):
        with CheckpointReader(path) as r:
            return {n: r.read_tensor(n, copy=True) for n in r}
    with fastckpt.open(path) as f:
        return {n: np.array(f.host(n)) for n in f.keys()}


def _same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("first,second", [("safetensors", "npz"), ("npz", "safetensors"), ("safetensors", "tf"),
                                          ("npz", "tf")])
def test_round_trip_through_every_format(tmp_path, first, second):
    src = str(tmp_path / "src")
    write_checkpoint(src, NUMERIC)
    ext = {"safetensors": ".safetensors", "npz": ".npz", "tf": ".index"}
    mid = str(tmp_path / f"mid{ext[first]}")
    out = str(tmp_path / f"out{ext[second]}")
    assert convert(src, mid)["destination"] == first
    assert convert(mid, out)["destination"] == second
    _same(_values(out), {k: np.asarray(v) for k, v in NUMERIC.items()})


def test_destination_format():
    assert destination_format("x.SAFETENSORS") == "safetensors"
    assert destination_format("x.weights", "npz") == "npz"
    with pytest.raises(ValueError, match="unknown destination format"):
        destination_format("x", "onnx")


def test_tensorflow_fixture_to_safetensors_drops_only_the_object_graph(tmp_path):
    src = DATA / EXPECTED["object_based"]["prefix"]
    with pytest.raises(ValueError, match="string tensor.*skip_unsupported=True"):
        convert(src, tmp_path / "a.safetensors")
    summary = convert(src, tmp_path / "a.safetensors", skip_unsupported=True)
    assert summary["dropped"] == ["_CHECKPOINTABLE_OBJECT_GRAPH"]
    assert summary["skipped"] == ["model/text/.ATTRIBUTES/VARIABLE_VALUE"]
    with fastckpt.open(tmp_path / "a.safetensors") as f:
        for name, entry in EXPECTED["object_based"]["tensors"].items():
            if "strings" in entry:
                assert name not in f
            else:
                assert f.host(name).tobytes() == bytes.fromhex(entry["hex"]), name
                assert str(f.host(name).dtype) == entry["dtype"]


def test_back_to_tensorflow_rebuilds_the_object_graph(tmp_path):
    src = DATA / EXPECTED["object_based"]["prefix"]
    convert(src, tmp_path / "a.safetensors", skip_unsupported=True)
    assert convert(tmp_path / "a.safetensors", tmp_path / "plain", to="tf")["needs_object_graph"]
    summary = convert(tmp_path / "a.safetensors", tmp_path / "back", to="tf", object_graph=True)
    assert not summary["needs_object_graph"]
    with CheckpointReader(tmp_path / "back") as reader:
        graph = reader.object_graph()
        keys = {key for node in graph.nodes for _, _, key in node.attributes}
        assert keys == set(reader.tensor_names()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
        assert "model/table/a.Sb..c/.ATTRIBUTES/VARIABLE_VALUE" in keys


def test_partitioned_and_sharded_tensorflow_to_npz(tmp_path):
    convert(DATA / EXPECTED["name_based"]["prefix"], tmp_path / "n.npz")
    with fastckpt.open(tmp_path / "n.npz") as f:
        assert f.host("emb").tobytes() == bytes.fromhex(EXPECTED["name_based"]["tensors"]["emb"]["hex"])
    convert(DATA / "sharded", tmp_path / "s.npz")
    _same(_values(tmp_path / "s.npz"), _values(DATA / EXPECTED["sharded"]["prefix"]))


def test_tf_to_tf_keeps_strings_and_can_shard(tmp_path):
    src = DATA / EXPECTED["object_based"]["prefix"]
    convert(src, tmp_path / "copy.index", num_shards=2, data_alignment=64)
    with CheckpointReader(tmp_path / "copy") as reader:
        assert reader.header.num_shards == 2
        assert all(i.offset % 64 == 0 for i in reader.infos.values())
    with CheckpointReader(tmp_path / "copy") as a, CheckpointReader(src) as b:
        assert a.tensor_names() == b.tensor_names()
        for name in a:
            assert a[name].tolist() == b[name].tolist()


def test_existing_destination_needs_overwrite(tmp_path):
    write_checkpoint(tmp_path / "src", {"w": np.zeros(1)})
    convert(tmp_path / "src", tmp_path / "w.npz")
    with pytest.raises(FileExistsError, match="pass overwrite=True to replace it") as refused:
        convert(tmp_path / "src", tmp_path / "w.npz")
    assert "--" not in str(refused.value)  # Python's convert() names its keyword, not the command's flag
    convert(tmp_path / "src", tmp_path / "w.npz", overwrite=True)
    with pytest.raises(TypeError, match="force"):  # 0.2's spelling, deprecated in 0.3, gone in 0.4
        convert(tmp_path / "src", tmp_path / "w.npz", force=True)


def test_cli_convert_overwrite_flag_and_no_other_spelling(tmp_path, capsys):
    from fastckpt.cli import main

    write_checkpoint(tmp_path / "src", {"w": np.zeros(1)})
    out = str(tmp_path / "w.npz")
    assert main(["convert", str(tmp_path / "src"), out]) == 0
    assert main(["convert", str(tmp_path / "src"), out]) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "src"), out, "--overwrite"]) == 0
    with pytest.raises(SystemExit):  # 0.2's --force, deprecated in 0.3, gone in 0.4: an unknown option
        main(["convert", str(tmp_path / "src"), out, "--force"])
    assert "unrecognized arguments: --force" in capsys.readouterr().err


def test_destination_dtype_limits_surface_as_errors(tmp_path):
    write_checkpoint(tmp_path / "src", {"z": np.zeros(2, np.complex128)})
    with pytest.raises(ValueError, match="complex128"):
        convert(tmp_path / "src", tmp_path / "z.safetensors")
    assert not (tmp_path / "z.safetensors").exists()


def test_bfloat16_is_kept_by_npz(tmp_path):
    b = np.arange(3, dtype=np.float32).astype(ml_dtypes.bfloat16)
    write_checkpoint(tmp_path / "src", {"b": b})
    convert(tmp_path / "src", tmp_path / "b.npz")
    with fastckpt.open(tmp_path / "b.npz") as f:
        assert f.host("b").dtype == b.dtype and f.host("b").tobytes() == b.tobytes()


def test_safetensors_metadata_is_kept_or_reported(tmp_path):
    fastckpt.save_safetensors(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)}, metadata={"step": "3"})
    convert(tmp_path / "m.safetensors", tmp_path / "m2.safetensors")
    with fastckpt.open(tmp_path / "m2.safetensors") as f:
        assert f.metadata == {"step": "3"}
    assert convert(tmp_path / "m.safetensors", tmp_path / "ck", to="tf")["dropped"] == ["metadata"]


def test_cli(tmp_path, capsys):
    write_checkpoint(tmp_path / "src", {"w": np.arange(4, dtype=np.int32), "s": b"text"})
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "o.safetensors")]) == 1
    assert "--skip-unsupported" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "o.safetensors"), "--skip-unsupported"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith(": 1 tensor\n") and "skipped s: a string tensor" in captured.err
    assert main(["convert", str(tmp_path / "o.safetensors"), str(tmp_path / "o"), "--to", "tf", "--shards", "2"]) == 0
    assert CheckpointReader(tmp_path / "o")["w"].tolist() == [0, 1, 2, 3]
    assert main(["inspect", str(tmp_path / "o")]) == 0
    assert "int32" in capsys.readouterr().out
