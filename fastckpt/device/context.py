"""The default OpenCL device: one context and queue per process, made on first use.

``default("auto")`` picks a GPU when one is present and otherwise the CPU
device (pocl, installed from PyPI with fastckpt, so a machine with no GPU
driver still has one). pyopencl is imported here, inside the call, and never
at ``import fastckpt``.

>>> handle = default("cpu")                     # doctest: +SKIP
>>> handle.device.type & cl.device_type.CPU     # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceHandle", "default", "reset", "shares_host_memory"]

_KINDS = ("auto", "gpu", "cpu")
_lock = threading.Lock()
_cache: dict[str, "DeviceHandle"] = {}

_NO_PLATFORM = (
    "no OpenCL platform found. fastckpt needs one OpenCL device: on Linux `pip install "
    "pocl-binary-distribution` gives a CPU device with no driver (it is a default dependency, so a plain "
    "`pip install fastckpt` has it); for a GPU install the vendor's OpenCL driver (ICD)."
)


@dataclass(frozen=True)
class DeviceHandle:
    """A device with its own context and in-order queue.

    >>> handle = default("cpu")                          # doctest: +SKIP
    >>> handle.kind, handle.host_unified_memory          # doctest: +SKIP
    ('cpu', True)
    """

    context: Any
    queue: Any
    device: Any
    kind: str  # "gpu", "cpu" or "other"

    @property
    def name(self) -> str:
        return f"{self.device.platform.name.strip()} / {self.device.name.strip()}"

    @property
    def host_unified_memory(self) -> bool:
        """True when device memory is host memory (CPU devices, integrated GPUs)."""
        return shares_host_memory(self.device)


def shares_host_memory(device) -> bool:
    """True when ``device``'s memory is host memory (``host_unified_memory``: CPU devices, integrated GPUs).

    The one place the load path asks (whether to stage copies, whether zero-copy can work), so that a test run can
    present a device as discrete. A runtime that no longer answers the (OpenCL 2.0-deprecated) query counts as
    discrete.

    >>> shares_host_memory(default("cpu").device)     # doctest: +SKIP
    True
    """
    try:
        return bool(device.host_unified_memory)
    except Exception:
        return False


def _kind_of(device) -> str:
    import pyopencl as cl

    if device.type & cl.device_type.GPU:
        return "gpu"
    if device.type & cl.device_type.CPU:
        return "cpu"
    return "other"


def _pick(kind: str):
    import pyopencl as cl

    try:
        platforms = cl.get_platforms()
    except cl.LogicError as exc:  # CL_PLATFORM_NOT_FOUND_KHR
        raise RuntimeError(_NO_PLATFORM) from exc
    devices = [d for p in platforms for d in p.get_devices()]
    if not devices:
        raise RuntimeError(_NO_PLATFORM)
    gpus = [d for d in devices if _kind_of(d) == "gpu"]
    cpus = [d for d in devices if _kind_of(d) == "cpu"]
    if kind == "gpu":
        if not gpus:
            raise RuntimeError(
                "no OpenCL GPU found (devices: " + ", ".join(d.name.strip() for d in devices) + "); "
                "use default('cpu') or default('auto'), or install the GPU vendor's OpenCL driver"
            )
        return gpus[0]
    if kind == "cpu":
        if not cpus:
            raise RuntimeError("no OpenCL CPU device found; `pip install pocl-binary-distribution` provides one")
        return cpus[0]
    return (gpus or cpus or devices)[0]


def default(kind: str = "auto") -> DeviceHandle:
    """The process-wide device of ``kind`` ("auto", "gpu" or "cpu"), created once and cached.

    ``FASTCKPT_DEVICE`` (``gpu``/``cpu``) overrides what ``"auto"`` picks.

    >>> q = default().queue   # doctest: +SKIP
    """
    if kind not in _KINDS:
        raise ValueError(f"device kind must be one of {_KINDS}, got {kind!r}")
    if kind == "auto":
        kind = os.environ.get("FASTCKPT_DEVICE", "auto").lower() or "auto"
        if kind not in _KINDS:
            raise ValueError(f"FASTCKPT_DEVICE must be one of {_KINDS}, got {kind!r}")
    with _lock:
        handle = _cache.get(kind)
        if handle is None:
            import pyopencl as cl

            device = _pick(kind)
            context = cl.Context([device])
            handle = DeviceHandle(context, cl.CommandQueue(context), device, _kind_of(device))
            _cache[kind] = handle
        return handle


def reset() -> None:
    """Forget the cached handles (tests; after a fork).

    >>> reset(); default() is default()                  # doctest: +SKIP
    True
    """
    with _lock:
        _cache.clear()
