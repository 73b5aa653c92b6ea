"""``fastckpt demo`` (the README's first command): one line per capability, each checked, not only printed."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.device


def test_training_line_resumes_bit_for_bit(tmp_path, capsys):
    from fastckpt.cli.demo import _training_demo

    _training_demo(str(tmp_path))
    out = capsys.readouterr().out
    assert out.startswith("training     saved model, optimizer, scheduler, data iterator, RNG and loss scaler")
    assert out.rstrip().endswith("the next 10 losses after the resume identical bit for bit: True")


def test_tf_line_reads_back_every_kernel(tmp_path, capsys):
    from fastckpt.cli.demo import _tf_demo

    _tf_demo(str(tmp_path))
    out = capsys.readouterr().out
    assert "read its 8 kernels back with CRC-32C checks" in out
    assert out.rstrip().endswith("values identical: True")


@pytest.mark.parametrize("mpi", [True, False], ids=["mpi-or-threads", "threads"])
def test_sharded_line_reshards_2_to_3_exactly(tmp_path, capsys, monkeypatch, mpi):
    import fastckpt.cli.demo as demo

    if not mpi:
        monkeypatch.setattr(demo, "_mpiexec", lambda: None)
    demo._sharded_demo(str(tmp_path), ids=5000)
    out = capsys.readouterr().out
    assert out.startswith("sharded      saved 5,000 ids x 16 float32 with Adam's m and v")
    if not mpi:
        assert "on 2 thread ranks (mpi4py or mpiexec not installed)" in out
    elif demo._mpiexec() is not None:
        assert "on 2 MPI ranks" in out
    assert "loaded on 3 ranks (resharded 2 -> 3)" in out
    assert "written as RecIS's own layout and loaded back in" in out and "identical: True; every row" in out
    assert out.rstrip().endswith("every row identical: True")


def test_the_whole_demo_prints_the_device_first_and_every_line_true(capsys, monkeypatch):
    import fastckpt.cli.demo as demo
    from fastckpt.cli import main

    # Small sizes, and the sharded ranks as threads: each line's own test above checks its work in detail (the
    # sharded one at 5,000 ids, on MPI ranks where mpiexec is installed).
    monkeypatch.setattr(demo, "_mpiexec", lambda: None)
    assert main(["demo", "--mib", "4", "--hidden", "64", "--ids", "5000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device       ")
    assert [line.split()[0] for line in lines[1:]] == ["safetensors", "npz", "model", "training", "TensorFlow",
                                                       "sharded"]
    assert all(line.rstrip().endswith("True") or "True;" in line for line in lines[1:])
