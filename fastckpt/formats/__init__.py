"""The format floor: tensor files on disk, read through one contract and written atomically.

* :mod:`~fastckpt.formats.contract` - :class:`TensorReader`, the reader
  contract every format implements;
* :mod:`~fastckpt.formats.reader` - :func:`fastckpt.open`: any path (file,
  TF prefix, training-checkpoint directory, registered openers) to a reader;
* :mod:`~fastckpt.formats.npz`, :mod:`~fastckpt.formats.safetensors`,
  :mod:`~fastckpt.formats.tf` - each format's reader, writer and byte-level
  specification;
* :mod:`~fastckpt.formats.hfsharded` - Hugging Face sharded safetensors
  directories (``model.safetensors.index.json``): the spec, ``save_sharded``
  and the reader;
* :mod:`~fastckpt.formats.atomic` - 0.2's import path of the atomic writes,
  a re-export of :mod:`fastckpt.store.commit` (the one commit);
* :mod:`~fastckpt.formats.remote` - URLs (``s3://``, ``memory://``, any
  fsspec filesystem): atomic uploads, the manifest-last commit of checkpoint
  prefixes, ranged reads of tensor files;
* :mod:`~fastckpt.formats.convert` - any format to any other;
* :mod:`~fastckpt.formats.tree` - pytrees (dicts, lists, tuples of arrays and
  Python values; ``save_tree`` / ``load_tree``) under ``/``-joined tensor names;
* :mod:`~fastckpt.formats.torchload` - ``load_torch``: a file as writable
  PyTorch tensors (mapped copy-on-write).

A new format plugs in here: a reader implementing the contract, an opener
registered with :func:`fastckpt.formats.reader.register_opener` (or a magic
number in :func:`fastckpt.open`), and a writer that goes through
:mod:`fastckpt.store.commit`.

>>> from fastckpt.formats.contract import TensorReader
>>> TensorReader.__name__
'TensorReader'
"""

# fastckpt.open(url) reads through fastckpt.formats.remote, which registers its opener with the reader below it
from fastckpt.formats import remote as _remote  # noqa: E402,F401
