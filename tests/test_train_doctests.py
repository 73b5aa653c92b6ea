"""The examples in the docstrings of fastckpt.train run and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["optim", "sched", "scaler", "data", "model", "checkpoint", "asyncsave", "manager", "verify", "selfcheck",
           "bench", "__init__"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module("fastckpt.train" if name == "__init__" else f"fastckpt.train.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
