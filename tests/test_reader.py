"""fastckpt.open: one suite run over every format (NPZ and safetensors), both backends."""

import numpy as np
import pytest

import fastckpt
from fastckpt import FormatError, TensorNotFoundError

TENSORS = {
    "embed.weight": np.arange(24, dtype=np.float32).reshape(4, 6),
    "scale": np.array(1.5, dtype=np.float16),
    "mask": np.array([True, False, True]),
    "ids": np.arange(-3, 4, dtype=np.int64),
    "empty": np.zeros((0, 5), np.float64),
}

WRITERS = {
    "npz": lambda p, t: fastckpt.save_npz(p, t),
    "safetensors": lambda p, t: fastckpt.save_safetensors(p, t),
}


@pytest.fixture(params=sorted(WRITERS))
def written(request, tmp_path):
    fmt = request.param
    # A misleading suffix: the format must come from the bytes.
    path = tmp_path / ("model.safetensors" if fmt == "npz" else "model.npz")
    WRITERS[fmt](path, TENSORS)
    return fmt, path


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_every_tensor_reads_back_exactly(written, backend):
    fmt, path = written
    with fastckpt.open(path, backend=backend) as f:
        assert f.format == fmt
        assert sorted(f.keys()) == sorted(TENSORS)
        for name, expected in TENSORS.items():
            got = f.host(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert got.tobytes() == expected.tobytes()
            info = f.info(name)
            assert (info.dtype, info.shape, info.nbytes) == (expected.dtype, expected.shape, expected.nbytes)


def test_host_views_are_zero_copy_read_only_and_outlive_close(written):
    _, path = written
    f = fastckpt.open(path)
    a, b = f.host("embed.weight"), f["embed.weight"]
    assert np.shares_memory(a, b) and not a.flags.writeable
    f.close()
    f.close()
    assert f.closed and repr(f) == "<Closed fastckpt.TensorFile>"
    assert np.array_equal(a, TENSORS["embed.weight"])


def test_data_region_covers_every_payload(written):
    _, path = written
    with fastckpt.open(path) as f:
        start, end = f.data_region
        for info in f.infos.values():
            assert start <= info.offset and info.offset + info.nbytes <= end
        assert end <= f.mapped.size


def test_unknown_tensor_is_a_key_error_naming_file_and_neighbours(written):
    _, path = written
    with fastckpt.open(path) as f:
        with pytest.raises(TensorNotFoundError, match=r"no tensor named 'embed\.wieght'.*'embed\.weight'") as info:
            f.host("embed.wieght")
        assert isinstance(info.value, KeyError) and str(path) in str(info.value)
        assert "embed.wieght" not in f


def test_copy_on_write_views_are_private(written):
    _, path = written
    before = path.read_bytes()
    with fastckpt.open(path, copy_on_write=True) as f:
        w = f.host("embed.weight")
        w[...] = -1
        assert np.all(f.host("embed.weight") == -1)
    assert path.read_bytes() == before


def test_safetensors_metadata_is_exposed(tmp_path):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"w": np.ones(2, np.float32)}, metadata={"step": "12", "note": "ünï"})
    with fastckpt.open(path) as f:
        assert f.metadata == {"step": "12", "note": "ünï"}


@pytest.mark.parametrize("content", [b"", b"hello world, not a tensor file", b"\x89PNG\r\n\x1a\n0000"])
def test_unknown_formats_are_refused_with_what_was_seen(tmp_path, content):
    path = tmp_path / "x.bin"
    path.write_bytes(content)
    with pytest.raises(FormatError, match="x.bin"):
        fastckpt.open(path)


def test_files_from_numpy_and_safetensors_libraries_read_exactly(tmp_path):
    from safetensors.numpy import save_file

    np.savez(tmp_path / "np.npz", **TENSORS)
    save_file(dict(TENSORS), str(tmp_path / "lib.safetensors"))
    for name in ("np.npz", "lib.safetensors"):
        with fastckpt.open(tmp_path / name) as f:
            for key, expected in TENSORS.items():
                assert f[key].dtype == expected.dtype and f[key].tobytes() == expected.tobytes()


def test_missing_file_is_file_not_found_with_errno(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        fastckpt.open(tmp_path / "nope.safetensors")
    assert info.value.errno == 2


def test_max_header_size_is_passed_to_the_npz_parser(tmp_path):
    # 600 fields make a .npy header of 14518 characters: over numpy's 10000-character cap.
    arr = np.zeros(2, np.dtype([(f"field_{i:05d}", "<u1") for i in range(600)]))
    path = tmp_path / "wide.npz"
    np.savez(path, w=arr)
    with pytest.raises(FormatError, match=r"wide\.npz: member 'w\.npy'.*over the 10000-byte cap.*"
                                          r"max_header_size= to fastckpt\.open"):
        fastckpt.open(path)
    with pytest.raises(FormatError, match="npy header is 14518 bytes, over the 12000-byte cap"):
        fastckpt.open(path, max_header_size=12000)
    with fastckpt.open(path, max_header_size=20000) as f:
        got = f.host("w")
        assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "20000", True])
def test_max_header_size_must_be_a_positive_int(tmp_path, bad):
    path = tmp_path / "a.npz"
    fastckpt.save_npz(path, {"a": np.arange(3)})
    with pytest.raises(ValueError, match=r"max_header_size must be a positive int or None, got"):
        fastckpt.open(path, max_header_size=bad)


@pytest.mark.parametrize("head,fmt", [
    (b"PK\x03\x04\x14\x00\x00\x00\x00", "npz"),
    (b"PK\x05\x06\x00\x00\x00\x00\x00", "npz"),
    ((2).to_bytes(8, "little") + b"{", "safetensors"),
    # A safetensors header of exactly 0x04034B50 bytes: its length field starts with the ZIP magic.
    (b"PK\x03\x04\x00\x00\x00\x00{", "safetensors"),
    (b"PK\x03\x04", "npz"),
    (b"\x89PNG\r\n\x1a\n0", None),
])
def test_detect_format_reads_the_bytes(head, fmt):
    from fastckpt.formats.reader import detect_format

    assert detect_format(head) == fmt


def test_parsed_infos_behave_like_constructed_ones(written):
    import dataclasses

    _, path = written
    with fastckpt.open(path) as f:
        for info in f.infos.values():
            rebuilt = type(info)(**{fl.name: getattr(info, fl.name) for fl in dataclasses.fields(info)})
            assert info == rebuilt and hash(info) == hash(rebuilt) and repr(info) == repr(rebuilt)
            with pytest.raises(dataclasses.FrozenInstanceError):
                info.offset = 0
