"""Kept for the documented import path: ``fastckpt.tensor`` is :mod:`fastckpt.device.tensor`.

>>> import fastckpt.tensor, fastckpt.device.tensor
>>> fastckpt.tensor.__all__ == fastckpt.device.tensor.__all__
True
"""

from fastckpt.device.tensor import *  # noqa: F401,F403
from fastckpt.device.tensor import __all__  # noqa: F401
