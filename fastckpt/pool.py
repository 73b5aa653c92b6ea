"""Kept for the documented import path: ``fastckpt.pool`` is :mod:`fastckpt.device.pool`.

>>> import fastckpt.pool, fastckpt.device.pool
>>> fastckpt.pool.__all__ == fastckpt.device.pool.__all__
True
"""

from fastckpt.device.pool import *  # noqa: F401,F403
from fastckpt.device.pool import __all__  # noqa: F401
