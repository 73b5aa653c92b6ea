"""Reads of cold files straight into their destinations: ``fastckpt.formats.readinto.read_into`` (``O_DIRECT`` for
the aligned blocks, the unaligned heads and tails through the page cache) and the pooled loads that use it for a
file not in the page cache (``fastckpt.device.load.DIRECT_READS``).

Every test checks exact bytes; none is timed (speed comes from ``fastckpt bench --suite cold``). The loads are made
to take the cold path by telling them the file is not cached (``load.cached``), so they do not depend on what the
page cache holds on the machine that runs them.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import fastckpt
from _cold_files import eight_tensors
from fastckpt.formats import readinto
from fastckpt.formats.readinto import DIRECT_ALIGN, direct_pieces, open_direct, read_into

A = DIRECT_ALIGN


def _file(tmp_path, size: int, name: str = "data.bin") -> tuple[str, bytes]:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def _aligned(n: int, shift: int) -> np.ndarray:
    """``n`` bytes of memory whose address is ``shift`` modulo DIRECT_ALIGN."""
    block = np.zeros(n + 2 * A, np.uint8)
    base = -block.ctypes.data % A
    return block[base + shift:base + shift + n]


def _descriptors(path: str):
    fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)
    return fd, open_direct(path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


@pytest.mark.parametrize("size", [1, 100, A - 1, A, A + 1, 3 * A + 123, 5 * A])
def test_every_head_tail_and_length_reads_exactly_the_files_bytes(tmp_path, size):
    path, data = _file(tmp_path, size)
    fd, direct = _descriptors(path)
    try:
        cases = []
        for offset in sorted({0, 1, A - 1, A, A + 7, size // 2, size - 1, size} & set(range(size + 1))):
            for n in sorted({0, 1, A - 1, A, A + 1, size - offset} & set(range(size - offset + 1))):
                for shift in ((offset % A), (offset + 3) % A):  # agreeing with the offset (direct), and not
                    cases.append((_aligned(n, shift), offset))
        calls = read_into(fd, cases, path, direct_fd=direct, threads=3, piece=A)
        for out, offset in cases:
            assert out.tobytes() == data[offset:offset + len(out)], (offset, len(out), out.ctypes.data % A)
        assert calls >= sum(1 for out, _ in cases if len(out))
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)


def test_only_whole_blocks_whose_address_agrees_with_the_offset_are_read_direct():
    out = _aligned(3 * A, 0)
    pieces = direct_pieces(memoryview(out)[100:], 100, 2 * A)
    assert [(len(v), o, d) for v, o, d in pieces] == [(A - 100, 100, False), (2 * A, A, True)]
    other = direct_pieces(memoryview(_aligned(3 * A, 5)), 0, A)  # address 5 apart from the offset: no direct read
    assert [d for _v, _o, d in other] == [False, False, False]
    assert direct_pieces(memoryview(_aligned(A - 1, 0)), 0, A)[0][2] is False  # less than a block
    assert direct_pieces(memoryview(_aligned(0, 0)), 0, A) == []


def test_a_file_system_that_refuses_direct_reads_is_read_through_the_page_cache(tmp_path, monkeypatch):
    path, data = _file(tmp_path, 4 * A + 5)
    fd, direct = _descriptors(path)
    if direct is None:
        direct = os.open(path, os.O_RDONLY)  # no O_DIRECT here: a stand-in that is refused below
    refused = []
    real = os.preadv

    def preadv(f, buffers, offset):
        if f == direct:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(f, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    out = _aligned(len(data), 0)
    try:
        read_into(fd, [(out, 0)], path, direct_fd=direct, threads=2, piece=A)
    finally:
        os.close(fd)
        os.close(direct)
    assert out.tobytes() == data and refused


def test_a_file_shorter_than_the_bytes_asked_for_is_an_error_naming_it_and_the_offset(tmp_path):
    path, _data = _file(tmp_path, 2 * A + 10)
    fd, direct = _descriptors(path)
    out = _aligned(3 * A, 0)
    try:
        with pytest.raises(OSError, match=rf"{path}: the file ended at byte {2 * A + 10}"):
            read_into(fd, [(out, 0)], path, direct_fd=direct, piece=A)
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)


def test_pairs_of_several_files_are_read_together_each_from_its_own_file(tmp_path):
    (p1, d1), (p2, d2) = _file(tmp_path, 3 * A + 1, "a.bin"), _file(tmp_path, 2 * A + 2, "b.bin")
    (f1, x1), (f2, x2) = _descriptors(p1), _descriptors(p2)
    o1, o2 = _aligned(3 * A - 9, 10 % A), _aligned(2 * A, 2)
    try:
        read_into(f1, [(o1, 10, f1, x1, p1), (o2, 2, f2, x2, p2)], p1, threads=4, piece=A)
    finally:
        for f in (f1, x1, f2, x2):
            if f is not None:
                os.close(f)
    assert o1.tobytes() == d1[10:10 + len(o1)] and o2.tobytes() == d2[2:2 + len(o2)]


# ------------------------------------------------------------------ pooled loads of cold files

TENSORS = {"odd": np.arange(3, dtype=np.float32), "big": np.arange(1 << 18, dtype=np.float32),
           "empty": np.zeros((0, 4), np.float32), "bytes": np.arange(4097, dtype=np.uint8),
           "mid": np.arange(77777, dtype=np.int64), "f16": np.ones((33, 3), np.float16)}


@pytest.fixture
def cold(monkeypatch):
    """Loads take the cold path: every region is reported as not in the page cache."""
    from fastckpt.device import load

    monkeypatch.setattr(load, "cached", lambda *a, **k: False)
    return load


def _exact(loaded, tensors) -> None:
    for name, want in tensors.items():
        got = loaded[name].to_host()
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), name
        assert loaded[name].offset % want.dtype.itemsize == 0, name


def test_a_cold_file_is_read_into_the_arena_exactly(tmp_path, unified_device, pool, cold):
    path = str(tmp_path / "m.safetensors")
    fastckpt.save_safetensors(path, TENSORS)
    loaded = fastckpt.load_file(path, unified_device.queue, pool=pool)
    assert loaded.report.reads > 0 and loaded.report.copies == 0
    _exact(loaded, TENSORS)
    npz = str(tmp_path / "m.npz")
    np.savez(npz, **TENSORS)  # numpy's own layout: payloads at odd offsets, regions read through the page cache
    loaded = fastckpt.load_file(npz, unified_device.queue, pool=pool)
    assert loaded.report.reads > 0
    for name, want in TENSORS.items():
        assert loaded[name].to_host().tobytes() == want.tobytes(), name


def test_a_warm_file_is_copied_from_its_mapping(tmp_path, unified_device, pool, monkeypatch):
    from fastckpt.device import load

    monkeypatch.setattr(load, "cached", lambda *a, **k: True)
    path = str(tmp_path / "m.safetensors")
    fastckpt.save_safetensors(path, TENSORS)
    loaded = fastckpt.load_file(path, unified_device.queue, pool=pool)
    assert loaded.report.reads == 0 and loaded.report.copies > 0
    _exact(loaded, TENSORS)


def _sharded_and_recorded(tmp_path, monkeypatch):
    """``TENSORS`` as a Hugging Face directory of several shards, its shard paths, and the list that records the
    files each read_into call reads (sorted paths)."""
    directory = str(tmp_path / "hf")
    fastckpt.save_sharded(directory, TENSORS, max_shard_size=600_000)
    calls = []
    real = readinto.read_into

    def read_into_(fd, pairs, path, **kw):
        calls.append(sorted({pair[4] for pair in pairs}))
        return real(fd, pairs, path, **kw)

    monkeypatch.setattr(readinto, "read_into", read_into_)
    shards = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))
    return directory, shards, calls


def test_a_hugging_face_directory_reads_all_its_files_at_once(tmp_path, unified_device, pool, cold, monkeypatch):
    directory, shards, calls = _sharded_and_recorded(tmp_path, monkeypatch)
    loaded = fastckpt.load_file(directory, unified_device.queue, pool=pool)
    assert len(shards) > 2 and calls == [shards]  # one read of every shard's regions
    _exact(loaded, TENSORS)


def test_a_cold_netcl_model_loads_exactly(tmp_path, unified_device, pool, cold):
    from fastckpt.io import load_model, save_model
    from fastckpt.nn import build_sequential

    config = [{"type": "Linear", "args": {"in_features": 64, "out_features": 48, "bias": True}}] * 3
    path = str(tmp_path / "m.netcl")
    save_model(build_sequential(unified_device.queue, config), path)
    model = load_model(path, unified_device.queue, pool=pool)
    assert model.load_report.file_report.reads > 0
    with np.load(path) as z:
        want = {k: z[k] for k in z.files if k != "__netcl_meta__"}
    got = model.state_dict()
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_file_changed_before_its_cold_load_is_an_error_naming_it(tmp_path, unified_device, pool, cold):
    path = str(tmp_path / "m.safetensors")
    fastckpt.save_safetensors(path, TENSORS)
    with fastckpt.open(path) as f:
        with open(path, "r+b") as w:  # the same size, other bytes
            w.seek(-8, os.SEEK_END)
            w.write(b"\xff" * 8)
        os.utime(path, ns=(1, 1))
        with pytest.raises(fastckpt.FormatError, match=rf"{path}: the file was truncated or replaced .* written to"):
            fastckpt.load_file(f, unified_device.queue, pool=pool)


@pytest.mark.parametrize("how", ["truncated", "written"])
def test_a_file_changed_while_it_is_read_is_an_error_naming_it(tmp_path, unified_device, pool, cold, monkeypatch,
                                                               how):
    directory = str(tmp_path / "hf")
    fastckpt.save_sharded(directory, TENSORS, max_shard_size=600_000)
    victim = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))[-1]
    real = readinto.read_into

    def read_into_(fd, pairs, path, **kw):
        if how == "truncated":
            os.truncate(victim, 100)
        else:
            with open(victim, "r+b") as w:
                w.seek(-4, os.SEEK_END)
                w.write(b"\0\0\0\0")
            os.utime(victim, ns=(2, 2))
        return real(fd, pairs, path, **kw)

    monkeypatch.setattr(readinto, "read_into", read_into_)
    with pytest.raises(fastckpt.FormatError, match=rf"{victim}: the file was truncated or replaced"):
        fastckpt.load_file(directory, unified_device.queue, pool=pool)
    assert pool.stats.bytes_in_use == 0  # the leases went back


# ------------------------------------------------------------------ host copies of cold files (load_tree)

@pytest.fixture
def cold_host(monkeypatch):
    """Host copies take the cold path: every file's data is reported as not in the page cache."""
    from fastckpt.formats import reader

    monkeypatch.setattr(reader, "cached", lambda *a, **k: False)
    monkeypatch.setattr(reader, "COPY_READ_MIN", 1)  # the small tensors too: every head and tail
    return reader


def test_load_tree_of_a_cold_file_reads_every_tensor_exactly(tmp_path, cold_host, monkeypatch):
    path = str(tmp_path / "t.safetensors")
    fastckpt.save_safetensors(path, TENSORS)
    calls = []
    real = readinto.read_into
    monkeypatch.setattr(readinto, "read_into", lambda fd, pairs, p, **kw: calls.append(len(pairs)) or
                        real(fd, pairs, p, **kw))
    tree = fastckpt.load_tree(path)
    assert calls == [len(TENSORS) - 1]  # one read of every tensor but the empty one
    for name, want in TENSORS.items():
        got = tree[name]
        assert got.flags.writeable and got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name
    npz = str(tmp_path / "t.npz")
    np.savez(npz, **TENSORS)  # odd offsets: no address agrees, every byte through the page cache
    tree = fastckpt.load_tree(npz)
    assert all(tree[name].tobytes() == want.tobytes() for name, want in TENSORS.items())


def test_copies_of_a_hugging_face_directory_read_every_shard_at_once(tmp_path, cold_host, monkeypatch):
    directory, shards, calls = _sharded_and_recorded(tmp_path, monkeypatch)
    with fastckpt.open(directory) as r:
        out = cold_host.copies(r)
    assert len(shards) > 2 and calls == [shards]
    assert list(out) == list(TENSORS) and all(out[k].tobytes() == v.tobytes() for k, v in TENSORS.items())


def test_a_file_changed_while_its_copies_are_read_is_an_error_naming_it(tmp_path, cold_host, monkeypatch):
    path = str(tmp_path / "t.safetensors")
    fastckpt.save_safetensors(path, TENSORS)
    real = readinto.read_into

    def read_into_(fd, pairs, p, **kw):
        os.truncate(path, 4096)
        return real(fd, pairs, p, **kw)

    monkeypatch.setattr(readinto, "read_into", read_into_)
    with pytest.raises(fastckpt.FormatError, match=rf"{path}: the file was truncated or replaced"):
        fastckpt.load_tree(path)


@pytest.mark.parametrize("cold_file", [True, False])
def test_pread_backend_copies_of_large_tensors_of_a_cold_file_are_read_in_pieces(tmp_path, monkeypatch, cold_file):
    from fastckpt.formats import reader

    monkeypatch.setattr(reader, "file_cached", lambda fd, offsets: not cold_file)
    monkeypatch.setattr(reader, "COPY_READ_MIN", 4096)
    calls = []
    real = readinto.read_into
    monkeypatch.setattr(readinto, "read_into", lambda fd, pairs, p, **kw: calls.append(len(pairs)) or
                        real(fd, pairs, p, **kw))
    path = str(tmp_path / "t.safetensors")
    fastckpt.save_safetensors(path, TENSORS)
    with fastckpt.open(path, backend="pread") as f:
        got = {name: f.host(name) for name in f.keys()}
    big = [n for n, a in TENSORS.items() if a.nbytes >= 4096]
    assert calls == ([1] * len(big) if cold_file else [])
    for name, want in TENSORS.items():
        assert got[name].tobytes() == want.tobytes() and got[name].shape == want.shape, name
        assert not got[name].flags.writeable, name  # the backend's copies are read-only, as its views would be


def test_a_hugging_face_directorys_next_shard_is_read_ahead_once_this_one_is(tmp_path, monkeypatch):
    from fastckpt.formats import reader

    tensors = {f"w{i}": np.full(1 << 18, i, np.float32) for i in range(4)}  # 1 MiB each, one per shard
    directory = str(tmp_path / "hf")
    fastckpt.save_sharded(directory, tensors, max_shard_size=(1 << 20) + 1)
    events = []
    monkeypatch.setattr(reader, "cached", lambda *a, **k: False)
    monkeypatch.setattr(reader, "read_ahead", lambda mapped, start, end, **k: events.append(
        ("ahead", os.path.basename(mapped.path))) or 1)
    with fastckpt.open(directory) as r:
        for name in r.keys():
            events.append(("view", r.weight_map[name]))
            assert r.host(name).tobytes() == tensors[name].tobytes()
    shards = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    assert len(shards) == 4
    for k, shard in enumerate(shards[1:], 1):
        # each later shard was asked for before its first view, right after the view of the shard before it
        assert events.index(("ahead", shard)) < events.index(("view", shard)), events


@pytest.mark.parametrize("source", ["file", "hf"])
def test_a_cold_staged_load_reads_whole_blocks_direct_into_the_staging_buffers(tmp_path, device, pool, cold,
                                                                               monkeypatch, source):
    from fastckpt.device import staging

    tensors = {**TENSORS, "large": np.arange(3 << 20, dtype=np.uint8)}
    path = str(tmp_path / "m.safetensors") if source == "file" else str(tmp_path / "hf")
    if source == "file":
        fastckpt.save_safetensors(path, tensors)
    else:
        fastckpt.save_sharded(path, tensors, max_shard_size=2 << 20)
    direct_reads, calls = [], []
    real = staging.read_into

    def read_into_(fd, pairs, p, **kw):
        if kw.get("direct_fd") is not None:
            for dst, offset in pairs:
                direct_reads.extend((len(v), d) for v, _o, d in direct_pieces(memoryview(dst), offset, 1 << 30))
        calls.append(real(fd, pairs, p, **kw))
        return calls[-1]

    monkeypatch.setattr(staging, "read_into", read_into_)
    loaded = fastckpt.load_file(path, device.queue, pool=pool, staging=True)
    _exact(loaded, tensors)
    assert loaded.report.staging_chunk and loaded.report.reads == sum(calls) > 0  # the fills' reads, counted
    if _has_direct(tmp_path):
        # Counted in bytes, not pieces: how many small head and tail pieces a load has depends on how its batches
        # fell, while the whole blocks between them are nearly every byte whatever the batches.
        direct = sum(n for n, d in direct_reads if d)
        assert direct_reads and direct >= 0.9 * sum(n for n, _d in direct_reads), ("most bytes are read whole "
                                                                                    "blocks directly", direct_reads)


def _has_direct(directory) -> bool:
    """Whether the file system of ``directory`` opens files ``O_DIRECT`` (tmpfs and some FUSE do not)."""
    probe = str(directory / "direct-probe")
    open(probe, "wb").close()
    st = os.stat(probe)
    fd = open_direct(probe, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    if fd is not None:
        os.close(fd)
    return fd is not None


def test_a_cold_staged_load_leases_the_buffers_of_its_direct_fill_threads(tmp_path, device, pool, cold, monkeypatch):
    """A cold load's fills are O_DIRECT reads on DIRECT_THREADS threads however few the cores: its staging buffers
    are those that many threads fill at once (staging_shape's rule for that many cores). With the buffers of the 2
    cores' shape, 3-4 reads were in the disk's queue and the fills waited for the copies (docs/reading.md)."""
    from fastckpt.device import staging
    from fastckpt.formats.readinto import DIRECT_THREADS

    if not _has_direct(tmp_path):
        pytest.skip("the file system has no O_DIRECT reads")
    monkeypatch.setattr(staging, "_cpus", lambda: 2)  # a 2-core host, whatever this one has
    tensors = {"large": np.arange(64 << 20, dtype=np.uint8) * 3}
    path = str(tmp_path / "m.safetensors")
    fastckpt.save_safetensors(path, tensors)
    loaded = fastckpt.load_file(path, device.queue, pool=pool, staging=True)
    _exact(loaded, tensors)
    chunk, total = loaded.report.staging_chunk, 64 << 20
    want = staging.staging_shape(total, chunk, cpus=DIRECT_THREADS).buffers
    assert want > staging.staging_shape(total, chunk, cpus=2).buffers  # the test tells the two shapes apart
    assert loaded.report.staging_buffers == want and loaded.report.fill_threads == DIRECT_THREADS
    assert pool.stats.staging_allocations == want  # leased once, at that count


def test_a_warm_staged_load_keeps_the_shape_of_its_cores(tmp_path, device, pool, monkeypatch):
    from fastckpt.device import load, staging

    monkeypatch.setattr(staging, "_cpus", lambda: 2)
    monkeypatch.setattr(load, "cached", lambda *a, **k: True)  # every region in the page cache: no O_DIRECT
    tensors = {"large": np.arange(64 << 20, dtype=np.uint8) * 5}
    path = str(tmp_path / "m.safetensors")
    fastckpt.save_safetensors(path, tensors)
    loaded = fastckpt.load_file(path, device.queue, pool=pool, staging=True)
    _exact(loaded, tensors)
    shape = staging.staging_shape(64 << 20, loaded.report.staging_chunk, cpus=2)
    assert (loaded.report.staging_buffers, loaded.report.fill_threads) == (shape.buffers, shape.threads)


def test_a_staged_load_leases_its_buffers_before_the_arenas_prefault_begins(tmp_path, unified_device, pool, cold,
                                                                              monkeypatch):
    """Each step of a new arena's prefault holds the process's memory map while it zeroes 8 MiB; the staging
    lease's allocations and advice waited behind it (6-23 ms for 6 buffers, docs/reading.md)."""
    from fastckpt.device import load, staging

    events = []
    real_lease, real_begin = staging.lease_staging, load._Prefault.begin
    monkeypatch.setattr(staging, "lease_staging", lambda *a: events.append("lease") or real_lease(*a))
    monkeypatch.setattr(load._Prefault, "begin", lambda self: events.append("prefault") or real_begin(self))
    tensors = {"large": np.arange(24 << 20, dtype=np.uint8) * 11}
    path = str(tmp_path / "m.safetensors")
    fastckpt.save_safetensors(path, tensors)
    loaded = fastckpt.load_file(path, unified_device.queue, pool=pool, staging=True)
    _exact(loaded, tensors)
    assert events[:2] == ["lease", "prefault"], events


def _vm_flags(address: int) -> list:
    """The ``VmFlags`` of the mapping holding ``address`` in this process (``hg``: advised MADV_HUGEPAGE)."""
    flags, inside = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    return flags


@pytest.mark.parametrize("advised", [True, False])
def test_new_staging_buffers_on_a_device_sharing_host_memory_are_advised_huge_pages(unified_device, pool,
                                                                                     monkeypatch, advised):
    """An O_DIRECT read into 4 KiB pages goes to the disk in requests of at most max_segments scattered pages; into
    2 MiB pages in requests of max_sectors_kb (a cold 512 MiB staged load: 1,000 requests of 540 KiB against 200 of
    2.6 MiB, docs/reading.md). STAGING_HUGE_PAGES = False leaves the runtime's pages."""
    from fastckpt.device import staging
    from fastckpt.device.hugepages import huge_pages_available

    if not os.path.exists("/proc/self/smaps") or not huge_pages_available():
        pytest.skip("no transparent huge pages to ask for here")
    monkeypatch.setattr(staging, "STAGING_HUGE_PAGES", advised)
    asked = []
    real = staging.advise_huge_pages
    monkeypatch.setattr(staging, "advise_huge_pages",
                        lambda queue, buffer, n: asked.append(n) or real(queue, buffer, n))
    stage = staging.lease_staging(unified_device.queue, pool, 8 << 20, 2)
    try:
        assert asked == ([8 << 20] * 2 if advised else [])
        for host in stage.hosts:
            middle = host.ctypes.data + (4 << 20)  # inside the advised range, whatever the buffer's alignment
            # (unadvised memory may still lie in a mapping advised before: the runtime's malloc reuses memory)
            assert "hg" in _vm_flags(middle) or not advised
            host[:] = 7  # still the buffer's memory, written as a fill writes it
            assert int(host[::4096].sum()) == 7 * len(host[::4096])
    finally:
        stage.release()


def test_a_cold_staged_load_cuts_its_batches_and_fill_parts_on_file_blocks(tmp_path, device, pool, cold,
                                                                           monkeypatch):
    """Every batch and fill part of a cold staged load starts and ends on a block of the file, so that only the
    ends of each region are read through the page cache (a head and a tail at every cut cost two small reads each,
    waited for one after the other by a fill thread), and the fills run on as many threads as direct reads do."""
    from fastckpt.device import staging
    from fastckpt.formats.readinto import DIRECT_THREADS

    if not _has_direct(tmp_path):
        pytest.skip("the file system has no O_DIRECT reads")
    tensors = {"head": np.arange(5, dtype=np.uint8), "large": np.arange(24 << 20, dtype=np.uint8) * 7}
    path = str(tmp_path / "m.safetensors")
    fastckpt.save_safetensors(path, tensors)  # data at an offset that is not a multiple of a block
    plain = []
    real = staging.read_into

    calls = []

    def read_into_(fd, pairs, p, **kw):
        for dst, offset in pairs:
            plain.extend(len(v) for v, _o, d in direct_pieces(memoryview(dst), offset, 1 << 30) if not d)
        calls.append(real(fd, pairs, p, **kw))
        return calls[-1]

    monkeypatch.setattr(staging, "read_into", read_into_)
    loaded = fastckpt.load_file(path, device.queue, pool=pool, staging=4 << 20)  # ramp batches of 2 MiB less 2 KiB
    _exact(loaded, tensors)
    assert len(plain) <= 2 and all(n < DIRECT_ALIGN for n in plain), plain  # the region's head and tail only
    assert loaded.report.fill_threads >= DIRECT_THREADS
    assert loaded.report.reads == sum(calls) > 0  # the fills' reads are the load's reads (they were left out)


@pytest.mark.parametrize("source", ["file", "hf"])
def test_a_cold_pooled_load_with_progress_reads_into_the_arena_and_counts_every_tensor(tmp_path, unified_device,
                                                                                      pool, cold, source):
    path = str(tmp_path / "m.safetensors") if source == "file" else str(tmp_path / "hf")
    if source == "file":
        fastckpt.save_safetensors(path, TENSORS)
    else:
        fastckpt.save_sharded(path, TENSORS, max_shard_size=600_000)
    seen = []
    loaded = fastckpt.load_file(path, unified_device.queue, pool=pool,
                                progress=lambda done, total, item: seen.append((done, total, item)))
    assert loaded.report.reads > 0 and loaded.report.copies == 0  # the direct reads, not copies from the mapping
    _exact(loaded, TENSORS)
    payload = sum(a.nbytes for a in TENSORS.values())
    counted = [item for _d, _t, item in seen if item]
    assert sorted(counted) == sorted(n for n, a in TENSORS.items() if a.nbytes), seen  # each once, as it arrives
    assert seen[-1][0] == seen[-1][1] == payload
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("source", ["file", "hf"])
def test_a_cold_file_whose_first_window_the_open_read_is_still_read_ahead_of_its_copies(tmp_path, monkeypatch,
                                                                                        source):
    """The open of a cold file reads its first window (its own advice, the header's parse): the file must still be
    found cold and read ahead to its end past the views, every shard of a Hugging Face directory too. The page cache
    is played by ``mincore``: a page is cached where it lies in the first MiB of its file."""
    import ctypes

    from fastckpt.formats import reader

    tensors, path = eight_tensors(tmp_path, source)
    asked = []
    monkeypatch.setattr(reader, "read_ahead", lambda mapped, start, end, **k: asked.append(
        (os.path.basename(mapped.path), start, end)) or 1)
    with fastckpt.open(path) as r:
        files = [r] if source == "file" else list(r.files.values())
        bases = sorted((f.mapped.address - f.mapped.address % 4096, f.mapped.size) for f in files)

        def mincore(address, _length, out):
            cached = any(base <= address < base + (1 << 20) for base, _size in bases)
            ctypes.memset(out, 1 if cached else 0, 1)
            return 0

        monkeypatch.setattr(readinto, "_mincore_fn", mincore)
        for name in r.keys():
            assert r.host(name).tobytes() == tensors[name].tobytes(), name
    ends = {}
    for name, _start, end in asked:
        ends[name] = max(end, ends.get(name, 0))
    assert ends == {os.path.basename(f.path): f.mapped.size for f in files}, asked  # every file, to its end


# ------------------------------------------------------------------ staged loads on a device sharing host memory


@pytest.mark.parametrize("source", ["file", "hf"])
def test_a_staged_load_on_a_device_sharing_host_memory_makes_its_new_arena_present_while_it_fills(
        tmp_path, unified_device, pool, cold, monkeypatch, source):
    """The runtime's copies out of the pinned buffers are CPU copies there: the new arena's pages are made present on
    a thread of their own (0.5.0: every copy faulted and zeroed the fresh pages it wrote); a pool hit has its pages."""
    import gc

    from fastckpt.device import load
    from fastckpt.device.hugepages import host_address

    made = []
    real = load._Prefault

    def recording(*args, **kw):
        made.append(real(*args, **kw))
        return made[-1]

    monkeypatch.setattr(load, "_Prefault", recording)
    tensors = {"a": np.arange(5 << 20, dtype=np.float32) * 3, "b": np.arange(7, dtype=np.int16),
               "c": np.arange(3 << 20, dtype=np.uint8)}
    path = str(tmp_path / "m.safetensors") if source == "file" else str(tmp_path / "hf")
    if source == "file":
        fastckpt.save_safetensors(path, tensors)
    else:
        fastckpt.save_sharded(path, tensors, max_shard_size=(12 << 20))
    loaded = fastckpt.load_file(path, unified_device.queue, pool=pool, staging=True)
    _exact(loaded, tensors)
    assert loaded.report.staging_chunk > 0 and loaded.report.pool_misses >= 1
    assert len(made) == loaded.report.pool_misses  # one per new arena
    for prefault in made:
        assert prefault.thread is None or not prefault.thread.is_alive()  # stopped before load_file returned
        assert prefault.steps >= 1  # it made pages present
    buffers = {loaded[name].buffer.int_ptr: loaded[name].buffer for name in tensors}
    addresses = {host_address(unified_device.queue, b, b.size) for b in buffers.values()}
    assert {p.start for p in made} <= {a + -a % 4096 for a in addresses}, (made, addresses)  # the arenas' memory
    made.clear()
    del loaded
    gc.collect()  # the leases go back to the pool
    again = fastckpt.load_file(path, unified_device.queue, pool=pool, staging=True)
    _exact(again, tensors)
    assert again.report.pool_misses == 0 and made == []  # a pool hit: its pages are there


def test_an_unstaged_or_warm_pooled_load_makes_no_arena_present_on_a_thread(tmp_path, unified_device, pool,
                                                                          monkeypatch):
    from fastckpt.device import load

    made = []
    monkeypatch.setattr(load, "_Prefault", lambda *a, **k: made.append(1))
    path = str(tmp_path / "m.safetensors")
    tensors = {"a": np.arange(5 << 20, dtype=np.float32)}
    fastckpt.save_safetensors(path, tensors)
    _exact(fastckpt.load_file(path, unified_device.queue, pool=pool), tensors)  # the unified path reads into it
    assert made == []


# ------------------------------------------------------------------ opening a cold file: its index read first


def _preads(monkeypatch):
    calls, real = [], os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: calls.append((n, offset)) or real(fd, n, offset))
    return calls


@pytest.mark.parametrize("tensors", [4, 3000])  # an index in the first 64 KiB, and one of about 200 KiB
def test_a_cold_files_index_is_read_with_pread_before_its_parse_and_a_warm_files_is_not(tmp_path, monkeypatch,
                                                                                          tensors):
    from fastckpt.formats import reader

    path = str(tmp_path / "m.safetensors")
    arrays = {f"layer.{i:05d}.a_rather_long_parameter_name.weight": np.full(3, i, np.int16) for i in range(tensors)}
    fastckpt.save_safetensors(path, arrays)
    with open(path, "rb") as f:
        header_end = 8 + int.from_bytes(f.read(8), "little")
    asked = []
    monkeypatch.setattr(reader, "cached",
                        lambda mapped, start, end, samples=2, **k: asked.append((start, end)) or False)
    calls = _preads(monkeypatch)
    with reader.open_file(path, first_window=False) as f:  # as a Hugging Face directory opens its shards
        assert {k: f.host(k).tolist() for k in f.keys()} == {k: a.tolist() for k, a in arrays.items()}
    assert asked[0] == (0, 1)  # the first page: is the file cold?
    assert calls[0] == (reader.HEAD_READ, 0)
    read = sum(n for n, _offset in calls)
    assert read >= header_end and read - header_end < reader.READ_AHEAD_MIN  # the whole index, not the file
    assert [offset for _n, offset in calls] == [sum(n for n, _o in calls[:k]) for k in range(len(calls))]  # in order
    if header_end <= reader.HEAD_READ:
        assert len(calls) == 1
    monkeypatch.setattr(reader, "cached", lambda *a, **k: True)  # warm: the parse reads the cached index as before
    calls.clear()
    with reader.open_file(path, first_window=False) as f:
        assert len(f) == tensors
    assert calls == []
    monkeypatch.setattr(reader, "cached", lambda *a, **k: False)  # a file opened alone: advised at once, as in 0.8
    with fastckpt.open(path) as f:
        assert len(f) == tensors
    assert calls == []


def test_an_index_that_cannot_be_read_first_is_parsed_from_the_mapping_as_before(tmp_path, monkeypatch):
    from fastckpt.formats import reader

    path = str(tmp_path / "m.safetensors")
    fastckpt.save_safetensors(path, {"a": np.arange(5, dtype=np.int32)})
    monkeypatch.setattr(reader, "cached", lambda *a, **k: False)

    def failing(fd, n, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "pread", failing)
    with reader.open_file(path, first_window=False) as f:
        assert f["a"].tolist() == [0, 1, 2, 3, 4]
    fastckpt.save_npz(str(tmp_path / "m.npz"), {"b": np.ones(2, np.float32)})  # NPZ: the first bytes only
    monkeypatch.undo()
    monkeypatch.setattr(reader, "cached", lambda *a, **k: False)
    calls = _preads(monkeypatch)
    with reader.open_file(str(tmp_path / "m.npz"), first_window=False) as f:
        assert f["b"].tolist() == [1.0, 1.0]
    assert calls == [(reader.HEAD_READ, 0)]


def test_hosts_after_a_view_reads_ahead_from_where_the_views_window_ends_not_from_the_first_tensor(tmp_path,
                                                                                                   monkeypatch):
    from fastckpt.formats import reader

    path = str(tmp_path / "m.safetensors")
    tensors = {f"w{i}": np.full(1 << 18, i, np.float32) for i in range(12)}  # 1 MiB each
    fastckpt.save_safetensors(path, tensors)
    asked = []
    monkeypatch.setattr(reader, "cached", lambda *a, **k: False)  # as if cold
    monkeypatch.setattr(reader, "READ_AHEAD", 4 << 20)
    monkeypatch.setattr(reader, "read_ahead", lambda mapped, start, end, **k: asked.append((start, end)))
    with fastckpt.open(path) as f:
        first = f.info("w0")
        assert f.host("w0").tobytes() == tensors["w0"].tobytes()
        assert asked == [(first.offset, first.offset + first.nbytes + (4 << 20))]
        views = f.hosts()
        assert {k: v.tobytes() for k, v in views.items()} == {k: v.tobytes() for k, v in tensors.items()}
    assert asked[1:] == [(asked[0][1], os.path.getsize(path))]  # the rest of the file, once; nothing read twice


def test_a_hugging_face_directory_advises_each_shards_first_window_once_every_index_is_parsed(tmp_path, monkeypatch):
    from fastckpt.formats import reader

    tensors = {f"w{i}": np.full(1 << 10, i, np.float32) for i in range(4)}
    directory = str(tmp_path / "hf")
    fastckpt.save_sharded(directory, tensors, max_shard_size=(4 << 10) + 1)  # one tensor a shard
    events, parse, advise = [], reader._parse, reader._advise
    monkeypatch.setattr(reader, "_parse", lambda mapped, *a: events.append(("parse", mapped.path)) or parse(mapped, *a))
    monkeypatch.setattr(reader, "_advise",
                        lambda mapped, kind: events.append((kind, mapped.path)) or advise(mapped, kind))
    with fastckpt.open(directory) as r:
        assert {k: r.host(k).tolist() for k in r.keys()} == {k: a.tolist() for k, a in tensors.items()}
        shards = sorted(f.path for f in r.files.values())
    assert len(shards) == 4
    kinds = [kind for kind, _path in events]
    last_parse = max(k for k, kind in enumerate(kinds) if kind == "parse")
    assert sorted(p for kind, p in events if kind == "willneed") == shards  # each shard's window, once
    assert all(k > last_parse for k, kind in enumerate(kinds) if kind == "willneed")  # after every index
    events.clear()
    single = str(tmp_path / "one.safetensors")
    fastckpt.save_safetensors(single, tensors)
    with fastckpt.open(single) as f:
        assert f["w3"].tolist() == tensors["w3"].tolist()
    assert events == [("parse", single)]  # a file alone: MappedFile's own advice at the map, as in 0.8


def test_load_tree_and_pooled_loads_ask_no_first_window_of_what_they_read_themselves(tmp_path, monkeypatch, queue,
                                                                                      pool):
    # They read a cold file with O_DIRECT into their destinations: the first window's MADV_WILLNEED at the map read
    # those bytes once more through the page cache (8 MiB of each file, 520 MiB from disk for a 512 MiB file).
    from fastckpt.formats import hfsharded, reader
    from fastckpt.formats.reader import TensorFile

    tensors = {f"w{i}": np.full(1 << 10, i, np.float32) for i in range(4)}
    single, directory = str(tmp_path / "one.safetensors"), str(tmp_path / "hf")
    fastckpt.save_safetensors(single, tensors)
    fastckpt.save_sharded(directory, tensors, max_shard_size=(4 << 10) + 1)  # one tensor a shard
    opened, windows = [], []

    def spied(open_file):
        return lambda path, **k: opened.append(k.get("first_window", True)) or open_file(path, **k)

    monkeypatch.setattr(reader, "open_file", spied(reader.open_file))
    monkeypatch.setattr(hfsharded, "open_file", spied(hfsharded.open_file))
    advise = TensorFile.advise_first_window
    monkeypatch.setattr(TensorFile, "advise_first_window", lambda f: windows.append(f.path) or advise(f))
    expected = {k: a.tolist() for k, a in tensors.items()}

    def flat(tree):
        return {k: v.tolist() for k, v in tree.items()}

    assert flat(fastckpt.load_tree(single)) == expected and flat(fastckpt.load_tree(directory)) == expected
    for source in (single, directory):
        loaded = fastckpt.load_file(source, queue, pool=pool)
        assert {k: loaded[k].to_host().tolist() for k in loaded} == expected
    assert opened == [False] * 10 and windows == []  # a file, 4 shards; twice
    from fastckpt.io import load_model, save_model
    from fastckpt.nn import Linear, Sequential

    netcl = str(tmp_path / "m.netcl")
    save_model(Sequential(Linear(queue, 3, 2)), netcl)
    opened.clear()
    model = load_model(netcl, pool=pool)
    assert opened == [False] and windows == [] and len(model.state_dict()) == 2
    opened.clear()
    with fastckpt.open(single) as f, fastckpt.open(directory) as d:  # what a caller copying out of views gets
        assert f["w0"].tolist() == d.host("w0").tolist()
    assert opened == [True, False, False, False, False] and len(windows) == 4


def test_a_cold_staged_load_asks_the_kernel_to_read_ahead_only_what_it_does_not_read_direct(tmp_path, device, pool,
                                                                                          monkeypatch):
    # A region read with O_DIRECT into the staging buffers was also advised WILLNEED, which read its first window a
    # second time through the page cache (520 MiB from disk for the cold suite's 512 MiB file).
    from fastckpt.device import load

    path = str(tmp_path / "m.safetensors")
    tensors = {**TENSORS, "large": np.arange(3 << 20, dtype=np.uint8)}
    fastckpt.save_safetensors(path, tensors)
    advised = []
    monkeypatch.setattr(load, "_read_ahead", lambda mapped, start, end: advised.append((start, end)))
    monkeypatch.setattr(load, "cached", lambda *a, **k: False)  # cold
    _exact(fastckpt.load_file(path, device.queue, pool=pool, staging=True), tensors)
    direct = _has_direct(tmp_path)
    assert (advised == []) == direct, advised  # read direct: nothing advised; no direct reads here: advised
    pool.files.clear()
    advised.clear()
    monkeypatch.setattr(load, "cached", lambda *a, **k: True)  # warm: read through the mapping, advised ahead
    _exact(fastckpt.load_file(path, device.queue, pool=pool, staging=True), tensors)
    assert advised and all(start < end for start, end in advised)
