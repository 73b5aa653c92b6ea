"""The reader contract (fastckpt.formats.contract.TensorReader): every reader fastckpt.open returns, and load_file /
load_model taking any of them."""

from __future__ import annotations

import errno
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import fastckpt
from fastckpt import CheckpointDirectory, TensorReader
from fastckpt.errors import (CheckpointNotFoundError, FormatError, IntegrityError, NotZeroCopyWarning,
                             TensorNotFoundError)
from fastckpt.formats.reader import register_opener, unregister_opener
from fastckpt.tf import CheckpointReader, save, write_checkpoint

TF_DATA = Path(__file__).parent / "data" / "tf"
TF_FIXTURES = ["object_based", "name_based", "sharded"]

TENSORS = {
    "b": np.arange(6, dtype=np.float32).reshape(2, 3),
    "a": np.array([1, -2, 3], dtype=np.int64),
    "s": np.float16(2.5) * np.ones((), np.float16),
    "e": np.zeros((0, 4), np.float32),
}


def _tf_prefix(fixture: str) -> str:
    import json

    expected = json.loads((TF_DATA / "expected.json").read_text())
    return str(TF_DATA / expected[fixture]["prefix"])


def _training_checkpoint(out) -> Path:
    from fastckpt.train import AdamW, TinyLM, save_checkpoint

    model = TinyLM(vocab=8, dim=4, hidden=8)
    opt = AdamW(model.parameters(), lr=1e-2)
    save_checkpoint(model, opt, None, None, None, out, step=5, fsync=False)
    return Path(out)


@pytest.fixture(params=["npz", "safetensors", "tensorflow", "training"])
def opened(request, tmp_path):
    """(format, reader from fastckpt.open, {name: expected array} or None when the values come from elsewhere)."""
    kind = request.param
    if kind == "npz":
        fastckpt.save_npz(tmp_path / "m.npz", TENSORS)
        reader, expected = fastckpt.open(tmp_path / "m.npz"), TENSORS
    elif kind == "safetensors":
        fastckpt.save_safetensors(tmp_path / "m.safetensors", TENSORS, metadata={"k": "v"})
        reader, expected = fastckpt.open(tmp_path / "m.safetensors"), TENSORS
    elif kind == "tensorflow":
        write_checkpoint(tmp_path / "ckpt-1", TENSORS)
        reader, expected = fastckpt.open(tmp_path / "ckpt-1"), TENSORS
    else:
        reader, expected = fastckpt.open(_training_checkpoint(tmp_path / "ckpt")), None
    with reader:
        yield kind, reader, expected


# -- the contract ----------------------------------------------------------------------------------------------


def test_every_reader_implements_the_contract(opened):
    kind, reader, expected = opened
    assert isinstance(reader, TensorReader)
    assert reader.format == {"training": "fastckpt.train.checkpoint"}.get(kind, kind)
    assert isinstance(reader.path, str)
    names = list(reader.keys())
    assert names == list(reader.infos) and len(set(names)) == len(names)
    if expected is not None:
        assert sorted(names) == sorted(expected)
    for name in names:
        info = reader.info(name)
        assert info is reader.infos[name] and isinstance(info, fastckpt.TensorInfo) and info.name == name
        value = reader.host(name)
        assert isinstance(value, np.ndarray) and value.dtype == info.dtype and value.shape == info.shape
        if expected is not None:
            assert value.tobytes() == np.asarray(expected[name]).tobytes()
        if info.zero_copy and value.size:
            assert not value.flags.writeable  # a view of the mapping, read-only
    with pytest.raises(TypeError):
        reader.infos[names[0]] = None  # read-only
    metadata = reader.metadata
    assert metadata is None or all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    assert (metadata is None) == (kind in ("npz", "tensorflow"))


def test_unknown_names_are_key_errors_naming_the_reader_and_close_matches(opened):
    _, reader, _ = opened
    first = next(iter(reader.keys()))
    typo = first + "x"
    for call in (reader.info, reader.host):
        with pytest.raises(TensorNotFoundError, match="no tensor named") as info:
            call(typo)
        assert isinstance(info.value, KeyError)
        assert reader.path in str(info.value) and f"did you mean {first!r}" in str(info.value)


def test_close_is_idempotent_and_views_outlive_it(opened):
    _, reader, _ = opened
    name = next(n for n in reader.keys() if reader.info(n).size)
    view = reader.host(name)
    before = view.copy()
    reader.close()
    reader.close()
    assert reader.closed and np.array_equal(view, before)


# -- fastckpt.open: what each kind of path opens as ------------------------------------------------------------


def test_tensorflow_checkpoints_open_from_every_path_form(tmp_path):
    prefix = save(tmp_path / "run", {"w": np.arange(4, dtype=np.float32)})  # run/ckpt-1 + run/checkpoint
    for form in (prefix, prefix + ".index", prefix + ".data-00000-of-00001", tmp_path / "run", Path(prefix)):
        with fastckpt.open(form) as reader:
            assert isinstance(reader, CheckpointReader) and reader.path == prefix
            assert reader.host("w").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_directory_with_one_index_and_no_state_file_opens_it(tmp_path):
    write_checkpoint(tmp_path / "model", {"w": np.ones(2, np.int32)})
    with fastckpt.open(tmp_path) as reader:
        assert reader.path == str(tmp_path / "model") and list(reader.keys()) == ["w"]
    write_checkpoint(tmp_path / "other", {"w": np.ones(2, np.int32)})
    with pytest.raises(CheckpointNotFoundError, match=r"2 TensorFlow checkpoints \(model.index, other.index\)"):
        fastckpt.open(tmp_path)


def test_tensorflow_host_copies_only_where_it_must_and_never_warns():
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotZeroCopyWarning)
        with fastckpt.open(_tf_prefix("name_based")) as reader:
            emb = reader.host("emb")  # a partitioned variable: assembled into a new array, no warning
            with pytest.warns(NotZeroCopyWarning):
                assert np.array_equal(reader.read_tensor("emb"), emb)
            assert emb.shape == reader.info("emb").shape
        with fastckpt.open(_tf_prefix("object_based")) as reader:
            text = reader.host("model/text/.ATTRIBUTES/VARIABLE_VALUE")
            assert text.dtype == object and text.tolist()[0] == b"ab"


def test_tensorflow_copy_on_write_views_are_private(tmp_path):
    write_checkpoint(tmp_path / "c", {"w": np.arange(3, dtype=np.float32)})
    data = tmp_path / "c.data-00000-of-00001"
    before = data.read_bytes()
    with fastckpt.open(tmp_path / "c", copy_on_write=True) as reader:
        view = reader.host("w")
        assert view.flags.writeable
        view[...] = -1
    assert data.read_bytes() == before and view.tolist() == [-1.0, -1.0, -1.0]


def test_training_directory_names_tensors_by_file_stem_and_closes_every_file(tmp_path):
    out = _training_checkpoint(tmp_path / "ckpt")
    reader = fastckpt.open(out)
    assert isinstance(reader, CheckpointDirectory) and list(reader.files) == ["weights", "optim"]
    with fastckpt.open(out / "weights.safetensors") as weights, fastckpt.open(out / "optim.safetensors") as optim:
        expected = {f"weights/{n}": weights.host(n) for n in weights.keys()}
        expected.update({f"optim/{n}": optim.host(n) for n in optim.keys()})
        assert list(reader.keys()) == list(expected)
        for name, value in expected.items():
            assert reader.host(name).tobytes() == value.tobytes()
            assert reader.info(name).offset == (weights if name.startswith("w") else optim).info(
                name.partition("/")[2]).offset
        # tied weights are stored once: the alias is a metadata entry, not a tensor
        assert reader.metadata["weights/lm_head.weight"] == "ALIAS(embed.weight)"
        assert "weights/lm_head.weight" not in reader
        assert reader.metadata["optim/fastckpt.format"] == "fastckpt.train.optim"
    assert reader.manifest["step"] == 5
    reader.close()
    assert all(f.closed for f in reader.files.values())


def test_training_directory_that_fails_to_open_closes_what_it_opened(tmp_path, monkeypatch):
    out = _training_checkpoint(tmp_path / "ckpt")
    (out / "optim.safetensors").write_bytes(b"not a tensor file")
    opened = []
    import fastckpt.train.directory as directory

    real = directory.open_file

    def recording(*args, **kwargs):
        opened.append(real(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(directory, "open_file", recording)
    with pytest.raises(IntegrityError, match="optim.safetensors"):  # its size and hash, before any file opens
        fastckpt.open(out)
    assert opened == []
    with pytest.raises(FormatError, match="optim.safetensors"):
        directory.CheckpointDirectory(out, verify=False)
    assert len(opened) == 1 and opened[0].closed


def test_a_manifest_of_another_format_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "something.else"}')
    with pytest.raises(FormatError, match="'format' is 'something.else'"):
        fastckpt.open(tmp_path)


def test_other_directories_and_missing_paths_say_what_was_expected(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointNotFoundError, match=f"{tmp_path}: a directory .*manifest.json.*TensorFlow"):
        fastckpt.open(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        fastckpt.open(tmp_path / "nope")
    assert info.value.errno == errno.ENOENT and info.value.filename == str(tmp_path / "nope")
    assert "TensorFlow checkpoint prefix" in str(info.value)
    with pytest.raises(FormatError, match="notes.txt: not an NPZ"):
        fastckpt.open(tmp_path / "notes.txt")


def test_registered_openers_come_first_and_can_be_removed(tmp_path):
    fastckpt.save_safetensors(tmp_path / "shard-1.safetensors", {"w": np.zeros(2, np.float32)})
    calls = []

    def is_sharded(path):
        return Path(path, "shard-1.safetensors").is_file()

    def open_sharded(path, **options):
        calls.append(options)
        return fastckpt.formats.reader.open_file(Path(path, "shard-1.safetensors"), **options)

    assert register_opener(is_sharded, open_sharded) is open_sharded
    try:
        with fastckpt.open(tmp_path, backend="pread") as reader:
            assert list(reader.keys()) == ["w"]
        assert calls == [{"backend": "pread", "copy_on_write": False, "max_header_size": None}]
    finally:
        unregister_opener(open_sharded)
    with pytest.raises(CheckpointNotFoundError):
        fastckpt.open(tmp_path)
    with pytest.raises(ValueError, match="not registered"):
        unregister_opener(open_sharded)
    with pytest.raises(TypeError):
        register_opener("not callable", open_sharded)


# -- load_file and load_model take any reader --------------------------------------------------------------------


def _host_values(reader) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotZeroCopyWarning)
        return {n: np.array(reader.host(n)) for n in reader.keys() if reader.info(n).dtype.kind != "O"}


@pytest.mark.parametrize("fixture", TF_FIXTURES)
@pytest.mark.parametrize("use_pool", [False, True], ids=["buffers", "pool"])
def test_load_file_of_a_tensorflow_reader_equals_its_host_values(fixture, use_pool, queue, pool):
    from fastckpt.device.load import load_file

    with CheckpointReader(_tf_prefix(fixture)) as reader:
        expected = _host_values(reader)
        strings = [n for n in reader.keys() if reader.info(n).dtype.kind == "O"]
        with pytest.warns(NotZeroCopyWarning, match="read through its host"):
            loaded = load_file(reader, queue, pool=pool if use_pool else None)
        assert not reader.closed  # a reader passed in stays open
    assert list(loaded) == list(expected) and loaded.report.skipped == strings
    assert loaded.report.format == "tensorflow" and loaded.report.path == _tf_prefix(fixture)
    for name, value in expected.items():
        got = loaded[name].to_host()
        assert got.dtype == value.dtype and got.shape == value.shape and got.tobytes() == value.tobytes()
        assert loaded.report.paths[name] == ("empty" if value.size == 0 else "decoded")


def test_load_file_of_a_tensorflow_prefix_path_and_named_strings(queue):
    from fastckpt.device.load import load_file

    prefix = _tf_prefix("object_based")
    with pytest.warns(NotZeroCopyWarning):
        loaded = load_file(prefix, queue, names=["model/scalar/.ATTRIBUTES/VARIABLE_VALUE"])
    with fastckpt.open(prefix) as reader:
        assert loaded["model/scalar/.ATTRIBUTES/VARIABLE_VALUE"].to_host().tobytes() == reader.host(
            "model/scalar/.ATTRIBUTES/VARIABLE_VALUE").tobytes()
        with pytest.raises(TypeError, match="string tensors cannot be loaded.*model/text"):
            load_file(reader, queue, names=["model/text/.ATTRIBUTES/VARIABLE_VALUE"])
        with pytest.raises(TensorNotFoundError, match="did you mean"):
            load_file(reader, queue, names=["model/scalar/.ATTRIBUTES/VARIABLE_VALUEX"])


def test_load_file_of_a_training_directory(tmp_path, queue, pool):
    from fastckpt.device.load import load_file

    out = _training_checkpoint(tmp_path / "ckpt")
    with fastckpt.open(out) as reader:
        expected = _host_values(reader)
        with pytest.warns(NotZeroCopyWarning):
            loaded = load_file(reader, queue, pool=pool, names=["optim/state.0.m", "weights/fc1.weight"])
        assert list(loaded) == ["weights/fc1.weight", "optim/state.0.m"]  # the reader's order
    with pytest.warns(NotZeroCopyWarning):
        everything = load_file(out, queue)  # a path: opened, loaded, closed
    assert list(everything) == list(expected)
    for name, value in expected.items():
        assert everything[name].to_host().tobytes() == value.tobytes()
    assert loaded["weights/fc1.weight"].to_host().tobytes() == expected["weights/fc1.weight"].tobytes()


def test_load_model_takes_an_open_reader(tmp_path, device):
    import fastckpt.nn as nn
    from fastckpt.io import load_model, save_model

    config = [{"type": "Linear", "args": {"in_features": 5, "out_features": 3, "bias": True}}]
    model = nn.build_sequential(device.queue, config, seed=3)
    save_model(model, tmp_path / "m.netcl")
    expected = {k: t.to_host() for k, t in model.named_tensors().items()}
    with fastckpt.open(tmp_path / "m.netcl") as reader:  # a mapped file: the one-copy path
        loaded = load_model(reader, device.queue)
        assert not reader.closed
    assert loaded.load_report.path == str(tmp_path / "m.netcl") and loaded.load_report.layout == "single-file"
    assert {k: t.to_host().tobytes() for k, t in loaded.named_tensors().items()} == {
        k: v.tobytes() for k, v in expected.items()}
    # the same model as a TensorFlow checkpoint: its weights go through host()
    from fastckpt.formats.convert import convert

    convert(tmp_path / "m.netcl", tmp_path / "tf" / "m", to="tf")
    with fastckpt.open(tmp_path / "tf" / "m") as reader, pytest.warns(NotZeroCopyWarning):
        again = load_model(reader, device.queue)
    assert {k: t.to_host().tobytes() for k, t in again.named_tensors().items()} == {
        k: v.tobytes() for k, v in expected.items()}
    with pytest.raises(TypeError, match="a path or an open reader"):
        load_model(42, device.queue)


def test_load_file_refuses_what_is_not_a_reader(queue):
    from fastckpt.device.load import load_file

    class Partial:  # infos and host, but no keys/info/metadata/close: not the contract
        infos = {}

        def host(self, name):
            raise KeyError(name)

    with pytest.raises(TypeError, match="fastckpt.formats.contract.TensorReader"):
        load_file(Partial(), queue)


def test_a_copied_tensorflow_directory_opens_through_its_only_index(tmp_path):
    # No state file, one .index: fastckpt.open reads that checkpoint, the copy.
    prefix = _tf_prefix("sharded")
    for p in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        shutil.copy(p, tmp_path / p.name)
    with fastckpt.open(tmp_path) as reader, CheckpointReader(prefix) as original:
        assert reader.path == str(tmp_path / Path(prefix).name)
        assert _host_values(reader).keys() == _host_values(original).keys()
