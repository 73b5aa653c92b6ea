"""The paths users bring: a Hugging Face index file, diffusers-named shards, torch and Keras files, bytes."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

import fastckpt
from fastckpt.cli import main
from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.formats.convert import convert

TENSORS = {"embed.weight": np.arange(8, dtype=np.float32).reshape(2, 4), "lm_head.weight": np.ones(3, np.float16)}


def _sharded(directory: Path, prefix: str = "model") -> Path:
    fastckpt.save_sharded(directory, TENSORS, max_shard_size=16, prefix=prefix)
    return directory / f"{prefix}.safetensors.index.json"


def _values(reader) -> dict:
    return {name: np.array(reader.host(name)) for name in reader.keys()}


def _same(got: dict) -> None:
    assert list(got) == list(TENSORS)
    for name, value in TENSORS.items():
        assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes()


@pytest.mark.parametrize("prefix", ["model", "diffusion_pytorch_model", "unet"])
def test_the_index_path_opens_its_directory(tmp_path, prefix, capsys):
    index = _sharded(tmp_path / "hf", prefix)
    assert sorted(os.listdir(tmp_path / "hf")) == [f"{prefix}-00001-of-00002.safetensors",
                                                   f"{prefix}-00002-of-00002.safetensors", index.name]
    for path in (index, tmp_path / "hf"):  # the file hf_hub_download returns, and the directory
        with fastckpt.open(path) as r:
            assert r.format == "hf-sharded" and r.index_path == str(index)
            _same(_values(r))
    assert main(["inspect", str(index)]) == 0
    assert capsys.readouterr().out.startswith(f"{index}: hf-sharded, 2 tensors")
    convert(index, tmp_path / "one.safetensors")
    with fastckpt.open(tmp_path / "one.safetensors") as f:
        _same(_values(f))


@pytest.mark.parametrize("prefix", ["model", "diffusion_pytorch_model"])
def test_load_file_takes_the_index_path(tmp_path, queue, prefix):
    index = _sharded(tmp_path / "hf", prefix)
    loaded = fastckpt.load_file(index, queue)
    _same({name: loaded[name].to_host() for name in loaded})


def test_two_prefixes_in_one_directory_are_named(tmp_path):
    _sharded(tmp_path / "hf", "a")
    _sharded(tmp_path / "hf", "b")
    with pytest.raises(FormatError, match=r"holds 2 Hugging Face indexes \(a.safetensors.index.json, "
                                          r"b.safetensors.index.json\); open the one meant by its path"):
        fastckpt.open(tmp_path / "hf")
    with fastckpt.open(tmp_path / "hf" / "b.safetensors.index.json") as r:
        _same(_values(r))


def test_verify_checks_a_hugging_face_directory(tmp_path, capsys):
    index = _sharded(tmp_path / "hf")
    assert main(["verify", str(tmp_path / "hf")]) == 0
    assert main(["verify", str(index)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(line.startswith("OK ") and "hugging face safetensors: 2 files, 2 tensors" in line for line in out)
    shard = tmp_path / "hf" / "model-00002-of-00002.safetensors"
    with open(shard, "ab") as f:
        f.write(b"\0" * 3)
    weight_map = json.loads(index.read_text())
    weight_map["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(weight_map))
    assert main(["verify", str(tmp_path / "hf")]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {tmp_path / 'hf'}\n  - {index}: the index puts tensor 'ghost' in "
                          "'model-00001-of-00002.safetensors', which holds no such tensor")
    del weight_map["weight_map"]["ghost"]
    index.write_text(json.dumps(weight_map))
    assert main(["verify", str(tmp_path / "hf")]) == 1
    out = capsys.readouterr().out
    assert "model-00002-of-00002.safetensors" in out and "3 unexpected trailing bytes after the data section" in out


def test_verify_a_file(tmp_path, capsys):
    fastckpt.save_npz(tmp_path / "m.npz", {"w": np.arange(100, dtype=np.int32)})
    fastckpt.save_safetensors(tmp_path / "m.safetensors", {"w": np.arange(4, dtype=np.int32)})
    assert main(["verify", str(tmp_path / "m.npz")]) == 0
    assert main(["verify", str(tmp_path / "m.safetensors")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"OK   {tmp_path / 'm.npz'}  npz: 1 tensor, every member's CRC-32 checked",
        f"OK   {tmp_path / 'm.safetensors'}  safetensors: 1 tensor, header and sizes checked (safetensors stores no "
        "checksums)"]
    data = bytearray((tmp_path / "m.npz").read_bytes())
    data[300] ^= 0xFF  # a byte of the payload
    (tmp_path / "m.npz").write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "m.npz")]) == 1
    assert "CRC-32 is 0x" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "missing.npz")]) == 1
    assert capsys.readouterr().out == f"FAIL {tmp_path / 'missing.npz'}: no such file or directory\n"
    from fastckpt.tf import write_checkpoint

    write_checkpoint(tmp_path / "tf" / "ckpt-1", {"w": np.arange(3, dtype=np.int64)})
    for path in (tmp_path / "tf" / "ckpt-1", tmp_path / "tf" / "ckpt-1.index", tmp_path / "tf"):
        assert main(["verify", str(path)]) == 0
        assert capsys.readouterr().out == f"OK   {path}  tensorflow: 1 tensor, every tensor's CRC32C checked\n"


# -- other tools' files ---------------------------------------------------------------------------------------------

def _torch_zip(path: Path, archive: str = "archive") -> Path:
    """The layout torch.save writes (a ZIP whose first member is <archive>/data.pkl); no pickle is run to check it."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{archive}/data.pkl", b"\x80\x02}q\x00.")
        z.writestr(f"{archive}/.format_version", b"1")
        z.writestr(f"{archive}/data/0", bytes(8))
    return path


def _keras_zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("metadata.json", "{}")
        z.writestr("config.json", "{}")
        z.writestr("model.weights.h5", b"\x89HDF\r\n\x1a\n")
    return path


@pytest.mark.parametrize("make,kind", [
    (lambda d: _torch_zip(d / "model.pt"), "a torch pickle"),
    (lambda d: _torch_zip(d / "pytorch_model.bin", "pytorch_model"), "a torch pickle"),
    (lambda d: (d / "old.pth").write_bytes(b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.") and d / "old.pth",
     "a torch pickle"),
    (lambda d: _torch_zip(d / "__0_0.distcp"), "a torch distributed checkpoint"),
    (lambda d: _keras_zip(d / "model.keras"), "a Keras file"),
    (lambda d: (d / "model.weights.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(504)) and d / "model.weights.h5",
     "a Keras file"),
])
def test_other_tools_files_are_named_with_the_way_to_safetensors(tmp_path, make, kind, capsys):
    path = make(tmp_path)
    with pytest.raises(FormatError) as caught:
        fastckpt.open(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: this is {kind}")
    assert ".npy" not in message and "zip64" not in message
    assert "model.safetensors" in message
    if kind != "a Keras file":
        assert "fastckpt never unpickles" in message
    assert main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err == f"fastckpt inspect: {message}\n"


def test_a_dcp_directory_is_named(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04.")
    _torch_zip(tmp_path / "dcp" / "__0_0.distcp")
    with pytest.raises(FormatError, match=r"dcp: this is a torch distributed checkpoint .* dcp_to_torch_save"):
        fastckpt.open(tmp_path / "dcp")
    with pytest.raises(CheckpointNotFoundError):  # a directory of nothing known is still "cannot read"
        (tmp_path / "empty").mkdir()
        fastckpt.open(tmp_path / "empty")


def test_real_torch_files_when_torch_is_installed(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(2)}, tmp_path / "new.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    for name in ("new.pt", "old.pt"):
        with pytest.raises(FormatError, match="this is a torch pickle"):
            fastckpt.open(tmp_path / name)


def test_open_of_bytes_says_to_use_load_bytes():
    data = fastckpt.save_bytes({"w": np.ones(2, np.float32)})
    with pytest.raises(TypeError, match=r"fastckpt.open takes a path \(str or os.PathLike\), not bytes "
                                        r"\(\d+ bytes, starting .*\): for a file's bytes held in memory, use "
                                        r"fastckpt.load_bytes\(data\)"):
        fastckpt.open(data)
    assert fastckpt.load_bytes(data)["w"].tolist() == [1.0, 1.0]


def test_load_bytes_of_a_torch_file_says_what_it_is(tmp_path):
    data = _torch_zip(tmp_path / "m.pt").read_bytes()
    with pytest.raises(FormatError, match=r"^<bytes>: this is a torch pickle .* fastckpt never unpickles"):
        fastckpt.load_bytes(data)
    with pytest.raises(FormatError, match=r"^<bytes>: this is a torch pickle"):
        fastckpt.load_bytes(memoryview(b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."))
