"""``load_torch(path)``: any file ``fastckpt.open`` reads, as a state_dict of PyTorch tensors to train.

One call for what a PyTorch user does with ``safetensors.torch.load_file``:
the file is mapped *privately* (``fastckpt.open(path, copy_on_write=True)``),
each tensor is a zero-copy view of that mapping, and every view is writable:
a page is copied the first time it is written to, so ``model.load_state_dict(sd,
assign=True)`` followed by ``optimizer.step()`` trains in place and the file
never changes. Pages that are only read stay shared with the page cache (and
with every other process reading the file). Readers that decode (an NPZ
member that is compressed, a TensorFlow bundle whose tensors need a conversion)
give private arrays; any view that is still read-only is copied
(:func:`fastckpt.to_torch`'s default), so no tensor returned here is read-only.

As for any mapping (``safetensors.torch.load_file`` maps files privately in the
same way), the file must not be truncated in place while its tensors are
alive; fastckpt's own writers never do that (they write a new file and rename
it). bfloat16 and float8 tensors keep their dtype.

>>> import fastckpt, numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
>>> fastckpt.save_safetensors(path, {"w": np.ones(2, np.float32)})
>>> sd = load_torch(path)  # doctest: +SKIP
>>> sd["w"].add_(1).tolist(), fastckpt.open(path).host("w").tolist()  # doctest: +SKIP
([2.0, 2.0], [1.0, 1.0])
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from fastckpt.arrays import to_torch

__all__ = ["load_torch"]


def load_torch(path: str | os.PathLike, *, names: Iterable[str] | None = None, **options: Any) -> dict[str, Any]:
    """The tensors of ``path`` (every one, or those in ``names``) as writable PyTorch tensors, in the file's order.

    ``options`` go to :func:`fastckpt.open` (``backend="pread"``,
    ``storage_options`` for a URL, ...); ``copy_on_write`` is always on. See
    the module docstring for what is shared and what is copied.

    >>> import fastckpt, numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> fastckpt.save_safetensors(path, {"a": np.zeros(1, np.int8), "b": np.ones(2, np.float32)})
    >>> list(load_torch(path, names=["b"]))  # doctest: +SKIP
    ['b']
    """
    from fastckpt.formats.reader import open as open_reader

    if options.pop("copy_on_write", True) is not True:
        raise ValueError("load_torch maps files copy-on-write, so that every tensor can be written to; for "
                         "zero-copy read-only tensors use fastckpt.to_torch(f.host(name), copy=False)")
    with open_reader(path, copy_on_write=True, **options) as f:
        wanted = list(f.keys()) if names is None else list(names)
        return {name: to_torch(f.host(name)) for name in wanted}
