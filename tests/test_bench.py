"""The benchmark package: its timing helper, and every suite run at its quickest through ``fastckpt bench``.

The suites are run with tiny sizes and one round, only to check that each one still measures every path it
promises and prints its table with the same rows and columns; the figures themselves are not looked at.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import time

import pytest

from fastckpt.bench import SUITES, configure, suite_of, timing
from fastckpt.cli import main


def _first_cells(out: str) -> list[str]:
    """The first cell of every markdown table row (rule lines left out)."""
    return [line.split(" | ")[0][2:] for line in out.splitlines() if line.startswith("| ")]


# ------------------------------------------------------------------ the timing helper

@pytest.fixture
def no_collections(monkeypatch):
    # A full collection before every run is right for timing but slow for counting calls: left out here.
    monkeypatch.setattr(timing.gc, "collect", lambda: 0)


def test_round_robin_reports_in_the_given_order_and_shuffles_each_round(no_collections):
    calls = []
    paths = {name: (lambda name=name: calls.append(name)) for name in "abcdef"}
    result = timing.round_robin(paths, repeat=4)
    assert list(result) == list("abcdef")
    assert calls[:6] == list("abcdef")  # the warm-up round, in the given order
    rounds = [calls[6 + 6 * i:12 + 6 * i] for i in range(4)]
    assert all(sorted(r) == list("abcdef") for r in rounds)  # every path once per round
    assert len({tuple(r) for r in rounds}) > 1  # in an order that changes from round to round
    calls.clear()
    timing.round_robin(paths, repeat=4)
    assert [calls[6 + 6 * i:12 + 6 * i] for i in range(4)] == rounds  # seeded: the same orders again


def test_round_robin_caps_prepares_and_syncs(monkeypatch, no_collections):
    runs = {"fast": 0, "slow": 0}
    prepared = []
    syncs = []
    monkeypatch.setattr(timing.os, "sync", lambda: syncs.append(1))

    def bump(name):
        runs[name] += 1

    result = timing.round_robin({"fast": lambda: bump("fast"), "slow": lambda: bump("slow")}, repeat=5,
                                max_runs={"slow": 2}, prepare={"slow": lambda: prepared.append(runs["slow"])},
                                sync=True)
    assert runs == {"fast": 1 + 5, "slow": 1 + 2}  # one warm-up run each, then the timed ones
    assert prepared == [0, 1, 2]  # before every run of that path, warm-up included
    assert len(syncs) == 5 + 2  # before every timed run
    assert all(t.best <= t.median for t in result.values())


def test_round_robin_keeps_the_result_until_the_clock_stops_when_asked(no_collections):
    class SlowToRelease:
        def __del__(self):
            time.sleep(0.05)

    kept = timing.round_robin({"r": SlowToRelease}, repeat=3, time_release=False)
    dropped = timing.round_robin({"r": SlowToRelease}, repeat=1)
    assert kept["r"].best < 0.05 <= dropped["r"].best
    with pytest.raises(ValueError):
        timing.round_robin({"r": SlowToRelease}, repeat=0)


def test_formatting_helpers():
    assert timing.summarize([3.0, 1.0, 2.0]) == (2.0, 1.0)
    assert timing.format_duration(0.0005) == "500 µs"
    assert timing.format_duration(0.0005, ms_digits=3, micro=False) == "0.500 ms"
    assert timing.format_size(800 * 1024) == "800 KiB"
    assert timing.format_ratio(0.5) == "0.50x"
    assert timing.table_lines(["a", "b", "c"], [[1, 2, ""]], "lrl") == ["| a | b | c |", "|---|---:|---|",
                                                                        "| 1 | 2 |  |"]


# ------------------------------------------------------------------ one way to start

def test_every_suite_has_configure_run_and_a_docstring():
    assert set(SUITES) == {"device", "formats", "model", "tf", "train", "stateful", "sharded", "incremental", "s3",
                           "memory", "torch", "link", "cold", "ranks"}
    for name, module_name in SUITES.items():
        module = importlib.import_module(module_name)
        assert callable(module.configure) and callable(module.run), name
        assert "python -m fastckpt bench" in module.__doc__, name  # says how it is run


@pytest.mark.parametrize("old", ["fastckpt.bench_formats", "fastckpt.io.bench", "fastckpt.tf.bench",
                                 "fastckpt.train.bench", "fastckpt.stateful.bench"])
def test_the_old_entry_points_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_suite_is_read_first_and_picks_the_options():
    assert suite_of(["bench", "--repeat", "9"]) == "device"
    assert suite_of(["bench", "--suite=train"]) == "train"
    with pytest.raises(SystemExit) as bad_suite:
        main(["bench", "--suite", "nope"])
    assert bad_suite.value.code == 2
    with pytest.raises(SystemExit):  # --case is the device suite's, not the model suite's
        main(["bench", "--suite", "model", "--case", "b"])


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_suite_has_a_quick_run(suite):
    # `bench --suite S --quick` is the smoke run of every suite (the slow tests below run each one)
    parser = argparse.ArgumentParser()
    configure(parser, ["--suite", suite, "--quick"])
    assert parser.parse_args(["--suite", suite, "--quick"]).quick is True


# ------------------------------------------------------------------ every suite at its quickest

@pytest.mark.slow  # a benchmark smoke run
def test_torch_suite(capsys):
    pytest.importorskip("torch")
    assert main(["bench", "--suite", "torch", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "### load\n" in out and "### load + write\n" in out
    rows = _first_cells(out)
    for label in ("fastckpt.load_torch (copy-on-write map)", "fastckpt.to_torch(f.hosts()) (copies)",
                  "safetensors.torch.load_file"):
        assert label in rows, label


@pytest.mark.slow  # a benchmark smoke run
@pytest.mark.device
def test_device_suite(tmp_path, capsys):
    from fastckpt.bench import device

    assert main(["bench", "--quick", "--repeat", "1", "--case", "b", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| path | median | GB/s | vs. bound |" in out
    rows = _first_cells(out)
    for label in (device.BOUND, device.BOUND_ONE, device.POOLED, device.POOLED_TOUCH, device.POOLED_FRESH,
                  device.UNPOOLED, device.OPEN_ONLY, device.SAFETENSORS, device.SAFETENSORS_BLOCKING, device.NPLOAD):
        assert label in rows, label
    assert "### targets" in out and "(b) repeated pooled loads: 0 pool misses" in out


@pytest.mark.device
def test_device_suite_large_case_measures_the_pinned_bound_and_reads_every_load_back(tmp_path, device):
    from fastckpt.bench import device as suite

    text, facts = suite.bench_large_case("d", "4 x 256 KiB", 4, 1 << 16, "safetensors", str(tmp_path), 1, device)
    rows = {name: (gbs, share, exact) for name, _t, gbs, share, exact in facts["rows"]}
    staged = suite.LARGE_UNSTAGED if facts["discrete"] else suite.LARGE_STAGED
    assert set(rows) >= {suite.PINNED_BOUND, suite.PAGEABLE, suite.LARGE_WARM, staged, suite.LARGE_NEW,
                         suite.LARGE_NOPOOL}
    assert rows[suite.PINNED_BOUND][1] == 1.0 and rows[suite.PINNED_BOUND][2] is None
    # Every load is read back and exact; the rows that only move bytes (the bounds, and torch's pinned copies where
    # torch with CUDA is there) have no exactness to report.
    loads = {suite.LARGE_WARM, staged, suite.LARGE_NEW, suite.LARGE_NOPOOL}
    assert all(rows[name][2] is True for name in loads)
    assert all(exact is not False for _gbs, _share, exact in rows.values())
    assert facts["exact"] and facts["staging"][0] > 0  # the staged row (forced where not the default) was staged
    assert "| path | median | GB/s | share of the pinned bound | exact |" in text
    assert "d" not in suite.DEFAULT_CASES, "4 GiB only when asked for"


@pytest.mark.slow  # a benchmark smoke run
def test_formats_suite_tables(tmp_path):
    from fastckpt.bench import formats

    text = formats.bench_case("(t) 4 tiny tensors", 4, 256, str(tmp_path), 1)
    assert "### open + host arrays: (t) 4 tiny tensors" in text and "### save: (t) 4 tiny tensors" in text
    rows = _first_cells(text)
    for label in ("fastckpt.open (safetensors) + host views", "fastckpt.open (npz) + host views",
                  "np.load(npz) + every member", "safetensors.safe_open(numpy) + get_tensor",
                  "raw sequential write", "raw sequential write + fsync",
                  "raw sequential write, Python's default buffer", "raw gathered write (os.writev, 1024 arrays a call)",
                  "raw write of the NPZ file's bytes, padding included",
                  "fastckpt.save_safetensors, no fsync", "fastckpt.save_safetensors (atomic, fsync)",
                  "fastckpt.save_npz, no fsync", "fastckpt.save_npz (atomic, fsync)",
                  "fastckpt.save_npz(alignment=64), no fsync", "fastckpt.save_npz(alignment=4096), no fsync",
                  "safetensors.numpy.save_file"):
        assert label in rows, label


@pytest.mark.slow  # a benchmark smoke run
@pytest.mark.device
def test_model_suite(tmp_path, capsys):
    assert main(["bench", "--suite", "model", "--repeats", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "median of 1 runs, page cache warm." in out
    assert "| model | MiB | method | median ms | vs np.load |" in out
    main_table, fresh_table = out.split("### first load in a new process (1 processes per method)", 1)
    methods = [line.split(" | ")[2] for line in main_table.splitlines() if line.startswith(("| MLP", "| 400"))]
    assert methods == ["fastckpt load_model, pool warm", "fastckpt load_model, new pool",
                       "fastckpt load_model, no pool", "np.load + new buffers", "safetensors + enqueue_copy",
                       "one copy of the bytes"] * 2
    fresh = [line.split(" | ")[:2] for line in fresh_table.split("### targets")[0].splitlines()
             if line.startswith(("| MLP", "| 400"))]
    assert fresh == [[f"| {model}", f"fastckpt load_model, {method}"]
                     for model in ("MLP, 8 layers", "400 small layers") for method in ("new pool", "no pool")]
    targets = [re.sub(r": [0-9.]+x? .*|: [0-9.]+ ms$", "", line.split(": ", 1)[1])
               for line in out.split("### targets", 1)[1].splitlines() if line.startswith(("- met: ", "- MISSED: "))]
    assert targets == ["MLP, 8 layers, pool warm <= 1.15x one copy of its bytes",
                       "MLP, 8 layers, new pool <= 1.3x no pool",
                       "400 small layers, pool warm <= 1.5 ms", "400 small layers, new pool <= 1.3x no pool",
                       "MLP, 8 layers, first load in a new process, new pool <= 1.3x no pool",
                       "400 small layers, first load in a new process, new pool <= 1.3x no pool"]


def test_tf_suite_leaves_the_tensorflow_row_out_without_tensorflow(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # import tensorflow fails, as where it is not installed
    assert main(["bench", "--suite", "tf", "--mib", "1", "--tensors", "4", "--runs", "1", "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "tensorflow is not installed: its row is left out" in captured.err
    assert "| reader | checkpoint | median time | throughput | vs TensorFlow |" in captured.out
    assert _first_cells(captured.out)[1:] == ["fastckpt, verified, zero-copy", "fastckpt, verified, copies",
                                              "fastckpt, verify=False (zero-copy)",
                                              "fastckpt, verify=False (zero-copy)"]
    assert re.search(r"\| fastckpt, verified, copies \| 1 MiB \| [0-9.]+ ms \| [0-9.]+ GiB/s \| n/a \|",
                     captured.out)


def test_train_suite(tmp_path, capsys):
    assert main(["bench", "--suite", "train", "--mib", "2", "--runs", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(weights + Adam m, v), medians" in out and "| case | seconds | MiB/s | note |" in out
    assert _first_cells(out)[1:] == ["raw write + fsync (floor)", "save_checkpoint (sync)",
                                     "async save: trainer blocked, first", "async save: trainer blocked, steady",
                                     "async save: until durable", "load_checkpoint(verify=True)",
                                     "load_checkpoint(verify=True), sha256", "load_checkpoint(verify=False)",
                                     "verified load vs unverified load"]
    assert re.search(r"\| verified load vs unverified load \| -?[0-9.]+ \|  \| [0-9.]+x \(BLAKE3; target <= 1.3x\), "
                     r"sha256: [0-9.]+x \|", out)
    assert list(tmp_path.iterdir()) == [], "its files are removed"


def test_train_suite_quick_is_small():
    import argparse

    from fastckpt.bench import train

    parser = argparse.ArgumentParser()
    train.configure(parser)
    assert parser.parse_args(["--quick"]).quick and (train.QUICK_MIB, train.QUICK_RUNS) == (8, 3)


def test_stateful_suite(capsys):
    assert main(["bench", "--suite", "stateful", "--quick", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line[:40].rstrip() for line in lines] == [
        "reader sync", "reader sync+checkpointing", "reader prefetch=4+checkpointing", "reader get_state",
        "MT19937 get_state+str", "checkpoint collect+save fsync=True", "checkpoint collect+save fsync=False",
        "checkpoint load+apply"]
    assert lines[0].endswith("batches/s of 256") and lines[3].endswith("us per call")
    assert lines[-1].endswith(" ms") and "1 MiB array state" in lines[-1]


@pytest.mark.slow  # a benchmark smoke run
def test_sharded_suite(tmp_path, capsys):
    assert main(["bench", "--suite", "sharded", "--quick", "--ids", "3000", "--dense-mib", "0.25",
                 "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Sharded state: ") and "a table of 3,000 ids x 8 float32 with Adam m, v" in out
    header = ("| ranks | parallel | files | {0} | GB/s | {1} | GB/s | ratio | ratio of bests | ratio in the same round "
              "(median) | CPU {0} | CPU {1} | CPU ratio | load average before / after | >= 0.85x |")
    assert header.format("raw write + fsync", "Saver.save") in out
    assert header.format("raw read", "Loader.load(verify=False)") in out
    assert ("| ranks | parallel | Loader.load(verify=False) | BLAKE3 of the files | Loader.load() (verified) | "
            "verified / unverified | verified / (unverified + BLAKE3) | <= 1.3x |") in out
    assert ("| ranks | parallel | raw read | raw read, new pages | Loader.load(verify=False) | load / raw read (the "
            "target's) | load / raw read, new pages | CPU raw read | CPU raw read, new pages | CPU load |") in out
    pairs = [line.split(" | ")[:2] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    # save, save(direct=True), load, the raw read into new pages, verification, memory
    assert pairs == [["| 1", "1"], ["| 1", "2"], ["| 2", "1"], ["| 2", "2"]] * 6
    rows = _first_cells(out)
    assert "| v4 | 2 -> 3 | no |" in out and "| v4 | 2 -> 3 | yes |" in out  # --quick's resharding pair
    assert "HashTable.import_() into a new table" in rows
    targets = out.split("### targets")[1].strip().splitlines()
    # save, load, verification, the resharding pair unverified and verified, export, import; then the sizes' note
    assert [line.split(":")[0] in ("- met", "- MISSED") for line in targets] == [True] * 7 + [False]
    assert targets[-1] == "- (--quick sizes: the targets are stated for the full sizes)"
    assert list(tmp_path.iterdir()) == [], "its files are removed"


def test_sharded_suite_save_only_runs_the_save_rows_alone(tmp_path, capsys):
    assert main(["bench", "--suite", "sharded", "--quick", "--ids", "3000", "--dense-mib", "0.25", "--ranks", "2",
                 "--parallel", "1,2", "--save-only", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| raw write + fsync | GB/s | Saver.save | GB/s |" in out
    assert "| raw write + fsync | GB/s | Saver.save(direct=True) | GB/s |" in out
    assert "Loader" not in out and "raw read" not in out and "HashTable" not in out and "->" not in out
    pairs = [line.split(" | ")[:2] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert pairs == [["| 2", "1"], ["| 2", "2"]] * 3  # save, save(direct=True), memory
    targets = out.split("### targets")[1].strip().splitlines()
    assert [line.split(":")[0] for line in targets][:1] in (["- met"], ["- MISSED"]) and len(targets) == 2
    assert "save throughput >= 0.85x" in targets[0]
    assert list(tmp_path.iterdir()) == [], "its files are removed"


@pytest.mark.slow  # a benchmark smoke run, workers in fresh processes
def test_ranks_suite(tmp_path, capsys):
    import fastckpt

    here = os.path.dirname(os.path.dirname(fastckpt.__file__))
    assert main(["bench", "--suite", "ranks", "--quick", "--no-mpi", "--steady", "--steady-ids", "20000",
                 "--steady-dense-mib", "1", "--against", here, "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("| files | ranks | mode | fastckpt | opening CPU per rank | files mapped per rank | slowest rank's load | "
            "CPU per rank | before / after (opening) | before / after (load) | before / after (CPU) |") in out
    rows = [line.split(" | ")[:4] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows == [["| 4", "2", "threads", "after"], ["| 4", "2", "threads", "before"],
                    ["| 8", "2", "threads", "after"], ["| 8", "2", "threads", "before"]]
    assert [line.split(" | ")[5] for line in out.splitlines() if "| threads |" in line] == ["2", "2", "4", "4"]
    steady = _first_cells(out)
    assert {"raw read", "Loader.load(verify=False) (after)", "Loader.load(verify=False) (before)"} <= set(steady)
    assert list(tmp_path.iterdir()) == [], "its files are removed"


@pytest.mark.slow  # a benchmark smoke run, workers in fresh processes
def test_ranks_suite_of_recis_layout(tmp_path, capsys):
    import fastckpt

    here = os.path.dirname(os.path.dirname(fastckpt.__file__))
    assert main(["bench", "--suite", "ranks", "--quick", "--no-mpi", "--layout", "recis", "--against", here,
                 "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Sharded load (RecIS's layout)" in out
    rows = [line.split(" | ")[:4] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows == [["| 4", "2", "threads", "after"], ["| 4", "2", "threads", "before"],
                    ["| 8", "2", "threads", "after"], ["| 8", "2", "threads", "before"]]
    assert list(tmp_path.iterdir()) == [], "its files are removed"


@pytest.mark.slow  # a benchmark smoke run, workers in fresh processes
def test_ranks_suite_of_both_layouts_prints_recis_over_fastckpt(tmp_path, capsys):
    assert main(["bench", "--suite", "ranks", "--quick", "--no-mpi", "--layout", "both", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ")[:5] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows[:4] == [["| 4", "2", "threads", "after", "recis"], ["| 4", "2", "threads", "after", "fastckpt"],
                        ["| 8", "2", "threads", "after", "recis"], ["| 8", "2", "threads", "after", "fastckpt"]]
    assert ("| files asked | ranks | mode | fastckpt | opening CPU per rank | slowest rank's load | CPU per rank |"
            in out)
    ratios = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and line.endswith("x |")
              and line.count(" | ") == 6]
    assert [r[:4] for r in ratios] == [["| 4", "2", "threads", "after"], ["| 8", "2", "threads", "after"]]
    assert list(tmp_path.iterdir()) == [], "its files are removed"


@pytest.mark.slow  # a benchmark smoke run, with a worker process
def test_sharded_suite_runs_another_fastckpt_in_the_same_rounds(tmp_path, capsys):
    import fastckpt

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__)))
    assert main(["bench", "--suite", "sharded", "--quick", "--ids", "3000", "--dense-mib", "0.25", "--ranks", "2",
                 "--parallel", "1", "--dir", str(tmp_path), "--against", checkout]) == 0
    out = capsys.readouterr().out
    assert f"### before and after: the same paths run by the fastckpt in {checkout} (a worker process)" in out
    rows = [line.split(" | ")[:3] for line in out.split("### before and after")[1].split("###")[0].splitlines()
            if line.startswith("| 2 ")]
    assert rows == [["| 2", "1", path] for path in ("Saver.save", "Loader.load(verify=False)",
                                                    "Loader.load() (verified)")]
    assert list(tmp_path.iterdir()) == [], "its files are removed"


def test_the_against_worker_names_a_failed_call(tmp_path):
    from fastckpt.bench.sharded import Against

    import fastckpt

    worker = Against(os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__))))
    try:
        with pytest.raises(RuntimeError, match=r"the --against worker \(.*\): load: CheckpointNotFoundError: "):
            worker.call("load", path=str(tmp_path / "none"), ranks=1, dim=2, parallel=1, verify=False)
        assert worker.call("where") == worker.where  # it goes on after a failed call
    finally:
        worker.close()


@pytest.mark.slow  # a benchmark smoke run
def test_incremental_suite(tmp_path, capsys):
    assert main(["bench", "--suite", "incremental", "--quick", "--ids", "4000", "--deltas", "2",
                 "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Incremental checkpoints: a table of 4,000 ids x 8 float32 with Adam m, v")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 1") and "%" in line]
    assert [r[0] for r in rows] == ["| 1%", "| 10%"] and all(r[7] == "2" for r in rows)
    full_bytes, delta_bytes = (int(rows[0][i].replace(",", "")) for i in (1, 2))
    assert 0 < delta_bytes < full_bytes  # a delta at 1% touched stores less than a full save
    targets = out.split("### targets")[1].strip().splitlines()
    assert [line.split(":")[0] in ("- met", "- MISSED") for line in targets] == [True] * 4 + [False]
    assert list(tmp_path.iterdir()) == [], "its files are removed"


@pytest.mark.slow  # a benchmark smoke run
@pytest.mark.device
def test_s3_suite_streaming_table(capsys):
    pytest.importorskip("s3fs")
    pytest.importorskip("aiohttp")
    assert main(["bench", "--suite", "s3", "--quick", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("S3 and HTTP streaming (the range server on loopback, fastckpt.bench.objectserver; 16 MiB")
    assert "| path | median | GB/s | share of the bound | CPU | peak RSS growth | exact |" in out
    rows = _first_cells(out)[1:]
    assert rows[:3] == ["raw s3: 8 threads x 8 MiB ranged GETs into memory", "raw s3: s3fs cat_ranges, 8 MiB ranges",
                        "raw http: 8 threads x 8 MiB ranged GETs into memory"]
    assert {"fastckpt.open(s3) + copies", "load_file(s3, pool)", "load_file(s3 HF prefix, pool)",
            "load_model(s3 .netcl, pool)"} <= set(rows)
    assert "| NO |" not in out and "FAILED" not in out  # every row exact, none failed


@pytest.mark.slow  # a benchmark smoke run
def test_s3_suite(capsys):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    assert main(["bench", "--suite", "s3", "--quick", "--moto"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("S3 (moto's server on loopback, s3fs as the client): one safetensors file of 16 MiB")
    assert "| operation | fastckpt (median) | s3fs put/get (median) | ratio | <= 1.2x |" in out
    assert _first_cells(out)[1:] == ["save", "load"]
    targets = out.split("### targets")[1].strip().splitlines()
    assert [line.split(":")[0] in ("- met", "- MISSED") for line in targets] == [True, True, False]


@pytest.mark.slow  # a benchmark smoke run
@pytest.mark.device
def test_memory_suite(capsys):
    assert main(["bench", "--suite", "memory", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Memory: 64 MiB of float32 in 8 tensors, device ")
    assert "| call | peak RSS growth | above the arrays | anon growth | above the arrays |" in out
    assert _first_cells(out)[1:4] == ["save_safetensors (atomic, fsync)", "save_npz (atomic, fsync)",
                                      "load_file, new pool"]
    assert "| warm |" in out and "| cold |" in out
    targets = out.split("### targets")[1].strip().splitlines()
    assert all(line.split(":")[0] in ("- met", "- MISSED") for line in targets[:-1]), targets
    assert targets[-1] == "- (--quick sizes: the targets are stated for 2 GiB)"


def test_sharded_suite_resharding_from_s3_says_what_each_rank_fetches(tmp_path, capsys):
    # The resharding rows from S3 came with times alone; a rank's requests and the tensor-file headers it fetched
    # (since index.json names the files it reads: those files' headers, none where it fetches them whole) are now a
    # table of their own, so that the suite shows what a remote load asks for.
    pytest.importorskip("s3fs")
    assert main(["bench", "--suite", "sharded", "--quick", "--ids", "3000", "--dense-mib", "0.25", "--reshard", "4:2",
                 "--reshard-only", "--s3", "--repeat", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = out.split("### resharding from S3: what each rank fetches")[1].split("###")[0]
    rows = {tuple(cells[:2]): cells[2:] for cells in (line.strip("| ").split(" | ") for line in table.splitlines()
                                                      if line.startswith("| 4 -> "))}
    # unverified: the headers of the files a rank reads, fewer than the checkpoint's 16 (4 ranks x parallel 4);
    # verified: none (the files it reads are fetched whole)
    assert all(cells[0] == "16" and 0 < int(cells[1]) < 16 for (pair, v), cells in rows.items() if v == "no")
    assert all(cells[0] == "16" and cells[1] == "0" for (pair, v), cells in rows.items() if v == "yes")
    assert sorted(rows) == [("4 -> 2", "no"), ("4 -> 2", "yes"), ("4 -> 4", "no"), ("4 -> 4", "yes")]
