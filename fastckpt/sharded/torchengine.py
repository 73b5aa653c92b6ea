"""``TorchDistributedEngine``: the engine of a job that ``torchrun`` (or ``torch.multiprocessing``) starts.

Every rank calls ``torch.distributed.init_process_group`` first (any backend: gloo, nccl); the engine then
coordinates a sharded save over that group with the semantics of every engine of
:mod:`fastckpt.sharded.engine`: ``barrier``, ``broadcast`` and ``gather`` with timeouts, JSON only (never
pickles), and :class:`~fastckpt.sharded.engine.BarrierTimeoutError` naming in ``missing`` the ranks that did
not arrive.

The messages go through the process group's own key-value store (the one ``init_process_group`` made: the
``TCPStore`` of ``torchrun`` or of ``MASTER_ADDR``/``MASTER_PORT``), not through collectives: a collective
of gloo or NCCL cannot stop waiting at a timeout of its own or say which ranks never came, and it would
share the backend's stream with the training. A call is numbered; each rank sets its arrival key (with its
value) and the call's root (rank 0 for barriers), polling the arrivals, either sets the result key once
every rank has arrived or, when its time is up, a failure naming the ranks that did not. The others wait
for that result (the timeout plus a grace, at most 10 s, then they raise naming the root). An abort sets a
key that every waiting rank sees at its next poll. Keys are removed once read.

>>> import torch.distributed as dist  # doctest: +SKIP
>>> dist.init_process_group("gloo")  # doctest: +SKIP
>>> engine = TorchDistributedEngine()  # doctest: +SKIP
>>> engine.gather({"rank": engine.rank}, timeout=30)  # doctest: +SKIP
[{'rank': 0}, {'rank': 1}]
>>> _prefix({"TORCHELASTIC_RESTART_COUNT": "2"})
'fastckpt.engine/2/'
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from fastckpt.sharded.engine import (
    BarrierTimeoutError,
    EngineError,
    _abort_error,
    _aborted_self_error,
    _call_name,
    _failure,
    _MessageEngine,
    _out_of_step,
    _released,
    _seconds,
    _timeout_error,
)

__all__ = ["TorchDistributedEngine"]

_POLL_FIRST, _POLL_MAX = 1e-4, 5e-3  # seconds between polls of the store: doubling from the first to the most
_SEQ: dict[int, list] = {}  # id(store) -> [next call number, aborted ranks]: shared by the engines of one store
_SEQ_LOCK = threading.Lock()


def _prefix(environ=os.environ) -> str:
    """The keys' prefix: a torchrun restart keeps its store, and must not read the keys of the attempt before.

    >>> _prefix({})
    'fastckpt.engine/0/'
    """
    return f"fastckpt.engine/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class TorchDistributedEngine(_MessageEngine):
    """One rank of an initialised ``torch.distributed`` process group (see the module docs).

    ``group`` is a process group (default: the default one); ``store`` a ``torch.distributed.Store`` that
    every rank shares (default: the default group's). Every rank makes its engines in the same order; the
    engines of one store share the call count (as the MPI engines of one communicator do). One thread at a
    time may call the engines of one store.
    """

    def __init__(self, group=None, store=None):
        import torch.distributed as dist  # the optional dependency: only where torch is asked for

        if not dist.is_available() or not dist.is_initialized():
            raise EngineError("TorchDistributedEngine needs torch.distributed.init_process_group(...) first (torchrun "
                              "sets the environment it reads: init_process_group('gloo') or ('nccl'))")
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if store is None:
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
        self._store = store
        with _SEQ_LOCK:
            self._shared = _SEQ.setdefault(id(store), [0, {}])
        self._prefix = _prefix()

    def __repr__(self) -> str:
        return f"<TorchDistributedEngine rank {self.rank} of {self.size}>"

    def abort(self, reason: str = "") -> None:
        """Tell every other rank that this one will not arrive: their waits raise at once, naming it."""
        self._shared[1][self.rank] = str(reason)
        self._store.set(f"{self._prefix}abort/{self.rank}", json.dumps(str(reason)))
        self._store.add(f"{self._prefix}aborts", 1)

    # -- the store --------------------------------------------------------------------------------------------
    def _has(self, key: str) -> bool:
        return self._store.check([key])

    def _get(self, key: str) -> Any:
        data = self._store.get(key)
        try:
            return json.loads(bytes(data).decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise EngineError(f"rank {self.rank}: store key {key!r} does not hold one of fastckpt's messages "
                              f"({exc})") from None

    def _aborts(self) -> dict[int, str]:
        """The ranks that aborted (a counter first: one store round trip while nobody has)."""
        if self._store.add(f"{self._prefix}aborts", 0) > len(self._shared[1]):
            for r in range(self.size):
                key = f"{self._prefix}abort/{r}"
                if r not in self._shared[1] and self._has(key):
                    self._shared[1][r] = str(self._get(key))
        return self._shared[1]

    # -- one collective call ----------------------------------------------------------------------------------
    def _call(self, tag: str, kind: str, root: int, value: Any, timeout: float) -> Any:
        rank, size, shared = self.rank, self.size, self._shared
        if rank in shared[1]:
            raise _aborted_self_error(rank, size)
        seq, shared[0] = shared[0], shared[0] + 1
        call = [tag, kind, root]
        base = f"{self._prefix}{seq}/"
        start = time.monotonic()
        if rank != root:
            self._store.set(f"{base}arrive/{rank}", json.dumps({"call": call, "value": value}))
            return self._as_member(base, call, timeout, start)
        return self._as_root(base, call, value, timeout, start)

    def _as_member(self, base: str, call: list, timeout: float, start: float) -> Any:
        tag, kind, root = call
        deadline = start + timeout + min(max(timeout, 0.1), 10.0)  # the root decides first; then hear it
        pause = _POLL_FIRST
        while not self._has(f"{base}result"):
            if self._aborts():
                raise _abort_error(dict(self._shared[1]), tag, kind, root, timeout, self.size)
            if time.monotonic() >= deadline:
                raise BarrierTimeoutError(
                    f"rank {self.rank} of {self.size} had no answer from rank {root} at "
                    f"{_call_name(tag, kind, root)} within {_seconds(timeout)}: rank {root}, which waits for every "
                    f"rank there, did not reach it or stopped (its own error names the ranks that did not arrive)",
                    missing=(root,), tag=tag, timeout=timeout, size=self.size)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
        answer = self._get(f"{base}result")
        if self._store.add(f"{base}read", 1) == self.size - 1:  # the last reader removes the call's keys
            for key in (f"{base}result", f"{base}read"):
                self._store.delete_key(key)
        return _released(answer, kind, tag, timeout, self.size)

    def _as_root(self, base: str, call: list, value: Any, timeout: float, start: float) -> Any:
        tag, kind, root = call
        size = self.size
        values, calls = {root: json.loads(json.dumps(value))}, {root: call}
        waiting = set(range(size)) - {root}
        pause = _POLL_FIRST
        error: Exception | None = None
        while waiting:
            arrived = [r for r in sorted(waiting) if self._has(f"{base}arrive/{r}")]
            for r in arrived:
                body = self._get(f"{base}arrive/{r}")
                self._store.delete_key(f"{base}arrive/{r}")
                values[r], calls[r] = body.get("value"), body.get("call")
                waiting.discard(r)
            if not waiting:
                break
            if self._aborts():
                error = _abort_error(dict(self._shared[1]), tag, kind, root, timeout, size)
                break
            if time.monotonic() >= start + timeout:
                error = _timeout_error(waiting, tag, kind, root, timeout, size)
                break
            if not arrived:
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX)
        error = error or _out_of_step(calls, call, size)
        if error is not None:
            self._store.set(f"{base}result", json.dumps({"ok": False, "failure": _failure(error)}))
            raise error
        if size > 1:
            self._store.set(f"{base}result", json.dumps({"ok": True, "value": values[root] if kind == "broadcast"
                                                         else None}))
        if kind == "broadcast":
            return values[root]
        if kind == "gather":
            return [values[r] for r in range(size)]
        return None
