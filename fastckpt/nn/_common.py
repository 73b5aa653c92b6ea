"""What :mod:`fastckpt.nn.module` and :mod:`fastckpt.nn.layers` both use, below them both.

``layers`` imports ``module`` (every layer is a :class:`~fastckpt.nn.module.Module`);
``module`` needs a little of what layers do (``Sequential`` turns what an empty
model is given into a device tensor). That little lives here, so that imports
in :mod:`fastckpt.nn` point one way only: ``_common`` <- ``module`` <- ``layers``.

>>> import numpy as np
>>> from fastckpt.device.tensor import Tensor
>>> t = Tensor(None, (3,), np.float32)  # a device tensor is returned as it is (no device needed to show it)
>>> as_tensor(t, None, np.float64) is t
True
>>> as_tensor(np.array(["a"]), None, None)
Traceback (most recent call last):
...
TypeError: cannot run a layer on a <U1 array; pass numbers
"""

from __future__ import annotations

import numpy as np

from fastckpt.device.tensor import Tensor

__all__ = ["as_tensor", "default_queue"]


def default_queue(queue):
    """``queue``, or the default device's queue when it is None."""
    if queue is not None:
        return queue
    from fastckpt.device import default

    return default().queue


def as_tensor(x, queue, dtype) -> Tensor:
    """``x`` as a device tensor: a Tensor as it is, host data uploaded (cast to ``dtype`` when given)."""
    if isinstance(x, Tensor):
        return x
    host = np.asarray(x)
    if host.dtype.hasobject or host.dtype.kind in "USMmV":
        raise TypeError(f"cannot run a layer on a {host.dtype} array; pass numbers")
    if dtype is not None and host.dtype != dtype:
        host = host.astype(dtype)
    return Tensor.from_host(default_queue(queue), host)
