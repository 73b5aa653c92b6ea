"""Batch readers over files or in-memory arrays that can resume at the exact next batch.

A reader splits its samples into ``num_shards`` disjoint shards, orders them
(optionally shuffled, reproducibly from ``seed`` and the epoch number) and
yields batches of one epoch at a time from :meth:`Reader.next_epoch`:

>>> import numpy as np
>>> reader = ArrayReader(np.arange(10), enable_checkpointing=True)
>>> it = reader.next_epoch(batch_size=4)
>>> next(it).tolist()
[0, 1, 2, 3]
>>> state = str(reader.get_state())       # safe to write to disk
>>> resumed = ArrayReader(np.arange(10))
>>> resumed.set_state(state)
>>> [b.tolist() for b in resumed.next_epoch(batch_size=4)]
[[4, 5, 6, 7], [8, 9]]

Sample order
    Epoch ``e`` orders all ``N`` samples by ``arange(N)`` or, with
    ``shuffle=True``, by the stable ``argsort`` of ``N`` raw 64-bit outputs of
    ``numpy.random.PCG64(numpy.random.SeedSequence([seed, e]))``: that stream is
    fixed by numpy's stability policy for bit generators, so the order does
    not change across numpy versions or machines. Shard ``s`` of ``S`` takes
    positions ``N*s//S`` up to ``N*(s+1)//S`` of that order; every shard must be
    built with the same ``seed``. Shards are disjoint and cover the data;
    their sizes differ by at most one. The last batch of an epoch may be
    smaller than ``batch_size``.

Epochs
    :meth:`Reader.next_epoch` continues the current epoch if it was left part
    way (an abandoned iterator, or a restored mid-epoch state) and otherwise
    starts the next one. Calling it again closes the previous iterator.

State
    The state is the position of the next batch: ``(epoch, samples of this
    shard already handed out)``, plus the reader's configuration so that a
    state is never applied to a reader it does not fit. With
    ``prefetch_queue_depth > 0`` a background thread prepares that many
    batches ahead; each carries the snapshot of the position after it, so the
    state reported is always that of the last batch handed to the caller
    (``prefetch_queue_depth + 1`` snapshots in flight), never of what was
    prefetched.

Rules shared with the API users know from DALI: ``get_state`` needs
``enable_checkpointing=True`` and a started epoch (``RuntimeError`` before);
``set_state`` is accepted only before the first ``next_epoch`` call
(``RuntimeError`` after). Not thread-safe: ``get_state``/``set_state`` must
not run while another thread iterates the same reader.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from fastckpt.state import StateObject, dumps

__all__ = ["Reader", "ReaderState", "ArrayReader", "FileReader", "READER_STATE_VERSION"]

#: Version of the reader state layout written by :meth:`Reader.get_state`.
READER_STATE_VERSION = 1


class ReaderState(StateObject):
    """The position of a :class:`Reader`, JSON-safe; ``str()`` it to store it.

    Keys: ``reader`` (class name), ``version``, ``epoch``, ``position``
    (samples of the shard handed out in that epoch), and the configuration it
    must match: ``num_samples``, ``fingerprint``, ``shard_id``, ``num_shards``,
    ``shuffle``, ``seed``.

    >>> import numpy as np
    >>> r = ArrayReader(np.arange(6), enable_checkpointing=True)
    >>> _ = next(r.next_epoch(batch_size=2))
    >>> s = r.get_state()
    >>> (s.epoch, s.position)
    (0, 2)
    """

    __slots__ = ()

    def __init__(self, data: dict):
        if not isinstance(data, dict) or not isinstance(data.get("reader"), str):
            raise ValueError("not a reader state: it has no 'reader' key naming the reader class")
        super().__init__(data)

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (see the class example)."""
        return self._json_tree()["epoch"]

    @property
    def position(self) -> int:
        """Samples of this shard already handed out in :attr:`epoch` (see the class example)."""
        return self._json_tree()["position"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def epoch_order(num_samples: int, epoch: int, *, shuffle: bool, seed: int) -> np.ndarray:
    """The order of all samples in one epoch (before sharding), as int64 indices.

    >>> epoch_order(5, 0, shuffle=False, seed=0).tolist()
    [0, 1, 2, 3, 4]
    >>> sorted(epoch_order(5, 3, shuffle=True, seed=1).tolist())
    [0, 1, 2, 3, 4]
    """
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(num_samples)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


class _End:
    """Marks the end of an epoch in the prefetch channel."""


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class _Channel:
    """A bounded hand-off between the prefetch thread and the consumer that can be closed."""

    def __init__(self, depth: int):
        self._items: collections.deque = collections.deque()
        self._depth = depth
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item) -> bool:
        with self._cond:
            while len(self._items) >= self._depth and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self):
        with self._cond:
            while not self._items:
                self._cond.wait()
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


def _produce(load, indices, batch_size, epoch, start, channel: _Channel) -> None:
    # Runs on the prefetch thread. It references no iterator, so dropping an
    # abandoned iterator closes the channel (in __del__) and ends this thread.
    try:
        n = len(indices)
        pos = start
        while pos < n and not channel.closed:
            batch = load(indices[pos : pos + batch_size])
            pos = min(pos + batch_size, n)
            cursor = (epoch + 1, 0) if pos == n else (epoch, pos)
            if not channel.put((batch, cursor)):
                return
        channel.put(_End)
    except BaseException as exc:  # handed to the consumer, raised there
        channel.put(_Failure(exc))


class _EpochIterator:
    """Iterator over the remaining batches of one epoch (returned by ``next_epoch``)."""

    def __init__(self, reader: "Reader", batch_size: int, epoch: int, indices: np.ndarray):
        self._reader = reader
        self._batch_size = batch_size
        self._epoch = epoch
        self._indices = indices
        self._finished = False
        self._closed = False
        self._channel: _Channel | None = None
        self._thread: threading.Thread | None = None

    def __iter__(self) -> "_EpochIterator":
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        if self._closed:
            raise RuntimeError(
                "this epoch iterator was closed (by close() or a later next_epoch() call); "
                "use the iterator returned by the latest next_epoch()"
            )
        reader = self._reader
        n = len(self._indices)
        if reader._prefetch_queue_depth == 0:
            pos = reader._position
            if pos >= n:
                self._finish((self._epoch + 1, 0))
                raise StopIteration
            batch = reader._load(self._indices[pos : pos + self._batch_size])
            pos = min(pos + self._batch_size, n)
            if pos == n:
                self._finish((self._epoch + 1, 0))
            else:
                reader._epoch, reader._position = self._epoch, pos
            return batch
        if self._thread is None:
            self._channel = _Channel(reader._prefetch_queue_depth)
            self._thread = threading.Thread(
                target=_produce,
                args=(reader._load, self._indices, self._batch_size, self._epoch, reader._position, self._channel),
                name=f"fastckpt-{type(reader).__name__}-prefetch",
                daemon=True,
            )
            self._thread.start()
        item = self._channel.get()
        if item is _End:
            self._finish((self._epoch + 1, 0))
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        batch, cursor = item
        if cursor[0] != self._epoch:
            self._finish(cursor)
        else:
            reader._epoch, reader._position = cursor
        return batch

    def _finish(self, cursor: tuple[int, int]) -> None:
        self._reader._epoch, self._reader._position = cursor
        self._finished = True
        self.close()

    def close(self) -> None:
        """Stop and join the prefetch thread; batches it prepared are dropped (the state is unaffected)."""
        self._closed = True
        if self._channel is not None:
            self._channel.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __del__(self):
        channel = getattr(self, "_channel", None)
        if channel is not None:
            channel.close()


class Reader:
    """Base class of the readers: sharding, shuffling, prefetch and checkpoint state.

    Subclasses call ``Reader.__init__`` with the sample count and a
    fingerprint of the data, and implement ``_load(indices) -> batch``.

    Keyword arguments (all readers):

    * ``shuffle`` (default ``False``) and ``seed`` (default ``0``): reorder
      the samples every epoch, reproducibly from ``(seed, epoch)``;
    * ``shard_id`` / ``num_shards`` (default ``0`` / ``1``): read only shard
      ``shard_id`` of ``num_shards`` disjoint shards;
    * ``prefetch_queue_depth`` (default ``0``: no thread): prepare this many
      batches ahead on a background thread;
    * ``enable_checkpointing`` (default ``False``): allow :meth:`get_state`.

    A minimal reader over ``range(n)``:

    >>> class RangeReader(Reader):
    ...     def __init__(self, n, **options):
    ...         super().__init__(n, f"range-{n}", **options)
    ...     def _load(self, indices):
    ...         return indices.tolist()
    >>> r = RangeReader(5, num_shards=2, shard_id=1)
    >>> (r.num_samples, r.shard_bounds, r.shard_size)
    (5, (2, 5), 3)
    >>> list(r.next_epoch(batch_size=2)), (r.epoch, r.position)
    ([[2, 3], [4]], (1, 0))
    """

    def __init__(
        self,
        num_samples: int,
        fingerprint: str,
        *,
        shuffle: bool = False,
        seed: int = 0,
        shard_id: int = 0,
        num_shards: int = 1,
        prefetch_queue_depth: int = 0,
        enable_checkpointing: bool = False,
    ):
        self._num_samples = _check_int("num_samples", num_samples, 0)
        self._fingerprint = fingerprint
        if not isinstance(shuffle, (bool, np.bool_)):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__}")
        self._shuffle = bool(shuffle)
        self._seed = _check_int("seed", seed, 0)
        self._num_shards = _check_int("num_shards", num_shards, 1)
        self._shard_id = _check_int("shard_id", shard_id, 0)
        if self._shard_id >= self._num_shards:
            raise ValueError(f"shard_id must be < num_shards ({self._num_shards}), got {self._shard_id}")
        self._prefetch_queue_depth = _check_int("prefetch_queue_depth", prefetch_queue_depth, 0)
        self._checkpointing = bool(enable_checkpointing)
        self._started = False
        self._epoch = 0
        self._position = 0
        self._active: weakref.ref | None = None

    # ----------------------------------------------------------------- layout
    @property
    def num_samples(self) -> int:
        """Samples in the whole data set (all shards)."""
        return self._num_samples

    @property
    def shard_bounds(self) -> tuple[int, int]:
        """``(start, stop)`` positions of this shard within each epoch's order."""
        n, s, k = self._num_samples, self._shard_id, self._num_shards
        return n * s // k, n * (s + 1) // k

    @property
    def shard_size(self) -> int:
        """Samples in this reader's shard (one epoch)."""
        lo, hi = self.shard_bounds
        return hi - lo

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of this shard already handed out in :attr:`epoch`."""
        return self._position

    @property
    def checkpointing_enabled(self) -> bool:
        """Whether :meth:`get_state` is allowed.

        >>> import numpy as np
        >>> ArrayReader(np.arange(2)).checkpointing_enabled
        False
        """
        return self._checkpointing

    def shard_indices(self, epoch: int) -> np.ndarray:
        """Sample indices of this shard in the order epoch ``epoch`` reads them.

        >>> import numpy as np
        >>> ArrayReader(np.arange(5), shard_id=1, num_shards=2).shard_indices(0).tolist()
        [2, 3, 4]
        """
        lo, hi = self.shard_bounds
        return epoch_order(self._num_samples, epoch, shuffle=self._shuffle, seed=self._seed)[lo:hi]

    # -------------------------------------------------------------- iteration
    def next_epoch(self, batch_size: int) -> Iterator[Any]:
        """An iterator over the remaining batches of the current epoch, or of the next one.

        It continues an epoch left part way (an abandoned iterator or a
        restored mid-epoch state), otherwise it starts the next epoch. A
        previous iterator of this reader is closed.

        >>> import numpy as np
        >>> r = ArrayReader(np.arange(3))
        >>> [b.tolist() for b in r.next_epoch(batch_size=2)]
        [[0, 1], [2]]
        >>> [b.tolist() for b in r.next_epoch(batch_size=3)]
        [[0, 1, 2]]
        """
        batch_size = _check_int("batch_size", batch_size, 1)
        self._close_active()
        self._started = True
        iterator = _EpochIterator(self, batch_size, self._epoch, self.shard_indices(self._epoch))
        self._active = weakref.ref(iterator)
        return iterator

    def _close_active(self) -> None:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None

    def close(self) -> None:
        """Stop the prefetch thread, if any. The reader stays usable (``next_epoch`` resumes).

        >>> import numpy as np
        >>> with ArrayReader(np.arange(4), prefetch_queue_depth=2) as r:
        ...     next(r.next_epoch(batch_size=2)).tolist()
        [0, 1]
        """
        self._close_active()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _load(self, indices: np.ndarray):
        raise NotImplementedError

    # ------------------------------------------------------------ checkpoints
    def _config(self) -> dict:
        return {
            "num_samples": self._num_samples,
            "fingerprint": self._fingerprint,
            "shard_id": self._shard_id,
            "num_shards": self._num_shards,
            "shuffle": self._shuffle,
            "seed": self._seed,
        }

    def get_state(self) -> ReaderState:
        """The position of the next batch, as a :class:`ReaderState` (``str()`` it to store it).

        With prefetching this is the position after the last batch handed out,
        not after the last batch prefetched. Raises ``RuntimeError`` unless the
        reader was built with ``enable_checkpointing=True`` (or registered with
        a Checkpoint before it started) and ``next_epoch`` was called.

        >>> import numpy as np
        >>> r = ArrayReader(np.arange(4), enable_checkpointing=True)
        >>> _ = next(r.next_epoch(batch_size=3))
        >>> r.get_state().position
        3
        """
        name = type(self).__name__
        if not self._checkpointing:
            raise RuntimeError(
                f"{name} was built without checkpointing; construct it with enable_checkpointing=True "
                "(or register it with a Checkpoint before its first next_epoch())"
            )
        if not self._started:
            raise RuntimeError(
                f"{name} has not started any epoch yet, so it has no state to capture; call next_epoch() first"
            )
        return ReaderState(
            {"reader": name, "version": READER_STATE_VERSION, "epoch": self._epoch, "position": self._position}
            | self._config()
        )

    def set_state(self, state: ReaderState | str | dict) -> None:
        """Resume from ``state`` (a :class:`ReaderState`, its ``str()`` or its ``to_dict()``).

        Accepted only before the first :meth:`next_epoch` call; the state is
        kept and the next ``next_epoch`` starts from it. It enables
        checkpointing. The state must come from a reader of the same class over
        the same data with the same ``shard_id``, ``num_shards``, ``shuffle``
        and ``seed``; otherwise ``ValueError`` names the field.

        >>> import numpy as np
        >>> a = ArrayReader(np.arange(6), enable_checkpointing=True)
        >>> _ = next(a.next_epoch(batch_size=4))
        >>> b = ArrayReader(np.arange(6)); b.set_state(a.get_state())
        >>> next(b.next_epoch(batch_size=4)).tolist()
        [4, 5]
        """
        name = type(self).__name__
        if self._started:
            raise RuntimeError(
                f"{name}.set_state() after iteration began: a state can only be applied to a fresh reader "
                "before its first next_epoch() call; build a new reader and call set_state() first"
            )
        data = ReaderState.coerce(state).to_dict()
        epoch, position = self._check_state(data)
        self._epoch, self._position = epoch, position
        self._checkpointing = True

    def _prepare_for_checkpoint(self) -> None:
        # Called by Checkpoint.register: opting in late is fine until iteration began.
        if self._checkpointing:
            return
        if self._started:
            raise RuntimeError(
                f"{type(self).__name__} was built without enable_checkpointing=True and has already started "
                "iterating, so it cannot be checkpointed now; construct it with enable_checkpointing=True "
                "(or register it before its first next_epoch())"
            )
        self._checkpointing = True

    def _check_state(self, data: dict) -> tuple[int, int]:
        name = type(self).__name__
        if data.get("reader") != name:
            raise ValueError(f"the state belongs to a {data.get('reader')!r} reader, not to a {name!r}")
        version = data.get("version")
        if version != READER_STATE_VERSION:
            raise ValueError(
                f"{name} state version {version!r} is not supported (this fastckpt reads version "
                f"{READER_STATE_VERSION}); the state was written by a different fastckpt"
            )
        for key in ("epoch", "position"):
            value = data.get(key)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} state: {key!r} must be a non-negative int, got {value!r}")
        mine = self._config()
        for key, expected in mine.items():
            if key == "seed" and not self._shuffle:
                continue
            found = data.get(key)
            if found != expected or type(found) is not type(expected):
                fix = f"; construct the reader with {key}={found!r}" if key in ("shard_id", "num_shards", "shuffle", "seed") else (
                    "; the data changed since the state was taken" if key in ("num_samples", "fingerprint") else ""
                )
                raise ValueError(f"{name} state does not fit this reader: {key} is {found!r} in the state but {expected!r} here{fix}")
        epoch, position = data["epoch"], data["position"]
        if position > self.shard_size:
            raise ValueError(
                f"{name} state: position {position} is past the end of this shard ({self.shard_size} samples)"
            )
        if position == self.shard_size and position > 0:
            epoch, position = epoch + 1, 0
        return epoch, position


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(dumps(obj).encode("ascii")).hexdigest()[:32]


class ArrayReader(Reader):
    """Batches of in-memory arrays: one array, a tuple/list of arrays, or a dict of arrays.

    All arrays share their first dimension (the sample axis). A batch has the
    same structure, each array indexed by the batch's sample indices (a
    copy). The state's fingerprint covers the structure, dtypes and shapes,
    not the values.

    >>> import numpy as np
    >>> r = ArrayReader({"x": np.arange(4), "y": np.arange(4) * 10}, shuffle=True, seed=3)
    >>> b = next(r.next_epoch(batch_size=2))
    >>> bool((b["y"] == b["x"] * 10).all())
    True
    """

    def __init__(self, data: np.ndarray | Sequence[Any] | Mapping[str, Any], **options: Any) -> None:
        if isinstance(data, Mapping):
            self._structure = "dict"
            items = [(str(k), np.asarray(v)) for k, v in data.items()]
        elif isinstance(data, (list, tuple)):
            self._structure = "tuple"
            items = [(str(i), np.asarray(v)) for i, v in enumerate(data)]
        else:
            self._structure = "array"
            items = [("0", np.asarray(data))]
        if not items:
            raise ValueError("ArrayReader needs at least one array")
        lengths = set()
        for key, arr in items:
            if arr.ndim == 0:
                raise ValueError(f"ArrayReader: array {key!r} is 0-d; arrays need a leading sample axis")
            lengths.add(arr.shape[0])
        if len(lengths) != 1:
            shapes = {key: arr.shape for key, arr in items}
            raise ValueError(f"ArrayReader: arrays differ in their first dimension: {shapes}")
        self._keys = [key for key, _ in items] if self._structure == "dict" else None
        self._arrays = [arr for _, arr in items]
        layout = [self._structure] + [[key, arr.dtype.str, list(arr.shape)] for key, arr in items]
        super().__init__(lengths.pop(), _fingerprint(layout), **options)

    def _load(self, indices: np.ndarray):
        parts = [arr[indices] for arr in self._arrays]
        if self._structure == "array":
            return parts[0]
        if self._structure == "tuple":
            return tuple(parts)
        return dict(zip(self._keys, parts))


class FileReader(Reader):
    """Batches of whole files under ``file_root``: lists of ``(relative_name, bytes)``.

    Files are the regular files matching ``glob`` (default: every file, in
    every subdirectory), ordered by their relative POSIX path, so the order is
    the same on every machine. The state's fingerprint covers the list of
    names: restoring over a directory whose files changed is refused.

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> for i in range(3):
    ...     _ = (root / f"{i}.txt").write_bytes(b"%d" % i)
    >>> reader = FileReader(root)
    >>> reader.files, reader.file_root == root
    (['0.txt', '1.txt', '2.txt'], True)
    >>> next(reader.next_epoch(batch_size=2))
    [('0.txt', b'0'), ('1.txt', b'1')]
    """

    def __init__(self, file_root: str | os.PathLike, *, glob: str = "**/*", **options):
        root = Path(file_root)
        if not root.is_dir():
            raise FileNotFoundError(f"FileReader: file_root {str(root)!r} is not a directory")
        names = sorted(p.relative_to(root).as_posix() for p in root.glob(glob) if p.is_file())
        if not names:
            raise FileNotFoundError(f"FileReader: no files match {glob!r} under {str(root)!r}")
        self._root = root
        self._files = names
        super().__init__(len(names), _fingerprint(names), **options)

    @property
    def files(self) -> list[str]:
        """Relative names of all files (all shards), in sample-index order (see the class example)."""
        return list(self._files)

    @property
    def file_root(self) -> Path:
        """The directory the files are read from (see the class example)."""
        return self._root

    def _load(self, indices: np.ndarray):
        batch = []
        for i in indices.tolist():
            name = self._files[i]
            with open(self._root / name, "rb") as f:
                batch.append((name, f.read()))
        return batch
