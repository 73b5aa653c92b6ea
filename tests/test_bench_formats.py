"""The format benchmark runs end to end and reports every path it promises."""

import re

from fastckpt import bench_formats


def test_quick_run_reports_every_path(capsys):
    assert bench_formats.main(["--quick", "--repeat", "1", "--case", "b"]) == 0
    out = capsys.readouterr().out
    for label in ("fastckpt.open (safetensors) + host views", "fastckpt.open (npz) + host views",
                  "np.load(npz) + every member", "safetensors.safe_open(numpy) + get_tensor",
                  "raw sequential write + fsync", "fastckpt.save_npz (atomic, fsync)",
                  "safetensors.numpy.save_file"):
        assert re.search(rf"\| {re.escape(label)} \| [0-9.]+ m?s \| [0-9.]+ m?s \| [0-9.]+x \| [0-9.]+x \|", out), label
    # each table's base row divides by itself
    assert out.count("| 1.00x | 1.00x |") >= 2


def test_markdown_table_divides_by_the_base_row():
    table = bench_formats.markdown_table("t", [("a", (2.0, 1.0)), ("b", (4.0, 3.0))], "a")
    assert "| b | 4.000 s | 3.000 s | 2.00x | 3.00x |" in table
