"""The device floor: OpenCL context and queue, device tensors, the persistent buffer pool, the load path.

* :mod:`fastckpt.device.context` - :func:`default` / :func:`reset`: one
  context and queue per process (a GPU when there is one, else pocl's CPU
  device);
* :mod:`fastckpt.device.tensor` - :class:`~fastckpt.device.tensor.Tensor`, a
  device buffer with a dtype and shape;
* :mod:`fastckpt.device.pool` - :class:`~fastckpt.device.pool.PersistentBufferPool`,
  device memory (arenas) kept between loads;
* :mod:`fastckpt.device.load` - :func:`~fastckpt.device.load.load_file`, one
  function per strategy (zero-copy, arenas, buffers, decoded), and
  :func:`~fastckpt.device.load.realign`;
* :mod:`fastckpt.device.staging` - the staged copies of a load to a device
  that does not share host memory (pinned buffers filled ahead of the copies).

Only the context's names are imported here (pyopencl itself is imported on
first use); the other modules load when asked for.

>>> from fastckpt.device import default, reset
>>> callable(default) and callable(reset)
True
"""

from fastckpt.device.context import DeviceHandle, default, reset

__all__ = ["DeviceHandle", "default", "reset"]
