"""Fixtures shared by the test files: the default OpenCL device, its queue and a fresh buffer pool.

Tests that need these ask for them by name; a file that needs something different (another device kind, a pool
option) defines its own fixture of that name, which takes precedence, with a comment saying why.
"""

from __future__ import annotations

import pytest

# Tests asking for any of these use the OpenCL device: they get the `device` marker (declared in pyproject.toml)
# without having to say so, so that `-m "not device"` leaves them out.
DEVICE_FIXTURES = frozenset({"device", "queue", "pool"})


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if DEVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.device)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: no error where xdist is not loaded
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts) starts a worker per core for the whole suite only: a run naming its files or
    tests would spend more time starting workers, each importing numpy and pyopencl, than it saves."""
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return 0
    return None  # xdist's own count: one per core


@pytest.fixture(scope="module")
def device():
    """The default device (``fastckpt.device.default()``: a GPU if there is one, else the CPU through pocl)."""
    pytest.importorskip("pyopencl")
    from fastckpt.device import default

    return default()


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
