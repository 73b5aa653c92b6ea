"""tools/asv-check.sh says why it cannot run, and its exit status tells a regression (3) from a check that could not
run (2): in the README's environment it exited 1 with no output (the base needed a build, Cython was missing), and 1
was also its "something got slower".

The script runs here in a small git repository of its own, with a stand-in ``asv`` on PATH that answers ``machine``,
``run`` and ``compare`` as told (a real asv run takes minutes a side); the comparison rows are asv compare's format.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "asv-check.sh"

FAKE_ASV = """#!/bin/sh
case "$1" in
  machine) exit 0 ;;
  run) [ -n "$FAKE_ASV_RUN_FAILS" ] && { echo "bench_x.T.time_load   failed"; exit 1; }; exit 0 ;;
  compare) printf '%b' "$FAKE_ASV_COMPARE"; exit 0 ;;
esac
exit 0
"""
SLOWER_ROW = "|   +  |  1.00+-0.01ms |  9.00+-0.10ms |   9.00 | bench_x.T.time_load |\\n"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.fixture
def checkout(tmp_path):
    """A repository with the script, an asv config, an importable package and two commits; a bin directory with
    python3 and git, and a stand-in asv that a test may leave out."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "tools" / "asv-check.sh")
    (repo / "asv_bench").mkdir()
    (repo / "asv_bench" / "asv.conf.json").write_text('{"version": 1}\n')
    (repo / "fastckpt" / "_native").mkdir(parents=True)
    (repo / "fastckpt" / "__init__.py").write_text("")
    (repo / "fastckpt" / "_native" / "core.pyx").write_text("# one\n")
    (repo / "setup.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    (repo / "fastckpt" / "__init__.py").write_text("x = 1\n")
    _git(repo, "commit", "-qam", "two")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("python3", "git"):
        (bin_dir / tool).symlink_to(shutil.which(tool) if tool == "git" else sys.executable)
    (bin_dir / "asv").write_text(FAKE_ASV)
    (bin_dir / "asv").chmod(0o755)
    return repo, bin_dir


def _check(repo: Path, bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script puts the checkout first itself
    environ.update(PATH=f"{bin_dir}:/usr/bin:/bin", TMPDIR=str(repo.parent), **env)
    return subprocess.run(["bash", str(repo / "tools" / "asv-check.sh"), *args], capture_output=True, text=True,
                          timeout=120, env=environ)


def test_a_regression_exits_3_and_prints_its_rows(checkout):
    result = _check(*checkout, FAKE_ASV_COMPARE=SLOWER_ROW)
    assert result.returncode == 3, result.stderr
    assert "worse than" in result.stdout and "bench_x.T.time_load" in result.stdout


def test_nothing_slower_exits_0(checkout):
    result = _check(*checkout, FAKE_ASV_COMPARE="")
    assert (result.returncode, result.stdout.startswith("asv: nothing got slower")) == (0, True), result.stderr


@pytest.mark.parametrize("before, after, code", [("30.4k", "41.9k", 0), ("1.00M", "5.20M", 3), ("30.4k", "98.0k", 3)])
def test_memory_is_worse_by_a_fifth_and_64_kib(checkout, before, after, code):
    """tracemalloc's peak of one commit's cold pooled load moved 27-43 kB between processes; an extra copy of a
    benchmark's bytes, what the row is there for, is MiBs."""
    row = f"|   +  |  {before} |  {after} |   1.38 | bench_cold.ColdPooledLoad.track_allocated |\\n"
    result = _check(*checkout, FAKE_ASV_COMPARE=row)
    assert result.returncode == code, result.stdout + result.stderr
    assert ("track_allocated" in result.stdout) == (code == 3)


def test_missing_asv_is_named_with_the_way_to_install_it_and_exits_2(checkout):
    repo, bin_dir = checkout
    (bin_dir / "asv").unlink()
    result = _check(repo, bin_dir)
    assert result.returncode == 2
    assert "asv is not installed" in result.stderr and "pip install" in result.stderr


def test_an_unknown_base_exits_2_naming_it(checkout):
    result = _check(*checkout, "no-such-commit")
    assert result.returncode == 2 and "no commit named no-such-commit" in result.stderr


def test_a_failed_benchmark_run_exits_2_not_as_a_regression(checkout):
    result = _check(*checkout, FAKE_ASV_RUN_FAILS="1")
    assert result.returncode == 2 and "run failed" in result.stderr


def test_a_base_that_does_not_build_exits_2_with_the_reason(checkout):
    # The base's native sources differ from the checkout's, so it is built; here that build fails (no real
    # setup.py): the script says so and where the log is, instead of exiting 1 with nothing printed.
    # A stand-in Cython makes the script build in place (python3 setup.py build_ext), which this setup.py refuses.
    repo, bin_dir = checkout
    (repo / "setup.py").write_text("raise SystemExit('cannot build here')\n")
    _git(repo, "commit", "-qam", "a base that cannot build")
    (repo / "fastckpt" / "_native" / "core.pyx").write_text("# two\n")
    _git(repo, "commit", "-qam", "native sources change")
    fake_cython = repo.parent / "fake_cython"
    (fake_cython / "Cython").mkdir(parents=True)
    (fake_cython / "Cython" / "__init__.py").write_text("")
    result = _check(repo, bin_dir, FAKE_ASV_COMPARE="", PYTHONPATH=str(fake_cython))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "the base did not build (log:" in result.stderr
