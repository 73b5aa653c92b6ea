"""GatherWriter: buffers written in order, uncopied, with short writes resumed and errors raised."""

import errno
import os

import ml_dtypes
import numpy as np
import pytest
from _writing import file_size_limit
from fastckpt._native.gather import GatherWriter


@pytest.fixture
def fd(tmp_path):
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    yield fd
    os.close(fd)


def written(tmp_path):
    return (tmp_path / "out.bin").read_bytes()


def test_buffers_of_every_kind_come_out_in_order(tmp_path, fd):
    parts = [b"head", bytearray(b"-ba-"), memoryview(b"0123456789")[2:5], np.arange(6, dtype=np.int16).reshape(2, 3),
             np.array(7.5, np.float64), np.ones(3, ml_dtypes.bfloat16), np.array(["ab", "c"], "U2"),
             np.array([1, 2], "M8[s]"), np.zeros(0, np.float32), b""]
    with GatherWriter(fd) as out:
        for part in parts:
            out.write(part)
    expected = b"".join(bytes(memoryview(p).cast("B")) if not isinstance(p, np.ndarray) else p.tobytes() for p in parts)
    assert written(tmp_path) == expected
    assert out.written == len(expected)


def test_more_buffers_than_one_writev_takes(tmp_path, fd):
    arrays = [np.full(3, i, np.int32) for i in range(5000)]  # five calls of IOV_MAX (1024) buffers
    with GatherWriter(fd) as out:
        for a in arrays:
            out.write(a)
    assert np.array_equal(np.frombuffer(written(tmp_path), np.int32).reshape(-1, 3)[:, 0], np.arange(5000))


def test_nothing_is_written_before_a_flush_and_everything_after(tmp_path, fd):
    out = GatherWriter(fd)
    out.write(b"abc")
    assert written(tmp_path) == b"" and out.written == 0
    out.flush()
    assert written(tmp_path) == b"abc" and out.written == 3


def test_a_large_queue_flushes_by_itself(tmp_path, fd):
    out = GatherWriter(fd)
    for i in range(5):
        out.write(np.full(16 << 20, i, np.uint8))  # 64 MiB pending after the fourth
    assert out.written == 64 << 20
    out.flush()
    data = np.frombuffer(written(tmp_path), np.uint8)
    assert data.size == 80 << 20 and np.array_equal(data[:: 16 << 20], np.arange(5))


def test_a_short_write_keeps_what_went_out_and_the_failure_is_raised(tmp_path, fd):
    out = GatherWriter(fd)
    for i in range(8):
        out.write(bytes([i]) * 1000)
    with file_size_limit(2500):  # the kernel writes 2500 bytes, then refuses with EFBIG
        with pytest.raises(OSError) as info:
            out.flush()
    assert info.value.errno == errno.EFBIG
    assert written(tmp_path) == b"\x00" * 1000 + b"\x01" * 1000 + b"\x02" * 500
    out.write(b"more")  # the failed buffers were let go
    out.flush()
    assert written(tmp_path)[2500:] == b"more"


def test_an_exception_in_the_block_drops_what_is_pending(tmp_path, fd):
    with pytest.raises(RuntimeError, match="stop"):
        with GatherWriter(fd) as out:
            out.write(b"never")
            raise RuntimeError("stop")
    assert written(tmp_path) == b""


def test_a_bad_descriptor_raises_oserror_with_its_errno():
    r, w = os.pipe()
    os.close(w)
    os.close(r)
    out = GatherWriter(w)
    out.write(b"x")
    with pytest.raises(OSError) as info:
        out.flush()
    assert info.value.errno == errno.EBADF


def test_objects_without_bytes_are_refused(fd):
    out = GatherWriter(fd)
    with pytest.raises(TypeError):
        out.write("text is not bytes")
    with pytest.raises((BufferError, ValueError)):
        out.write(np.arange(6)[::2])  # not contiguous: its bytes are not one buffer
    out.flush()
    assert out.written == 0


def test_zero_padding_of_any_length_comes_out_in_place(tmp_path, fd):
    with GatherWriter(fd) as out:
        out.write(b"a")
        out.write_zeros(0)
        out.write_zeros(5)
        out.write(b"b")
        out.write_zeros((1 << 16) * 2 + 3)  # longer than the static zero block
        out.write(b"c")
    assert written(tmp_path) == b"a" + bytes(5) + b"b" + bytes((1 << 16) * 2 + 3) + b"c"
    with pytest.raises(ValueError, match="cannot write -1 zero bytes"):
        out.write_zeros(-1)


def test_zero_padding_fills_queues_like_any_buffer(tmp_path, fd):
    with GatherWriter(fd) as out:
        for i in range(3000):  # three IOV_MAX queues of (byte, padding) pairs
            out.write(bytes([i % 251]))
            out.write_zeros(3)
    assert written(tmp_path) == b"".join(bytes([i % 251]) + bytes(3) for i in range(3000))


def test_writes_interrupted_by_signals_resume_where_they_stopped():
    # A pipe drained slowly while SIGALRM fires every millisecond: writev returns short counts
    # (or EINTR) mid-buffer, and the writer must carry on from the exact byte.
    import signal
    import threading
    import time

    payload = [np.arange(i * 1000, (i + 1) * 1000, dtype=np.int64) for i in range(64)]  # 512 KB
    expected = b"".join(p.tobytes() for p in payload)
    r, w = os.pipe()
    got = bytearray()

    def drain():
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                return
            got.extend(chunk)
            time.sleep(0.0005)

    reader = threading.Thread(target=drain)
    alarms = []
    previous = signal.signal(signal.SIGALRM, lambda *a: alarms.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
    reader.start()
    try:
        out = GatherWriter(w)
        for p in payload:
            out.write(p)
        out.flush()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.close(w)
        reader.join()
        os.close(r)
    assert alarms, "no signal arrived during the write"
    assert bytes(got) == expected and out.written == len(expected)


def test_ctrl_c_during_a_blocked_write_raises_keyboard_interrupt():
    import signal

    r, w = os.pipe()  # nobody reads: the write blocks once the pipe is full

    def interrupt(*args):
        raise KeyboardInterrupt

    import threading

    # Should the interrupt be lost, closing the read end after 10 s fails the write (EPIPE) instead of
    # leaving the test blocked.
    watchdog = threading.Timer(10, os.close, (r,))
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    watchdog.start()
    try:
        out = GatherWriter(w)
        out.write(np.zeros(1 << 20, np.uint8))
        with pytest.raises(KeyboardInterrupt):
            out.flush()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        watchdog.cancel()
        os.close(w)
        try:
            os.close(r)
        except OSError:  # the watchdog closed it
            pass


def test_a_hasher_sees_every_byte_in_file_order(tmp_path):
    import hashlib

    import blake3

    from fastckpt.formats.hashing import blake3_file

    hashers = {"blake3": (blake3.blake3(), blake3.blake3), "sha256": (hashlib.sha256(), hashlib.sha256)}
    for name, (hasher, new) in hashers.items():
        path = tmp_path / f"{name}.bin"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with GatherWriter(descriptor, hasher) as out:
            out.write(b"head")
            out.write_zeros(70_000)  # more than one zero block
            for i in range(1500):  # more than one writev
                out.write(np.full(5, i, np.int64))
            out.write(np.full(20 << 20, 3, np.uint8))
        os.close(descriptor)
        data = path.read_bytes()
        assert hasher.hexdigest() == new(data).hexdigest()
    assert hashers["blake3"][0].hexdigest() == blake3_file(tmp_path / "blake3.bin")[0]



class _PositionHasher:
    """A hasher that records, at each update, the update's size and how many bytes the file held then."""

    def __init__(self, fd):
        import blake3

        self.fd, self.inner, self.calls = fd, blake3.blake3(), []

    def update(self, data):
        self.calls.append((memoryview(data).nbytes, os.lseek(self.fd, 0, os.SEEK_CUR)))
        self.inner.update(data)


def test_a_hasher_is_fed_each_step_just_before_it_is_written(tmp_path, fd):
    # Each step (a MiB at most) is hashed, then written, so the write copies bytes the hash has just brought into
    # the cache: the hash of a step never runs ahead of the file by more than that step.
    hasher = _PositionHasher(fd)
    big = np.arange(5 << 20, dtype=np.uint8)
    with GatherWriter(fd, hasher) as out:
        out.write(b"head")
        for i in range(3):
            out.write(np.full(1000, i, np.int64))
        out.write(big)
    data = written(tmp_path)
    assert data == b"head" + b"".join(np.full(1000, i, np.int64).tobytes() for i in range(3)) + big.tobytes()
    assert hasher.inner.hexdigest() == __import__("blake3").blake3(data).hexdigest()
    hashed = 0
    for size, position in hasher.calls:
        assert size <= 1 << 20
        assert hashed - position < 1 << 20, (hashed, position)  # written up to the step before this one
        hashed += size
    assert hashed == len(data)
    assert max(position for _, position in hasher.calls) >= len(data) - (1 << 20)


# -- direct=True: past the page cache, through an aligned stage ---------------------------------------------------

STAGE = 4 << 20  # the direct writer's stage


def _direct_flag(fd) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))


def _mixed_writes(out, rows_source, rows):
    out.write(b"x" * 1001)
    out.write_zeros(5000)
    out.write_rows(rows_source, rows, 1 << 20)
    out.write(np.arange(3_000_000, dtype=np.int16))  # crosses stages
    out.write_rows(rows_source[:, :25], rows, 1000)  # 100-byte rows: one straddles a stage's end


@pytest.mark.parametrize("tail", [0, 1, 4095, 4096, STAGE - 5000 - 1001])  # the last stage: short, full, aligned
def test_a_direct_writer_writes_and_hashes_the_bytes_a_buffered_one_does(tmp_path, tail):
    import blake3

    rng = np.random.default_rng(0)
    source = rng.random((60_000, 32), dtype=np.float32)
    rows = rng.permutation(60_000)[:50_001].astype(np.intp)
    results = []
    for direct in (False, True):
        path, hasher = tmp_path / f"out-{direct}", blake3.blake3()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            with GatherWriter(fd, hasher, 0, direct) as out:
                _mixed_writes(out, source, rows)
                out.write(b"t" * tail)
                if direct and hasattr(os, "O_DIRECT"):
                    assert _direct_flag(fd)  # ext4, xfs, btrfs and tmpfs (Linux 6.6+) take direct writes
            assert not _direct_flag(fd)  # its flags given back
            assert os.lseek(fd, 0, os.SEEK_CUR) == out.written == path.stat().st_size
        finally:
            os.close(fd)
        results.append((path.read_bytes(), hasher.hexdigest()))
    assert results[0] == results[1]
    assert results[0][1] == blake3.blake3(results[0][0]).hexdigest()
    expected = (b"x" * 1001 + bytes(5000) + source[rows].tobytes() + np.arange(3_000_000, dtype=np.int16).tobytes()
                + np.ascontiguousarray(source[:, :25])[rows].tobytes() + b"t" * tail)
    assert results[1][0] == expected


def test_a_direct_writer_copies_each_buffer_as_it_is_given(tmp_path, fd):
    buffer = np.zeros(10_000, np.uint8)
    with GatherWriter(fd, None, 0, True) as out:
        for value in range(1, 4):
            buffer[:] = value  # refilled at once: a direct writer holds no buffer of the caller's
            out.write(buffer)
    assert written(tmp_path) == b"".join(bytes([v]) * 10_000 for v in range(1, 4))


def test_a_direct_writer_off_an_aligned_offset_or_on_a_pipe_writes_through_the_cache(tmp_path, fd):
    os.write(fd, b"abc")
    with GatherWriter(fd, None, 0, True) as out:
        assert not _direct_flag(fd)
        out.write(b"d" * 10_000)
    assert written(tmp_path) == b"abc" + b"d" * 10_000
    read, write = os.pipe()
    try:
        with GatherWriter(write, None, 0, True) as out:
            out.write(b"through a pipe")
        assert os.read(read, 100) == b"through a pipe"
    finally:
        os.close(read)
        os.close(write)


def test_a_direct_writer_dropped_by_an_exception_writes_nothing_more_and_gives_the_flags_back(tmp_path, fd):
    with pytest.raises(RuntimeError, match="stop"), GatherWriter(fd, None, 0, True) as out:
        out.write(b"staged, never written")
        raise RuntimeError("stop")
    assert written(tmp_path) == b"" and not _direct_flag(fd)


def test_a_direct_write_cut_short_goes_on_through_the_cache_and_raises_the_failure(tmp_path, fd):
    # the second stage crosses the limit: short, then EFBIG
    with file_size_limit(STAGE + 1000), pytest.raises(OSError) as info, GatherWriter(fd, None, 0, True) as out:
        out.write(np.full(2 * STAGE, 7, np.uint8))
    assert info.value.errno == errno.EFBIG
    assert written(tmp_path) == b"\x07" * (STAGE + 1000)
    assert not _direct_flag(fd)
