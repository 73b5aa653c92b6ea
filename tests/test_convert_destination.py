"""``convert`` writes the format it is told, never a guess: the destination rule, its errors, ``--skip-unsupported``."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import fastckpt
from fastckpt.cli import main
from fastckpt.errors import DestinationError
from fastckpt.formats.convert import convert, destination_format
from fastckpt.tf import CheckpointReader, write_checkpoint

# Python's convert() names its keywords; the command prints its flags instead (CLI_CHOICES).
CHOICES = "name a .safetensors or .npz file, or a TensorFlow checkpoint prefix such as out/ckpt-1 with to='tf'"
CLI_CHOICES = "name a .safetensors or .npz file, or a TensorFlow checkpoint prefix such as out/ckpt-1 with --to tf"


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "src.safetensors"
    fastckpt.save_safetensors(path, {"w": np.arange(6, dtype=np.float32)})
    return path


def _listing(directory):
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("dst,to,match", [
    ("model.safetensor", None, r"\.safetensor is not \.safetensors \(one letter short\)"),
    ("model.pt", None, r"\.pt names a torch pickle"),
    ("model.pt", "safetensors", r"\.pt names a torch pickle"),
    ("model.h5", None, r"\.h5 names an HDF5/Keras file"),
    ("model.netcl", None, r"unknown suffix '\.netcl'"),
    ("ckpt-1", None, "no suffix"),
    ("x.npz", "safetensors", r"the suffix \.npz names npz, not safetensors \(to='safetensors'\)"),
    ("x.safetensors", "tf", r"the suffix \.safetensors names safetensors, not tf \(to='tf'\)"),
    ("x.index", "npz", r"the suffix \.index names tf, not npz \(to='npz'\)"),
])
def test_an_unstated_or_contradicted_format_is_an_error_and_nothing_is_written(tmp_path, src, dst, to, match):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DestinationError, match=match) as caught:
        convert(src, out / dst, to=to)
    assert isinstance(caught.value, ValueError)
    if "the suffix" not in match:
        assert CHOICES in str(caught.value)
    assert _listing(out) == []


@pytest.mark.parametrize("to", [None, "tf", "npz"])
@pytest.mark.parametrize("trailing_slash", [True, False])
def test_a_directory_destination_is_an_error(tmp_path, src, to, trailing_slash):
    out = tmp_path / "outdir"
    out.mkdir()
    with pytest.raises(DestinationError, match="is a directory; inside it, name a .safetensors or .npz file"):
        convert(src, str(out) + ("/" if trailing_slash else ""), to=to)
    assert _listing(out) == []  # no hidden outdir/.index, outdir/.data-...


def test_a_slash_ended_path_that_does_not_exist_is_a_directory_too(tmp_path, src):
    with pytest.raises(DestinationError, match="is a directory"):
        convert(src, str(tmp_path / "new") + "/", to="tf")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("dst,to,fmt", [
    ("m.safetensors", None, "safetensors"), ("m.SAFETENSORS", "safetensors", "safetensors"), ("m.npz", None, "npz"),
    ("ckpt-1.index", None, "tf"), ("ckpt-1", "tf", "tf"), ("model.ckpt-100", "tf", "tf"), ("w.netcl", "npz", "npz"),
])
def test_the_stated_formats(tmp_path, src, dst, to, fmt):
    assert destination_format(dst, to) == fmt
    summary = convert(src, tmp_path / dst, to=to)
    assert summary["destination"] == fmt
    with fastckpt.open(summary["path"]) as f:
        assert f.format == {"tf": "tensorflow"}.get(fmt, fmt)
        assert f.host("w").tolist() == list(range(6))


def test_the_command_prints_the_error_and_writes_nothing(tmp_path, src, capsys):
    out = tmp_path / "outdir"
    out.mkdir()
    assert main(["convert", str(src), str(out / "model.safetensor")]) == 1
    assert main(["convert", str(src), str(out) + "/"]) == 1
    assert main(["convert", str(src), str(out / "x.npz"), "--to", "safetensors"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3
    assert err[0].endswith("model.safetensor: .safetensor is not .safetensors (one letter short), not a format "
                           f"convert writes; {CLI_CHOICES}")
    assert err[1].endswith(f"outdir/: is a directory; inside it, {CLI_CHOICES}")
    assert err[2].endswith("x.npz: the suffix .npz names npz, not safetensors (--to safetensors); rename the "
                           "destination or leave --to out")
    assert all(line.startswith("fastckpt convert: ") for line in err)
    assert _listing(out) == []


def test_skip_unsupported_skips_a_netcl_files_text_metadata(tmp_path, capsys):
    """A .netcl model file's ``__netcl_meta__`` is a 0-d ``<U{n}`` array: safetensors cannot hold it."""
    meta = np.array(json.dumps({"config": "x" * 260}))
    assert meta.dtype.str.startswith("<U")
    path = tmp_path / "m.netcl"
    fastckpt.save_npz(path, {"fc.weight": np.ones((2, 2), np.float32), "__netcl_meta__": meta})
    with pytest.raises(DestinationError, match=r"1 tensor\(s\) cannot be stored in safetensors: '__netcl_meta__': "
                                               r"dtype <U\d+ has no safetensors equivalent"):
        convert(path, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    summary = convert(path, tmp_path / "m.safetensors", skip_unsupported=True)
    assert summary["skipped"] == ["__netcl_meta__"] and summary["tensors"] == 1
    assert "no safetensors equivalent" in summary["reasons"]["__netcl_meta__"]
    with fastckpt.open(tmp_path / "m.safetensors") as f:
        assert list(f) == ["fc.weight"]
    assert main(["convert", str(path), str(tmp_path / "n.safetensors"), "--skip-unsupported"]) == 0
    assert "skipped __netcl_meta__: dtype <U" in capsys.readouterr().err
    # NPZ holds the text: nothing is skipped
    assert convert(path, tmp_path / "copy.npz")["skipped"] == []


def test_skip_unsupported_skips_complex128_for_safetensors(tmp_path):
    write_checkpoint(tmp_path / "c", {"z": np.array([1j]), "w": np.ones(2, np.float32)})
    with pytest.raises(DestinationError, match="'z': dtype complex128 has no safetensors equivalent"):
        convert(tmp_path / "c", tmp_path / "c.safetensors")
    assert convert(tmp_path / "c", tmp_path / "c.safetensors", skip_unsupported=True)["skipped"] == ["z"]


def test_to_tf_with_an_index_suffix_writes_the_prefix(tmp_path, src):
    summary = convert(src, tmp_path / "ckpt-2.index")
    assert summary["path"] == str(tmp_path / "ckpt-2")
    with CheckpointReader(tmp_path / "ckpt-2") as r:
        assert list(r) == ["w"]


def test_skip_unsupported_on_a_model_file_written_by_save_model(tmp_path, device):
    from fastckpt.io.serialization import save_model
    from fastckpt.nn import Linear, ReLU, Sequential

    save_model(Sequential(Linear(None, 4, 2), ReLU()), tmp_path / "tiny.netcl")
    with fastckpt.open(tmp_path / "tiny.netcl") as f:
        assert f.info("__netcl_meta__").dtype.kind == "U"
    summary = convert(tmp_path / "tiny.netcl", tmp_path / "tiny.safetensors", skip_unsupported=True)
    assert summary["skipped"] == ["__netcl_meta__"] and summary["tensors"] == 2
    with fastckpt.open(tmp_path / "tiny.safetensors") as f, fastckpt.open(tmp_path / "tiny.netcl") as g:
        assert {n: f.host(n).tobytes() for n in f} == {n: g.host(n).tobytes() for n in ("0:weight", "0:bias")}
