"""An open-addressing hash index: int64 id -> int64 row number (the index of :mod:`fastckpt.sharded.hashtable`).

Linear probing over a power-of-two bucket array (each bucket a key and its row side by side, 16 bytes: a probe
touches one cache line; the row is stored plus one, so that a bucket of zeros is empty and new buckets, zeroed by
the allocator or by the kernel as their pages are first touched, need no pass to empty them; an array of 2 MiB or
more is a mapping of its own that asks the kernel for huge pages, so that probes spread over it do not miss the TLB,
and freed ones of up to 64 MiB in all are kept for the next index of their size), the ids mixed by splitmix64's
finalizer, at most 70% full (it doubles before a call could pass that), deletion by backward shift (no tombstones,
so lookups never slow down). Every call takes whole arrays and loops in C; the caller keeps the rows themselves (the
index only numbers them). The loops hold the GIL on purpose: the buckets are freed and replaced as the index grows,
so a loop that ran beside another thread's call could read freed memory; holding the GIL, a table misused from two
threads gives wrong answers, never a crash. The one exception is ``fill``, the bulk build of a new index: it fills
buckets of its own without the GIL and makes them the index's only once it holds the GIL again, so no other call
ever sees them half built.

>>> import numpy as np
>>> index = IdIndex()
>>> rows = np.empty(3, np.int64)
>>> index.upsert(np.array([7, -(2**63), 7]), rows, 0)  # ids -> rows, new ids numbered from 0: returns how many new
2
>>> rows.tolist()
[0, 1, 0]
>>> index.find(np.array([7, 5]), rows[:2]), rows[:2].tolist()  # returns how many are missing (row -1)
(1, [0, -1])
>>> keep = np.empty(3, np.uint8)
>>> last_occurrence(np.array([0, 1, 0]), keep, 2), keep.tolist()  # repeats, and which occurrence is the last
(1, [0, 1, 1])
"""

cimport cython
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport calloc, free

from fastckpt._native.mapped cimport kept_alloc, kept_free

# Bucket memory, every byte zero (an empty bucket is all zeros, so new buckets need no pass of their own): the
# process's kept memory (mapped.pyx): from 2 MiB on a mapping of its own aligned to 2 MiB and advised to use huge
# pages (random probes over tens of MiB otherwise miss the TLB at almost every id), whose pages the kernel hands out
# zeroed as they are first touched, or a freed one of the same size zeroed again (a loader builds an index per table
# at each load, of the sizes the last load freed: one memset where a new mapping takes a fault and the kernel's
# zeroing of every page, on a virtual machine several times the memset); calloc below that.
cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define fastckpt_idindex_prefetch(p) __builtin_prefetch((p), 1, 3)
    #else
    #define fastckpt_idindex_prefetch(p) ((void)0)
    #endif
    """
    void fastckpt_idindex_prefetch(const void* address) nogil

ctypedef struct Bucket:
    int64_t key
    int64_t stored  # the row + 1; 0: empty (a new bucket is all zeros)

DEF _MIN_BUCKETS = 16
# Grow when more than _LOAD_NUM / _LOAD_DEN of the buckets would be full.
DEF _LOAD_NUM = 7
DEF _LOAD_DEN = 10
# fill(): how many ids ahead the home bucket is fetched
DEF _PREFETCH = 16


cdef inline uint64_t _mix(int64_t key) noexcept nogil:
    cdef uint64_t x = <uint64_t>key
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9ULL
    x ^= x >> 27
    x *= 0x94D049BB133111EBULL
    x ^= x >> 31
    return x


cdef Py_ssize_t _buckets_for(Py_ssize_t count) noexcept:
    """The fewest buckets (a power of two) that hold ``count`` ids within the load limit."""
    cdef Py_ssize_t buckets = _MIN_BUCKETS
    while buckets * _LOAD_NUM < count * _LOAD_DEN:
        buckets *= 2
    return buckets


cdef class IdIndex:
    """A set of distinct int64 ids, each with the row number the caller gave it.

    ``len(index)`` is the number of ids; ``nbytes`` the memory of the buckets.
    """

    cdef Bucket* _b
    cdef Py_ssize_t _buckets  # a power of two
    cdef Py_ssize_t _count

    def __cinit__(self, Py_ssize_t capacity=0):
        self._b = NULL
        self._count = 0
        self._allocate(_buckets_for(capacity))

    def __dealloc__(self):
        kept_free(self._b, <size_t>self._buckets * sizeof(Bucket))

    cdef int _allocate(self, Py_ssize_t buckets) except -1:
        """Empty buckets (the old ones freed: the caller re-inserts their entries first where it keeps them)."""
        cdef Bucket* b = _new_buckets(buckets)
        if b == NULL:
            raise MemoryError(f"IdIndex: cannot allocate {buckets} buckets")
        kept_free(self._b, <size_t>self._buckets * sizeof(Bucket))
        self._b = b
        self._buckets = buckets
        self._count = 0
        return 0

    cdef int _reserve(self, Py_ssize_t count) except -1:
        """Buckets enough for ``count`` ids within the load limit, the entries kept."""
        if count * _LOAD_DEN <= self._buckets * _LOAD_NUM:
            return 0
        cdef Bucket* old = self._b
        cdef Py_ssize_t old_buckets = self._buckets, old_count = self._count, i
        self._b = NULL
        try:
            self._allocate(_buckets_for(count))
        except MemoryError:
            self._b, self._buckets, self._count = old, old_buckets, old_count
            raise
        for i in range(old_buckets):
            if old[i].stored:
                self._put(old[i].key, old[i].stored)
        kept_free(old, <size_t>old_buckets * sizeof(Bucket))
        return 0

    cdef inline Py_ssize_t _slot(self, int64_t key) noexcept nogil:
        """The bucket holding ``key``, or the empty bucket where it would go."""
        cdef Py_ssize_t mask = self._buckets - 1
        cdef Py_ssize_t i = <Py_ssize_t>(_mix(key) & <uint64_t>mask)
        while self._b[i].stored and self._b[i].key != key:
            i = (i + 1) & mask
        return i

    cdef inline void _put(self, int64_t key, int64_t stored) noexcept nogil:
        """``key`` with ``stored`` (its row + 1)."""
        cdef Py_ssize_t i = self._slot(key)
        if not self._b[i].stored:
            self._count += 1
            self._b[i].key = key
        self._b[i].stored = stored

    cdef inline void _remove_at(self, Py_ssize_t i) noexcept nogil:
        """Empty bucket ``i``, shifting back the entries after it that probed past it."""
        cdef Py_ssize_t mask = self._buckets - 1
        cdef Py_ssize_t j = i, home
        while True:
            j = (j + 1) & mask
            if not self._b[j].stored:
                break
            home = <Py_ssize_t>(_mix(self._b[j].key) & <uint64_t>mask)
            # The entry at j may move to i only if its home is not cyclically within (i, j].
            if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
                continue
            self._b[i] = self._b[j]
            i = j
        self._b[i].key = 0
        self._b[i].stored = 0
        self._count -= 1

    def __len__(self):
        return self._count

    @property
    def nbytes(self):
        """Bytes of the buckets."""
        return self._buckets * sizeof(Bucket)

    def clear(self, Py_ssize_t capacity=0):
        """Remove every id (buckets sized for ``capacity`` ids)."""
        self._allocate(_buckets_for(capacity))

    def reserve(self, Py_ssize_t count):
        """Make room for ``count`` ids in all, so that inserting up to that many does not rehash."""
        self._reserve(count)

    def find(self, const int64_t[::1] keys, int64_t[::1] rows):
        """``rows[i]`` = the row of ``keys[i]``, or -1 where it is absent; returns how many are absent."""
        if rows.shape[0] != keys.shape[0]:
            raise ValueError(f"find: {keys.shape[0]} keys but {rows.shape[0]} rows")
        cdef Py_ssize_t n = keys.shape[0], i, missing = 0, mask = self._buckets - 1
        cdef int64_t row
        for i in range(n):
            if i + _PREFETCH < n:  # the home bucket of an id further on, fetched meanwhile
                fastckpt_idindex_prefetch(&self._b[_mix(keys[i + _PREFETCH]) & <uint64_t>mask])
            row = self._b[self._slot(keys[i])].stored - 1
            rows[i] = row
            if row < 0:
                missing += 1
        return missing

    def fill(self, const int64_t[::1] keys, runs=()):
        """Number the ids of an empty index: ``keys[i]`` gets row ``i`` (a repeated id keeps the row of its first
        occurrence). Returns how many distinct ids were added (``len(keys)`` when none repeats).

        The bulk build of a loader: the buckets are new memory, filled without the GIL (other threads run meanwhile;
        this index stays empty to them until the call returns). Raises ``ValueError`` where the index is not empty.

        ``runs``: ``[(start, stop, first_row, rows, size, begin, end)]``, ascending and apart: ``keys[start:stop]``
        are the ids of a version-4 table part's rows ``first_row`` on, each of which must lie in the slice group
        that ``rows`` (the part's group offsets) places it in, in ascending slice position, within ``[begin,
        end)`` (what :func:`slice_run_check` checks, in the same pass as the build: the ids are read once). Where
        one does not, ``ValueError`` names the run and the index stays empty.

        >>> import numpy as np
        >>> index = IdIndex()
        >>> index.fill(np.array([30, -5, 30, 8]))  # 30 repeats: three distinct ids
        3
        >>> rows = np.empty(3, np.int64); index.find(np.array([8, 30, -5]), rows), rows.tolist()
        (0, [3, 0, 1])
        >>> IdIndex().fill(np.array([0, 1, 5, 9]), [(0, 4, 0, np.array([0, 2, 4]), 10, 0, 10)])
        4
        >>> IdIndex().fill(np.array([0, 6, 5, 9]), [(0, 4, 0, np.array([0, 2, 4]), 10, 0, 10)])
        Traceback (most recent call last):
        ...
        ValueError: fill: run 0 (keys 0..4): an id is not where the slice groups of rows 0.. place it
        """
        if self._count:
            raise ValueError(f"fill: the index holds {self._count} ids; fill numbers those of an empty index "
                             "(upsert adds to one)")
        if not runs:
            return self._fill_plain(keys)
        cdef Py_ssize_t n = keys.shape[0], at = 0, start, stop, k = 0
        cdef Py_ssize_t buckets = _buckets_for(n)
        if buckets < self._buckets:
            buckets = self._buckets
        cdef const int64_t* first = &keys[0] if n else NULL
        cdef const int64_t[::1] rows
        cdef int64_t first_row, size, begin, end
        cdef Py_ssize_t added = 0, groups, g
        cdef bint ok = True
        cdef Bucket* b = _new_buckets(buckets)
        if b == NULL:
            raise MemoryError(f"IdIndex.fill: cannot allocate {buckets} buckets")
        try:
            for k, (start, stop, first_row, rows, size, begin, end) in enumerate(runs):
                groups = rows.shape[0] - 1
                ok = at <= start <= stop <= n and size >= 1 and groups >= 1
                if ok:
                    for g in range(groups):
                        ok = ok and rows[g] <= rows[g + 1]
                    ok = ok and (start == stop or (rows[0] <= first_row and first_row + (stop - start) <= rows[groups]))
                if not ok:
                    break
                with nogil:
                    added += _fill(first, at, start, b, buckets)
                    if start < stop:
                        ok = _fill_checked(first, start, stop, b, buckets, &rows[0], groups, first_row, size,
                                           <uint64_t>max(begin, 0), <uint64_t>max(end, 0), &added)
                if not ok:
                    break
                at = stop
            if ok:
                with nogil:
                    added += _fill(first, at, n, b, buckets)
        except BaseException:
            kept_free(b, <size_t>buckets * sizeof(Bucket))
            raise
        if not ok:
            kept_free(b, <size_t>buckets * sizeof(Bucket))
            start, stop, first_row = runs[k][:3]
            raise ValueError(f"fill: run {k} (keys {start}..{stop}): an id is not where the slice groups of rows "
                             f"{first_row}.. place it")
        kept_free(self._b, <size_t>self._buckets * sizeof(Bucket))
        self._b = b
        self._buckets = buckets
        self._count = added
        return added

    def _fill_plain(self, const int64_t[::1] keys):
        """:meth:`fill` without runs to check.

        >>> import numpy as np
        >>> IdIndex()._fill_plain(np.array([4, 4]))
        1
        """
        cdef Py_ssize_t n = keys.shape[0]
        cdef Py_ssize_t buckets = _buckets_for(n)
        if buckets < self._buckets:
            buckets = self._buckets  # keep the capacity asked for when the index was made
        cdef Bucket* b = _new_buckets(buckets)
        if b == NULL:
            raise MemoryError(f"IdIndex.fill: cannot allocate {buckets} buckets")
        cdef Py_ssize_t added = 0
        cdef const int64_t* first = &keys[0] if n else NULL
        with nogil:
            added = _fill(first, 0, n, b, buckets)
        kept_free(self._b, <size_t>self._buckets * sizeof(Bucket))
        self._b = b
        self._buckets = buckets
        self._count = added
        return added

    def upsert(self, const int64_t[::1] keys, int64_t[::1] rows, int64_t next_row):
        """``rows[i]`` = the row of ``keys[i]``; an absent id is added with the row ``next_row + (new ids before
        it)``. A repeated id gets the same row each time. Returns how many ids were added (rows ``next_row`` on)."""
        if rows.shape[0] != keys.shape[0]:
            raise ValueError(f"upsert: {keys.shape[0]} keys but {rows.shape[0]} rows")
        if next_row < 0:
            raise ValueError(f"upsert: next_row must be >= 0, got {next_row}")
        cdef Py_ssize_t n = keys.shape[0], i, at, mask
        cdef int64_t added = 0
        self._reserve(self._count + n)  # the worst case, all new: no rehash inside the loop
        mask = self._buckets - 1
        for i in range(n):
            if i + _PREFETCH < n:  # the home bucket of an id further on, fetched meanwhile
                fastckpt_idindex_prefetch(&self._b[_mix(keys[i + _PREFETCH]) & <uint64_t>mask])
            at = self._slot(keys[i])
            if not self._b[at].stored:
                self._b[at].key = keys[i]
                self._b[at].stored = next_row + added + 1
                self._count += 1
                added += 1
            rows[i] = self._b[at].stored - 1
        return added

    def remove(self, const int64_t[::1] keys, int64_t[::1] rows):
        """Remove ``keys``: ``rows[i]`` = the row ``keys[i]`` had, or -1 where it was absent (or a repeat).
        Returns how many were removed."""
        if rows.shape[0] != keys.shape[0]:
            raise ValueError(f"remove: {keys.shape[0]} keys but {rows.shape[0]} rows")
        cdef Py_ssize_t n = keys.shape[0], i, at, removed = 0
        for i in range(n):
            at = self._slot(keys[i])
            rows[i] = self._b[at].stored - 1
            if self._b[at].stored:
                self._remove_at(at)
                removed += 1
        return removed

    def assign(self, const int64_t[::1] keys, const int64_t[::1] rows):
        """Give ids already present new rows (``rows[i]`` to ``keys[i]``); raises ``KeyError`` at an absent one."""
        if rows.shape[0] != keys.shape[0]:
            raise ValueError(f"assign: {keys.shape[0]} keys but {rows.shape[0]} rows")
        cdef Py_ssize_t n = keys.shape[0], i, at, bad = -1
        for i in range(n):
            if rows[i] < 0:
                raise ValueError(f"assign: row {rows[i]} for id {keys[i]}: rows are >= 0")
        for i in range(n):
            at = self._slot(keys[i])
            if not self._b[at].stored:
                bad = i
                break
            self._b[at].stored = rows[i] + 1
        if bad >= 0:
            raise KeyError(f"assign: id {keys[bad]} is not in the index")


cdef Bucket* _new_buckets(Py_ssize_t buckets) noexcept:
    """``buckets`` empty buckets (all zeros), or NULL where the memory is not there."""
    return <Bucket*>kept_alloc(<size_t>buckets * sizeof(Bucket), True)


cdef Py_ssize_t _fill(const int64_t* keys, Py_ssize_t lo, Py_ssize_t n, Bucket* b, Py_ssize_t buckets) noexcept nogil:
    """``keys[i]`` -> row ``i`` for ``i`` in ``[lo, n)`` into new buckets (``buckets`` a power of two); returns how
    many were added (a repeated id meets its first occurrence already placed and is not added again).

    Almost every id of a large index misses the cache at its home bucket: the home bucket of the id
    ``_PREFETCH`` places ahead is fetched meanwhile, so that the misses overlap.
    """
    cdef Py_ssize_t mask = buckets - 1, i
    cdef Py_ssize_t added = 0
    for i in range(lo, n):
        if i + _PREFETCH < n:
            fastckpt_idindex_prefetch(&b[_mix(keys[i + _PREFETCH]) & <uint64_t>mask])
        added += _place(b, mask, keys[i], i + 1)
    return added


cdef inline Py_ssize_t _place(Bucket* b, Py_ssize_t mask, int64_t key, int64_t stored) noexcept nogil:
    """``key`` with ``stored`` (its row + 1) into buckets of :func:`_fill`, where it is not there yet; returns 1
    where it was added, 0 where it was there (a repeat keeps its first row)."""
    cdef Py_ssize_t at = <Py_ssize_t>(_mix(key) & <uint64_t>mask)
    while b[at].stored and b[at].key != key:
        at = (at + 1) & mask
    if b[at].stored:
        return 0
    b[at].key = key
    b[at].stored = stored
    return 1


@cython.cdivision(True)  # size >= 1 and groups >= 1: checked by the caller
cdef bint _fill_checked(const int64_t* keys, Py_ssize_t lo, Py_ssize_t hi, Bucket* b, Py_ssize_t buckets,
                        const int64_t* rows, Py_ssize_t groups, int64_t first_row, int64_t size, uint64_t begin,
                        uint64_t end, Py_ssize_t* added) noexcept nogil:
    """:func:`_fill` of ``keys[lo:hi]``, the ids of a version-4 part's rows ``first_row`` on, each checked in the same
    pass as :func:`slice_run_check` checks it, and to lie in ``[begin, end)``; returns whether all did (the
    caller checked that ``rows`` ascend and hold rows ``first_row`` to ``first_row + hi - lo``)."""
    cdef Py_ssize_t mask = buckets - 1, i, g = 0
    cdef uint64_t usize = <uint64_t>size, smask = usize - 1, p, previous = 0, lower, upper
    cdef bint power = (usize & smask) == 0
    cdef int64_t key, row
    while rows[g + 1] <= first_row:
        g += 1
    lower = <uint64_t>(g * size // groups)
    upper = <uint64_t>((g + 1) * size // groups)
    for i in range(lo, hi):
        if i + _PREFETCH < hi:
            fastckpt_idindex_prefetch(&b[_mix(keys[i + _PREFETCH]) & <uint64_t>mask])
        row = first_row + (i - lo)
        while rows[g + 1] <= row:
            g += 1
            lower = <uint64_t>(g * size // groups)
            upper = <uint64_t>((g + 1) * size // groups)
        key = keys[i]
        p = (<uint64_t>key) & smask if power else (<uint64_t>key) % usize
        if p < previous or p < lower or p >= upper or p < begin or p >= end:
            return False
        previous = p
        added[0] += _place(b, mask, key, i + 1)
    return True


def last_occurrence(const int64_t[::1] rows, uint8_t[::1] keep, int64_t row_count):
    """``keep[i]`` = 1 where ``rows[i]`` does not occur again after ``i``, else 0 (every row in
    ``[0, row_count)``); returns how many are repeats (the zeros)."""
    if keep.shape[0] != rows.shape[0]:
        raise ValueError(f"last_occurrence: {rows.shape[0]} rows but {keep.shape[0]} flags")
    cdef Py_ssize_t n = rows.shape[0], i
    cdef int64_t row, repeats = 0, bad = -1
    cdef uint8_t* seen = <uint8_t*>calloc(<size_t>(row_count // 8 + 1), 1)
    if seen == NULL:
        raise MemoryError(f"last_occurrence: cannot allocate {row_count // 8 + 1} bytes")
    for i in range(n - 1, -1, -1):
        row = rows[i]
        if row < 0 or row >= row_count:
            bad = i
            break
        if seen[row >> 3] & (1 << (row & 7)):
            keep[i] = 0
            repeats += 1
        else:
            seen[row >> 3] |= <uint8_t>(1 << (row & 7))
            keep[i] = 1
    free(seen)
    if bad >= 0:
        raise ValueError(f"last_occurrence: row {rows[bad]} at {bad} is outside [0, {row_count})")
    return repeats


cdef extern from *:
    """
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    #include <Python.h>
    /* A position of the key space of `size` slices: uint64(id) % size (a mask where size is a power of two). */
    static inline uint64_t fastckpt_position(int64_t id, uint64_t size, int power) {
        return power ? ((uint64_t)id & (size - 1)) : ((uint64_t)id % size);
    }
    /* Count every byte of every id's position (counts[256 * d + byte d]); returns whether the positions ascend. The
       loops are written out for a power-of-two size (a mask) and for another (a division), so that neither tests
       which it is per id. */
    #define FASTCKPT_COUNT(POSITION) \
        for (i = 0; i < n; i++) { \
            p = POSITION; \
            for (d = 0; d < digits; d++) counts[256 * d + ((p >> (8 * d)) & 255)]++; \
            ordered &= p >= previous; \
            previous = p; \
        }
    static int fastckpt_count_digits(const int64_t* ids, Py_ssize_t n, uint64_t size, int digits, int64_t* counts) {
        Py_ssize_t i;
        int d, ordered = 1;
        uint64_t p, previous = 0, mask = size - 1;
        if ((size & mask) == 0 && digits == 2) {  /* 65536 slices, the default: both bytes at once */
            for (i = 0; i < n; i++) {
                p = (uint64_t)ids[i] & mask;
                counts[p & 255]++;
                counts[256 + (p >> 8)]++;
                ordered &= p >= previous;
                previous = p;
            }
        } else if ((size & mask) == 0) {
            FASTCKPT_COUNT((uint64_t)ids[i] & mask)
        } else {
            FASTCKPT_COUNT((uint64_t)ids[i] % size)
        }
        return ordered;
    }
    /* One pass of the radix sort: each row to at[its byte `shift` bits up], then that slot on. The first pass reads
       the ids (source NULL), later ones the words (position << 32 | row) the pass before left in source; the last
       writes the rows to order, the others the words to target. */
    #define FASTCKPT_PLACE(WORD, OUT) \
        for (i = 0; i < n; i++) { \
            x = WORD; \
            OUT; \
        }
    static void fastckpt_place(const int64_t* ids, const uint64_t* source, Py_ssize_t n, uint64_t size, int shift,
                               int64_t* at, uint64_t* target, Py_ssize_t* order) {
        Py_ssize_t i;
        uint64_t x, mask = size - 1;
        int key = 32 + shift;
        if (source == NULL && (size & mask) == 0) {
            if (order) FASTCKPT_PLACE((uint64_t)ids[i] & mask, order[at[(x >> shift) & 255]++] = i)
            else FASTCKPT_PLACE(((uint64_t)ids[i] & mask) << 32 | (uint64_t)i, target[at[(x >> key) & 255]++] = x)
        } else if (source == NULL) {
            if (order) FASTCKPT_PLACE((uint64_t)ids[i] % size, order[at[(x >> shift) & 255]++] = i)
            else FASTCKPT_PLACE(((uint64_t)ids[i] % size) << 32 | (uint64_t)i, target[at[(x >> key) & 255]++] = x)
        } else if (order) {
            FASTCKPT_PLACE(source[i], order[at[(x >> key) & 255]++] = (Py_ssize_t)(x & 0xFFFFFFFFu))
        } else {
            FASTCKPT_PLACE(source[i], target[at[(x >> key) & 255]++] = x)
        }
    }
    /* Two bytes apart (up to 65536 slices) and no array of n words of its own: the rows placed by their position's
       high byte into order itself as words (position << 32 | row), then each high byte's run, a few thousand rows
       that the caches hold, copied aside and placed back by the low byte as rows. Stable, as both placements are.
       Returns -1 where the copy's memory (the longest run) cannot be had. */
    static int fastckpt_two_bytes(const int64_t* ids, Py_ssize_t n, uint64_t size, const int64_t* high,
                                  Py_ssize_t* order) {
        int64_t at[256], low[256];
        uint64_t* words = (uint64_t*)order;  /* a Py_ssize_t and a word are both 8 bytes here */
        uint64_t* aside;
        uint64_t x, mask = size - 1;
        Py_ssize_t i, start = 0, run, longest = 0;
        int b, power = (size & mask) == 0;
        for (b = 0; b < 256; b++) {
            at[b] = start;
            start += high[b];
            if (high[b] > longest) longest = high[b];
        }
        aside = (uint64_t*)malloc((size_t)longest * sizeof(uint64_t));
        if (aside == NULL) return -1;
        if (power) FASTCKPT_PLACE(((uint64_t)ids[i] & mask) << 32 | (uint64_t)i, words[at[(x >> 40) & 255]++] = x)
        else FASTCKPT_PLACE(((uint64_t)ids[i] % size) << 32 | (uint64_t)i, words[at[(x >> 40) & 255]++] = x)
        start = 0;
        for (b = 0; b < 256; b++) {
            run = high[b];
            if (run == 1) order[start] = (Py_ssize_t)(words[start] & 0xFFFFFFFFu);
            if (run > 1) {
                memcpy(aside, words + start, (size_t)run * sizeof(uint64_t));
                memset(low, 0, sizeof(low));
                for (i = 0; i < run; i++) low[(aside[i] >> 32) & 255]++;
                for (i = 0, x = (uint64_t)start; i < 256; i++) {
                    Py_ssize_t count = low[i];
                    low[i] = (int64_t)x;
                    x += (uint64_t)count;
                }
                for (i = 0; i < run; i++) {
                    x = aside[i];
                    order[low[(x >> 32) & 255]++] = (Py_ssize_t)(x & 0xFFFFFFFFu);
                }
            }
            start += run;
        }
        free(aside);
        return 0;
    }
    """
    uint64_t fastckpt_position(int64_t id, uint64_t size, int power) noexcept nogil
    int fastckpt_two_bytes(const int64_t* ids, Py_ssize_t n, uint64_t size, const int64_t* high,
                           Py_ssize_t* order) noexcept nogil
    int fastckpt_count_digits(const int64_t* ids, Py_ssize_t n, uint64_t size, int digits, int64_t* counts) noexcept nogil
    void fastckpt_place(const int64_t* ids, const uint64_t* source, Py_ssize_t n, uint64_t size, int shift,
                        int64_t* at, uint64_t* target, Py_ssize_t* order) noexcept nogil


DEF _DIGIT_BITS = 8  # a position is sorted 8 bits at a time: 256 write streams a pass, which the caches keep
DEF _DIGITS = 4  # positions fit 32 bits (sizes up to 2**32)


@cython.boundscheck(False)  # every index below is a row < n or a bucket < 256, by the counts
@cython.wraparound(False)
@cython.initializedcheck(False)  # order is read only where it was made (the ids out of order)
@cython.cdivision(True)  # size >= 1, checked first
def slice_order(const int64_t[::1] ids, uint64_t size, const int64_t[::1] bounds):
    """``(order, rows)``: the stable order of ``ids`` by slice position ``uint64(id) % size`` (a version-4 table
    part's order, :func:`fastckpt.sharded.format.slice_order`), None where the ids are in that order already, and
    ``rows[k]``, how many ids have a position below ``bounds[k]`` (``bounds``: ascending positions, the part's
    slice group bounds).

    A radix sort of the positions, 8 bits a pass, without the GIL: a pass counting every byte of every position,
    then each pass that a byte's values tell apart places each row after those of lower bytes and of its own byte
    seen before it, through 256 write streams that stay in the caches (a counting sort by the whole position writes
    65536 streams, one cache miss a row once the rows outgrow the cache, and needs counts of every position).
    Positions of two bytes (up to 65536 slices, the default) are placed by the high byte into the order itself, then
    each high byte's run (a few thousand rows, in the cache) by the low byte: 1,000,000 ids in 3.5-3.9 ms, where
    two passes through an array of their own took 5.7-6.1 ms and the counting sort 8.0-8.3 ms. Larger sizes take a
    pass a byte, least significant first, through one or two arrays of ``len(ids)`` words. Nothing is in
    proportion to ``size``. ``rows`` is counted by binary search of the ordered positions.

    >>> import numpy as np
    >>> order, rows = slice_order(np.array([65537, 3, 1, 65536]), 65536, np.array([0, 1, 2, 4, 65536]))
    >>> order.tolist(), rows.tolist()
    ([3, 0, 2, 1], [0, 1, 3, 4, 4])
    >>> slice_order(np.array([65536, 1, 65539]), 65536, np.array([0, 65536]))[0] is None
    True
    """
    import numpy as np

    if size < 1 or size > (<uint64_t>1 << 32):
        raise ValueError(f"slice_order: size must be from 1 to {1 << 32}, got {size}")
    cdef Py_ssize_t n = ids.shape[0], i, k, nb = bounds.shape[0], lo, hi, mid
    if <uint64_t>n > (<uint64_t>1 << 32):
        raise ValueError(f"slice_order: a table part of {n} rows; at most {1 << 32} are sorted at once")
    for k in range(nb):
        if bounds[k] < 0 or <uint64_t>bounds[k] > size or (k and bounds[k] < bounds[k - 1]):
            raise ValueError(f"slice_order: bounds must ascend within [0, {size}], got {np.asarray(bounds).tolist()}")
    cdef int power = (size & (size - 1)) == 0, digits = 1, d, last
    cdef bint ordered
    while digits < _DIGITS and (size - 1) >> (_DIGIT_BITS * digits):
        digits += 1
    counts_array = np.zeros((_DIGITS, 256), np.int64)
    rows_array = np.empty(nb, np.int64)
    cdef int64_t[:, ::1] counts = counts_array
    cdef int64_t[::1] rows = rows_array
    cdef int64_t at[256]
    cdef int64_t total
    cdef Py_ssize_t[::1] order
    cdef uint64_t[::1] packed, spare
    cdef const int64_t* id_data = &ids[0] if n else NULL
    cdef uint64_t* source
    cdef uint64_t* target
    cdef uint64_t* words[2]
    cdef int needed[_DIGITS]
    cdef int passes = 0, done
    with nogil:
        ordered = fastckpt_count_digits(id_data, n, size, digits, &counts[0, 0])
    if ordered:
        order_array = None
    else:
        order_array = np.empty(n, np.intp)
        order = order_array
        for d in range(digits):  # a byte every position shares leaves the order as it is: no pass
            if max(counts_array[d]) < n:
                needed[passes] = d
                passes += 1
        if passes == 2 and digits == 2:  # up to 65536 slices (the default): no array of n words
            with nogil:
                done = fastckpt_two_bytes(id_data, n, size, &counts[1, 0], &order[0])
            if done != 0:
                raise MemoryError(f"slice_order: cannot allocate {8 * max(counts_array[1])} bytes")
            passes = 0
        packed_array = np.empty(n if passes > 1 else 0, np.uint64)
        spare_array = np.empty(n if passes > 2 else 0, np.uint64)
        packed, spare = packed_array, spare_array
        words[0] = &packed[0] if passes > 1 else NULL
        words[1] = &spare[0] if passes > 2 else NULL
        with nogil:
            source = NULL  # the first pass reads the ids; the others the words the pass before left
            for k in range(passes):
                d = needed[k]
                last = k == passes - 1
                total = 0
                for i in range(256):
                    at[i] = total
                    total += counts[d, i]
                target = NULL if last else words[k % 2]
                fastckpt_place(id_data, source, n, size, _DIGIT_BITS * d, at, target, &order[0] if last else NULL)
                source = target
    with nogil:
        for k in range(nb):  # rows below bounds[k]: the first of the ordered positions at or above it
            lo, hi = 0, n
            while lo < hi:
                mid = (lo + hi) // 2
                i = mid if ordered else order[mid]
                if fastckpt_position(ids[i], size, power) < <uint64_t>bounds[k]:
                    lo = mid + 1
                else:
                    hi = mid
            rows[k] = lo
    return order_array, rows_array


@cython.boundscheck(False)  # every index below is a row < n or a group < len(rows) - 1, by the checks first
@cython.cdivision(True)  # size >= 1 and groups >= 1, checked first
def slice_run_check(const int64_t[::1] ids, int64_t first_row, const int64_t[::1] rows, int64_t size,
                    int64_t begin, int64_t end):
    """``(lo, hi)``, the rows whose slice positions (``uint64(id) % size``) lie in ``[begin, end)``, where the ids
    ``ids`` of a version-4 table part's rows ``first_row`` on are each in the slice group that ``rows`` (the part's
    recorded group offsets, ``groups + 1`` of them, group ``g`` holding the positions ``[g*size//groups,
    (g+1)*size//groups)``) places them in, in ascending position; None where one is not
    (:func:`fastckpt.sharded.format.slice_run` then names it).

    One pass without the GIL and without arrays of its own: each id's position is compared with the one before
    and with its group's bounds, and counted below ``begin`` and ``end``.

    >>> import numpy as np
    >>> slice_run_check(np.array([0, 1, 5, 9]), 0, np.array([0, 2, 4]), 10, 1, 6)
    (1, 3)
    >>> slice_run_check(np.array([0, 6, 5, 9]), 0, np.array([0, 2, 4]), 10, 1, 6) is None
    True
    """
    cdef Py_ssize_t n = ids.shape[0], groups = rows.shape[0] - 1, i, g = 0
    if size < 1 or groups < 1:
        raise ValueError(f"slice_run_check: size {size} and {rows.shape[0]} group offsets: need size >= 1 and at "
                         "least 2 offsets")
    if n == 0:
        return first_row, first_row
    for i in range(groups):
        if rows[i] > rows[i + 1]:
            return None
    if first_row < rows[0] or first_row + n > rows[groups]:
        return None
    cdef uint64_t usize = <uint64_t>size, mask = usize - 1, p, previous = 0
    cdef uint64_t lower = 0, upper = 0, ubegin = <uint64_t>max(begin, 0), uend = <uint64_t>max(end, 0)
    cdef bint power = (usize & mask) == 0, ok = True
    cdef int64_t row, below_begin = 0, below_end = 0
    with nogil:
        while rows[g + 1] <= first_row:  # the group of the first row (rows[groups] > first_row: checked above)
            g += 1
        lower = <uint64_t>(g * size // groups)
        upper = <uint64_t>((g + 1) * size // groups)
        for i in range(n):
            row = first_row + i
            while rows[g + 1] <= row:
                g += 1
                lower = <uint64_t>(g * size // groups)
                upper = <uint64_t>((g + 1) * size // groups)
            p = (<uint64_t>ids[i]) & mask if power else (<uint64_t>ids[i]) % usize
            if p < previous or p < lower or p >= upper:
                ok = False
                break
            previous = p
            below_begin += p < ubegin
            below_end += p < uend
    if not ok:
        return None
    return first_row + below_begin, first_row + below_end
