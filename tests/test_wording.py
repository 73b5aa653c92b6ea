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


def test_saver_given_a_path_first_says_to_name_it_path():
    from fastckpt.sharded import Saver

    with pytest.raises(TypeError, match=r"first argument is shard_index, got the path 'ckpt/step-1'; .*"
                                        r"Saver\(path='ckpt/step-1', \.\.\.\)"):
        Saver("ckpt/step-1")


def test_the_reference_model_and_optimizers_print_their_shape_not_an_address():
    from fastckpt.train import SGD, AdamW, TinyLM

    model = TinyLM(vocab=8, dim=4, hidden=16)
    assert repr(model) == "TinyLM(vocab=8, dim=4, hidden=16, tied=True, dropout=0.1, 212 parameters)"
    assert repr(AdamW(model.parameters())) == ("AdamW(lr=0.001, beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0.01, "
                                               "t=0, 5 parameters)")
    assert repr(SGD(model.parameters(), lr=0.5)).startswith("SGD(lr=0.5, momentum=0, ")


def test_the_npz_spec_says_np_load_needs_ml_dtypes_imported_and_what_numpy_says_otherwise(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import ml_dtypes

    path = tmp_path / "b.npz"
    fastckpt.save_npz(path, {"w": np.ones(2, ml_dtypes.bfloat16)})
    without = subprocess.run([sys.executable, "-c", f"import numpy as np; np.load({str(path)!r})['w']"],
                             capture_output=True, text=True, timeout=60)
    numpy_says = without.stderr.strip().splitlines()[-1].split(": ", 1)[1]
    spec = " ".join((Path(__file__).parents[1] / "docs" / "formats" / "npz.md").read_text(encoding="utf-8").split())
    assert f"numpy says ``{numpy_says}``" in spec and "``import ml_dtypes`` before ``np.load``" in spec
    assert "so fastckpt refuses it" not in spec  # 0.3 writes bfloat16 under its name; the spec said it refused it
    with_ml_dtypes = subprocess.run([sys.executable, "-c", f"import ml_dtypes, numpy as np; "
                                     f"print(np.load({str(path)!r})['w'].dtype)"], capture_output=True, text=True,
                                    timeout=60)
    assert with_ml_dtypes.stdout.strip() == "bfloat16"


def test_an_error_renamed_by_two_nested_commits_names_the_temporary_once(tmp_path):
    # A shard's error inside a staging directory passed two commits, and the message said
    # "(written through the temporary ...)" twice.
    import errno
    import os

    from fastckpt.store.commit import _naming_target

    staging, final = str(tmp_path / ".d.partial"), str(tmp_path / "d")
    inner_tmp = os.path.join(staging, ".m.safetensors.partial")
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), inner_tmp)
    once = _naming_target(error, os.path.join(staging, "m.safetensors"), inner_tmp)
    twice = _naming_target(once, final, staging, inside=True)
    assert twice.filename == os.path.join(final, "m.safetensors")
    assert str(twice).count("written through the temporary") == 1 and ".m.safetensors.partial" in str(twice)


@pytest.mark.parametrize(("command", "kinds"), [
    ("inspect", ["Hugging Face", "TensorFlow", "training checkpoint", "sharded", "RecIS", "exit status"]),
    ("verify", ["Hugging Face", "TensorFlow", "sharded", "RecIS", "tensor file", "exit status: 0", "1 when a problem"]),
])
def test_inspect_and_verify_help_name_every_kind_they_read_and_their_exit_status(command, kinds, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert [kind for kind in kinds if kind not in text] == []


@pytest.mark.parametrize("name", ["t.safetensors", "t.npz"])
def test_save_tree_refuses_a_replace_nobody_asked_for_and_names_the_way_out(tmp_path, name):
    fastckpt.save_tree(tmp_path / name, {"a": np.zeros(2)})
    with pytest.raises(FileExistsError, match="pass overwrite=True") as caught:
        fastckpt.save_tree(tmp_path / name, {"a": np.ones(2)})
    assert caught.value.filename == str(tmp_path / name)
    assert fastckpt.load_tree(tmp_path / name)["a"].tolist() == [0.0, 0.0]
    fastckpt.save_tree(tmp_path / name, {"a": np.ones(2)}, overwrite=True)
    assert fastckpt.load_tree(tmp_path / name)["a"].tolist() == [1.0, 1.0]
