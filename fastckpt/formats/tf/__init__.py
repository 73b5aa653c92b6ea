"""TensorFlow v2 checkpoints as bytes: the bundle format, its protobufs and SSTable, reader and writer.

The user-facing API (and the ``Checkpointable`` naming protocol) is
:mod:`fastckpt.tf`; the byte-level specification is
:mod:`fastckpt.formats.tf.format`.

>>> from fastckpt.formats.tf.reader import CheckpointReader
>>> CheckpointReader.__module__
'fastckpt.formats.tf.reader'
"""
