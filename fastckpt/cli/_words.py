"""Counted nouns for the commands' output: ``1 tensor``, ``2 tensors``, ``1 copy``, ``2 copies``."""

from __future__ import annotations

__all__ = ["plural"]

_IRREGULAR = {"copy": "copies", "entry": "entries", "this": "these"}


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, the noun in the plural unless the count is one.

    >>> plural(1, "tensor"), plural(0, "tensor"), plural(2, "copy"), plural(1, "copy")
    ('1 tensor', '0 tensors', '2 copies', '1 copy')
    """
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {_IRREGULAR.get(noun, noun + 's')}"
