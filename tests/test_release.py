"""The release says what it is: one version (0.10.0) in the package, the command, the build metadata and the manifests,
a CHANGELOG whose newest release is that version, and a README whose promises the code keeps."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest

import fastckpt

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.10.0"


def test_the_package_is_0_10_0():
    assert fastckpt.__version__ == VERSION


def test_the_build_reads_the_version_from_the_package_not_a_second_copy():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fastckpt.__version__"}
    setuptools_config = pytest.importorskip("setuptools.config.pyprojecttoml")
    with warnings.catch_warnings():  # [tool.distutils] (the editable mode) is "experimental" to setuptools: known
        warnings.simplefilter("ignore")
        built = setuptools_config.read_configuration(ROOT / "pyproject.toml", expand=True)
    assert built["project"]["version"] == VERSION


def test_the_command_prints_the_version():
    out = subprocess.run([sys.executable, "-m", "fastckpt", "--version"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert (out.returncode, out.stdout.strip()) == (0, f"fastckpt {VERSION}")


def test_a_training_manifest_records_the_library_version(tmp_path):
    # The library version a manifest records (its `versions` field) is not a format version: golden tests leave that
    # field out of their comparison (tests/test_golden.py VOLATILE_MANIFEST_KEYS), so no golden byte changes.
    from fastckpt.train import TinyLM, save_checkpoint

    save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, tmp_path / "ckpt", step=1)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["versions"]["fastckpt"] == VERSION
    assert manifest["schema_version"] == "2.0"  # the format's own version, not the library's


def test_the_changelog_starts_with_this_release_and_its_breaking_changes():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## (\S+)", text, re.M)
    assert releases[0] == VERSION and {"0.9.0", "0.8.0", "0.7.0", "0.6.0", "0.5.0", "0.4.0", "0.3.0", "0.2.0"} <= set(releases)
    this_release = text.split(f"\n## {VERSION}\n", 1)[1].split("\n## ", 1)[0]
    sections = re.findall(r"^### (.+)", this_release, re.M)
    assert sections[0] == "Breaking changes", sections
    breaking = this_release.split("### Breaking changes", 1)[1].split("\n### ", 1)[0]
    entries = re.findall(r"^- (.*)", breaking, re.M)
    assert entries and all(entry.startswith("**Breaking") for entry in entries)
    assert "5953de2" in this_release  # what "since 0.9.0" counts from
    assert sections == ["Breaking changes", "Deprecated (working until 0.11)", "Added", "Changed", "Fixed", "Performance"]


def test_the_readme_promises_no_replace_unless_told_and_every_writer_keeps_it(tmp_path):
    # 0.3's README said the writers of 0.2 still replaced when overwrite= was left out, until 0.4. In 0.4 the
    # promise is whole again, and the code keeps it: a tensor file and a checkpoint manager's step alike.
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "No save replaces an existing file or checkpoint unless told to" in readme
    assert "until 0.4" not in readme
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"w": np.zeros(2, np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with pytest.raises(FileExistsError):
            fastckpt.save_safetensors(path, {"w": np.ones(2, np.float32)})
    assert fastckpt.open(path).host("w").tolist() == [0.0, 0.0]
    from fastckpt.train import TinyLM, CheckpointManager

    manager = CheckpointManager(tmp_path / "run")
    model = TinyLM(vocab=8, dim=4, hidden=8)
    manager.save(1, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with pytest.raises(FileExistsError):
            manager.save(1, model)
    manager.close()


def test_the_test_extra_names_a_boto3_window_that_aiobotocores_botocore_allows():
    # moto takes any boto3, and every boto3 1.X.N wants botocore >=1.X.N,<1.(X+1); s3fs's aiobotocore wants one narrow
    # botocore window. Left open, pip tried boto3 releases newest first and walked back through 20 of them on a fresh
    # machine. The extra names both windows, and they agree with the installed aiobotocore's own requirement.
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extra = {r.name: r for r in map(Requirement, project["project"]["optional-dependencies"]["test"])}
    boto3, aiobotocore = extra["boto3"].specifier, extra["aiobotocore"].specifier
    assert any(s.operator == "<" for s in boto3) and any(s.operator == "<" for s in aiobotocore)
    try:
        installed = importlib.metadata.version("aiobotocore")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("aiobotocore is not installed")
    if installed not in aiobotocore:
        pytest.skip(f"the installed aiobotocore {installed} is outside the extra's window {aiobotocore}")
    botocore = next(Requirement(r).specifier for r in importlib.metadata.requires("aiobotocore") or ()
                    if Requirement(r).name == "botocore")
    newest_boto3 = max(Version(s.version) for s in boto3 if s.operator == "<")
    # The newest boto3 the window allows (just under its bound) needs botocore >= itself: aiobotocore must allow that.
    last = Version(f"{newest_boto3.major}.{newest_boto3.minor}.{newest_boto3.micro - 1}")
    assert str(last) in botocore, (str(boto3), str(botocore))
    assert not any(str(Version(f"{last.major}.{last.minor}.{last.micro + k}")) in botocore for k in (1, 2)), \
        "aiobotocore allows a newer botocore: widen the boto3 window with it"
