"""fastckpt.sharded.hashtable.HashTable against a reference model (a dict id -> rows), and its errors."""

from __future__ import annotations

import pickle

import ml_dtypes
import numpy as np
import pytest

from fastckpt.sharded.hashtable import _SMALL_SORT, HashTable, MissingIdsError, _sort_ids

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EXTREMES = [I64_MIN, I64_MIN + 1, -1, 0, 1, I64_MAX - 1, I64_MAX]


class Model:
    """The reference: a dict id -> (value row, {slot: row}), with the table's documented semantics."""

    def __init__(self, dim, slots):
        self.dim, self.slots, self.rows = dim, slots, {}

    def insert(self, ids, values, slots):
        for i, id_ in enumerate(ids.tolist()):
            old = self.rows.get(id_)
            slot_rows = dict(old[1]) if old else {s: np.zeros(self.dim, np.float32) for s in self.slots}
            slot_rows.update({s: rows[i].astype(np.float32) for s, rows in slots.items()})
            self.rows[id_] = (values[i].astype(np.float32), slot_rows)

    def export(self):
        ids = sorted(self.rows)
        values = np.array([self.rows[i][0] for i in ids], np.float32).reshape(len(ids), self.dim)
        slots = {s: np.array([self.rows[i][1][s] for i in ids], np.float32).reshape(len(ids), self.dim)
                 for s in self.slots}
        return np.array(ids, np.int64), values, slots


def assert_same(table, model):
    ids, values, slots = table.export()
    want_ids, want_values, want_slots = model.export()
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(values, want_values)
    assert list(slots) == list(model.slots)
    for s in model.slots:
        np.testing.assert_array_equal(slots[s], want_slots[s])
    assert len(table) == len(model.rows)


def random_ids(rng, pool, size):
    return rng.choice(pool, size=size) if size else np.empty(0, np.int64)


@pytest.mark.parametrize("seed", range(8))
def test_random_sequences_match_a_dict_model(seed):
    rng = np.random.default_rng(seed)
    dim, slot_names = int(rng.integers(1, 5)), ("m", "v")[: int(rng.integers(0, 3))]
    table, model = HashTable(dim, slots=slot_names), Model(dim, slot_names)
    pool = np.concatenate([np.array(EXTREMES, np.int64), rng.integers(-50, 50, 60),
                           rng.integers(I64_MIN, I64_MAX, 40, dtype=np.int64, endpoint=True)])
    for _ in range(120):
        op = rng.choice(["insert", "insert", "update", "delete", "lookup"])
        size = int(rng.integers(0, 40))
        ids = random_ids(rng, pool, size)
        if op == "insert":
            if rng.random() < 0.3 and len(model.rows):  # ids beyond the largest: the append path
                top = max(model.rows)
                ids = np.unique(rng.integers(top, I64_MAX, size, dtype=np.int64, endpoint=True)) if top < I64_MAX \
                    else ids
            values = rng.standard_normal((len(ids), dim)).astype(np.float32)
            given = {s: rng.standard_normal((len(ids), dim)) for s in slot_names if rng.random() < 0.5}
            table.insert(ids, values, slots=given)
            model.insert(ids, values, given)
        elif op == "update":
            values = rng.standard_normal((len(ids), dim)).astype(np.float32)
            given = {s: rng.standard_normal((len(ids), dim)) for s in slot_names if rng.random() < 0.5}
            if all(i in model.rows for i in ids.tolist()):
                table.update(ids, values, slots=given)
                model.insert(ids, values, given)
            else:
                before = table.export()
                with pytest.raises(KeyError):
                    table.update(ids, values, slots=given)
                after = table.export()
                np.testing.assert_array_equal(before[0], after[0])
                np.testing.assert_array_equal(before[1], after[1])
        elif op == "delete":
            want = len(set(ids.tolist()) & set(model.rows))
            assert table.delete(ids) == want
            for i in ids.tolist():
                model.rows.pop(i, None)
        else:
            present = np.array([i for i in ids.tolist() if i in model.rows], np.int64)
            got = table.lookup(present)
            assert got.shape == (len(present), dim)
            for row, i in zip(got, present.tolist()):
                np.testing.assert_array_equal(row, model.rows[i][0])
            for s in slot_names:
                for row, i in zip(table.lookup_slot(s, present), present.tolist()):
                    np.testing.assert_array_equal(row, model.rows[i][1][s])
            filled = table.lookup(ids, default=7.5)
            for row, i in zip(filled, ids.tolist()):
                np.testing.assert_array_equal(row, model.rows[i][0] if i in model.rows else np.full(dim, 7.5))
        assert_same(table, model)
    for i in pool.tolist():
        assert (i in table) == (i in model.rows)


@pytest.mark.parametrize("seed", range(3))
def test_large_batches_with_repeats_keep_the_last_occurrence(seed):
    # Above _SMALL_SORT the ids are sorted by the packed-key path; repeats must still resolve to the last one.
    rng = np.random.default_rng(100 + seed)
    n = _SMALL_SORT + 5000
    pools = [rng.integers(-3000, 3000, n), rng.integers(I64_MIN, I64_MAX, n // 2, dtype=np.int64, endpoint=True)]
    ids = rng.choice(np.concatenate(pools), n)
    values = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    table = HashTable(2, slots=("m",))
    table.insert(ids, values, slots={"m": -values})
    last = {}
    for i, id_ in enumerate(ids.tolist()):
        last[id_] = i
    want_ids = np.array(sorted(last), np.int64)
    got_ids, got_values, got_slots = table.export()
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_values[:, 0], [last[i] for i in want_ids.tolist()])
    np.testing.assert_array_equal(got_slots["m"][:, 1], [-last[i] for i in want_ids.tolist()])
    # A second large batch, half present, half new, merged in.
    more = np.concatenate([rng.choice(want_ids, n // 2), rng.integers(I64_MIN, I64_MAX, n // 2, dtype=np.int64)])
    table.insert(more, np.full((n, 2), -1.0))
    assert set(table.ids().tolist()) == set(last) | set(more.tolist())
    np.testing.assert_array_equal(table.lookup(more), np.full((n, 2), -1.0, np.float32))
    untouched = np.setdiff1d(want_ids, more)
    np.testing.assert_array_equal(table.lookup(untouched)[:, 0], [last[i] for i in untouched.tolist()])
    np.testing.assert_array_equal(table.lookup_slot("m", untouched)[:, 0], [-last[i] for i in untouched.tolist()])


@pytest.mark.parametrize("kind", ["full range", "small span", "two clusters", "one value", "extremes", "sorted"])
def test_sort_ids_is_a_stable_argsort(kind):
    rng = np.random.default_rng(7)
    n = _SMALL_SORT + 1234
    if kind == "full range":
        ids = rng.integers(I64_MIN, I64_MAX, n, dtype=np.int64, endpoint=True)
        ids[::10] = ids[5]  # repeats
    elif kind == "small span":
        ids = rng.integers(-100, 100, n)
    elif kind == "two clusters":  # a span that needs a shift, with dense runs that tie on the shifted key
        ids = np.concatenate([rng.integers(-(2**62), -(2**62) + 5000, n // 2),
                              rng.integers(2**62, 2**62 + 5000, n - n // 2)])
    elif kind == "one value":
        ids = np.full(n, I64_MIN)
    elif kind == "extremes":
        ids = rng.choice(np.array(EXTREMES, np.int64), n)
    else:
        ids = np.arange(n) * 3 - n
    ids = ids.astype(np.int64)
    ordered, order = _sort_ids(ids)
    want = np.argsort(ids, kind="stable")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(ordered, ids[want])


def test_negative_huge_and_repeated_ids():
    table = HashTable(1)
    ids = np.array([I64_MAX, I64_MIN, 0, -1, I64_MAX, I64_MIN + 1, -1], np.int64)
    table.insert(ids, np.arange(7, dtype=np.float32)[:, None])
    assert table.ids().tolist() == [I64_MIN, I64_MIN + 1, -1, 0, I64_MAX]
    assert table.lookup([I64_MAX, -1, I64_MIN]).ravel().tolist() == [4.0, 6.0, 1.0]
    table.update([I64_MIN, I64_MIN], [[10.0], [11.0]])
    assert table.lookup([I64_MIN]).item() == 11.0
    # Python ints at the edges, and uint64 ids that fit.
    assert table.lookup([2**63 - 1, -(2**63)]).ravel().tolist() == [4.0, 11.0]
    assert table.lookup(np.array([0, 2**63 - 1], np.uint64)).ravel().tolist() == [2.0, 4.0]
    assert I64_MAX in table and I64_MIN in table and np.int64(-1) in table
    assert 2**63 not in table and -(2**63) - 1 not in table and 1.5 not in table and True not in table
    assert table.delete([I64_MAX, I64_MAX, 12345]) == 1
    assert I64_MAX not in table and len(table) == 4


def test_slots_follow_their_ids_through_merges_and_deletes():
    table = HashTable(2, slots=("m", "v"))
    table.insert([10, 30], [[1, 1], [3, 3]], slots={"m": [[10, 10], [30, 30]], "v": [[-10, -10], [-30, -30]]})
    table.insert([20, 5, 40], [[2, 2], [0.5, 0.5], [4, 4]], slots={"v": [[-20, -20], [-5, -5], [-40, -40]]})
    table.delete([30])
    table.insert([25], [[2.5, 2.5]], slots={"m": [[25, 25]]})
    ids, values, slots = table.export()
    assert ids.tolist() == [5, 10, 20, 25, 40]
    assert values[:, 0].tolist() == [0.5, 1, 2, 2.5, 4]
    assert slots["m"][:, 1].tolist() == [0, 10, 0, 25, 0]
    assert slots["v"][:, 0].tolist() == [-5, -10, -20, 0, -40]
    table.update([40, 5], [[9, 9], [8, 8]], slots={"m": [[1, 2], [3, 4]]})
    assert table.lookup_slot("m", [5, 40]).tolist() == [[3, 4], [1, 2]]
    assert table.lookup_slot("v", [5, 40]).tolist() == [[-5, -5], [-40, -40]]


def test_export_is_sorted_exact_and_copied():
    table = HashTable(3, dtype=np.float64, slots=("m",))
    rng = np.random.default_rng(3)
    ids = rng.permutation(np.arange(-500, 500, 7))
    values = rng.standard_normal((len(ids), 3))
    table.insert(ids, values)
    got_ids, got_values, got_slots = table.export()
    order = np.argsort(ids)
    np.testing.assert_array_equal(got_ids, ids[order])
    assert got_values.tobytes() == values[order].tobytes()
    for array in (got_ids, got_values, got_slots["m"]):
        assert array.flags.c_contiguous and array.flags.owndata and array.flags.writeable
    assert got_ids.dtype == np.int64 and got_values.dtype == np.float64 and got_slots["m"].shape == (len(ids), 3)
    got_values[:] = 0
    got_ids[:] = 0
    np.testing.assert_array_equal(table.lookup(ids), values)
    looked = table.lookup(ids[:3])
    looked[:] = 0
    np.testing.assert_array_equal(table.lookup(ids[:3]), values[:3])
    ids_copy = table.ids()
    ids_copy[:] = 0
    assert table.ids().tolist() == sorted(ids.tolist())


def test_import_and_from_export_round_trip():
    rng = np.random.default_rng(5)
    table = HashTable(4, dtype=np.float16, slots=("m", "v"), name="emb")
    ids = rng.integers(I64_MIN, I64_MAX, 300, dtype=np.int64)
    table.insert(ids, rng.standard_normal((300, 4)), slots={"m": rng.random((300, 4)), "v": rng.random((300, 4))})
    exported = table.export()
    copy = HashTable.from_export(*exported, name="copy")
    assert copy == table and copy.name == "copy" and copy.dtype == np.float16 and copy.slots == ("m", "v")
    other = HashTable(4, dtype=np.float16, slots=("m", "v"))
    other.import_(*exported)
    assert other == table
    # import_ is an upsert; clear=True replaces the contents.
    other.import_([1, 2], np.ones((2, 4)), {"m": np.full((2, 4), 2.0)})
    assert len(other) == 302 and other.lookup_slot("v", [1]).tolist() == [[0, 0, 0, 0]]
    other.import_(exported[0][:10], exported[1][:10], {s: a[:10] for s, a in exported[2].items()}, clear=True)
    assert other.ids().tolist() == exported[0][:10].tolist()
    np.testing.assert_array_equal(other.lookup_slot("m", exported[0][:10]), exported[2]["m"][:10])
    other.import_([], np.empty((0, 4)), clear=True)
    assert len(other) == 0 and other == HashTable(4, dtype=np.float16, slots=("m", "v"))
    # Unsorted ids with repeats import too (the last occurrence wins).
    back = HashTable.from_export([3, 1, 3], [[1.0], [2.0], [3.0]])
    assert back.export()[0].tolist() == [1, 3] and back.lookup([3]).item() == 3.0 and back.dtype == np.float64
    assert pickle.loads(pickle.dumps(table)) == table


def test_empty_tables_and_empty_id_arrays():
    table = HashTable(3, slots=("m",))
    ids, values, slots = table.export()
    assert ids.shape == (0,) and ids.dtype == np.int64 and values.shape == (0, 3) and slots["m"].shape == (0, 3)
    assert table.lookup([]).shape == (0, 3) and table.lookup_slot("m", np.empty(0, np.int64)).shape == (0, 3)
    assert table.lookup([1, 2], default=0).tolist() == [[0, 0, 0], [0, 0, 0]]
    assert table.delete([]) == 0 and table.delete([1]) == 0
    table.insert([], np.empty((0, 3)))
    table.update([], np.empty((0, 3)))
    table.insert(np.array([], np.int64), [])
    assert len(table) == 0 and table.nbytes == 0 and 0 not in table
    assert table == HashTable.from_export(ids, values, slots) and table.ids().shape == (0,)
    with pytest.raises(KeyError):
        table.lookup([0])
    table.insert([1], [[1, 2, 3]])
    assert table.delete([1]) == 1 and len(table) == 0 and table.lookup([]).shape == (0, 3)


def test_lookup_of_many_unsorted_ids_and_defaults():
    rng = np.random.default_rng(11)
    table = HashTable(2, dtype=np.int32)
    ids = rng.integers(-(10**12), 10**12, 2000)
    ids = np.unique(ids)
    table.insert(ids, np.stack([ids % 1000, ids % 7], axis=1))
    query = rng.permutation(np.concatenate([ids, ids[:100]]))
    np.testing.assert_array_equal(table.lookup(query), np.stack([query % 1000, query % 7], axis=1))
    with_missing = np.concatenate([query, [10**13, -(10**13)]])
    got = table.lookup(with_missing, default=-1)
    assert got.dtype == np.int32 and got[-2:].tolist() == [[-1, -1], [-1, -1]]
    with pytest.raises(TypeError, match="default"):
        table.lookup(query, default=0.5)  # a float into an int32 table
    with pytest.raises(ValueError, match="scalar"):
        table.lookup(query, default=[1, 2])


def test_missing_ids_name_up_to_eight_and_how_many():
    table = HashTable(1)
    table.insert([1, 2, 3], np.zeros((3, 1)))
    with pytest.raises(KeyError) as caught:
        table.update([1, 50, 40, 50, 2, 41, 42, 43, 44, 45, 46, 47, 48], np.ones((13, 1)))
    err = caught.value
    assert isinstance(err, MissingIdsError)
    assert err.ids == [50, 40, 41, 42, 43, 44, 45, 46] and err.count == 10
    assert str(err) == "10 ids not in the hashtable, the first 8: [50, 40, 41, 42, 43, 44, 45, 46]"
    assert table.lookup([1, 2, 3]).ravel().tolist() == [0, 0, 0]  # unchanged
    with pytest.raises(KeyError, match=r"1 id not in hashtable 'emb': \[9\]"):
        HashTable.from_export([1], [[0.0]], name="emb").lookup([1, 9])
    with pytest.raises(KeyError, match=r"\[9\]"):
        HashTable(1, slots=("m",)).lookup_slot("m", [9])


def test_argument_errors():
    table = HashTable(2, slots=("m",))
    table.insert([1], [[1, 1]])
    with pytest.raises(ValueError, match=r"shape \(2, 2\).*got \(2, 3\)"):
        table.insert([1, 2], np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"shape \(3, 2\).*got \(2, 2\)"):
        table.insert([1, 2, 3], np.zeros((2, 2)))  # lengths differ
    with pytest.raises(ValueError, match=r"slot 'm' must have shape \(1, 2\)"):
        table.insert([5], np.zeros((1, 2)), slots={"m": np.zeros((2, 2))})
    with pytest.raises(KeyError, match="unknown slots \\['x'\\]"):
        table.insert([5], np.zeros((1, 2)), slots={"x": np.zeros((1, 2))})
    with pytest.raises(KeyError, match="unknown slot 'v'"):
        table.lookup_slot("v", [1])
    with pytest.raises(TypeError, match="mapping"):
        table.insert([5], np.zeros((1, 2)), slots=[np.zeros((1, 2))])
    with pytest.raises(TypeError, match="complex128"):
        table.insert([5], np.zeros((1, 2), complex))
    with pytest.raises(TypeError, match="<U1"):
        table.insert([5], [["a", "b"]])
    with pytest.raises(TypeError, match="integers.*float64"):
        table.insert(np.array([1.0]), np.zeros((1, 2)))
    with pytest.raises(TypeError, match="1.5"):
        table.lookup([1, 1.5])
    with pytest.raises(TypeError, match="bool"):
        table.lookup(np.array([True]))
    with pytest.raises(ValueError, match="int64"):
        table.lookup(np.array([2**63], np.uint64))
    with pytest.raises(ValueError, match=str(2**63)):
        table.insert([1, 2**63], np.zeros((2, 2)))
    with pytest.raises(ValueError, match=str(-(2**63) - 1)):
        table.delete([-(2**63) - 1])
    assert table.lookup(np.array([1], dtype=object)).tolist() == [[1, 1]]  # Python ints in an object array
    with pytest.raises(TypeError, match="bool"):
        table.lookup(np.array([1, True], dtype=object))
    with pytest.raises(ValueError, match="1-D"):
        table.lookup([[1]])
    with pytest.raises(ValueError, match="1-D"):
        table.lookup(1)
    int_table = HashTable(1, dtype=np.int8)
    with pytest.raises(TypeError, match="int8"):
        int_table.insert([1], [[0.5]])
    assert len(table) == 1 and len(int_table) == 0  # nothing changed by a refused call
    with pytest.raises(ValueError, match="dim"):
        HashTable(0)
    with pytest.raises(TypeError, match="dim"):
        HashTable(2.0)
    with pytest.raises(TypeError, match="single string"):
        HashTable(2, slots="m")
    with pytest.raises(TypeError, match="slot names"):
        HashTable(2, slots=("m", ""))
    with pytest.raises(TypeError, match="name"):
        HashTable(2, name=1)
    with pytest.raises(ValueError, match="distinct"):
        HashTable(2, slots=("m", "m"))
    with pytest.raises(TypeError, match="numeric"):
        HashTable(2, dtype=object)
    with pytest.raises(ValueError, match="2-D"):
        HashTable.from_export([1], [1.0])


def test_values_cast_within_their_kind():
    table = HashTable(2)
    table.insert(np.array([3], np.uint8), np.array([[1.5, 2.5]], np.float64))
    table.insert(np.array([4], np.int16), np.array([[1, 2]], np.int64))
    table.insert([5], np.array([[True, False]]))
    assert table.lookup([3, 4, 5]).tolist() == [[1.5, 2.5], [1, 2], [1, 0]]
    bf16 = HashTable(2, dtype=ml_dtypes.bfloat16)
    bf16.insert([1], [[1.0, 2.0]])
    assert bf16.lookup([1]).astype(np.float32).tolist() == [[1.0, 2.0]]


def test_equality_nbytes_and_repr():
    a = HashTable(2, slots=("m",), name="a")
    b = HashTable(2, slots=("m",), name="b")
    assert a == b
    a.insert([1, 2], [[1, 2], [3, 4]])
    assert a != b
    b.insert([2, 1], [[3, 4], [1, 2]])
    assert a == b
    b.update([1], [[1, 2]], slots={"m": [[0, 1e-30]]})
    assert a != b
    assert a != HashTable(2, slots=("v",)) and a != HashTable(2, dtype=np.float64, slots=("m",))
    assert (a == 3) is False
    values = np.array([[1, 2], [3, 4]], np.float32)
    negative_zero = HashTable.from_export([1, 2], values, {"m": [[-0.0, 0], [0, 0]]})
    assert negative_zero != HashTable.from_export([1, 2], values, {"m": [[0.0, 0], [0, 0]]})  # bytes differ
    assert a.nbytes == 2 * 8 + 2 * (2 * 2 * 4)
    assert repr(a) == "HashTable(dim=2, dtype=float32, slots=('m',), name='a', len=2)"
    with pytest.raises(TypeError):
        hash(a)


def test_delete_moves_rows_and_gives_back_memory():
    rng = np.random.default_rng(21)
    ids = rng.permutation(np.arange(-3000, 3000, 3))
    table = HashTable(2, slots=("m",))
    table.insert(ids, np.stack([ids, -ids], axis=1), slots={"m": np.stack([ids * 2, ids], axis=1)})
    gone = rng.choice(ids, 1900, replace=False)
    assert table.delete(np.concatenate([gone, gone[:10], [10**15]])) == 1900
    left = np.setdiff1d(ids, gone)
    assert len(table) == len(left) and table.ids().tolist() == left.tolist()
    np.testing.assert_array_equal(table.lookup(left), np.stack([left, -left], axis=1))
    np.testing.assert_array_equal(table.lookup_slot("m", left), np.stack([left * 2, left], axis=1))
    assert len(table._ids) < 4 * len(table) + 64  # the capacity shrank with the table
    assert not any(i in table for i in gone[:50].tolist())
    table.insert(gone[:5], np.zeros((5, 2)))  # re-inserted: slot rows start at zero again
    assert table.lookup_slot("m", gone[:5]).tolist() == [[0, 0]] * 5


def test_a_failed_insert_leaves_the_table_as_it_was(monkeypatch):
    table = HashTable(1)
    table.insert([1, 2], [[1.0], [2.0]])

    def no_memory(rows):
        raise MemoryError("test")

    monkeypatch.setattr(table, "_reserve", no_memory)
    with pytest.raises(MemoryError):
        table.insert([2, 3, 4], [[20.0], [3.0], [4.0]])
    monkeypatch.undo()
    assert len(table) == 2 and 3 not in table and table.lookup([1, 2]).ravel().tolist() == [1.0, 2.0]
    table.insert([3, 4], [[3.0], [4.0]])
    assert table.ids().tolist() == [1, 2, 3, 4] and table.lookup([4, 3]).ravel().tolist() == [4.0, 3.0]


def test_tables_with_the_same_length_but_other_ids_differ():
    a = HashTable.from_export([1, 2], np.zeros((2, 1)))
    assert a != HashTable.from_export([1, 3], np.zeros((2, 1)))
    b = HashTable(1, dtype=np.float64)
    b.insert([2, 1], np.zeros((2, 1)))  # other insertion order, same contents
    assert a == b and b == a


@pytest.mark.parametrize("seed", range(3))
def test_the_id_index_against_a_dict(seed):
    from fastckpt._native.idindex import IdIndex, last_occurrence

    rng = np.random.default_rng(seed)
    index, model, next_row = IdIndex(), {}, 0
    pool = np.concatenate([np.array(EXTREMES, np.int64), rng.integers(I64_MIN, I64_MAX, 3000, dtype=np.int64)])
    for _ in range(60):
        keys = rng.choice(pool, int(rng.integers(0, 400)))
        rows = np.empty(len(keys), np.int64)
        if rng.random() < 0.6:
            before = next_row
            added = index.upsert(keys, rows, next_row)
            want = []
            for k in keys.tolist():
                if k not in model:
                    model[k] = next_row
                    next_row += 1
                want.append(model[k])
            assert added == next_row - before and rows.tolist() == want
        else:
            removed = index.remove(keys, rows)
            want = [model.pop(k, -1) for k in keys.tolist()]
            assert rows.tolist() == want and removed == sum(r >= 0 for r in want)
        assert len(index) == len(model)
        probe = rng.choice(pool, 500)
        found = np.empty(500, np.int64)
        assert index.find(probe, found) == sum(k not in model for k in probe.tolist())
        assert found.tolist() == [model.get(k, -1) for k in probe.tolist()]
    keys = np.array(list(model), np.int64)
    index.assign(keys, np.arange(len(keys)))
    found = np.empty(len(keys), np.int64)
    assert index.find(keys, found) == 0 and found.tolist() == list(range(len(keys)))
    with pytest.raises(KeyError):
        index.assign(np.array([I64_MIN + 12345], np.int64), np.array([0], np.int64))
    keep = np.empty(4, np.uint8)
    assert last_occurrence(np.array([3, 1, 3, 3]), keep, 4) == 2 and keep.tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="outside"):
        last_occurrence(np.array([0, 4]), np.empty(2, np.uint8), 4)
    index.clear()
    assert len(index) == 0 and index.find(keys[:3], found[:3]) == min(3, len(keys))


@pytest.mark.parametrize("n", [0, 1, 17, 5000, 200_003])
def test_fill_numbers_the_ids_as_upsert_does(n):
    from fastckpt._native.idindex import IdIndex

    rng = np.random.default_rng(n)
    ids = np.concatenate([np.array(EXTREMES, np.int64), rng.integers(I64_MIN, I64_MAX, n, dtype=np.int64)])
    ids = np.unique(ids)[: max(n, 1) if n else 0]
    rng.shuffle(ids)
    filled, upserted = IdIndex(), IdIndex()
    assert filled.fill(ids) == len(ids) == len(filled)
    assert upserted.upsert(ids, np.empty(len(ids), np.int64), 0) == len(ids)
    probe = np.concatenate([ids, rng.integers(I64_MIN, I64_MAX, 1000, dtype=np.int64), np.array(EXTREMES)])
    got, want = np.empty(len(probe), np.int64), np.empty(len(probe), np.int64)
    assert filled.find(probe, got) == upserted.find(probe, want)
    assert np.array_equal(got, want) and np.array_equal(got[: len(ids)], np.arange(len(ids)))
    # a filled index is an index like any other: it grows, removes and finds as before
    more = rng.integers(I64_MIN, I64_MAX, 3000, dtype=np.int64)
    rows_f, rows_u = np.empty(3000, np.int64), np.empty(3000, np.int64)
    assert filled.upsert(more, rows_f, len(ids)) == upserted.upsert(more, rows_u, len(ids))
    assert np.array_equal(rows_f, rows_u)
    gone = np.ascontiguousarray(ids[::3])
    assert filled.remove(gone, np.empty(len(gone), np.int64)) == len(gone)
    upserted.remove(gone, np.empty(len(gone), np.int64))
    assert filled.find(probe, got) == upserted.find(probe, want) and np.array_equal(got, want)


def test_fill_keeps_the_first_row_of_a_repeated_id_and_refuses_a_full_index():
    from fastckpt._native.idindex import IdIndex

    ids = np.array([5, -3, 5, I64_MIN, -3, I64_MIN, 7], np.int64)
    index = IdIndex()
    assert index.fill(ids) == 4 and len(index) == 4
    rows = np.empty(4, np.int64)
    assert index.find(np.array([5, -3, I64_MIN, 7]), rows) == 0 and rows.tolist() == [0, 1, 3, 6]
    with pytest.raises(ValueError, match="fill: the index holds 4 ids"):
        index.fill(np.array([1], np.int64))
    sized = IdIndex(100_000)
    assert sized.fill(np.array([2], np.int64)) == 1 and sized.nbytes == IdIndex(100_000).nbytes  # capacity kept


def test_indexes_built_in_memory_freed_by_earlier_ones_hold_only_their_own_ids():
    """Freed bucket mappings (2 MiB on) are kept (the process's kept memory, mapped.pyx) and handed to the next index
    of their size (a loader builds one per table each load), zeroed again: every new index, filled or grown, finds exactly its own ids
    and none of those that were there before, on kept memory and on new."""
    from fastckpt._native.idindex import IdIndex

    # small (calloc), 8 MiB, the same size again (kept), 64 MiB, 8 MiB again
    for round_, n in enumerate((1000, 300_000, 300_000, 1000, 1_500_000, 300_000)):
        # distinct even ids spread over the range (an odd multiplier keeps them distinct and even), new each round
        evens = (np.arange(n, dtype=np.uint64) + np.uint64(round_ << 32)) * np.uint64(2)
        ids = (evens * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
        filled = IdIndex()
        assert filled.fill(ids) == n
        grown = IdIndex()
        rows = np.empty(n, np.int64)
        assert grown.upsert(ids, rows, 0) == n and np.array_equal(rows, np.arange(n))
        others = ids + 1  # odd: never an id of this round
        for index in (filled, grown):
            found = np.empty(n, np.int64)
            assert index.find(ids, found) == 0 and np.array_equal(found, np.arange(n))
            assert index.find(others, found) == n and (found == -1).all()
        del filled, grown


def test_zeroed_buckets_are_empty_across_growth_to_huge_page_buckets_and_back():
    """A bucket of zeros is empty (rows are stored plus one): id 0 at row 0 is found and an absent 0 is not, through
    growth from small buckets to large ones (2 MiB on, huge pages advised from 4 MiB) and a clear back to small ones."""
    from fastckpt._native.idindex import IdIndex

    index = IdIndex()
    rows = np.empty(1, np.int64)
    assert index.find(np.array([0], np.int64), rows) == 1 and rows.tolist() == [-1]
    assert index.upsert(np.array([0], np.int64), rows, 0) == 1 and rows.tolist() == [0]
    assert index.nbytes < 2 << 20
    many = np.arange(1, 300_001, dtype=np.int64) * -7919  # grows past 2 MiB of buckets
    got = np.empty(len(many), np.int64)
    assert index.upsert(many, got, 1) == len(many) and np.array_equal(got, np.arange(1, len(many) + 1))
    assert index.nbytes >= 2 << 20
    probe = np.concatenate([[0], many[::1000], [7919, 1]]).astype(np.int64)
    found = np.empty(len(probe), np.int64)
    assert index.find(probe, found) == 2
    assert found.tolist() == [0, *range(1, len(many) + 1, 1000), -1, -1]
    assert index.remove(np.array([0], np.int64), rows) == 1 and rows.tolist() == [0]
    assert index.find(np.array([0], np.int64), rows) == 1 and rows.tolist() == [-1]
    with pytest.raises(ValueError, match="rows are >= 0"):  # a row of -1 would be stored as an empty bucket
        index.assign(many[:1], np.array([-1], np.int64))
    assert index.find(many[:1], rows) == 0 and rows.tolist() == [1]
    index.clear()
    assert len(index) == 0 and index.nbytes < 2 << 20
    assert index.find(probe, found) == len(probe) and (found == -1).all()
    filled = IdIndex()
    assert filled.fill(np.concatenate([[0], many])) == len(many) + 1 and filled.nbytes >= 2 << 20
    assert filled.find(probe[:2], found[:2]) == 0 and found[:2].tolist() == [0, 1]


@pytest.mark.parametrize("m", [0, 3, 70_000])
def test_adopt_builds_the_table_insert_builds(m):
    rng = np.random.default_rng(m)
    ids = np.unique(np.concatenate([np.array(EXTREMES), rng.integers(I64_MIN, I64_MAX, m, dtype=np.int64)]))[:m]
    rng.shuffle(ids)
    values = rng.random((m, 3), dtype=np.float32)
    m_slot = rng.random((m, 3), dtype=np.float32)
    inserted = HashTable(3, slots=("m",))
    inserted.insert(ids, values, {"m": m_slot})
    adopted = HashTable(3, slots=("m",))
    spare = 5
    ids_store = np.empty(m + spare, np.int64)
    ids_store[:m] = ids
    values_store, m_store = np.zeros((m + spare, 3), np.float32), np.zeros((m + spare, 3), np.float32)
    values_store[:m], m_store[:m] = values, m_slot
    adopted.adopt(ids_store, values_store, {"m": m_store}, rows=m)
    assert adopted == inserted and len(adopted) == m
    assert np.array_equal(adopted.lookup(ids), values) and np.array_equal(adopted.lookup_slot("m", ids), m_slot)
    assert 12345 not in inserted
    with pytest.raises(MissingIdsError):  # the spare rows hold no ids
        adopted.lookup([12345])
    extra = np.array([-11, -12], np.int64)  # later inserts fill the spare rows, then grow
    adopted.insert(extra, np.ones((2, 3)))
    inserted.insert(extra, np.ones((2, 3)))
    assert adopted == inserted


def test_adopt_refuses_repeated_ids_and_leaves_the_table_as_it_was():
    t = HashTable(1)
    t.insert([4], [[4.0]])
    ids = np.array([1, -2, 3, -2], np.int64)
    with pytest.raises(ValueError, match=r"adopt: the ids must be distinct \(1 repeated\)"):
        t.adopt(ids, np.zeros((4, 1), np.float32))
    assert t.ids().tolist() == [4] and t.lookup([4]).tolist() == [[4.0]]
    t.adopt(ids, np.zeros((4, 1), np.float32), rows=3)  # the repeat lies in the spare rows: not the table's
    assert sorted(t.ids().tolist()) == [-2, 1, 3]


def test_adopt_in_many_threads_at_once_builds_each_table_exactly():
    import concurrent.futures

    rng = np.random.default_rng(5)
    parts = [np.unique(rng.integers(I64_MIN, I64_MAX, 40_000 + 997 * k, dtype=np.int64)) for k in range(6)]

    def build(ids):
        t = HashTable(1)
        t.adopt(ids.copy(), ids.astype(np.float32)[:, None].copy())
        return t

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        tables = list(pool.map(build, parts))
    for ids, t in zip(parts, tables):
        assert len(t) == len(ids) and np.array_equal(t.lookup(ids)[:, 0], ids.astype(np.float32))
        assert np.array_equal(t.export()[0], np.sort(ids))


def test_adopt_takes_the_arrays_as_storage_and_checks_them_first():
    t = HashTable(2, slots=("m",))
    t.insert([9], [[9.0, 9.0]])
    ids = np.array([5, -3, I64_MAX])
    values = np.arange(6, dtype=np.float32).reshape(3, 2)
    m = -values
    t.adopt(ids, values, {"m": m})
    assert t.ids().tolist() == [-3, 5, I64_MAX] and 9 not in t
    assert t.lookup([I64_MAX, 5]).tolist() == [[4.0, 5.0], [0.0, 1.0]]
    assert t.lookup_slot("m", [-3]).tolist() == [[-2.0, -3.0]]
    assert np.shares_memory(t.rows()[1], values) and np.shares_memory(t.rows()[2]["m"], m)  # no copy
    t.insert([7], [[7.0, 7.0]])  # grows past the adopted arrays
    assert t.lookup([7, 5]).tolist() == [[7.0, 7.0], [0.0, 1.0]] and len(t) == 4

    before = HashTable.from_export(*t.export())
    bad = [
        (ValueError, "distinct", (np.array([1, 1]), np.zeros((2, 2), np.float32), {"m": np.zeros((2, 2), np.float32)})),
        (ValueError, "every slot", (np.array([1]), np.zeros((1, 2), np.float32), {})),
        (TypeError, "int64", (np.array([1], np.int32), z := np.zeros((1, 2), np.float32), {"m": z.copy()})),
        (TypeError, "values", (np.array([1]), np.zeros((1, 2), np.float64), {"m": np.zeros((1, 2), np.float32)})),
        (TypeError, "slot 'm'", (np.array([1]), np.zeros((1, 2), np.float32), {"m": np.zeros((2, 2), np.float32)})),
    ]
    for error, message, args in bad:
        with pytest.raises(error, match=message):
            t.adopt(*args)
        assert t == before  # unchanged


def test_adopt_with_spare_rows_fills_them_before_growing():
    ids = np.empty(10, np.int64)
    values = np.empty((10, 1), np.float32)
    ids[:3], values[:3] = [4, 5, 6], [[4.0], [5.0], [6.0]]
    t = HashTable(1)
    t.adopt(ids, values, rows=3)
    assert len(t) == 3 and t.ids().tolist() == [4, 5, 6] and len(t.changes()[0]) == 0
    t.insert(np.arange(100, 107), np.ones((7, 1)))  # fills the 7 spare rows in place
    assert np.shares_memory(t.rows()[1], values) and len(t) == 10
    assert sorted(t.changes()[0].tolist()) == list(range(100, 107))
    t.insert([1000], [[2.0]])  # now it grows
    assert not np.shares_memory(t.rows()[1], values) and t.lookup([5, 1000]).ravel().tolist() == [5.0, 2.0]
    with pytest.raises(ValueError, match=r"rows must be in \[0, 10\]"):
        HashTable(1).adopt(ids, values, rows=11)


def test_rows_of_any_shape_and_slots_of_their_own():
    """RecIS's tables: an embedding of rows [2, 3], Adam's slots shaped like it, a step filter's int64 [1] slot."""
    import pickle

    t = HashTable((2, 3), slots=("m", ("step_filter", 1, np.int64)), name="user")
    assert (t.dim, t.shape, t.slots) == (6, (2, 3), ("m", "step_filter"))
    assert t.slot_specs == {"m": ((2, 3), np.dtype(np.float32)), "step_filter": ((1,), np.dtype(np.int64))}
    values = np.arange(3 * 6, dtype=np.float32).reshape(3, 2, 3)
    t.insert([5, -1, 9], values, {"step_filter": [[7], [8], [9]]})
    assert t.lookup([9, 5]).tolist() == values[[2, 0]].tolist()
    assert t.lookup_slot("step_filter", [-1, 5]).tolist() == [[8], [7]]
    assert t.lookup_slot("m", [5]).shape == (1, 2, 3) and not t.lookup_slot("m", [5]).any()
    assert t.lookup([5, 4], default=-1)[1].tolist() == [[-1] * 3] * 2
    assert t.nbytes == 3 * (8 + 6 * 4 + 6 * 4 + 8)
    assert t.delete([-1]) == 1 and t.lookup_slot("step_filter", [9, 5]).tolist() == [[9], [7]]
    ids, exported, slots = t.export()
    assert ids.tolist() == [5, 9] and exported.shape == (2, 2, 3) and slots["step_filter"].dtype == np.int64
    same = HashTable.from_export(ids, exported, slots, name="copy")
    assert same == t and same.slot_specs == t.slot_specs and pickle.loads(pickle.dumps(t)) == t
    assert repr(t) == ("HashTable(dim=(2, 3), dtype=float32, slots=('m', ('step_filter', (1,), 'int64')), "
                       "name='user', len=2)")
    assert t != HashTable.from_export(ids, exported, {"m": slots["m"], "step_filter": slots["step_filter"] + 0.0})
    with pytest.raises(ValueError, match=r"slot 'step_filter' must have shape \(1, 1\)"):
        t.insert([1], values[:1], {"step_filter": [[1, 2]]})
    with pytest.raises(TypeError, match="castable to the table's int64"):
        t.update([5], values[:1], {"step_filter": [[0.5]]})
    with pytest.raises(ValueError, match=r"values must have shape \(1, 2, 3\)"):
        t.insert([1], np.zeros((1, 6), np.float32))
    with pytest.raises(TypeError, match=r"adopt: slot 'step_filter' must be a writeable, C-contiguous \(1, 1\) "
                                        "array of int64"):
        t.adopt(np.array([1]), np.zeros((1, 2, 3), np.float32), {"m": np.zeros((1, 2, 3), np.float32),
                                                                   "step_filter": np.zeros((1, 1), np.float32)})
    assert len(t) == 2  # nothing changed by a refused call
    with pytest.raises(ValueError, match=">= 1"):
        HashTable((2, 0))
    with pytest.raises(TypeError, match="shape of slot 's'"):
        HashTable(2, slots=(("s", "x", np.int64),))


def test_storage_rows_start_on_cache_lines_through_growth_and_deletes():
    # A save gathers a table's rows one random row at a time: each 64-byte row must fill one cache line, not two
    # (numpy's own arrays start 16 bytes into a line).
    t = HashTable(16, slots=("m", ("step", 1, np.int64)))
    rng = np.random.default_rng(3)
    for batch in range(5):  # grows the storage several times
        ids = rng.choice(1 << 40, 700, replace=False) + batch * (1 << 41)
        t.insert(ids, rng.random((700, 16), np.float32), {"m": rng.random((700, 16), np.float32)})
        t.delete(ids[:100])
        ids_, values, slots = t.rows()
        for array in (ids_, values, *slots.values()):
            assert array.ctypes.data % 64 == 0 and array.flags.c_contiguous
    assert len(t) == 5 * 600 and t.lookup(ids[100:102]).shape == (2, 16)
    assert HashTable.from_export(*t.export()).rows()[1].ctypes.data % 64 == 0
