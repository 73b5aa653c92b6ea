"""A sparse embedding table for recommendation models: int64 id -> one row of ``dim`` values.

Each id also owns one row in every optimizer *slot* (Adam's ``"m"`` and ``"v"``, say): the slot rows follow
their ids through inserts, deletes, exports and imports. A row may have any shape (``HashTable((2, 3))``: rows of
2 x 3 values), and a slot may have its own row shape and dtype (RecIS's step filter keeps one int64 per id:
``slots=("m", ("step_filter", 1, np.int64))``).

>>> import numpy as np
>>> from fastckpt.sharded.hashtable import HashTable
>>> table = HashTable(dim=2, slots=("m", "v"), name="user")
>>> table.insert([42, -7], [[1.0, 2.0], [3.0, 4.0]])
>>> table.lookup([-7, 42])
array([[3., 4.],
       [1., 2.]], dtype=float32)
>>> table.update([42], [[5.0, 6.0]], slots={"m": [[0.5, 0.5]]})
>>> table.lookup_slot("m", [42, -7])
array([[0.5, 0.5],
       [0. , 0. ]], dtype=float32)
>>> ids, values, slots = table.export()
>>> ids
array([-7, 42])
>>> HashTable.from_export(ids, values, slots) == table
True

How it is stored: the rows in ``(capacity, *shape)`` arrays (values, then one per slot, each of its own shape
and dtype) and the ids in an int64 array, all in the order the ids arrived, with spare capacity at the end; an open-addressing hash index
(:class:`fastckpt._native.idindex.IdIndex`, in Cython) maps each id to its row. Every call works on
whole arrays, with no Python object per id; for m ids given to a table of n:

* ``lookup``, ``lookup_slot``, ``update``, ``__contains__``: O(m) (one probe each);
* ``insert`` / ``import_``: O(m) amortized (new rows are appended; present ids are overwritten in place);
* ``delete``: O(m) (the last rows move into the holes);
* ``export`` / ``ids()``: a plain copy while the rows are in ascending id order (after an import of sorted ids,
  for one, or inserts of ascending ids), else one sort of the ids (O(n log n)) and a gather of the rows.

Changes are tracked for incremental checkpoints: every call that writes rows marks them in a per-row byte
(moved with its row) and every delete appends the ids removed, in the same vectorized call. :meth:`changes` gives
the ids written and deleted since the table last matched a committed checkpoint (its :attr:`base`);
:meth:`mark_clean` starts counting again, and a sharded save or load calls it once its checkpoint is committed
or loaded (a failed save leaves the changes as they were).

A table is not safe for concurrent use: give each thread its own, or hold a lock around each call that changes it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fastckpt._native.idindex import IdIndex, last_occurrence
from fastckpt.errors import FastCkptError, MissingIdsError  # noqa: F401 - MissingIdsError: its old import path

__all__ = ["HashTable", "MissingIdsError", "check_holds", "table_for"]

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_SHOWN = 8  # missing ids named in an error message
_SMALL_SORT = 1 << 15  # below this many ids a plain stable argsort is as fast as the packed sort
_CHUNK_ROWS = 1 << 16  # rows compared at a time by __eq__ (bounds its temporary memory)
# The storage arrays start at a multiple of this many bytes: a row of 64 bytes (16 float32) then fills one cache line,
# where numpy's 16-byte alignment puts every such row across two. A sharded save gathers the rows in key-space slice
# order, one random row at a time: a rank's 250,000 rows of 64 bytes in 1.3 ms aligned, 1.6 ms not.
_STORAGE_ALIGN = 64


def _empty(shape: tuple, dtype) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose data starts at a multiple of ``_STORAGE_ALIGN`` bytes.

    >>> a = _empty((3, 16), np.float32); a.shape, a.dtype.name, a.ctypes.data % _STORAGE_ALIGN, a.flags.c_contiguous
    ((3, 16), 'float32', 0, True)
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _STORAGE_ALIGN, np.uint8)
    start = -raw.ctypes.data % _STORAGE_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _check_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind in "biufc" or (dt.kind == "V" and dt.fields is None and dt.type.__module__.startswith("ml_dtypes")):
        return dt
    raise TypeError(f"HashTable dtype must be a numeric dtype (bool, integer, float, complex or an ml_dtypes type), "
                    f"got {dt}")


def _ids_from_objects(ids, what: str) -> np.ndarray:
    """Python ints (some beyond int64, so numpy made floats or objects of them): checked one by one."""
    out = []
    for value in ids:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{what} must be integers (int64), got the bool {value!r}")
        try:
            number = operator.index(value)
        except TypeError:
            raise TypeError(f"{what} must be integers (int64), got {value!r} ({type(value).__name__})") from None
        if not _INT64_MIN <= number <= _INT64_MAX:
            raise ValueError(f"{what} must fit in int64 [{_INT64_MIN}, {_INT64_MAX}], got {number}")
        out.append(number)
    return np.array(out, dtype=np.int64)


def _as_ids(ids, what: str = "ids") -> np.ndarray:
    """``ids`` as a 1-D C-contiguous int64 array (the caller's own array where it already is one: never stored)."""
    array = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of ids, got shape {array.shape}")
    if array.size == 0:
        return np.empty(0, np.int64)
    kind = array.dtype.kind
    if kind == "i":
        return np.ascontiguousarray(array, dtype=np.int64)
    if kind == "u":
        if array.dtype.itemsize == 8:
            big = array > np.uint64(_INT64_MAX)
            if big.any():
                raise ValueError(f"{what} must fit in int64 [{_INT64_MIN}, {_INT64_MAX}], got {array[big][0]} "
                                 f"({int(big.sum())} ids beyond)")
        return np.ascontiguousarray(array, dtype=np.int64)
    if kind == "O" or (kind == "f" and not isinstance(ids, np.ndarray)):
        return _ids_from_objects(ids, what)  # Python ints, some beyond int64 (or not ints at all)
    raise TypeError(f"{what} must be integers (int64), got an array of {array.dtype}")


def _sort_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ids[order], order)`` where ``order`` is a *stable* argsort of ``ids`` (equal ids keep their order).

    numpy's ``np.sort`` of 64-bit keys is about twice as fast as its ``argsort``: the id (less its minimum, shifted
    right where the span needs it) and its index are packed into one uint64 key and sorted. Where the shift made
    different ids equal, those runs (rare unless the ids cluster) are sorted again by (id, index).
    """
    m = len(ids)
    if m < _SMALL_SORT:
        order = np.argsort(ids, kind="stable")
        return ids[order], order
    low = int(ids.min())
    span = int(ids.max()) - low
    index_bits = (m - 1).bit_length()
    shift = max(0, span.bit_length() - (64 - index_bits))
    key = ids.view(np.uint64) - np.uint64(low & 0xFFFF_FFFF_FFFF_FFFF)  # wraps mod 2**64: the exact offset
    if shift:
        key >>= np.uint64(shift)
    key <<= np.uint64(index_bits)
    key |= np.arange(m, dtype=np.uint64)
    key.sort()
    order = (key & np.uint64((1 << index_bits) - 1)).astype(np.intp)
    ordered = ids[order]
    if shift:
        high = key >> np.uint64(index_bits)
        tie = high[1:] == high[:-1]
        if tie.any():
            at = np.flatnonzero(tie)
            in_run = np.zeros(m, bool)
            in_run[at] = True
            in_run[at + 1] = True
            sub = np.flatnonzero(in_run)
            run = np.cumsum(np.concatenate(([True], ~tie[sub[:-1]])))  # label of each run of tied keys
            again = np.lexsort((order[sub], ordered[sub], run))
            order[sub] = order[sub][again]
            ordered[sub] = ordered[sub][again]
    return ordered, order


def _row_shape(shape, what: str) -> tuple[int, ...]:
    """A row's shape from an int (``dim``) or a sequence of ints, each >= 1."""
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"{what} must be an int or a tuple of ints, got {shape!r}")
    try:
        dims = (operator.index(shape),)
    except TypeError:
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise TypeError(f"{what} must be an int or a tuple of ints, got {shape!r}") from None
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"{what} must be >= 1 (every axis of a row's shape), got {shape!r}")
    return dims


def _take(source: np.ndarray, index: np.ndarray | None) -> np.ndarray:
    return source if index is None else np.take(source, index, axis=0, mode="clip")


def _increasing(ids: np.ndarray) -> bool:
    """Whether ``ids`` ascend strictly: compared a stretch at a time, so that ids out of order (a load's, in key-space
    slice order) answer after the first stretch instead of after a comparison of every pair."""
    at, step = 0, 4096
    while at < len(ids) - 1:
        stop = min(at + step, len(ids) - 1)
        if not (ids[at + 1:stop + 1] > ids[at:stop]).all():
            return False
        at, step = stop, step * 4
    return True


class HashTable:
    """A sparse table: int64 id -> a row of ``dim`` values of ``dtype``, plus one row per optimizer slot.

    ``dim`` (>= 1, or a tuple: the row's shape, ``(2, 3)`` for rows of 2 x 3 values; :attr:`dim` is then their
    product) and ``dtype`` (any numeric dtype) fix each row; ``slots`` names the optimizer slots, rows that follow
    their ids: a name gives rows of the same shape and dtype as the values, a ``(name, shape, dtype)`` triple rows
    of their own (``("step_filter", 1, np.int64)``, RecIS's step filter). ``name`` is for messages and savers only.

    Values given to any method are cast to ``dtype`` where numpy casts them within their kind (``float64`` ->
    ``float32``, ``int`` -> ``float``); a cast across kinds (``float`` into an integer table) is a ``TypeError``.
    Every method checks all its arguments before it changes anything.

    >>> t = HashTable(4, dtype=np.float16, slots=["m"], name="item")
    >>> t
    HashTable(dim=4, dtype=float16, slots=('m',), name='item', len=0)
    >>> len(t), t.nbytes
    (0, 0)
    >>> HashTable((2, 3), slots=("m", ("step_filter", 1, np.int64)))
    HashTable(dim=(2, 3), dtype=float32, slots=('m', ('step_filter', (1,), 'int64')), name=None, len=0)
    """

    __hash__ = None  # mutable

    def __init__(self, dim: int | tuple[int, ...], dtype=np.float32, slots: Iterable[Any] = (),
                 name: str | None = None):
        if isinstance(dim, (bool, np.bool_)):
            raise TypeError(f"HashTable dim must be an int or a tuple of ints, got {dim!r}")
        shape = _row_shape(dim, "HashTable dim")
        if isinstance(slots, (str, bytes)):
            raise TypeError(f"HashTable slots must be an iterable of names, got the single string {slots!r} "
                            f"(write ({slots!r},))")
        self._dtype = _check_dtype(dtype)
        self._shape = shape
        self._dim = int(np.prod(shape))
        specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        names = []
        for slot in slots:
            if isinstance(slot, tuple) and len(slot) == 3:
                slot_name, slot_shape, slot_dtype = slot
                spec = (_row_shape(slot_shape, f"the shape of slot {slot_name!r}"), _check_dtype(slot_dtype))
            else:
                slot_name, spec = slot, (shape, self._dtype)
            if not isinstance(slot_name, str) or not slot_name:
                raise TypeError(f"HashTable slot names must be non-empty strings (or (name, shape, dtype) triples), "
                                f"got {slot!r}")
            names.append(slot_name)
            specs[slot_name] = spec
        if len(specs) != len(names):
            raise ValueError(f"HashTable slot names must be distinct, got {tuple(names)}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"HashTable name must be a string or None, got {name!r}")
        self._slots = tuple(names)
        self._specs = specs
        self.name = name
        self._n = 0
        self._index = IdIndex()
        self._sorted = True  # rows in ascending id order: export and ids() copy them as they are
        self._base = None  # the checkpoint the table matched, less the changes tracked since (None: none)
        self._deleted: list[np.ndarray] = []  # ids removed since then, in chunks (repeats, re-inserted ids kept)
        self._allocate(0)

    # -- attributes --------------------------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        """Values per row (the product of :attr:`shape`).

        >>> HashTable(8).dim, HashTable((2, 3)).dim
        (8, 6)
        """
        return self._dim

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one row of values: ``(dim,)``, or the tuple given as ``dim``.

        >>> HashTable(8).shape, HashTable((2, 3)).shape
        ((8,), (2, 3))
        """
        return self._shape

    @property
    def slot_specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{slot: (row shape, dtype)}`` for every slot, in the order of :attr:`slots`.

        >>> HashTable(2, slots=("m", ("step_filter", 1, np.int64))).slot_specs
        {'m': ((2,), dtype('float32')), 'step_filter': ((1,), dtype('int64'))}
        """
        return dict(self._specs)

    def _slot_params(self) -> tuple:
        """The ``slots`` argument that makes a table of these slots: names, or triples for slots of their own."""
        return tuple(s if self._specs[s] == (self._shape, self._dtype) else (s, self._specs[s][0],
                                                                             self._specs[s][1].name)
                     for s in self._slots)

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the values and the slots.

        >>> HashTable(8).dtype
        dtype('float32')
        """
        return self._dtype

    @property
    def slots(self) -> tuple[str, ...]:
        """The optimizer slot names, in the order given.

        >>> HashTable(8, slots=["m", "v"]).slots
        ('m', 'v')
        """
        return self._slots

    @property
    def nbytes(self) -> int:
        """Bytes held by the ids, the values and the slots (spare capacity and the hash index not counted).

        >>> t = HashTable(2, slots=("m",)); t.insert([1, 2, 3], np.zeros((3, 2)))
        >>> t.nbytes  # 3 ids * 8 + 2 arrays * 3 rows * 2 values * 4 bytes
        72
        """
        slot_bytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in self._specs.values())
        return self._n * (8 + self._dim * self._dtype.itemsize + slot_bytes)

    def __len__(self) -> int:
        """How many ids the table holds.

        >>> t = HashTable(1); t.insert([5, 5, 6], [[1], [2], [3]]); len(t)
        2
        """
        return self._n

    def __contains__(self, id) -> bool:
        """Whether the table holds ``id`` (anything that is not an int64 integer is never in it).

        >>> t = HashTable(1); t.insert([-(2**63)], [[0.0]])
        >>> -(2**63) in t, 0 in t, 2**64 in t, "x" in t
        (True, False, False, False)
        """
        if isinstance(id, (bool, np.bool_)):
            return False
        try:
            key = operator.index(id)
        except TypeError:
            return False
        if not _INT64_MIN <= key <= _INT64_MAX or not self._n:
            return False
        return not self._index.find(np.array([key], np.int64), np.empty(1, np.int64))

    def __repr__(self) -> str:
        dim = self._dim if len(self._shape) == 1 else self._shape
        return (f"HashTable(dim={dim}, dtype={self._dtype}, slots={self._slot_params()}, name={self.name!r}, "
                f"len={self._n})")

    # -- storage -----------------------------------------------------------------------------------------------

    def _allocate(self, capacity: int) -> None:
        """New, empty buffers of ``capacity`` rows (the old contents are dropped)."""
        self._ids = _empty((capacity,), np.int64)
        self._changed = np.zeros(capacity, np.uint8)  # 1: the row was written since the base
        self._values = _empty((capacity, *self._shape), self._dtype)
        self._slot_values = {s: _empty((capacity, *shape), dtype) for s, (shape, dtype) in self._specs.items()}

    def _arrays(self) -> list[np.ndarray]:
        return [self._ids, self._changed, self._values, *self._slot_values.values()]

    def _reserve(self, rows: int) -> None:
        """Capacity for ``rows`` rows, keeping the contents (grows by half at least, so appends are amortized)."""
        capacity = len(self._ids)
        if rows <= capacity:
            return
        self._resize(max(rows, capacity + capacity // 2, 16))

    def _resize(self, capacity: int) -> None:
        """Buffers of ``capacity`` rows (at least the rows held), keeping the contents."""
        n = self._n
        old = self._arrays()
        self._allocate(capacity)
        for new, was in zip(self._arrays(), old):
            new[:n] = was[:n]

    def _shrink(self) -> None:
        """Give back memory once the rows held fill less than a quarter of the capacity."""
        if len(self._ids) > 4 * self._n + 64:
            self._resize(self._n + self._n // 2)

    # -- checking arguments ------------------------------------------------------------------------------------

    def _rows(self, values, m: int, what: str, spec: tuple | None = None) -> np.ndarray:
        shape, dtype = (self._shape, self._dtype) if spec is None else spec
        array = np.asarray(values)
        if array.dtype != dtype:
            kind = array.dtype.kind
            if (kind not in "biufcV" or array.dtype.fields is not None
                    or not np.can_cast(array.dtype, dtype, "same_kind")):
                raise TypeError(f"{what} must be numbers castable to the table's {dtype} (within their kind), "
                                f"got {array.dtype}")
        if array.shape != (m, *shape) and not (m == 0 and array.shape == (0,)):
            row = f"dim {shape[0]}" if len(shape) == 1 else f"shape {shape}"
            raise ValueError(f"{what} must have shape {(m, *shape)} (one row of {row} for each of the {m} ids), "
                             f"got {array.shape}")
        return array.reshape(m, *shape)

    def _slot_rows(self, slots: Mapping[str, Any] | None, m: int) -> dict[str, np.ndarray]:
        if slots is None:
            return {}
        if not isinstance(slots, Mapping):
            raise TypeError(f"slots must be a mapping of slot name -> rows, got {type(slots).__name__}")
        unknown = [s for s in slots if s not in self._slot_values]
        if unknown:
            raise KeyError(f"unknown slots {unknown}: this table's slots are {self._slots}")
        return {s: self._rows(rows, m, f"slot {s!r}", self._specs[s]) for s, rows in slots.items()}

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """``(rows, missing)``: the row of each id (-1 where absent), and how many are absent."""
        rows = np.empty(len(ids), np.int64)
        missing = self._index.find(ids, rows) if self._n else len(ids)
        if not self._n:
            rows.fill(-1)
        return rows, missing

    def _missing(self, ids: np.ndarray, found: np.ndarray) -> MissingIdsError:
        missing = ids[~found]
        _, first = np.unique(missing, return_index=True)
        return MissingIdsError(missing[np.sort(first)[:_SHOWN]], len(first), self.name)

    @staticmethod
    def _last(rows: np.ndarray, row_count: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``(rows, source)`` with only the last occurrence of each row kept (``source`` is None: all kept)."""
        if len(rows) < 2:
            return rows, None
        keep = np.empty(len(rows), np.uint8)
        if not last_occurrence(rows, keep, row_count):
            return rows, None
        source = np.flatnonzero(keep)
        return rows[source], source

    # -- writing -----------------------------------------------------------------------------------------------

    def insert(self, ids, values, slots: Mapping[str, Any] | None = None) -> None:
        """Upsert: new ids are added, ids already present are overwritten.

        ``values`` is ``(len(ids), dim)``; ``slots`` maps some of the slot names to rows of the same shape. The
        slot rows of new ids that ``slots`` does not give are zeros; those of present ids are kept. Where an id is
        repeated within one call, its last occurrence wins.

        >>> t = HashTable(1, slots=("m",))
        >>> t.insert([7, 3, 7], [[1.0], [2.0], [9.0]], slots={"m": [[1.0], [1.0], [1.0]]})
        >>> t.lookup([3, 7]).ravel().tolist(), t.lookup_slot("m", [3, 7]).ravel().tolist()
        ([2.0, 9.0], [1.0, 1.0])
        >>> t.insert([3, 4], [[5.0], [6.0]])  # 3 overwritten (its slot row kept), 4 new (slot row zeros)
        >>> t.lookup([3, 4]).ravel().tolist(), t.lookup_slot("m", [3, 4]).ravel().tolist()
        ([5.0, 6.0], [1.0, 0.0])
        """
        ids = _as_ids(ids)
        values = self._rows(values, len(ids), "values")
        self._upsert(ids, values, self._slot_rows(slots, len(ids)))

    def update(self, ids, values, slots: Mapping[str, Any] | None = None) -> None:
        """Overwrite the rows (and the slot rows given) of ids the table holds already.

        Every id must be present: otherwise a ``KeyError`` (:class:`MissingIdsError`) names up to 8 of the missing
        ids and how many there are, and the table is left unchanged. A repeated id: its last occurrence wins.

        >>> t = HashTable(1); t.insert([1, 2], [[0.0], [0.0]])
        >>> t.update([2], [[4.0]]); t.lookup([1, 2]).ravel().tolist()
        [0.0, 4.0]
        >>> t.update([2, 3, 5], np.zeros((3, 1)))
        Traceback (most recent call last):
        ...
        fastckpt.errors.MissingIdsError: 2 ids not in the hashtable: [3, 5]
        """
        ids = _as_ids(ids)
        values = self._rows(values, len(ids), "values")
        slot_rows = self._slot_rows(slots, len(ids))
        rows, missing = self._find(ids)
        if missing:
            raise self._missing(ids, rows >= 0)
        rows, source = self._last(rows, self._n)
        self._write_rows(rows, values, slot_rows, source)
        self._changed[rows] = 1

    def _write_rows(self, rows: np.ndarray, values: np.ndarray, slot_rows: dict, source: np.ndarray | None) -> None:
        """Overwrite the table's ``rows`` with ``values[source]`` (and the same rows of the slots given)."""
        if not len(rows):
            return
        self._values[rows] = _take(values, source)
        for slot, given in slot_rows.items():
            self._slot_values[slot][rows] = _take(given, source)

    def _upsert(self, ids: np.ndarray, values: np.ndarray, slot_rows: dict) -> None:
        m, n = len(ids), self._n
        if not m:
            return
        rows = np.empty(m, np.int64)
        added = self._index.upsert(ids, rows, n)  # new ids get rows n, n + 1, ... in the order they come
        try:
            self._reserve(n + added)
        except BaseException:
            self._index.remove(ids[rows >= n], np.empty(int(np.count_nonzero(rows >= n)), np.int64))
            raise
        end = n + added
        if added == m:  # every id new, none repeated: rows n .. end - 1, in the order given
            self._ids[n:end] = ids
            self._changed[n:end] = 1
            self._values[n:end] = values
            for slot, array in self._slot_values.items():
                array[n:end] = slot_rows.get(slot, 0)
        else:
            rows, source = self._last(rows, end)
            self._ids[rows] = _take(ids, source)
            for slot, array in self._slot_values.items():
                if slot not in slot_rows:
                    array[n:end] = 0
            self._write_rows(rows, values, slot_rows, source)
            self._changed[rows] = 1
        self._n = end
        if added and self._sorted:
            self._sorted = _increasing(self._ids[max(n - 1, 0):end])

    def delete(self, ids) -> int:
        """Remove the ids present (absent ones are ignored, repeats count once); returns how many were removed.

        >>> t = HashTable(1); t.insert([1, 2, 3], np.zeros((3, 1)))
        >>> t.delete([2, 2, 9]), t.ids()
        (1, array([1, 3]))
        """
        ids = _as_ids(ids)
        if not len(ids) or not self._n:
            return 0
        rows = np.empty(len(ids), np.int64)
        removed = self._index.remove(ids, rows)
        if not removed:
            return 0
        gone = rows[rows >= 0]  # distinct: a repeat found its id removed already
        self._deleted.append(self._ids[gone])
        n, kept = self._n, self._n - removed
        holes = np.sort(gone[gone < kept])
        if len(holes):  # the rows held past the new end move into the holes below it
            tail = np.ones(n - kept, bool)
            tail[gone[gone >= kept] - kept] = False
            moved = kept + np.flatnonzero(tail)
            for array in self._arrays():
                array[holes] = array[moved]
            self._index.assign(self._ids[holes], holes)
            self._sorted = False
        self._n = kept
        self._shrink()
        return removed

    # -- reading -----------------------------------------------------------------------------------------------

    def _read(self, source: np.ndarray, ids, default) -> np.ndarray:
        ids = _as_ids(ids)
        if default is not None:
            if np.ndim(default) != 0:
                raise ValueError(f"default must be a scalar, got shape {np.shape(default)}")
            kind = np.asarray(default).dtype
            if kind != source.dtype and not np.can_cast(kind, source.dtype, "same_kind"):
                raise TypeError(f"default must be castable to the table's {source.dtype}, got {default!r} ({kind})")
        rows, missing = self._find(ids)
        if not missing:
            return np.take(source[: self._n], rows, axis=0)
        found = rows >= 0
        if default is None:
            raise self._missing(ids, found)
        out = np.empty((len(ids), *source.shape[1:]), source.dtype)
        out[found] = np.take(source[: self._n], rows[found], axis=0)
        out[~found] = default
        return out

    def lookup(self, ids, default=None) -> np.ndarray:
        """The rows of ``ids``, ``(len(ids), dim)`` (``(len(ids), *shape)``), a copy, in the order given.

        A missing id is a ``KeyError`` (:class:`MissingIdsError`, naming up to 8), unless ``default`` is given:
        a scalar that fills the rows of the missing ids.

        >>> t = HashTable(2); t.insert([10], [[1.0, 2.0]])
        >>> t.lookup([10, 11], default=-1.0)
        array([[ 1.,  2.],
               [-1., -1.]], dtype=float32)
        """
        return self._read(self._values, ids, default)

    def lookup_slot(self, name: str, ids) -> np.ndarray:
        """The rows of slot ``name`` for ``ids`` (a copy; missing ids as :meth:`lookup` without a default).

        >>> t = HashTable(1, slots=("v",)); t.insert([1], [[0.0]], slots={"v": [[0.25]]})
        >>> t.lookup_slot("v", [1])
        array([[0.25]], dtype=float32)
        """
        if name not in self._slot_values:
            raise KeyError(f"unknown slot {name!r}: this table's slots are {self._slots}")
        return self._read(self._slot_values[name], ids, None)

    def ids(self) -> np.ndarray:
        """The ids held, sorted ascending (int64, a copy).

        >>> t = HashTable(1); t.insert([3, -1, 2], np.zeros((3, 1))); t.ids()
        array([-1,  2,  3])
        """
        ids = self._ids[: self._n]
        return ids.copy() if self._sorted else np.sort(ids)

    # -- bulk --------------------------------------------------------------------------------------------------

    def rows(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """``(ids, values, slots)`` as read-only views of the table's own storage, in its row order (not sorted).

        No copy: for writers that only read them before the table changes next (any insert, update, delete
        or import may move or overwrite the rows they show). :meth:`export` gives sorted copies.

        >>> t = HashTable(1); t.insert([2, 1], [[20.0], [10.0]])
        >>> ids, values, _ = t.rows()
        >>> ids.tolist(), values.ravel().tolist(), ids.flags.writeable
        ([2, 1], [20.0, 10.0], False)
        """
        n = self._n
        views = [self._ids[:n], self._values[:n], *(array[:n] for array in self._slot_values.values())]
        for view in views:
            view.flags.writeable = False
        return views[0], views[1], dict(zip(self._slot_values, views[2:]))

    def export(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """``(ids, values, slots)``: the ids sorted ascending (int64), their rows ``(n, *shape)`` in that order, and
        ``{slot: (n, *its shape)}`` in the order of :attr:`slots`. C-contiguous copies.

        >>> t = HashTable(1, slots=("m",)); t.insert([2, 1], [[20.0], [10.0]])
        >>> ids, values, slots = t.export()
        >>> ids.tolist(), values.ravel().tolist(), slots["m"].ravel().tolist()
        ([1, 2], [10.0, 20.0], [0.0, 0.0])
        """
        n = self._n
        if self._sorted:
            return (self._ids[:n].copy(), self._values[:n].copy(),
                    {slot: array[:n].copy() for slot, array in self._slot_values.items()})
        ids, order = _sort_ids(self._ids[:n])
        return (ids, np.take(self._values[:n], order, axis=0),
                {slot: np.take(array[:n], order, axis=0) for slot, array in self._slot_values.items()})

    def import_(self, ids, values, slots: Mapping[str, Any] | None = None, *, clear: bool = False) -> None:
        """Bulk upsert, as :meth:`insert`; with ``clear=True`` the table holds exactly what is given afterwards.

        Distinct ids are copied in as they come (one probe of the index each); ids sorted ascending (what
        :meth:`export` gives) keep the table in order, so that the next export is a plain copy.

        >>> t = HashTable(1); t.insert([1, 2], [[1.0], [2.0]])
        >>> t.import_([5], [[5.0]], clear=True); t.ids()
        array([5])
        """
        ids = _as_ids(ids)
        values = self._rows(values, len(ids), "values")
        slot_rows = self._slot_rows(slots, len(ids))
        if clear:
            self._index.clear(len(ids))
            self._n = 0
            self._sorted = True
            self._base, self._deleted = None, []  # every row changes: only a full save records it
            if len(self._ids) > 2 * len(ids) + 64:  # give back the memory of a much larger table
                self._allocate(0)
        self._upsert(ids, values, slot_rows)

    def adopt(self, ids: np.ndarray, values: np.ndarray, slots: Mapping[str, np.ndarray] | None = None, *,
              rows: int | None = None, runs: Sequence[tuple] = ()) -> None:
        """Replace the contents with ``(ids, values, slots)``, taking the arrays themselves as storage (no copy).

        For loaders that build fresh arrays of a table's rows: the table owns them afterwards (do not use them
        elsewhere). ``ids`` must be distinct int64, ``values`` and every slot C-contiguous, writeable
        ``(len(ids), *shape)`` arrays of the table's dtype (a slot's: of its own shape and dtype), and ``slots``
        must give every slot of the table.
        With ``rows`` only the first ``rows`` ids and rows are the table's; the rest is spare capacity, which
        later inserts fill before the arrays grow (uninitialized ``np.empty`` rows cost no memory until used).
        Anything else raises before the table changes. The id index is built in one pass without the GIL
        (:meth:`IdIndex.fill <fastckpt._native.idindex.IdIndex.fill>`): the threads reading the rows, and the other
        ranks of a load run as threads, go on meanwhile. ``runs``: slice runs of the ids that the build checks as it
        reads them (``IdIndex.fill``'s ``runs``; one out of place raises ``ValueError``).

        >>> t = HashTable(1, slots=("m",))
        >>> ids, values = np.array([3, 1]), np.array([[3.0], [1.0]], np.float32)
        >>> t.adopt(ids, values, {"m": np.zeros((2, 1), np.float32)})
        >>> t.lookup([1]).tolist(), np.shares_memory(t.rows()[1], values)
        ([[1.0]], True)
        """
        slots = dict(slots or {})
        if set(slots) != set(self._slots):
            raise ValueError(f"adopt needs every slot of the table {self._slots}, got {tuple(slots)}")
        if not (isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1
                and ids.flags.c_contiguous and ids.flags.writeable):
            raise TypeError("adopt: ids must be a writeable, C-contiguous 1-D int64 array")
        capacity = len(ids)
        m = capacity if rows is None else operator.index(rows)
        if not 0 <= m <= capacity:
            raise ValueError(f"adopt: rows must be in [0, {capacity}], got {rows!r}")
        for what, array, (shape, dtype) in (("values", values, (self._shape, self._dtype)),
                                            *((f"slot {s!r}", a, self._specs[s]) for s, a in slots.items())):
            if not (isinstance(array, np.ndarray) and array.dtype == dtype
                    and array.shape == (capacity, *shape) and array.flags.c_contiguous and array.flags.writeable):
                raise TypeError(f"adopt: {what} must be a writeable, C-contiguous {(capacity, *shape)} array "
                                f"of {dtype}")
        index = IdIndex()
        if index.fill(ids[:m], runs) != m:  # built without the GIL: the copies of other threads go on meanwhile
            raise ValueError(f"adopt: the ids must be distinct ({m - len(np.unique(ids[:m]))} repeated)")
        self._index, self._n = index, m
        self._ids, self._values = ids, values
        self._changed = np.zeros(capacity, np.uint8)
        self._slot_values = {s: slots[s] for s in self._slots}
        self._sorted = _increasing(ids[:m])
        self._base, self._deleted = None, []  # the loader that adopts says which checkpoint this is (mark_clean)

    def _take_contents(self, other: HashTable) -> None:
        """Become ``other`` (same dim, dtype and slots), taking its storage without a copy; ``other`` must not be
        used afterwards. A loader fills a table of its own and hands it over only once every check has passed, so
        that a failed load leaves the caller's table as it was."""
        if (other._shape, other._dtype, other._specs, other._slots) != (self._shape, self._dtype, self._specs,
                                                                         self._slots):
            raise ValueError(f"cannot take the contents of a table of shape {other._shape} {other._dtype} slots "
                             f"{other._slot_params()} into one of shape {self._shape} {self._dtype} slots "
                             f"{self._slot_params()}")
        name = self.name
        self.__dict__.update(other.__dict__)
        self.name = name

    # -- change tracking ---------------------------------------------------------------------------------------

    @property
    def base(self):
        """The checkpoint the table matched when tracking last started (:meth:`mark_clean`), or None.

        None means no checkpoint holds the table's earlier state (a new table, or one replaced by
        ``import_(clear=True)`` or :meth:`adopt`): only a full save can record it.

        >>> t = HashTable(1); t.base is None
        True
        >>> t.mark_clean(("ckpt/step-1", "ab12")); t.base
        ('ckpt/step-1', 'ab12')
        """
        return self._base

    def changed_rows(self) -> np.ndarray:
        """The rows (positions in :meth:`rows`' order) written since :meth:`mark_clean`, ascending.

        >>> t = HashTable(1); t.insert([5, 6], [[0.0], [0.0]]); t.mark_clean(None); t.update([6], [[1.0]])
        >>> t.changed_rows().tolist()
        [1]
        """
        # Viewed as bool (the bytes are 0 or 1): numpy's nonzero is several times faster on bool than on uint8.
        return np.flatnonzero(self._changed[: self._n].view(np.bool_))

    def changes(self) -> tuple[np.ndarray, np.ndarray]:
        """``(written, deleted)``: the ids inserted or updated since :meth:`mark_clean` (the table holds them; in
        row order), and the ids deleted since then that it does not hold now (sorted, distinct).

        >>> t = HashTable(1); t.insert([1, 2, 3], np.zeros((3, 1))); t.mark_clean(None)
        >>> t.update([2], [[1.0]]); _ = t.delete([1, 3]); t.insert([3], [[3.0]])
        >>> [a.tolist() for a in t.changes()]
        [[2, 3], [1]]
        """
        written = self._ids[: self._n][self.changed_rows()]
        if not self._deleted:
            return written, np.empty(0, np.int64)
        deleted = np.unique(np.concatenate(self._deleted))
        if self._n:
            found = np.empty(len(deleted), np.int64)
            self._index.find(deleted, found)
            deleted = deleted[found < 0]  # re-inserted since: written, not deleted
        return written, deleted

    def mark_clean(self, base) -> None:
        """Start tracking changes afresh: the table now matches checkpoint ``base`` (any value naming it; a sharded
        save passes ``(path, manifest hash)``). Savers and loaders call it; call it yourself only to forget changes.

        >>> t = HashTable(1); t.insert([1], [[0.0]]); len(t.changes()[0])
        1
        >>> t.mark_clean("x"); len(t.changes()[0]), t.base
        (0, 'x')
        """
        self._changed[: self._n] = 0
        self._deleted = []
        self._base = base

    @classmethod
    def from_export(cls, ids, values, slots: Mapping[str, Any] | None = None, *, name: str | None = None
                    ) -> HashTable:
        """A new table holding ``(ids, values, slots)``, as :meth:`export` returns them.

        The row shape and ``dtype`` are those of ``values`` (``(ids, *shape)``, 2-D at least); the slot names those
        of ``slots``, in its order. A slot whose rows have the values' shape and a dtype of their kind is cast to
        the table's dtype; any other keeps its own row shape and dtype.

        >>> t = HashTable.from_export(np.array([4, 8]), np.ones((2, 3), np.float64), {"m": np.zeros((2, 3))})
        >>> t
        HashTable(dim=3, dtype=float64, slots=('m',), name=None, len=2)
        >>> HashTable.from_export([4], np.ones((1, 3)), {"step": np.array([[7]])}).slot_specs["step"]
        ((1,), dtype('int64'))
        """
        values = np.asarray(values)
        if values.ndim < 2:
            raise ValueError(f"values must be 2-D at least (ids, dim), got shape {values.shape}")
        slots = {s: np.asarray(rows) for s, rows in (slots or {}).items()}
        params = []
        for s, rows in slots.items():
            if rows.shape[1:] == values.shape[1:] and rows.dtype.kind == values.dtype.kind or rows.ndim < 2:
                params.append(s)
            else:
                params.append((s, rows.shape[1:], rows.dtype))
        shape = values.shape[1] if values.ndim == 2 else values.shape[1:]
        table = cls(shape, dtype=values.dtype, slots=params, name=name)
        table.import_(ids, values, slots)
        return table

    # -- comparison, pickling ----------------------------------------------------------------------------------

    def __eq__(self, other) -> bool:
        """Same row shape, dtype and slots (with their shapes and dtypes), and identical exported bytes (NaNs with the same bits are equal; the name is
        not compared).

        >>> a = HashTable(1); a.insert([1], [[np.nan]])
        >>> b = HashTable(1, name="b"); b.insert([1], [[np.nan]])
        >>> a == b, a == HashTable(2)
        (True, False)
        """
        if not isinstance(other, HashTable):
            return NotImplemented
        if (self._shape, self._dtype, self._slots, self._specs, self._n) != (other._shape, other._dtype, other._slots,
                                                                              other._specs, other._n):
            return False
        n = self._n
        if n == 0:
            return True
        rows, missing = other._find(self._ids[:n])
        if missing:
            return False
        pairs = [(self._values, other._values)]
        pairs += [(self._slot_values[s], other._slot_values[s]) for s in self._slots]
        for start in range(0, n, _CHUNK_ROWS):
            at = rows[start:start + _CHUNK_ROWS]
            for mine, theirs in pairs:
                a = mine[start:start + len(at)].view(np.uint8)
                if not np.array_equal(a, np.take(theirs, at, axis=0).view(np.uint8)):
                    return False
        return True

    def __reduce__(self):
        ids, values, slots = self.export()
        dim = self._dim if len(self._shape) == 1 else self._shape
        return _restore, (type(self), dim, self._dtype, self._slot_params(), self.name, ids, values, slots)


def _restore(cls, dim, dtype, slots, name, ids, values, slot_values) -> HashTable:
    """Unpickle: a table from its exported state.

    >>> import pickle
    >>> t = HashTable(2, slots=("m",), name="e"); t.insert([3], [[1.0, 2.0]])
    >>> pickle.loads(pickle.dumps(t)) == t
    True
    """
    table = cls(dim, dtype=dtype, slots=slots, name=name)
    table.import_(ids, values, slot_values)
    return table


def table_for(entry: Mapping[str, Any], name: str, slots: Iterable[str] | None = None) -> HashTable:
    """A new, empty :class:`HashTable` that holds a checkpoint's table ``entry`` whole: a sharded manifest's
    ``hashtables`` entry of any format version, or a RecIS directory's
    (:meth:`~fastckpt.sharded.recis.RecisCheckpointReader.hashtables`): its embedding's row shape and dtype, and
    every slot (those of ``slots`` where given, in that order) with its own row shape and dtype (``shape`` and
    ``slot_specs`` where the entry records them, else ``[dim]`` rows of the table's dtype).

    >>> table_for({"dim": 6, "shape": [2, 3], "dtype": "float32", "slots": ["m", "step_filter"], "slot_specs": {
    ...     "m": {"shape": [2, 3], "dtype": "float32"}, "step_filter": {"shape": [1], "dtype": "int64"}}}, "t")
    HashTable(dim=(2, 3), dtype=float32, slots=('m', ('step_filter', (1,), 'int64')), name='t', len=0)
    >>> table_for({"dim": 4, "dtype": "bfloat16", "slots": ["m", "v"]}, "u", slots=["v"])
    HashTable(dim=4, dtype=bfloat16, slots=('v',), name='u', len=0)
    """
    from fastckpt.sharded.format import dtype_of

    shape = tuple(entry.get("shape", (entry["dim"],)))
    specs = entry.get("slot_specs") or {}
    params = [(slot, tuple(specs[slot]["shape"]), dtype_of(specs[slot]["dtype"], f"{name}: slot {slot!r}"))
              if slot in specs else (slot, shape, dtype_of(entry["dtype"], name))
              for slot in (entry["slots"] if slots is None else slots)]
    return HashTable(shape if len(shape) > 1 else shape[0], dtype=dtype_of(entry["dtype"], name), slots=params,
                     name=name)


def check_holds(table: HashTable, entry: Mapping[str, Any], name: str, where: str) -> None:
    """Raise ``ValueError`` unless ``table`` can hold a checkpoint's table ``entry`` (``{"dim", "dtype", "slots"}``,
    with ``"shape"`` and ``"slot_specs"`` where rows or slots have shapes or dtypes of their own): the same row
    shape and dtype, and each of its slots stored there with the row shape and dtype it has. The checkpoint's
    other slots are not asked for (RecIS's loader too reads the slots of the table it fills).

    >>> check_holds(HashTable(2, slots=("m",)), {"dim": 2, "dtype": "float32", "slots": ["m", "v"]}, "t", "ckpt")
    >>> check_holds(HashTable(3), {"dim": 2, "dtype": "float32", "slots": []}, "t", "ckpt")
    Traceback (most recent call last):
    ...
    ValueError: ckpt: hashtable 't' is dim 2 float32 in the checkpoint, the table given is dim 3 float32
    """
    shape = tuple(entry.get("shape", (entry["dim"],)))
    if table.shape != shape or np.dtype(table.dtype).name != entry["dtype"]:
        got = f"dim {table.dim}" if len(table.shape) == 1 else f"shape {table.shape}"
        want = f"dim {entry['dim']}" if len(shape) == 1 else f"shape {shape}"
        raise ValueError(f"{where}: hashtable {name!r} is {want} {entry['dtype']} in the checkpoint, the table "
                         f"given is {got} {np.dtype(table.dtype).name}")
    missing = [s for s in table.slots if s not in entry["slots"]]
    if missing:
        raise ValueError(f"{where}: hashtable {name!r} has no slots {missing} in the checkpoint "
                         f"(it has {list(entry['slots'])})")
    specs = entry.get("slot_specs", {})
    for slot, (slot_shape, dtype) in table.slot_specs.items():
        stored = specs.get(slot, {"shape": list(shape), "dtype": entry["dtype"]})
        if (slot_shape, dtype.name) != (tuple(stored["shape"]), stored["dtype"]):
            raise ValueError(f"{where}: hashtable {name!r} slot {slot!r} holds rows of shape "
                             f"{tuple(stored['shape'])} {stored['dtype']} in the checkpoint, the table given has "
                             f"{slot_shape} {dtype.name}: give the table that slot as ({slot!r}, "
                             f"{tuple(stored['shape'])}, {stored['dtype']!r})")
