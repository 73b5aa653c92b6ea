"""progress= on every long operation, and the records of the "fastckpt" loggers.

Every operation's callback sees ``done`` never decrease and end exactly at ``total``, which is the exact payload of
the arrays (computed here from their ``nbytes``); ``True`` draws a tqdm bar on stderr; loads and saves log at INFO.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

import numpy as np
import pytest

import fastckpt
from fastckpt.progress import Progress, progress_from

TENSORS = {
    "w": np.arange(3000, dtype=np.float32).reshape(100, 30),
    "b": np.arange(7, dtype=np.float64),
    "strided": np.arange(400, dtype=np.int64)[::4],
    "big_endian": np.arange(5, dtype=">i4"),
    "empty": np.zeros((0, 3), np.float32),
    "scalar": np.int16(3),
}
PAYLOAD = sum(np.asarray(a).nbytes for a in TENSORS.values())  # 12000 + 56 + 800 + 20 + 0 + 2


class Calls(list):
    """A progress callback that records ``(done, total, item)``; ``check`` asserts the contract."""

    def __call__(self, done, total, item):
        self.append((done, total, item))

    def check(self, total: int) -> list:
        assert self, "the callback was never called"
        dones = [done for done, _, _ in self]
        assert dones == sorted(dones), f"done went down: {dones}"
        assert {t for _, t, _ in self} == {total}
        assert dones[-1] == total
        return [item for _, _, item in self]


def test_payload_of_the_test_tensors():
    assert PAYLOAD == 12878


# -- the Progress object ---------------------------------------------------------------------------


def test_off_is_disabled_and_counts_nothing():
    for off in (False, None):
        p = progress_from(off, 100, "x")
        assert not p.enabled
        p.advance(10, "a")
        assert p.done == 0


def test_a_callback_gets_running_totals_in_order():
    calls = Calls()
    with progress_from(calls, 10, "x") as p:
        p.advance(4, "a")
        p.advance(0, "b")
        p.advance(6, "c")
    assert calls == [(4, 10, "a"), (4, 10, "b"), (10, 10, "c")]


def test_a_part_counts_towards_its_whole_and_closing_it_closes_nothing():
    calls = Calls()
    whole = progress_from(calls, 5, "whole")
    part = progress_from(whole, 999, "part")
    part.advance(2, "a")
    part.close()
    whole.advance(3, "b")
    assert calls == [(2, 5, "a"), (5, 5, "b")]
    assert progress_from(progress_from(False, 1, "off"), 1, "part").enabled is False


def test_advance_from_many_threads_reports_every_byte_in_order():
    calls = Calls()
    p = progress_from(calls, 8 * 1000, "threads")

    def work():
        for _ in range(1000):
            p.advance(1, "x")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [done for done, _, _ in calls] == list(range(1, 8001))


def test_anything_else_is_refused_naming_the_choices():
    with pytest.raises(TypeError, match=r"progress must be False, True or a callable\(done, total, item\), got 'yes'"):
        progress_from("yes", 1, "x")


def test_true_draws_a_tqdm_bar_on_stderr(tmp_path, capsys):
    fastckpt.save_safetensors(tmp_path / "a.safetensors", TENSORS, progress=True)
    err = capsys.readouterr().err
    assert "save safetensors" in err
    assert "100%" in err
    assert "12.6k" in err  # 12878 bytes, in tqdm's binary units


# -- tensor files ----------------------------------------------------------------------------------


def test_save_safetensors_reports_every_tensor(tmp_path):
    calls = Calls()
    fastckpt.save_safetensors(tmp_path / "a.safetensors", TENSORS, progress=calls)
    assert sorted(calls.check(PAYLOAD)) == sorted(TENSORS)


def test_save_safetensors_reports_in_runs_of_written_bytes(tmp_path, monkeypatch):
    from fastckpt.formats import safetensors

    monkeypatch.setattr(safetensors, "_REPORT_BYTES", 100)  # one tensor per run
    calls = Calls()
    fastckpt.save_safetensors(tmp_path / "a.safetensors", TENSORS, progress=calls)
    assert calls.check(PAYLOAD) == ["strided", "b", "empty", "w", "big_endian", "scalar"]  # the file's order
    with fastckpt.open(tmp_path / "a.safetensors") as f:
        for name, value in TENSORS.items():
            np.testing.assert_array_equal(f.host(name), value)


def test_save_npz_reports_every_tensor_after_it_is_written(tmp_path):
    calls = Calls()
    fastckpt.save_npz(tmp_path / "a.npz", TENSORS, progress=calls)
    assert calls.check(PAYLOAD) == list(TENSORS)
    with np.load(tmp_path / "a.npz") as z:
        for name, value in TENSORS.items():
            np.testing.assert_array_equal(z[name], value)


def test_save_npz_of_pairs_has_no_total(tmp_path):
    calls = Calls()
    fastckpt.save_npz(tmp_path / "a.npz", iter([("a", np.zeros(3)), ("b", np.ones(2, np.int8))]), progress=calls)
    assert calls == [(24, None, "a"), (26, None, "b")]


def test_save_sharded_reports_over_all_shards(tmp_path):
    calls = Calls()
    names = fastckpt.save_sharded(tmp_path, TENSORS, max_shard_size=1000, progress=calls)
    assert len(names) > 2
    assert sorted(calls.check(PAYLOAD)) == sorted(TENSORS)


@pytest.mark.parametrize("to", ["safetensors", "npz", "tf"])
def test_convert_reports_every_tensor(tmp_path, to):
    from fastckpt.formats.convert import convert

    src = tmp_path / "src.safetensors"
    fastckpt.save_safetensors(src, TENSORS)
    calls = Calls()
    convert(src, tmp_path / f"dst.{to}", to=to, progress=calls)
    assert sorted(calls.check(PAYLOAD)) == sorted(TENSORS)


# -- device loads and model files ------------------------------------------------------------------


@pytest.mark.parametrize("staging", [False, True, 4096], ids=["direct", "staged", "staged-4KiB"])
@pytest.mark.parametrize("how", ["buffers", "pool", "zero_copy", "not_blocking"])
def test_load_file_reports_every_tensor(tmp_path, queue, pool, how, staging, monkeypatch):
    # Staged (the default on a discrete GPU) the tensors share staging buffers, and each is still reported on its
    # own: once reported only the last tensor of each buffer ("scalar"), as on a discrete GPU.
    from fastckpt.device import load

    monkeypatch.setattr(load, "COPY_CHUNK", 4096)  # several commands per region
    path = tmp_path / "a.safetensors"
    fastckpt.save_safetensors(path, TENSORS)
    calls = Calls()
    kwargs = {"pool": {"pool": pool}, "zero_copy": {"zero_copy": True}, "not_blocking": {"blocking": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastckpt.NotZeroCopyWarning)  # zero-copy falls back where it cannot
        loaded = load.load_file(path, queue, progress=calls, staging=staging, **kwargs.get(how, {}))
    assert bool(loaded.report.staging_chunk) == (bool(staging) and loaded.report.mode != "zero-copy")
    items = calls.check(PAYLOAD)
    assert set(items) <= set(TENSORS) - {"empty"}
    if how in ("buffers", "not_blocking") or loaded.report.staging_chunk:  # each tensor reported
        assert sorted(items) == sorted(set(TENSORS) - {"empty"})
    for name, value in TENSORS.items():
        np.testing.assert_array_equal(loaded[name].to_host(), value)


def test_load_file_of_an_npz_with_compressed_members_reports_them(tmp_path, queue):
    path = tmp_path / "c.npz"
    np.savez_compressed(path, a=np.arange(10.0), b=np.ones((3, 3), np.int32))
    calls = Calls()
    with pytest.warns(fastckpt.NotZeroCopyWarning):
        fastckpt.load_file(path, queue, progress=calls)
    assert sorted(calls.check(80 + 36)) == ["a", "b"]


def test_save_and_load_model_report_every_weight(tmp_path, queue, pool):
    import fastckpt.nn as nn
    from fastckpt.io import load_model, save_model

    model = nn.Sequential(nn.Linear(queue, 5, 3), nn.ReLU(), nn.Linear(queue, 3, 2))
    expected = sum(a.nbytes for a in model.state_dict().values())
    assert expected == (15 + 3 + 6 + 2) * 4
    saved = Calls()
    save_model(model, tmp_path / "m.netcl", progress=saved)
    assert saved.check(expected) == ["0:weight", "0:bias", "2:weight", "2:bias"]
    loaded = Calls()
    load_model(tmp_path / "m.netcl", queue, pool, progress=loaded)
    # One arena region: reported as its copy commands complete, each naming the last tensor it finished.
    assert set(loaded.check(expected)) <= {"0:weight", "0:bias", "2:weight", "2:bias"}


# -- training checkpoints --------------------------------------------------------------------------


def _training_state():
    from fastckpt.train import SGD, TinyLM

    model = TinyLM(vocab=8, dim=4, hidden=8)
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    payload = sum(p.data.nbytes for p in model.parameters())
    return model, opt, payload


def test_training_checkpoints_report_save_load_and_verify(tmp_path):
    from fastckpt.train import load_checkpoint, save_checkpoint, verify_checkpoint

    model, opt, weights = _training_state()
    out = tmp_path / "c"
    saved = Calls()
    save_checkpoint(model, opt, None, None, None, out, step=1, progress=saved)
    # The weights, and as many bytes of momentum buffers (SGD keeps one per parameter).
    saved.check(2 * weights)
    loaded = Calls()
    load_checkpoint(out, progress=loaded)
    assert sorted(loaded.check(2 * weights)) == sorted(item for _, _, item in saved)
    verified = Calls()
    assert verify_checkpoint(out, progress=verified) == []
    sizes = {name: os.path.getsize(out / name) for name in ("weights.safetensors", "optim.safetensors", "extra.json")}
    assert sorted(verified.check(sum(sizes.values()))) == sorted(sizes)


def test_the_manager_reports_save_and_restore(tmp_path):
    from fastckpt.train import CheckpointManager

    model, opt, weights = _training_state()
    with CheckpointManager(tmp_path) as manager:
        saved = Calls()
        manager.save(1, model, opt, progress=saved)
        saved.check(2 * weights)
        background = Calls()
        manager.save(2, model, opt, blocking=False, progress=background).wait()
        background.check(2 * weights)
        restored = Calls()
        manager.restore(2, model, opt, progress=restored)
        restored.check(2 * weights)


# -- sharded checkpoints ---------------------------------------------------------------------------


def _sharded_state():
    from fastckpt.sharded import HashTable

    table = HashTable(dim=4, slots=("m",))
    table.insert(np.arange(100), np.ones((100, 4), np.float32), {"m": np.zeros((100, 4), np.float32)})
    dense = {"w": np.arange(60, dtype=np.float32).reshape(20, 3), "step": np.int64(9)}
    payload = 100 * 8 + 2 * 100 * 4 * 4 + 60 * 4 + 8
    return table, dense, payload


def test_sharded_save_load_verify_report_every_byte(tmp_path):
    from fastckpt.sharded import CheckpointReader, HashTable, Loader, Saver

    table, dense, payload = _sharded_state()
    out = tmp_path / "ckpt"
    saved = Calls()
    Saver(path=out, parallel=3, hashtables={"emb": table}, tensors=dense, progress=saved).save()
    assert sorted(saved.check(payload)) == ["emb.embedding/part_0_1", "emb.id/part_0_1", "emb.m/part_0_1",
                                            "step/part_0_1", "w/part_0_1"]
    loaded = Calls()
    tables, tensors = Loader(str(out), progress=loaded).load()
    assert sorted(loaded.check(payload)) == ["emb", "step", "w"]
    assert isinstance(tables["emb"], HashTable) and len(tables["emb"]) == 100
    verified = Calls()
    with CheckpointReader(out) as reader:
        assert reader.verify(progress=verified) == []
        sizes = {name: entry["size"] for name, entry in reader.manifest["files"].items()}
    assert sorted(verified.check(sum(sizes.values()))) == sorted(sizes)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_reshard_reports_what_every_rank_writes(tmp_path, shards):
    from fastckpt.sharded import Saver
    from fastckpt.sharded.reshard import reshard

    table, dense, payload = _sharded_state()
    Saver(path=tmp_path / "a", parallel=2, hashtables={"emb": table}, tensors=dense).save()
    calls = Calls()
    reshard(tmp_path / "a", tmp_path / "b", shards, parallel=2, progress=calls)
    calls.check(payload)


def test_reshard_raises_the_failing_rank_s_error_not_the_others_waits(tmp_path):
    from fastckpt.sharded import Saver
    from fastckpt.sharded.reshard import reshard

    table, dense, _ = _sharded_state()
    Saver(path=tmp_path / "a", parallel=1, hashtables={"emb": table}, tensors=dense).save()
    # The rank that makes the report fails; the other ranks' waits break, and the first error is raised.
    with pytest.raises(TypeError, match="progress must be False, True or a callable"):
        reshard(tmp_path / "a", tmp_path / "b", 3, parallel=1, progress="yes")
    assert not (tmp_path / "b").exists()


# -- logs ------------------------------------------------------------------------------------------


def test_the_package_logger_is_silent_by_default():
    handlers = logging.getLogger("fastckpt").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def _records(caplog):
    return [r for r in caplog.records if r.name.startswith("fastckpt.") and r.levelno == logging.INFO]


def test_a_save_is_logged_at_info_with_path_and_bytes(tmp_path, caplog):
    path = tmp_path / "a.safetensors"
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        fastckpt.save_safetensors(path, TENSORS)
    [record] = _records(caplog)
    assert record.name == "fastckpt.formats.safetensors"
    assert record.getMessage().startswith(f"saved {path}: 6 tensors, {os.path.getsize(path)} bytes in ")


def test_an_npz_save_is_logged_at_info_with_path_and_bytes(tmp_path, caplog):
    path = tmp_path / "a.npz"
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        fastckpt.save_npz(path, TENSORS)
    [record] = _records(caplog)
    assert record.getMessage().startswith(f"saved {path}: 6 tensors, {os.path.getsize(path)} bytes in ")


def test_a_load_is_logged_at_info_with_the_paths_taken_and_at_debug_with_details(tmp_path, queue, pool, caplog):
    path = tmp_path / "a.safetensors"
    fastckpt.save_safetensors(path, TENSORS)
    with caplog.at_level(logging.DEBUG, logger="fastckpt"):
        fastckpt.load_file(path, queue, pool=pool)
    [record] = _records(caplog)
    assert record.name == "fastckpt.device.load"
    message = record.getMessage()
    assert message.startswith(f"loaded {path} (safetensors): 6 tensors, ")
    assert ", mode pool, paths: 5 arena, 1 empty" in message
    [debug] = [r for r in caplog.records if r.name == "fastckpt.device.load" and r.levelno == logging.DEBUG]
    assert debug.getMessage().startswith(f"load of {path}: 1 regions, 1 copies, pool 0 hits / 1 misses, ")


def test_a_fallback_is_named_in_the_load_record(tmp_path, queue, caplog):
    path = tmp_path / "c.npz"
    np.savez_compressed(path, a=np.arange(10.0))
    with caplog.at_level(logging.INFO, logger="fastckpt"), pytest.warns(fastckpt.NotZeroCopyWarning):
        fastckpt.load_file(path, queue)
    [record] = _records(caplog)
    message = record.getMessage()
    assert message.startswith(f"loaded {path} (npz): 1 tensors, 80 bytes copied in ")
    assert "paths: 1 decoded; fallback: " in message
    assert "compressed (deflate)" in message


def test_a_training_checkpoint_load_is_logged(tmp_path, caplog):
    from fastckpt.train import load_checkpoint, save_checkpoint

    model, opt, _ = _training_state()
    save_checkpoint(model, opt, None, None, None, tmp_path / "c", step=4)
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        load_checkpoint(tmp_path / "c")
    [record] = _records(caplog)
    files = sum(os.path.getsize(tmp_path / "c" / f) for f in ("weights.safetensors", "optim.safetensors",
                                                              "extra.json"))
    assert record.getMessage().startswith(f"loaded checkpoint {tmp_path / 'c'}: step 4, 3 files, {files} bytes in ")


def test_a_checkpoint_save_logs_one_info_line_and_its_files_at_debug(tmp_path, caplog):
    from fastckpt.formats.convert import convert
    from fastckpt.sharded import HashTable, Saver
    from fastckpt.train import save_checkpoint

    model, opt, _ = _training_state()
    table = HashTable(dim=2)
    table.insert(np.arange(4), np.ones((4, 2), np.float32))
    fastckpt.save_safetensors(tmp_path / "src.safetensors", TENSORS)
    saves = {
        "fastckpt.formats.convert": lambda: convert(tmp_path / "src.safetensors", tmp_path / "dst.npz"),
        "fastckpt.train.checkpoint": lambda: save_checkpoint(model, opt, None, None, None, tmp_path / "c", step=4),
        "fastckpt.sharded.saver": lambda: Saver(path=tmp_path / "s", parallel=2, hashtables={"t": table}).save(),
        "fastckpt.formats.hfsharded": lambda: fastckpt.save_sharded(tmp_path / "hf", TENSORS, max_shard_size=64),
    }
    for logger, save in saves.items():
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="fastckpt"):
            save()
        assert [r.name for r in _records(caplog)] == [logger], logger  # one INFO line: the save the caller made
        files = [r for r in caplog.records if r.levelno == logging.DEBUG and r.getMessage().startswith("saved ")
                 and r.name == "fastckpt.formats.safetensors"]
        if logger != "fastckpt.formats.convert":  # (its one file is an NPZ: logged by fastckpt.formats.npz)
            assert len(files) >= 2, logger  # the files it is made of, at DEBUG
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastckpt"):  # outside a larger save, a file save is INFO again
        fastckpt.save_safetensors(tmp_path / "alone.safetensors", TENSORS)
    assert [r.name for r in _records(caplog)] == ["fastckpt.formats.safetensors"]


def test_progress_objects_repr():
    assert repr(progress_from(False, 1, "x")) == "<Progress off>"
    p = progress_from(lambda *a: None, None, "x")
    p.advance(3)
    assert repr(p) == "<Progress 3/? bytes>"
    assert isinstance(p, Progress)


# -- the commands ----------------------------------------------------------------------------------


class _Terminal:
    """A stand-in for stderr that says it is a terminal and keeps what is written."""

    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text

    def flush(self):
        pass


@pytest.mark.parametrize("terminal", [True, False])
def test_the_commands_draw_bars_only_on_a_terminal(tmp_path, monkeypatch, capsys, terminal):
    import sys

    from fastckpt.cli import main

    fastckpt.save_safetensors(tmp_path / "a.safetensors", TENSORS)
    stderr = _Terminal()
    if terminal:
        monkeypatch.setattr(sys, "stderr", stderr)
    assert main(["convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b.npz")]) == 0
    written = stderr.text if terminal else capsys.readouterr().err
    assert ("convert to npz" in written and "100%" in written) is terminal
