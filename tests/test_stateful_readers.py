"""Readers: sharding, shuffling, prefetch, and exact resume from a saved checkpoint file."""

import threading

import numpy as np
import pytest

from fastckpt.stateful import ArrayReader, Checkpoint, FileReader, ReaderState, epoch_order

NUM_SAMPLES = 23
BATCH = 4
EPOCHS = 3


def make_files(root, n=NUM_SAMPLES):
    # Names sort differently as strings and as numbers, and some live in a subdirectory.
    for i in range(n):
        sub = root / ("sub" if i % 3 == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.bin").write_bytes(b"sample-%d" % i + bytes([i]) * i)
    return root


def make_reader(kind, root, **options):
    if kind == "array":
        data = {"x": np.arange(NUM_SAMPLES * 2, dtype=np.float32).reshape(NUM_SAMPLES, 2), "y": np.arange(NUM_SAMPLES)}
        return ArrayReader(data, **options)
    if kind == "tuple":
        return ArrayReader((np.arange(NUM_SAMPLES, dtype=np.int16), np.arange(NUM_SAMPLES) * 3.5), **options)
    return FileReader(root, **options)


def as_plain(batch):
    """A batch as nested Python values with dtypes spelled out, for exact comparison."""
    if isinstance(batch, dict):
        return {k: (v.dtype.str, v.shape, v.tolist()) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple((v.dtype.str, v.shape, v.tolist()) for v in batch)
    if isinstance(batch, np.ndarray):
        return (batch.dtype.str, batch.shape, batch.tolist())
    return batch


def run_epochs(reader, epochs):
    out = []
    for _ in range(epochs):
        out.extend(as_plain(b) for b in reader.next_epoch(batch_size=BATCH))
    return out


@pytest.fixture
def file_root(tmp_path):
    return make_files(tmp_path / "data")


def no_prefetch_threads():
    # The readers' prefetch threads only: other parts of fastckpt keep worker pools alive between calls.
    return not any(t.name.startswith("fastckpt-") and t.name.endswith("-prefetch") and t.is_alive()
                   for t in threading.enumerate())


SHARDINGS = [(0, 1), (1, 3), (2, 3)]


@pytest.mark.parametrize("kind", ["array", "tuple", "file"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("prefetch", [0, 2], ids=["sync", "prefetch2"])
@pytest.mark.parametrize("shard", SHARDINGS, ids=[f"shard{s}of{n}" for s, n in SHARDINGS])
@pytest.mark.parametrize("stop_after", [1, "epoch_end", "second_epoch"])
def test_resume_from_saved_file_matches_the_uninterrupted_run(tmp_path, file_root, kind, shuffle, prefetch, shard, stop_after):
    options = dict(shuffle=shuffle, seed=17, shard_id=shard[0], num_shards=shard[1], prefetch_queue_depth=prefetch)
    reference_reader = make_reader(kind, file_root, **options)
    reference = run_epochs(reference_reader, EPOCHS)
    per_epoch = -(-reference_reader.shard_size // BATCH)
    k = {1: 1, "epoch_end": per_epoch, "second_epoch": per_epoch + 1}[stop_after]

    reader = make_reader(kind, file_root, enable_checkpointing=True, **options)
    ckpt = Checkpoint()
    ckpt.register(reader, "reader")
    got = []
    while len(got) < k:
        it = reader.next_epoch(batch_size=BATCH)
        for batch in it:
            got.append(as_plain(batch))
            if len(got) == k:
                break
    ckpt.collect()
    path = ckpt.save(str(tmp_path / "ckpt_{seq:04d}.json"))
    reader.close()
    assert no_prefetch_threads()

    fresh = make_reader(kind, file_root, **options)
    restored = Checkpoint()
    assert restored.load(str(tmp_path / "ckpt_{seq:04d}.json")) == path
    restored.register(fresh, "reader")
    while len(got) < len(reference):
        got.extend(as_plain(b) for b in fresh.next_epoch(batch_size=BATCH))
    assert got == reference
    assert no_prefetch_threads()


@pytest.mark.parametrize("saved_prefetch, resumed_prefetch", [(3, 0), (0, 1)])
def test_state_does_not_depend_on_the_prefetch_setting(saved_prefetch, resumed_prefetch):
    data = np.arange(NUM_SAMPLES)
    reference = [b.tolist() for b in ArrayReader(data, shuffle=True).next_epoch(batch_size=BATCH)]
    reader = ArrayReader(data, shuffle=True, prefetch_queue_depth=saved_prefetch, enable_checkpointing=True)
    it = reader.next_epoch(batch_size=BATCH)
    got = [next(it).tolist(), next(it).tolist()]
    state = str(reader.get_state())
    reader.close()
    resumed = ArrayReader(data, shuffle=True, prefetch_queue_depth=resumed_prefetch)
    resumed.set_state(state)
    got.extend(b.tolist() for b in resumed.next_epoch(batch_size=BATCH))
    assert got == reference
    assert no_prefetch_threads()


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 23, 30])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_and_cover_the_data(num_shards, shuffle):
    data = np.arange(NUM_SAMPLES)
    seen = []
    sizes = []
    for shard_id in range(num_shards):
        reader = ArrayReader(data, shuffle=shuffle, seed=5, shard_id=shard_id, num_shards=num_shards)
        samples = [int(v) for b in reader.next_epoch(batch_size=BATCH) for v in b]
        assert samples == reader.shard_indices(0).tolist()
        seen.extend(samples)
        sizes.append(len(samples))
    assert sorted(seen) == list(range(NUM_SAMPLES))
    assert max(sizes) - min(sizes) <= 1


def test_unshuffled_shards_are_contiguous_ranges():
    assert ArrayReader(np.arange(10), shard_id=1, num_shards=3).shard_indices(0).tolist() == [3, 4, 5]


def test_shuffle_order_is_pinned():
    # The order is defined by PCG64 raw outputs (stable across numpy versions); a change here breaks every saved state.
    assert epoch_order(8, 0, shuffle=True, seed=0).tolist() == [3, 2, 1, 6, 0, 7, 4, 5]
    assert epoch_order(8, 1, shuffle=True, seed=0).tolist() == [7, 4, 5, 1, 6, 2, 0, 3]
    assert epoch_order(8, 0, shuffle=True, seed=1).tolist() == [2, 4, 7, 5, 0, 6, 3, 1]


def test_shuffle_changes_every_epoch_and_follows_the_seed():
    reader = ArrayReader(np.arange(NUM_SAMPLES), shuffle=True, seed=3)
    epochs = [[int(v) for b in reader.next_epoch(batch_size=5) for v in b] for _ in range(3)]
    assert all(sorted(e) == list(range(NUM_SAMPLES)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = ArrayReader(np.arange(NUM_SAMPLES), shuffle=True, seed=3)
    assert [int(v) for b in again.next_epoch(batch_size=5) for v in b] == epochs[0]
    other = ArrayReader(np.arange(NUM_SAMPLES), shuffle=True, seed=4)
    assert [int(v) for b in other.next_epoch(batch_size=5) for v in b] != epochs[0]


def test_last_batch_is_short_and_next_epoch_starts_over():
    reader = ArrayReader(np.arange(5))
    assert [b.tolist() for b in reader.next_epoch(batch_size=2)] == [[0, 1], [2, 3], [4]]
    assert reader.epoch == 1 and reader.position == 0
    assert [b.tolist() for b in reader.next_epoch(batch_size=5)] == [[0, 1, 2, 3, 4]]


def test_file_batches_are_names_and_bytes_in_path_order(file_root):
    reader = FileReader(file_root)
    assert reader.files == sorted(reader.files)
    batch = next(reader.next_epoch(batch_size=2))
    assert batch == [(name, (file_root / name).read_bytes()) for name in reader.files[:2]]


def test_glob_selects_files(file_root):
    reader = FileReader(file_root, glob="sub/*.bin")
    assert all(name.startswith("sub/") for name in reader.files)
    assert reader.num_samples == len([i for i in range(NUM_SAMPLES) if i % 3 == 0])


def test_state_is_the_last_batch_handed_out_not_the_last_prefetched():
    loaded = []
    ahead = threading.Event()

    class CountingReader(ArrayReader):
        def _load(self, indices):
            loaded.append(indices.tolist())
            if len(loaded) >= 4:
                ahead.set()
            return super()._load(indices)

    reader = CountingReader(np.arange(20), prefetch_queue_depth=3, enable_checkpointing=True)
    it = reader.next_epoch(batch_size=2)
    assert next(it).tolist() == [0, 1]
    assert ahead.wait(timeout=10)  # the thread filled its queue: batches 2..4 were prepared
    assert len(loaded) >= 4
    state = reader.get_state()
    assert (state.epoch, state.position) == (0, 2)
    it.close()
    assert no_prefetch_threads()


def test_abandoned_iterator_resumes_where_the_caller_stopped_and_is_closed():
    reader = ArrayReader(np.arange(10), prefetch_queue_depth=2)
    first = reader.next_epoch(batch_size=3)
    assert next(first).tolist() == [0, 1, 2]
    second = reader.next_epoch(batch_size=3)
    assert no_prefetch_threads()
    with pytest.raises(RuntimeError, match="closed .*later next_epoch"):
        next(first)
    assert [b.tolist() for b in second] == [[3, 4, 5], [6, 7, 8], [9]]
    assert no_prefetch_threads()


def test_dropping_an_iterator_stops_its_thread():
    reader = ArrayReader(np.arange(100), prefetch_queue_depth=1)
    it = reader.next_epoch(batch_size=1)
    next(it)
    thread = it._thread
    del it
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_errors_on_the_prefetch_thread_reach_the_caller(file_root):
    reader = FileReader(file_root, prefetch_queue_depth=2, enable_checkpointing=True)
    (file_root / reader.files[1]).unlink()
    it = reader.next_epoch(batch_size=1)
    assert next(it)[0][0] == reader.files[0]
    with pytest.raises(FileNotFoundError):
        next(it)
    assert no_prefetch_threads()
    assert reader.get_state().position == 1


def test_empty_shard_yields_nothing_and_advances_the_epoch():
    reader = ArrayReader(np.arange(2), shard_id=0, num_shards=3, enable_checkpointing=True)
    assert reader.shard_size == 0
    assert list(reader.next_epoch(batch_size=4)) == []
    assert reader.get_state().epoch == 1


# ---------------------------------------------------------------- state rules


def test_get_state_before_any_epoch_is_refused():
    reader = ArrayReader(np.arange(4), enable_checkpointing=True)
    with pytest.raises(RuntimeError, match=r"has not started any epoch yet.*next_epoch\(\)"):
        reader.get_state()


def test_get_state_needs_enable_checkpointing():
    reader = ArrayReader(np.arange(4))
    next(reader.next_epoch(batch_size=2))
    with pytest.raises(RuntimeError, match="enable_checkpointing=True"):
        reader.get_state()


def test_set_state_after_iteration_began_is_refused():
    source = ArrayReader(np.arange(8), enable_checkpointing=True)
    next(source.next_epoch(batch_size=2))
    reader = ArrayReader(np.arange(8))
    reader.next_epoch(batch_size=2)
    with pytest.raises(RuntimeError, match=r"set_state\(\) after iteration began"):
        reader.set_state(source.get_state())


def test_set_state_is_buffered_until_the_first_epoch_and_the_last_one_wins():
    source = ArrayReader(np.arange(8), enable_checkpointing=True)
    it = source.next_epoch(batch_size=2)
    next(it)
    s1 = source.get_state()
    next(it)
    s2 = source.get_state()
    reader = ArrayReader(np.arange(8))
    reader.set_state(s1)
    reader.set_state(str(s2))
    with pytest.raises(RuntimeError, match="has not started any epoch"):
        reader.get_state()  # as in the seed API: no state before the first epoch
    assert [b.tolist() for b in reader.next_epoch(batch_size=2)] == [[4, 5], [6, 7]]


@pytest.mark.parametrize("form", ["object", "str", "dict"])
def test_set_state_accepts_object_string_and_dict(form):
    source = ArrayReader(np.arange(8), enable_checkpointing=True)
    next(source.next_epoch(batch_size=3))
    state = source.get_state()
    reader = ArrayReader(np.arange(8))
    reader.set_state({"object": state, "str": str(state), "dict": state.to_dict()}[form])
    assert next(reader.next_epoch(batch_size=3)).tolist() == [3, 4, 5]


def _state(**changes):
    source = ArrayReader(np.arange(10), shuffle=True, seed=1, shard_id=1, num_shards=2, enable_checkpointing=True)
    next(source.next_epoch(batch_size=2))
    data = source.get_state().to_dict()
    data.update(changes)
    return data


@pytest.mark.parametrize("changes, match", [
    ({"shard_id": 0}, r"shard_id is 0 in the state but 1 here; construct the reader with shard_id=0"),
    ({"num_shards": 5}, r"num_shards is 5 in the state but 2 here"),
    ({"shuffle": False}, r"shuffle is False in the state but True here"),
    ({"seed": 2}, r"seed is 2 in the state but 1 here; construct the reader with seed=2"),
    ({"num_samples": 11}, r"num_samples is 11 in the state but 10 here; the data changed"),
    ({"fingerprint": "0" * 32}, r"fingerprint is '0+' in the state .*the data changed"),
    ({"reader": "FileReader"}, r"belongs to a 'FileReader' reader, not to a 'ArrayReader'"),
    ({"version": 99}, r"state version 99 is not supported \(this fastckpt reads version 1\)"),
    ({"position": 6}, r"position 6 is past the end of this shard \(5 samples\)"),
    ({"epoch": -1}, r"'epoch' must be a non-negative int, got -1"),
    ({"position": "2"}, r"'position' must be a non-negative int, got '2'"),
])
def test_state_that_does_not_fit_is_refused_naming_the_field(changes, match):
    reader = ArrayReader(np.arange(10), shuffle=True, seed=1, shard_id=1, num_shards=2)
    with pytest.raises(ValueError, match=match):
        reader.set_state(_state(**changes))
    assert (reader.epoch, reader.position) == (0, 0)


def test_state_at_the_end_of_the_shard_starts_the_next_epoch():
    reader = ArrayReader(np.arange(10), shuffle=True, seed=1, shard_id=1, num_shards=2)
    reader.set_state(_state(position=5, epoch=2))
    assert (reader.epoch, reader.position) == (3, 0)


def test_file_state_is_refused_when_the_files_changed(file_root):
    reader = FileReader(file_root, enable_checkpointing=True)
    next(reader.next_epoch(batch_size=2))
    state = reader.get_state()
    (file_root / "f1.bin").rename(file_root / "renamed.bin")
    with pytest.raises(ValueError, match="fingerprint .*the data changed"):
        FileReader(file_root).set_state(state)


def test_reader_state_exposes_epoch_and_position():
    reader = ArrayReader(np.arange(10), enable_checkpointing=True)
    for _ in reader.next_epoch(batch_size=4):
        pass
    next(reader.next_epoch(batch_size=4))
    state = reader.get_state()
    assert isinstance(state, ReaderState)
    assert (state.epoch, state.position) == (1, 4)
    with pytest.raises(ValueError, match="not a reader state"):
        ReaderState({"bit_generator": "PCG64"})


# --------------------------------------------------------------- constructors


@pytest.mark.parametrize("options, error, match", [
    ({"shard_id": 3, "num_shards": 3}, ValueError, r"shard_id must be < num_shards \(3\), got 3"),
    ({"num_shards": 0}, ValueError, r"num_shards must be >= 1, got 0"),
    ({"seed": -1}, ValueError, r"seed must be >= 0, got -1"),
    ({"seed": 1.5}, TypeError, r"seed must be an int, got float"),
    ({"shuffle": 1}, TypeError, r"shuffle must be a bool, got int"),
    ({"prefetch_queue_depth": -1}, ValueError, r"prefetch_queue_depth must be >= 0"),
])
def test_bad_options_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        ArrayReader(np.arange(4), **options)


def test_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match=r"batch_size must be >= 1, got 0"):
        ArrayReader(np.arange(4)).next_epoch(batch_size=0)


def test_bad_array_data_is_refused():
    with pytest.raises(ValueError, match="differ in their first dimension"):
        ArrayReader((np.arange(4), np.arange(5)))
    with pytest.raises(ValueError, match="0-d"):
        ArrayReader(np.float32(1.0))
    with pytest.raises(ValueError, match="at least one array"):
        ArrayReader({})


def test_bad_file_root_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        FileReader(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no files match"):
        FileReader(tmp_path)
