"""Work done once among the holders of a key in this process: the sharded layer's one mechanism for it.

The ranks of a load that run as threads of one process (resharding, benchmarks, a ``ThreadEngine``) often want the
same piece of work at the same time: the metadata and headers of a checkpoint at a URL, a whole tensor file fetched
from it, a tensor file's BLAKE3. :class:`Flights` keeps one :class:`Flight` per key while something holds it: the
first holder that asks for the work does it and sets its Future's result, the others wait on that Future; a failure
reaches those waiting and the next to ask does the work again; a key goes when its last holder lets go, so work
asked for later is done anew (a file replaced since is hashed again).

Holders come two ways: :meth:`Flights.join` holds a key and asks for its work in one step (a load's fetch), and
:meth:`Flights.hold` holds keys without asking (a reader that holds its files from open to close), the work asked
for later with :meth:`Flights.once`.

>>> flights = Flights()
>>> flights.hold("k")
>>> flights.once("k", lambda: 42), flights.once("k", lambda: 0)  # done once while "k" is held
(42, 42)
>>> flights.release("k"); flights.once("k", lambda: 7)            # not held: done, not kept
7
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable

__all__ = ["Flight", "Flights"]


class Flight:
    """One key's work: how many hold it, the Future of its result (None: nobody does it now), and what those who
    wait for it leave for the one that does it (``waiting``; None once that one took it)."""

    __slots__ = ("holders", "future", "waiting")

    def __init__(self):
        self.holders, self.future, self.waiting = 0, None, None


class Flights:
    """Work done once among the holders of a key (module docstring)."""

    def __init__(self):
        # Reentrant: a holder's weakref.finalize (release) may run from a garbage collection that an allocation
        # under the lock set off (a Future made here), in the thread that holds it; a plain Lock deadlocked there.
        self._lock = threading.RLock()
        self._flights: dict = {}

    def __len__(self) -> int:
        return len(self._flights)

    def holders(self, key) -> int:
        flight = self._flights.get(key)
        return 0 if flight is None else flight.holders

    def hold(self, key, count: int = 1) -> None:
        """Hold ``key`` ``count`` times without asking for its work (:meth:`release` each)."""
        with self._lock:
            self._flights.setdefault(key, Flight()).holders += count

    def release(self, key, count: int = 1) -> None:
        """Let go of ``key`` ``count`` times; the last holder's release forgets its work."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                flight.holders -= count
                if flight.holders <= 0:
                    del self._flights[key]

    def join(self, key, waiter=None) -> tuple[Flight, concurrent.futures.Future, bool]:
        """Hold ``key`` and ask for its work: ``(its flight, a new Future, True)`` where this caller does it, else
        ``(its flight, the Future to wait for, False)``, with ``waiter`` added to the flight's ``waiting`` while
        that is open. Let go with :meth:`leave`."""
        with self._lock:
            flight = self._flights.setdefault(key, Flight())
            flight.holders += 1
            if flight.future is None:
                flight.future, flight.waiting = concurrent.futures.Future(), []
                return flight, flight.future, True
            if waiter is not None and flight.waiting is not None:
                flight.waiting.append(waiter)
            return flight, flight.future, False

    def take_waiting(self, flight: Flight) -> list:
        """What those waiting for ``flight`` left for it; those that come later wait for the result alone."""
        with self._lock:
            waiting, flight.waiting = flight.waiting or [], None
        return waiting

    def fail(self, flight: Flight, future: concurrent.futures.Future, exc: BaseException) -> None:
        """The work of ``flight`` (its ``future``) failed: those waiting get ``exc``, the next to ask does it again."""
        with self._lock:
            if flight.future is future:
                flight.future = None
        future.set_exception(exc)

    def leave(self, key, flight: Flight) -> None:
        """Let go of ``key`` held by :meth:`join` (of ``flight``, not of a later flight under the same key)."""
        with self._lock:
            flight.holders -= 1
            if flight.holders == 0 and self._flights.get(key) is flight:
                del self._flights[key]

    def once(self, key, compute: Callable[[], Any]) -> Any:
        """``compute()`` once among the holders of ``key`` (those asking while it runs wait for its result, those
        asking later get it); where nothing holds ``key``, ``compute()`` alone, its result not kept."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is None:
                future, mine = None, True
            elif flight.future is None:
                future, mine = concurrent.futures.Future(), True
                flight.future = future
            else:
                future, mine = flight.future, False
        if not mine:
            return future.result()
        try:
            result = compute()
        except BaseException as exc:
            if future is not None:
                self.fail(flight, future, exc)
            raise
        if future is not None:
            future.set_result(result)
        return result
