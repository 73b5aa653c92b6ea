"""Fixtures shared by the test files: an OpenCL device, its queue and a fresh buffer pool.

Tests that need these ask for them by name; a file that needs something different (a pool option) defines its own
fixture of that name, which takes precedence, with a comment saying why.

Device tests run on every OpenCL device kind present (``device_kinds``): the GPU and the CPU device (pocl) where both
are, parametrized over them (ids ``gpu``, ``cpu``); the one there is elsewhere. ``FASTCKPT_TEST_DEVICES`` narrows
them (``gpu``, ``cpu`` or ``gpu,cpu``). ``FASTCKPT_TEST_DEVICES=discrete`` runs the suite as a GPU-only machine would,
on pocl: the CPU device is presented as a GPU that does not share host memory (so loads are staged and zero-copy
falls back), and ``default("cpu")`` finds no CPU device. A test that needs host-unified memory or a CPU device asks
for ``unified_device`` or ``cpu_device`` and is skipped, with that reason, where there is none.
"""

from __future__ import annotations

import functools
import gc
import os

import pytest

# Tests asking for any of these use the OpenCL device: they get the `device` marker (declared in pyproject.toml)
# without having to say so, so that `-m "not device"` leaves them out.
DEVICE_FIXTURES = frozenset({"device", "queue", "pool", "device_kind"})

SIMULATED_DISCRETE = os.environ.get("FASTCKPT_TEST_DEVICES", "").strip().lower() == "discrete"


@functools.cache
def device_kinds() -> tuple:
    """The device kinds the device tests run on ("gpu", "cpu"), GPU first; ("none",) without pyopencl or a device."""
    try:
        import pyopencl as cl

        from fastckpt.device import context

        present = {context._kind_of(d) for p in cl.get_platforms() for d in p.get_devices()}
    except Exception:  # no pyopencl, no platform: the device fixture skips
        return ("none",)
    wanted = os.environ.get("FASTCKPT_TEST_DEVICES", "").strip().lower()
    if wanted and wanted != "discrete":
        present &= {k.strip() for k in wanted.split(",")}
    return tuple(k for k in ("gpu", "cpu") if k in present) or ("none",)


def pytest_configure(config):
    if SIMULATED_DISCRETE:
        _simulate_discrete_gpu()


def _simulate_discrete_gpu() -> None:
    """Present the CPU device as a discrete GPU, and no CPU device, for the whole run (see the module docstring)."""
    import fastckpt.device.context as context
    import fastckpt.device.load as load
    import fastckpt.device.staging as staging

    import pyopencl as cl

    real_pick, real_shares = context._pick, context.shares_host_memory

    def pick(kind):
        if kind == "cpu":
            raise RuntimeError("no OpenCL CPU device found; `pip install pocl-binary-distribution` provides one "
                               "(FASTCKPT_TEST_DEVICES=discrete hides it)")
        return real_pick("gpu")  # every device is a GPU now (_kind_of below)

    def shares(device):
        return False if isinstance(device, cl.Device) else real_shares(device)  # stand-ins keep their answer

    context._pick = pick
    context._kind_of = lambda device: "gpu"
    for module in (context, load, staging):
        module.shares_host_memory = shares


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if DEVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.device)


def pytest_collection_finish(session):
    """Collection leaves some 300,000 objects that live for the whole session (items, marks, test modules); every
    full garbage collection walked them all, about 0.4 s here each time, and the demo, the bench suites' timed
    rounds and many tests collect on purpose, some dozens of times. Frozen, they are left out of every collection;
    objects the tests make are collected as before."""
    gc.freeze()


@pytest.hookimpl(optionalhook=True)  # xdist's hook: no error where xdist is not loaded
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts) starts a worker per core for the whole suite only: a run naming its files or
    tests would spend more time starting workers, each importing numpy and pyopencl, than it saves."""
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return 0
    return None  # xdist's own count: one per core


def pytest_generate_tests(metafunc):
    if "device_kind" in metafunc.fixturenames:
        metafunc.parametrize("device_kind", device_kinds(), scope="module")


@pytest.fixture(scope="module")
def device_kind():
    """The first kind present: the device of a test that asks for one only while it runs (``getfixturevalue``),
    which collection cannot parametrize; every other test is parametrized over ``device_kinds()`` instead."""
    return device_kinds()[0]


@pytest.fixture(scope="module")
def device(device_kind):
    """A device of each kind present (``fastckpt.device.default(kind)``), one after the other."""
    pytest.importorskip("pyopencl")
    if device_kind == "none":
        pytest.skip("no OpenCL device")
    from fastckpt.device import default

    return default(device_kind)


@pytest.fixture(scope="module")
def unified_device(device):
    """``device``, for tests of what only a device sharing host memory does (zero-copy): skipped on others."""
    from fastckpt.device import context

    if not context.shares_host_memory(device.device):
        pytest.skip(f"needs a device that shares host memory (zero-copy); {device.name} does not")
    return device


@pytest.fixture(scope="module")
def cpu_device(device):
    """``device`` where it is the CPU device (pocl), for tests of that device itself: skipped on others."""
    if device.kind != "cpu":
        pytest.skip(f"needs the OpenCL CPU device; this run is on {device.name} ({device.kind})")
    return device


@pytest.fixture(scope="module")
def queue(device):
    # Module-scoped like the device, so that module-scoped fixtures (e.g. test_nn_layers' has_fp64) can use it.
    return device.queue


@pytest.fixture
def pool(device):
    """A new, empty PersistentBufferPool on the default device for each test (its counters start at zero)."""
    from fastckpt.device.pool import PersistentBufferPool

    return PersistentBufferPool(device.context, device.queue)


@pytest.fixture(scope="session")
def s3():
    """A real S3 API on loopback for the whole session (moto's server, s3fs the client; ``tests/_s3.py``):
    ``s3.storage_options`` reach it, ``s3.url("name")`` is a fresh key prefix in its bucket."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import _s3

    server = _s3.start()
    yield server
    server.server.stop()


@pytest.fixture(scope="session")
def objects():
    """An object server on loopback whose ranged GETs take time in proportion to the range (aiohttp's static file
    handler: ``fastckpt.bench.objectserver``), reachable as ``s3://b/<key>`` (``objects.storage_options``) and as
    ``objects.http_url("b", key)``; objects are files written under ``objects.path("b", key)``."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("s3fs")
    from fastckpt.bench.objectserver import ObjectServer

    server = ObjectServer()
    yield server
    server.stop()
