"""The native core: Cython modules that map files and parse untrusted bytes, every index bounds-checked.

* ``mapped`` - :class:`MappedFile`: a read-only (or copy-on-write) mapping
  with zero-copy views, ``pread`` fallback, and the file identity it was
  opened at;
* ``gather`` - ``GatherWriter``: buffered ``writev`` output that releases the
  GIL while writing;
* ``npy`` - the ``.npy`` header parser;
* ``npz`` - the ZIP container (central directory, local headers, ZIP64);
* ``safetensors`` - the safetensors header parser;
* ``tensorindex`` - ``TensorIndex``: a file's index in columns (offsets, dtypes,
  shapes, names), ``TensorInfo`` objects made on access, numpy views made in one loop;
* ``tftable`` - TensorFlow's SSTable blocks (the ``.index`` file);
* ``idindex`` - the open-addressing index of :class:`fastckpt.sharded.HashTable` (int64 id -> row).

Everything above this floor imports these modules through the formats
(:mod:`fastckpt.formats`); none of them imports anything of fastckpt but
each other.

>>> from fastckpt._native.mapped import MappedFile
>>> MappedFile.__module__
'fastckpt._native.mapped'
"""
