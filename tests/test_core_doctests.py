"""The examples in the docstrings of the core formats and the device layer run and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

# Modules whose examples need no device (device examples are marked +SKIP and run as tests elsewhere).
MODULES = ["reader", "_info", "_atomic", "npz", "safetensors", "inspect", "pool", "load", "tensor"]
CYTHON_MODULES = ["_mapped", "_gather", "_npz", "_safetensors"]


@pytest.mark.parametrize("name", MODULES + CYTHON_MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the examples' temporary files go with the test
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    module = importlib.import_module(f"fastckpt.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"fastckpt.{name}: no example was found to run"
