"""The README's Python examples run as written (in order, in one namespace, in a scratch directory)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_blocks(blocks: list[str], when: str = "") -> None:
    """Run the blocks in order in one new namespace; a failure names the block (and ``when``)."""
    namespace: dict = {}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"README python block {i} failed{when}: {exc!r}\n{block}") from exc


def test_readme_starts_with_the_two_setup_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).strip().splitlines()
    assert first_block == [
        'python3 -m pip install -e . && python3 -m fastckpt demo',
        'python3 -m pip install -e ".[test]" && python3 -m pytest -q',
    ]
    assert text.index("```bash") < text.index("```python")


@pytest.mark.device
def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 6
    run_blocks(blocks)
    out = capsys.readouterr().out
    assert "[] []" in out and "[10, 20]" in out
    assert "['dense/kernel']" in out
    assert "(256008, 256008)" in out and "['embed.weight', 'step']" in out


@pytest.mark.device
def test_readme_examples_run_twice_in_one_directory(tmp_path, monkeypatch, capsys):
    # A reader trying the examples again, in the directory the first run filled, gets the same results.
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(README.read_text())
    for run in (1, 2):
        run_blocks(blocks, f" on run {run}")
        out = capsys.readouterr().out
        assert "[10, 20]" in out and "(256008, 256008)" in out, f"run {run}"
