"""MappedFile: zero-copy views, lifetime rules, bounds checks, both backends."""

import gc
import os
import random
import threading

import numpy as np
import pytest
from fastckpt._native.mapped import MappedFile

from fastckpt import FormatError

BACKENDS = ["mmap", "pread"]


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(np.arange(256, dtype=np.uint8).tobytes())
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_view_and_read_return_exact_bytes(data_file, backend):
    with MappedFile(data_file, backend=backend) as m:
        assert m.size == 256
        assert bytes(m.view(10, 5)) == bytes(range(10, 15))
        assert m.read(250, 6) == bytes(range(250, 256))
        assert bytes(m.view(200)) == bytes(range(200, 256))
        assert bytes(m.view(256, 0)) == b""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset,length", [(-1, 1), (0, 257), (256, 1), (255, 2), (2**62, 2**62)])
def test_out_of_range_raises_format_error_naming_file_and_range(data_file, backend, offset, length):
    with MappedFile(data_file, backend=backend) as m:
        with pytest.raises(FormatError, match=r"data\.bin.*file has 256 bytes"):
            m.view(offset, length)


def test_mmap_views_are_zero_copy_and_read_only(data_file):
    m = MappedFile(data_file)
    a = m.array(0, np.uint8, (256,))
    b = m.array(0, np.uint8, (256,))
    assert np.shares_memory(a, b)
    assert not a.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a[0] = 1
    assert m.address is not None and m.address % 4096 == 0


def test_views_outlive_close_and_handle(data_file):
    m = MappedFile(data_file)
    arr = m.array(4, "<u4", (2, 2))
    view = m.view(0, 4)
    m.close()
    m.close()  # idempotent
    assert m.closed and not m.valid
    assert repr(m) == "<Closed MappedFile>"
    del m
    gc.collect()
    expected = np.frombuffer(bytes(range(4, 20)), "<u4").reshape(2, 2)
    assert np.array_equal(arr, expected)
    assert bytes(view) == b"\x00\x01\x02\x03"


def test_closed_handle_refuses_new_views(data_file):
    m = MappedFile(data_file)
    m.close()
    with pytest.raises(ValueError, match="closed"):
        m.view(0, 1)


def test_copy_on_write_never_touches_the_file(data_file):
    m = MappedFile(data_file, copy_on_write=True)
    a = m.array(0, np.uint8, (256,))
    a[:] = 7
    assert np.all(m.array(0, np.uint8, (256,)) == 7)
    assert data_file.read_bytes() == bytes(range(256))


def test_fortran_order_and_zero_d(data_file):
    m = MappedFile(data_file)
    f = m.array(0, np.uint8, (2, 3), order="F")
    assert np.array_equal(f, np.arange(6, dtype=np.uint8).reshape((2, 3), order="F"))
    assert m.array(7, np.uint8, ()).item() == 7


def test_replaced_file_keeps_old_bytes_in_existing_views(data_file, tmp_path):
    m = MappedFile(data_file)
    arr = m.array(0, np.uint8, (256,))
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(b"\xff" * 256)
    os.replace(replacement, data_file)
    assert np.array_equal(arr, np.arange(256, dtype=np.uint8))
    assert MappedFile(data_file).read(0, 1) == b"\xff"


def test_empty_file(tmp_path):
    p = tmp_path / "empty"
    p.write_bytes(b"")
    for backend in BACKENDS:
        with MappedFile(p, backend=backend) as m:
            assert m.size == 0 and bytes(m.view()) == b""


def test_missing_file_keeps_errno(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        MappedFile(tmp_path / "nope")
    assert info.value.errno == 2


def test_bad_backend_is_rejected(data_file):
    with pytest.raises(ValueError, match="backend"):
        MappedFile(data_file, backend="magic")


def test_advice_accepts_known_kinds(data_file):
    with MappedFile(data_file) as m:
        m.advise("willneed", 10, 20)
        with pytest.raises(ValueError, match="advice"):
            m.advise("fast")


@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_is_the_fstat_of_the_file_as_opened(data_file, backend, tmp_path):
    st = os.stat(data_file)
    with MappedFile(data_file, backend=backend) as m:
        assert m.identity == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        (tmp_path / "new.bin").write_bytes(b"x" * 256)
        os.replace(tmp_path / "new.bin", data_file)
        assert os.stat(data_file).st_ino != m.identity[1], "identity describes the mapped file, not the path"


def test_pread_reads_in_many_threads_each_get_their_own_bytes(tmp_path):
    data = np.random.default_rng(0).bytes(1 << 20)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    m = MappedFile(path, backend="pread")
    wrong = []

    def reader(seed):
        rng = random.Random(seed)
        for _ in range(200):
            offset = rng.randrange(len(data) - 1)
            length = rng.randrange(1, min(1 << 17, len(data) - offset) + 1)
            if m.read(offset, length) != data[offset:offset + length]:
                wrong.append((offset, length))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.close()
    assert wrong == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_while_other_threads_read_never_gives_wrong_bytes(tmp_path, backend):
    data = np.random.default_rng(1).bytes(1 << 20)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    other = tmp_path / "other.bin"
    other.write_bytes(b"\xee" * len(data))  # what a reused descriptor would read
    m = MappedFile(path, backend=backend)
    wrong, started = [], threading.Barrier(4)

    def reader(seed):
        rng = random.Random(seed)
        started.wait()
        for _ in range(300):
            offset = rng.randrange(len(data) - (1 << 16))
            try:
                got = bytes(m.view(offset, 1 << 16))
            except ValueError as e:  # refused after close(): the only acceptable failure
                if "closed" not in str(e):
                    wrong.append(repr(e))
                return
            if got != data[offset:offset + (1 << 16)]:
                wrong.append(offset)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait()
    m.close()
    reopened = [os.open(other, os.O_RDONLY) for _ in range(8)]  # would take a descriptor closed too early
    for t in threads:
        t.join()
    for fd in reopened:
        os.close(fd)
    assert wrong == []


SHUTDOWN_SCRIPT = """
import sys
import numpy as np
import fastckpt
from fastckpt._native.mapped import MappedFile
from fastckpt.device.pool import PersistentBufferPool

data, npz = sys.argv[1], sys.argv[2]
open_view = MappedFile(data).array(0, np.uint8, (256,))        # the handle is gone, the view lives
pread = MappedFile(data, backend="pread"); pread_view = pread.view(0, 16)
closed = MappedFile(data); closed_view = closed.view(0, 8); closed.close()

class Cycle:
    pass

c = Cycle(); c.self = c                                          # freed only by the final collection
c.mapped = MappedFile(data, copy_on_write=True); c.view = c.mapped.array(0, np.uint8, (4,))
c.file = fastckpt.open(npz); c.tensor = c.file.host("a")
c.pool = PersistentBufferPool(None, allocator=lambda n: bytearray(n)); c.lease = c.pool.allocate(10)
print(int(open_view.sum()), bytes(pread_view[:2]), bytes(closed_view[:2]), c.tensor.tolist())
"""


def test_live_handles_views_and_cycles_at_interpreter_exit_are_clean(data_file, tmp_path):
    import subprocess
    import sys

    import fastckpt

    npz = tmp_path / "a.npz"
    fastckpt.save_npz(npz, {"a": np.arange(3, dtype=np.int16)}, fsync=False)
    done = subprocess.run([sys.executable, "-X", "dev", "-c", SHUTDOWN_SCRIPT, str(data_file), str(npz)],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"{sum(range(256))} b'\\x00\\x01' b'\\x00\\x01' [0, 1, 2]\n"


def test_array_refuses_object_dtypes_and_impossible_shapes(data_file):
    with MappedFile(data_file) as m:
        with pytest.raises(ValueError, match="holds Python objects"):
            m.array(0, object, (2,))
        with pytest.raises(FormatError, match="more bytes than memory can address"):
            m.array(0, np.float64, (2**40, 2**40))
        with pytest.raises(FormatError, match="at most 32"):
            m.array(0, np.uint8, (1,) * 33)
        with pytest.raises(FormatError, match="negative dimension"):
            m.array(0, np.uint8, (2, -1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_array_views_match_numpy_for_every_layout(data_file, backend):
    raw = np.arange(256, dtype=np.uint8)
    with MappedFile(data_file, backend=backend) as m:
        for offset, dtype, shape, order in [(0, "<u2", (4, 8), "C"), (3, ">i4", (2, 3, 4), "F"),
                                            (17, "<f8", (0, 5), "C"), (255, "u1", (), "C")]:
            dt = np.dtype(dtype)
            n = int(np.prod(shape)) * dt.itemsize
            expected = np.frombuffer(raw[offset:offset + n].tobytes(), dt).reshape(shape, order=order)
            got = m.array(offset, dt, shape, order=order)
            assert got.dtype == dt and got.shape == shape and got.tobytes(order="A") == expected.tobytes(order="A")
            assert np.array_equal(got, expected)
            assert got.flags.f_contiguous if order == "F" else got.flags.c_contiguous
