"""``overwrite=`` holds for single-file uploads too: on ``s3://`` a conditional write (``If-None-Match: *``), so an
existing object is never replaced by a save that did not ask to, and of racing writers exactly one commits."""

import threading
import warnings

import numpy as np
import pytest
from _threads import run_in_threads

import fastckpt


def _load(url, options):
    with fastckpt.open(url, storage_options=options) as reader:
        return {name: reader.host(name).tolist() for name in reader.keys()}


@pytest.mark.parametrize("save", [fastckpt.save_safetensors, fastckpt.save_npz], ids=["safetensors", "npz"])
def test_an_existing_object_is_refused_without_overwrite_and_replaced_with_it(s3, save):
    url, options = s3.url("model.bin"), s3.storage_options
    save(url, {"w": np.zeros(3, np.float32)}, storage_options=options, overwrite=False)
    with pytest.raises(FileExistsError) as refused:
        save(url, {"w": np.ones(3, np.float32)}, storage_options=options, overwrite=False)
    assert refused.value.filename == url
    assert _load(url, options) == {"w": [0.0, 0.0, 0.0]}
    save(url, {"w": np.ones(3, np.float32)}, storage_options=options, overwrite=True)
    assert _load(url, options) == {"w": [1.0, 1.0, 1.0]}


def test_left_out_overwrite_refuses_an_existing_object_as_every_writer_does_since_0_4(s3):
    url, options = s3.url("model.safetensors"), s3.storage_options
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a new object: no warning, and none for the refusal either
        fastckpt.save_safetensors(url, {"w": np.zeros(2, np.float32)}, storage_options=options)
        with pytest.raises(FileExistsError, match="pass overwrite=True"):
            fastckpt.save_safetensors(url, {"w": np.ones(2, np.float32)}, storage_options=options)
    assert _load(url, options) == {"w": [0.0, 0.0]}
    fastckpt.save_safetensors(url, {"w": np.ones(2, np.float32)}, storage_options=options, overwrite=True)
    assert _load(url, options) == {"w": [1.0, 1.0]}


@pytest.mark.parametrize("writers", [2, 4])
def test_racing_uploads_without_overwrite_exactly_one_commits(s3, writers):
    url, options = s3.url("model.safetensors"), s3.storage_options
    start, winners = threading.Barrier(writers), []

    def save(k):
        start.wait()
        fastckpt.save_safetensors(url, {"w": np.full(4, k, np.float32)}, storage_options=options, overwrite=False)
        winners.append(k)

    errors = run_in_threads(save, writers)
    assert len(winners) == 1, errors
    assert len(errors) == writers - 1
    assert all(isinstance(exc, FileExistsError) and exc.filename == url for exc in errors)
    assert _load(url, options) == {"w": [float(winners[0])] * 4}


def test_a_filesystem_without_conditional_writes_refuses_an_existing_file_too(tmp_path):
    url = f"memory://{tmp_path.name}/model.npz"
    fastckpt.save_npz(url, {"w": np.zeros(2)}, overwrite=False)
    with pytest.raises(FileExistsError) as refused:
        fastckpt.save_npz(url, {"w": np.ones(2)}, overwrite=False)
    assert refused.value.filename == url
    assert _load(url, None) == {"w": [0.0, 0.0]}
