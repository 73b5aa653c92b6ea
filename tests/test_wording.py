"""Words a user reads: each side names its own spelling of an option, counts agree with their nouns, one option
name per meaning across the bench suites."""

from __future__ import annotations

import numpy as np
import pytest

import fastckpt
from fastckpt.cli import build_parser, main
from fastckpt.formats.convert import convert
from fastckpt.words import command_line_wording

SUITES = ["device", "formats", "model", "tf", "train", "stateful", "sharded", "memory", "s3", "incremental"]


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("spelling", ["--repeat", "--repeats", "--runs"])
def test_every_bench_suite_takes_repeat_and_the_spellings_it_had(suite, spelling):
    # --repeat, --repeats and --runs meant the same in different suites; each now takes all three (the help lists one).
    argv = ["bench", "--suite", suite, spelling, "2"]
    args = build_parser("bench", argv).parse_args(argv)
    assert [getattr(args, name) for name in ("repeat", "repeats", "runs") if hasattr(args, name)] == [2]


@pytest.mark.parametrize("suite", SUITES)
def test_the_help_of_every_suite_names_repeat(suite, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--suite", suite, "--help"])
    out = capsys.readouterr().out
    assert "--repeat N" in out and "--repeats" not in out and "--runs" not in out


def test_python_names_keywords_and_the_command_names_flags(tmp_path, capsys):
    fastckpt.save_safetensors(tmp_path / "m.safetensors", {"w": np.zeros(2, np.float32)})
    convert(tmp_path / "m.safetensors", tmp_path / "m.npz")
    with pytest.raises(FileExistsError) as refused:
        convert(tmp_path / "m.safetensors", tmp_path / "m.npz")
    assert "pass overwrite=True to replace it" in str(refused.value) and "--overwrite" not in str(refused.value)
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "m.npz")]) == 1
    err = capsys.readouterr().err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "with --to tf" in err and "to=" not in err


def test_command_line_wording_leaves_other_words_alone():
    assert command_line_wording("max_to=3, photo='a', overwrite=False") == "max_to=3, photo='a', overwrite=False"


@pytest.mark.parametrize(("names", "counted"), [(["w"], "1 tensor: 'w'"), (["w", "b"], "2 tensors: 'b', 'w'")])
def test_an_unknown_name_counts_the_tensors_in_the_right_number(tmp_path, names, counted):
    fastckpt.save_safetensors(tmp_path / "m.safetensors", {n: np.zeros(1, np.float32) for n in names})
    with fastckpt.open(tmp_path / "m.safetensors") as f, pytest.raises(KeyError) as missing:
        f.host("nope")
    assert f"({counted})" in str(missing.value)
