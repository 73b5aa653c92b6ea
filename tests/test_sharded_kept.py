"""The memory of a load's dropped arrays, kept for the next load of the same size (fastckpt.sharded.kept)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from fastckpt._native.idindex import IdIndex
from fastckpt._native.mapped import kept_limit
from fastckpt.sharded import HashTable, Loader, kept


@pytest.fixture(autouse=True)
def nothing_kept():
    kept.release()
    yield
    kept.release()


def test_a_dropped_array_s_mapping_is_reused_by_the_next_of_its_size():
    a = kept.empty((1 << 19, 8), np.float32)  # 16 MiB
    a[:] = 7
    address = a.ctypes.data
    view = a[5:]
    del a
    assert kept.kept_bytes() == 0  # a view still holds it
    del view
    assert kept.kept_bytes() == 16 << 20
    b = kept.empty((1 << 20, 4), np.int32)  # another shape of the same size
    assert b.ctypes.data == address and kept.kept_bytes() == 0
    assert b.flags.c_contiguous and b.flags.writeable and b.shape == (1 << 20, 4) and b.dtype == np.int32
    b[:] = 3
    assert int(b.sum()) == 3 * (1 << 22)


def test_small_arrays_are_numpy_s_and_the_total_kept_is_bounded():
    small = kept.empty(10, np.int64)
    assert small.flags.owndata and small.shape == (10,)
    before = kept_limit(4 << 20)
    try:
        arrays = [kept.empty(2 << 20, np.uint8) for _ in range(3)]
        del arrays
        assert kept.kept_bytes() == 4 << 20  # two kept, the third unmapped
        kept_limit(0)
        assert kept.kept_bytes() == 0
        dropped = kept.empty(2 << 20, np.uint8)
        del dropped
        assert kept.kept_bytes() == 0  # a limit of 0 keeps nothing
    finally:
        kept_limit(before)
    assert kept_limit() == before


def test_a_freed_buffer_that_does_not_fit_makes_room_by_unmapping_the_buffers_kept_longest():
    """A process whose loads change shape (a reshard after a same-shape load) keeps the sizes it uses now."""
    before = kept_limit(6 << 20)
    try:
        a, b = kept.empty(2 << 20, np.uint8), kept.empty(2 << 20, np.uint8)
        c = kept.empty(4 << 20, np.uint8)
        c_address = c.ctypes.data
        del a
        del b
        assert kept.kept_bytes() == 4 << 20
        del c  # 8 MiB would be kept: the first 2 MiB buffer (kept longest) goes
        assert kept.kept_bytes() == 6 << 20
        again = kept.empty(4 << 20, np.uint8)
        assert again.ctypes.data == c_address and kept.kept_bytes() == 2 << 20
        del again
        too_large = kept.empty(8 << 20, np.uint8)
        del too_large  # larger than the limit: unmapped, the others stay
        assert kept.kept_bytes() == 6 << 20
    finally:
        kept_limit(before)


def test_the_id_index_and_the_load_s_arrays_share_one_kept_list():
    """An index's freed buckets serve the next array of their size, and an array's memory the next index's buckets
    (zeroed again: the new index holds only its own ids)."""
    index = IdIndex(200_000)  # buckets of a power of two, 2 MiB and up
    size = index.nbytes
    assert size >= kept.MIN_BYTES
    del index
    assert kept.kept_bytes() == size
    a = kept.empty(size, np.uint8)
    assert kept.kept_bytes() == 0  # the index's buckets
    a[:] = 0xFF  # every bucket full of junk
    del a
    assert kept.kept_bytes() == size
    again = IdIndex(200_000)
    assert kept.kept_bytes() == 0 and again.nbytes == size
    ids = np.arange(1000, dtype=np.int64)
    rows = np.empty(1000, np.int64)
    assert again.upsert(ids, rows, 0) == 1000 and rows.tolist() == list(range(1000))
    found = np.empty(3, np.int64)
    assert again.find(np.array([5, 1000, -1], np.int64), found) == 2 and found.tolist() == [5, -1, -1]


def test_an_array_collected_by_the_cycle_collector_is_kept():
    a = kept.empty(2 << 20, np.uint8)
    cycle = [a]
    cycle.append(cycle)
    del a, cycle
    gc.collect()
    assert kept.kept_bytes() == 2 << 20


def test_a_table_loaded_twice_reuses_the_first_load_s_memory(tmp_path):
    from fastckpt.sharded import Saver

    ids = np.arange(300_000, dtype=np.int64)
    t = HashTable(8, slots=("m",))
    values = np.arange(ids.size * 8, dtype=np.float32).reshape(-1, 8)
    t.insert(ids, values, {"m": -values})
    Saver(path=str(tmp_path / "c"), parallel=2, hashtables={"emb": t}).save()
    first = Loader(str(tmp_path / "c")).load()[0]["emb"]
    assert sorted(first.export()[0].tolist()) == ids.tolist()
    del first
    gc.collect()
    held = kept.kept_bytes()
    assert held >= 2 * ids.size * 8 * 4  # the values and m
    again = Loader(str(tmp_path / "c")).load()[0]["emb"]
    assert kept.kept_bytes() < held
    got_ids, got_values, got_slots = again.export()
    order = np.argsort(got_ids)
    assert got_ids[order].tolist() == ids.tolist() and got_values[order].tobytes() == values.tobytes()
    assert got_slots["m"][order].tobytes() == (-values).tobytes()


def test_an_array_alive_at_exit_keeps_its_bytes_for_the_exit_handlers(tmp_path):
    """weakref.finalize runs its callbacks at exit by default: that would give back the pages of arrays an exit
    handler may still read (a table saved on exit)."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import atexit\n"
        "def late():  # registered first: runs after every exit hook registered later (weakref.finalize's)\n"
        "    assert kept.kept_bytes() == 0 and int(a.min()) == 7, 'given back at exit'\n"
        "    print('kept', flush=True)\n"
        "atexit.register(late)\n"
        "import numpy as np\n"
        "from fastckpt.sharded import kept\n"
        "a = kept.empty(4 << 20, np.uint8); a[:] = 7\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "kept", done.stdout + done.stderr
