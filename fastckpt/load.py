"""Kept for the documented import path: ``fastckpt.load`` is :mod:`fastckpt.device.load`.

>>> import fastckpt.load, fastckpt.device.load
>>> fastckpt.load.__all__ == fastckpt.device.load.__all__
True
"""

from fastckpt.device.load import *  # noqa: F401,F403
from fastckpt.device.load import __all__  # noqa: F401
