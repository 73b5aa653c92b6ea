"""Kept for the import path of 0.1: ``fastckpt.tf.proto`` is :mod:`fastckpt.formats.tf.proto`.

It holds the types that ``CheckpointReader.object_graph()`` returns (``ObjectGraph``, ``GraphNode``).

>>> from fastckpt.tf.proto import ObjectGraph
>>> ObjectGraph.__module__
'fastckpt.formats.tf.proto'
"""

from fastckpt.formats.tf.proto import *  # noqa: F401,F403
from fastckpt.formats.tf.proto import __all__  # noqa: F401
