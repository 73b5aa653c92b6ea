"""Kept for the documented import path: ``fastckpt.convert`` is :mod:`fastckpt.formats.convert`.

>>> from fastckpt.convert import convert
>>> convert.__module__
'fastckpt.formats.convert'
"""

from fastckpt.formats.convert import *  # noqa: F401,F403
from fastckpt.formats.convert import __all__  # noqa: F401
