"""The format benchmark (``fastckpt bench --suite formats``) runs end to end and reports every path it promises."""

import re

import pytest

from fastckpt.bench import formats as bench_formats
from fastckpt.cli import main


@pytest.mark.slow  # a benchmark smoke run
def test_quick_run_reports_every_path(capsys, tmp_path):
    assert main(["bench", "--suite", "formats", "--quick", "--repeat", "1", "--case", "b", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for label in ("fastckpt.open (safetensors) + host views", "fastckpt.open (npz) + host views",
                  "np.load(npz) + every member", "safetensors.safe_open(numpy) + get_tensor",
                  "raw sequential write + fsync", "fastckpt.save_npz (atomic, fsync)",
                  "safetensors.numpy.save_file"):
        assert re.search(rf"\| {re.escape(label)} \| [0-9.]+ m?s \| [0-9.]+ m?s \|( [a-z +]+ \|)? [0-9.]+x \| "
                         r"[0-9.]+x \|", out), label
    # each table's base row divides by itself
    assert out.count("| 1.00x | 1.00x |") >= 2


@pytest.mark.slow  # a benchmark smoke run
def test_open_cases_time_every_format_against_its_peer(capsys, tmp_path):
    assert main(["bench", "--suite", "formats", "--quick", "--repeat", "1", "--case", "f", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for title in ("safetensors", "NPZ", "TensorFlow checkpoint"):
        assert f"### {title}, open + host arrays of many small tensors: (f) 1000 tensors of 16 B" in out
    for label in ("fastckpt.open + hosts() (one native loop)", "np.load + every member",
                  "fastckpt.open + hosts() (CRC32C checked)", "CheckpointReader(verify=False) + hosts()"):
        assert re.search(rf"\| {re.escape(label)} \| [0-9.]+ m?s \| [0-9.]+ m?s \| [0-9.]+x \| [0-9.]+x \|", out), label
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the fixtures are removed


def test_markdown_table_divides_by_the_base_row():
    table = bench_formats.markdown_table("t", [("a", (2.0, 1.0)), ("b", (4.0, 3.0))], "a")
    assert "| b | 4.000 s | 3.000 s | 2.00x | 3.00x |" in table


def test_durable_rows_are_compared_with_the_durable_raw_write():
    rows = [("raw", (2.0, 1.0)), ("raw + fsync", (4.0, 2.0)), ("save, no fsync", (3.0, 1.0)),
            ("save (atomic, fsync)", (6.0, 6.0))]
    table = bench_formats.markdown_table("t", rows, "raw", durable_base="raw + fsync")
    assert "| raw + fsync | 4.000 s | 2.000 s | raw | 2.00x | 2.00x |" in table
    assert "| save, no fsync | 3.000 s | 1.000 s | raw | 1.50x | 1.00x |" in table
    assert "| save (atomic, fsync) | 6.000 s | 6.000 s | raw + fsync | 1.50x | 3.00x |" in table


def test_many_small_tensors_case():
    # The case the NPZ alignment policy is for: 10,000 float32 tensors of 1 KiB (1000 with --quick).
    assert bench_formats.CASES["c"] == ("10,000 tensors of 1 KiB", 10_000, 256)
    assert bench_formats.QUICK["c"] == ("1000 tensors of 1 KiB", 1000, 256)
