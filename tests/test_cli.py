"""The fastckpt command line: every sub-command configures, inspect prints exact facts."""

import json
import subprocess
import sys

import numpy as np
import pytest

import fastckpt
from fastckpt.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_sub_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert COMMANDS[command].HELP.split()[0] in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_inspect_json_reports_offsets_and_alignment(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"b": np.zeros(3, np.int8), "a": np.ones((2, 2), np.float32)}, metadata={"k": "v"})
    assert main(["inspect", "--json", str(path)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "safetensors" and d["metadata"] == {"k": "v"}
    with fastckpt.open(path) as f:
        expected = {i.name: (str(i.dtype), list(i.shape), i.offset, i.nbytes, i.alignment) for i in f.infos.values()}
    got = {t["name"]: (t["dtype"], t["shape"], t["offset"], t["nbytes"], t["alignment"]) for t in d["tensors"]}
    assert got == expected
    assert got["a"][:2] == ("float32", [2, 2]) and got["b"][:2] == ("int8", [3])
    assert got["a"][4] == 4096, "the data section starts on a 4096-byte boundary; float32 comes first"
    assert d["data_region"][0] % 4096 == 0


def test_inspect_table_and_error_exit(tmp_path, capsys):
    path = tmp_path / "m.npz"
    fastckpt.save_npz(path, {"w": np.zeros((2, 3), np.float16)})
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "npz, 1 tensor\n" in out and "float16" in out and "2x3" in out
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"nope")
    assert main(["inspect", str(bad)]) == 1
    assert "bad.bin" in capsys.readouterr().err


def test_python_m_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "fastckpt", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"fastckpt {fastckpt.__version__}"


def test_inspect_passes_max_header_size(tmp_path, capsys):
    arr = np.zeros(2, np.dtype([(f"field_{i:05d}", "<u1") for i in range(600)]))  # a 14518-byte npy header
    path = tmp_path / "wide.npz"
    np.savez(path, w=arr)
    assert main(["inspect", str(path)]) == 1
    assert "over the 10000-byte cap" in capsys.readouterr().err
    assert main(["inspect", "--json", "--max-header-size", "20000", str(path)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [(t["name"], t["shape"], t["nbytes"]) for t in d["tensors"]] == [("w", [2], 1200)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_is_a_module_of_its_own(command):
    module = COMMANDS[command]
    assert module.__name__ == f"fastckpt.cli.{command}"
    assert callable(module.add_parser) and callable(module.run) and module.HELP


def test_a_command_imports_only_what_it_needs():
    # The command modules are light: running `inspect` does not import the benchmarks nor the training code.
    check = ("import sys\n"
             "from fastckpt.cli import build_parser\n"
             "build_parser('inspect', ['inspect', 'x.npz']).parse_args(['inspect', 'x.npz'])\n"
             "print(sorted(m for m in sys.modules if m.startswith(('fastckpt.bench', 'fastckpt.train'))))\n")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_python_m_fastckpt_cli_runs():
    out = subprocess.run([sys.executable, "-m", "fastckpt.cli", "--version"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == f"fastckpt {fastckpt.__version__}"


def test_inspect_a_training_checkpoint_directory_lists_every_file_s_tensors(tmp_path, capsys):
    from fastckpt.train import AdamW, TinyLM, save_checkpoint

    model = TinyLM(vocab=8, dim=4, hidden=8)
    save_checkpoint(model, AdamW(model.parameters()), None, None, None, tmp_path / "ckpt", step=1)
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "fastckpt.train.checkpoint" and "data_region" not in d
    names = [t["name"] for t in d["tensors"]]
    assert "weights/embed.weight" in names and "lm_head.weight" not in " ".join(names)  # tied: stored once
    assert any(n.startswith("optim/") for n in names)
    assert d["metadata"]["weights/lm_head.weight"] == "ALIAS(embed.weight)"
