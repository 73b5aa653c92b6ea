"""Counted nouns for messages and the commands' output: ``1 tensor``, ``2 tensors``, ``1 copy``, ``2 copies``."""

from __future__ import annotations

import re

__all__ = ["plural", "command_line_wording"]

_IRREGULAR = {"copy": "copies", "entry": "entries", "this": "these"}


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, the noun in the plural unless the count is one.

    >>> plural(1, "tensor"), plural(0, "tensor"), plural(2, "copy"), plural(1, "copy")
    ('1 tensor', '0 tensors', '2 copies', '1 copy')
    """
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {_IRREGULAR.get(noun, noun + 's')}"


# The library's messages name Python keywords; the commands print the flag that means the same.
_FLAGS = [(re.compile(r"\bto='(\w+)'"), r"--to \1"), (re.compile(r"\bto=(?=[\s,;)]|$)"), "--to"),
          (re.compile(r"\boverwrite=True\b"), "--overwrite"),
          (re.compile(r"\bskip_unsupported=True\b"), "--skip-unsupported"),
          (re.compile(r"\bquantized_as_ints=True\b"), "--quantized-as-ints"),
          (re.compile(r"\bobject_graph=True\b"), "--object-graph")]


def command_line_wording(message: str) -> str:
    """``message`` (written for Python callers) with each keyword argument it names as the command's flag.

    >>> command_line_wording("out.npz already exists; pass overwrite=True to replace it")
    'out.npz already exists; pass --overwrite to replace it'
    >>> command_line_wording("a prefix such as out/ckpt-1 with to='tf'; or leave to= out")
    'a prefix such as out/ckpt-1 with --to tf; or leave --to out'
    """
    for pattern, flag in _FLAGS:
        message = pattern.sub(flag, message)
    return message
