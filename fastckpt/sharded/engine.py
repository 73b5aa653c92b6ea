"""The engines that coordinate the ranks of a sharded save: barriers, broadcasts and gathers with timeouts.

Every rank of a sharded save holds one engine. An engine is an :class:`Engine`: its ``rank`` and ``size``,
and three collective calls that every rank makes in the same order, as with MPI's collectives:

* ``barrier(tag, timeout)``: returns once every rank has reached it;
* ``broadcast(obj, root=0, timeout=...)``: returns the root's ``obj`` on every rank;
* ``gather(obj, root=0, timeout=...)``: the root gets every rank's ``obj``, by rank; the others get ``None``.

Each call returns only once every rank has made it, so each is also a barrier. Where a rank does not arrive
within ``timeout`` seconds the call raises :class:`BarrierTimeoutError`, which names the call, the timeout
and exactly which ranks did not arrive (``ranks 2, 3 of 4 did not reach 'written' within 30 s``) instead
of hanging. Objects travel as JSON, never as pickles: an engine only ever runs ``json.loads`` on what it
receives, and every rank, the sender included, gets ``json.loads(json.dumps(obj))`` (tuples come back as
lists on every engine alike, so a single-process test sees what MPI ranks would).

The engines:

* :class:`LocalEngine`: one rank; every call is immediate.
* :class:`ThreadEngine`: ``ThreadEngine.group(n)`` gives ``n`` engines sharing state, one per thread: for
  tests, and for saving many shards from one process.
* :class:`MPIEngine`: one process per rank under ``mpiexec``, through mpi4py (``pip install
  "fastckpt[mpi]"`` installs mpi4py and MPICH, whose ``mpiexec`` lands next to the Python executable).
* :class:`TorchDistributedEngine`: one process per rank of an initialised
  ``torch.distributed`` group (``torchrun``), messages through the group's store.
* :func:`default_engine` picks one from ``(shard_index, shard_num)``.

Three ranks as threads: each writes its files, waits for the others, and rank 0 gathers what they wrote.

>>> from concurrent.futures import ThreadPoolExecutor
>>> def save_shard(engine):
...     written = [f"model-{engine.rank:05d}.safetensors"]
...     engine.barrier("written", timeout=10)
...     return engine.gather(written, root=0, timeout=10)
>>> with ThreadPoolExecutor(3) as threads:
...     results = list(threads.map(save_shard, ThreadEngine.group(3)))
>>> results
[[['model-00000.safetensors'], ['model-00001.safetensors'], ['model-00002.safetensors']], None, None]

The same function runs unchanged on ``MPIEngine()`` in each process of ``mpiexec -n 3 python save.py``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any, Protocol, runtime_checkable

from fastckpt.errors import BarrierTimeoutError, EngineError

__all__ = [
    "DEFAULT_TIMEOUT",
    "BarrierTimeoutError",
    "EngineError",
    "Engine",
    "LocalEngine",
    "ThreadEngine",
    "MPIEngine",
    "TorchDistributedEngine",
    "default_engine",
    "mpiexec",
]

#: Seconds that ``broadcast`` and ``gather`` wait for the other ranks unless told otherwise.
DEFAULT_TIMEOUT = 600.0


def mpiexec(search_path: bool = False) -> str | None:
    """The ``mpiexec`` that starts the ranks of an :class:`MPIEngine` job: the one next to this Python (the ``mpi``
    extra installs MPICH's there), or with ``search_path`` one on ``PATH``; None where there is none or mpi4py is
    not importable.

    >>> mpiexec() is None or os.path.basename(mpiexec()) == "mpiexec"
    True
    """
    from importlib.util import find_spec

    if find_spec("mpi4py") is None:
        return None
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(path, os.X_OK):
        return path
    if search_path:
        import shutil

        return shutil.which("mpiexec")
    return None


def error_info(exc: BaseException) -> dict:
    """``exc`` as rank 0 broadcasts it: its text, and for an ``OSError`` its errno and path, so that every rank
    raises the same kind (:func:`raise_from_root`).

    >>> error_info(FileExistsError(17, "File exists", "/ckpt/step-1"))["filename"]
    '/ckpt/step-1'
    """
    info = {"error": f"{type(exc).__name__}: {exc}"}
    if isinstance(exc, OSError) and exc.errno is not None:
        info.update(errno=exc.errno, strerror=exc.strerror or os.strerror(exc.errno),
                    filename=None if exc.filename is None else os.fspath(exc.filename))
    return info


def raise_from_root(info: dict, what: str) -> None:
    """Raise rank 0's failure on another rank: an ``OSError`` of the same errno (``FileExistsError`` stays one)
    naming the same path, anything else a ``RuntimeError``.

    >>> raise_from_root(error_info(FileExistsError(17, "File exists", "/c")), "save to /c")
    Traceback (most recent call last):
    FileExistsError: [Errno 17] File exists (save to /c): '/c'
    """
    if "errno" in info:
        raise OSError(info["errno"], f"{info['strerror']} ({what})", info["filename"])
    raise RuntimeError(f"{what}: {info['error']}")


@runtime_checkable
class Engine(Protocol):
    """What a sharded save needs to coordinate its ranks (see the module docs).

    >>> isinstance(LocalEngine(), Engine)
    True
    """

    rank: int
    size: int

    def barrier(self, tag: str, timeout: float) -> None:
        """Return once every rank has called ``barrier(tag, ...)``; else :class:`BarrierTimeoutError`."""

    def broadcast(self, obj: Any, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Any:
        """Return ``root``'s JSON-serializable ``obj`` on every rank (the others pass anything, e.g. ``None``)."""

    def gather(self, obj: Any, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> list | None:
        """Return every rank's JSON-serializable ``obj``, by rank, on ``root``; ``None`` on the others."""


# -- what every engine shares: argument checks, the JSON round trip, the messages -----------------------------

def _check_tag(tag: Any) -> str:
    if not isinstance(tag, str):
        raise TypeError(f"a barrier's tag must be a str, got {tag!r}")
    return tag


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 (math.inf waits forever), got {timeout!r}")
    return float(timeout)


def _check_root(root: Any, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in [0, {size}), got {root!r}")
    return root


def _encode(obj: Any, what: str) -> str:
    try:
        return json.dumps(obj)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what}: engines send JSON only (never pickles), and {type(obj).__name__} "
                        f"is not JSON-serializable: {exc}") from None


def _ranks(ranks: tuple[int, ...]) -> str:
    """``ranks 2, 3`` / ``rank 2`` / ``ranks 0, 4-9``: runs of three or more as ranges.

    >>> _ranks((2,)), _ranks((2, 3)), _ranks((0, 4, 5, 6, 7))
    ('rank 2', 'ranks 2, 3', 'ranks 0, 4-7')
    """
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = []
    for run in runs:
        parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(r) for r in run]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _call_name(tag: str, kind: str, root: int) -> str:
    """How messages name a call: a barrier by its tag, the others by kind and root."""
    if kind == "barrier":
        return repr(tag)
    return f"the broadcast from rank {root}" if kind == "broadcast" else f"the gather to rank {root}"


def _seconds(timeout: float) -> str:
    return f"{timeout:g} s"


def _timeout_error(missing, tag: str, kind: str, root: int, timeout: float, size: int) -> BarrierTimeoutError:
    missing = tuple(sorted(missing))
    return BarrierTimeoutError(
        f"{_ranks(missing)} of {size} did not reach {_call_name(tag, kind, root)} within {_seconds(timeout)} "
        f"(each rank must make the same engine calls in the same order; one that raised, hung or exited "
        f"never arrives)",
        missing=missing, tag=tag, timeout=timeout, size=size)


def _abort_error(aborted: dict[int, str], tag: str, kind: str, root: int, timeout: float,
                 size: int) -> BarrierTimeoutError:
    missing = tuple(sorted(aborted))
    reasons = "; ".join(f"rank {r}: {aborted[r]}" for r in missing if aborted[r])
    return BarrierTimeoutError(
        f"{_ranks(missing)} of {size} aborted and will not reach {_call_name(tag, kind, root)}"
        + (f" ({reasons})" if reasons else ""),
        missing=missing, tag=tag, timeout=timeout, size=size)


def _out_of_step_error(calls: dict[int, str], size: int) -> EngineError:
    seen = ", ".join(f"rank {r} at {calls[r]}" for r in sorted(calls))
    return EngineError(f"the {size} ranks are out of step ({seen}): each rank must make the same engine "
                       f"calls in the same order")


def _aborted_self_error(rank: int, size: int) -> EngineError:
    return EngineError(f"rank {rank} of {size} aborted this engine; the ranks cannot coordinate through it any "
                       f"more")


# -- one rank -------------------------------------------------------------------------------------------------

class LocalEngine:
    """The engine of a save with one rank: ``rank`` 0 of ``size`` 1; every call returns at once.

    Values still make the JSON round trip, so what works here works on every engine.

    >>> engine = LocalEngine()
    >>> engine.barrier("written", timeout=1.0)
    >>> engine.broadcast({"step": 7, "shape": (2, 3)})
    {'step': 7, 'shape': [2, 3]}
    >>> engine.gather("model-00000.safetensors")
    ['model-00000.safetensors']
    """

    rank = 0
    size = 1

    def __repr__(self) -> str:
        return "<LocalEngine rank 0 of 1>"

    def barrier(self, tag: str, timeout: float) -> None:
        _check_tag(tag)
        _check_timeout(timeout)

    def broadcast(self, obj: Any, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Any:
        _check_root(root, 1)
        _check_timeout(timeout)
        return json.loads(_encode(obj, "broadcast"))

    def gather(self, obj: Any, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> list | None:
        _check_root(root, 1)
        _check_timeout(timeout)
        return [json.loads(_encode(obj, "gather"))]

    def abort(self, reason: str = "") -> None:
        """Nothing to tell: there are no other ranks."""


# -- ranks as threads of one process --------------------------------------------------------------------------

class _Round:
    """One collective call of a thread group: who arrived, with what, and how it ended."""

    __slots__ = ("calls", "collected", "done", "failure", "texts")

    def __init__(self):
        self.calls: dict[int, tuple[str, str, int]] = {}  # rank -> (tag, kind, root)
        self.texts: dict[int, str] = {}
        self.done = False
        self.failure: tuple | None = None  # how to build each rank's own exception: (function, arguments)
        self.collected = 0


class _ThreadGroup:
    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.rounds: dict[int, _Round] = {}
        self.aborted: dict[int, str] = {}


class ThreadEngine:
    """One rank of a group of ranks that are threads of one process; make the group with :meth:`group`.

    Each engine of a group must be used by its own thread (all of one group in one thread waits for
    itself until the timeout). A rank that does not arrive in time makes every rank that waits for it
    raise :class:`BarrierTimeoutError` naming it; a rank that arrives after that raises the same error.

    >>> engines = ThreadEngine.group(2)  # rank 1 never calls barrier
    >>> engines[0].barrier("written", timeout=0.05)
    Traceback (most recent call last):
        ...
    fastckpt.errors.BarrierTimeoutError: rank 1 of 2 did not reach 'written' within 0.05 s (...)
    """

    def __init__(self, group: _ThreadGroup, rank: int):
        self._group = group
        self.rank = rank
        self.size = group.size
        self._seq = 0

    @classmethod
    def group(cls, n: int) -> list[ThreadEngine]:
        """``n`` engines sharing one state: ``group(n)[i]`` is rank ``i`` of ``n``.

        >>> ThreadEngine.group(3)
        [<ThreadEngine rank 0 of 3>, <ThreadEngine rank 1 of 3>, <ThreadEngine rank 2 of 3>]
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"a group needs a positive int number of ranks, got {n!r}")
        shared = _ThreadGroup(n)
        return [cls(shared, rank) for rank in range(n)]

    def __repr__(self) -> str:
        return f"<ThreadEngine rank {self.rank} of {self.size}>"

    def barrier(self, tag: str, timeout: float) -> None:
        self._round(_check_tag(tag), "barrier", 0, "null", _check_timeout(timeout))

    def broadcast(self, obj: Any, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Any:
        root = _check_root(root, self.size)
        timeout = _check_timeout(timeout)
        text = _encode(obj, "broadcast") if self.rank == root else "null"
        texts = self._round("broadcast", "broadcast", root, text, timeout)
        return json.loads(texts[root])

    def gather(self, obj: Any, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> list | None:
        root = _check_root(root, self.size)
        timeout = _check_timeout(timeout)
        texts = self._round("gather", "gather", root, _encode(obj, "gather"), timeout)
        return [json.loads(texts[r]) for r in range(self.size)] if self.rank == root else None

    def abort(self, reason: str = "") -> None:
        """Tell the other ranks that this one will not arrive: their waits raise at once, naming it.

        Calls that every rank had already reached still complete; later calls on any rank of the group
        raise.

        >>> engines = ThreadEngine.group(2)
        >>> engines[1].abort("disk full")
        >>> engines[0].barrier("written", timeout=60)
        Traceback (most recent call last):
            ...
        fastckpt.errors.BarrierTimeoutError: rank 1 of 2 aborted and will not reach 'written' (rank 1: ...)
        """
        group = self._group
        with group.cond:
            group.aborted[self.rank] = str(reason)
            group.cond.notify_all()

    def _round(self, tag: str, kind: str, root: int, text: str, timeout: float) -> dict[int, str]:
        group, rank, size = self._group, self.rank, self.size
        deadline = time.monotonic() + timeout
        with group.cond:
            if rank in group.aborted:
                raise _aborted_self_error(rank, size)
            seq, self._seq = self._seq, self._seq + 1
            current = group.rounds.setdefault(seq, _Round())
            if current.failure is None and not current.done:
                current.calls[rank] = (tag, kind, root)
                current.texts[rank] = text
                if len(current.calls) == size:
                    if len(set(current.calls.values())) > 1:
                        names = {r: _call_name(*c) for r, c in current.calls.items()}
                        current.failure = (_out_of_step_error, (names, size))
                    else:
                        current.done = True
                    group.cond.notify_all()
            while not current.done and current.failure is None:
                if group.aborted:
                    current.failure = (_abort_error, (dict(group.aborted), tag, kind, root, timeout, size))
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = set(range(size)) - set(current.calls)
                    current.failure = (_timeout_error, (missing, tag, kind, root, timeout, size))
                    group.cond.notify_all()
                    break
                group.cond.wait(None if math.isinf(left) else left)
            current.collected += 1
            if current.collected == size:
                del group.rounds[seq]
            if current.failure is not None:
                build, arguments = current.failure
                raise build(*arguments)  # a new exception per rank: tracebacks are per thread
            return current.texts


# -- ranks as MPI processes -----------------------------------------------------------------------------------

# The engine's messages, on a communicator of its own (MPI_Comm_idup of the one given): every message is UTF-8
# JSON text carrying the call's number ("seq"). A rank sends ARRIVE (with its value) to the call's root; the
# root, once every rank has arrived or its time is up, answers every other rank with RELEASE: {"ok": true,
# "value": ...} or the error to raise. ABORT goes to every rank. A call that fails leaves messages nobody
# receives (a late arrival, an answer to a rank that left); MPICH refuses to finalize COMM_WORLD with such
# messages pending (the job then dies at exit), but not a communicator of the program's own.
_TAG_ARRIVE = 1
_TAG_RELEASE = 2
_TAG_ABORT = 3
_POLL_FIRST, _POLL_MAX = 2e-5, 2e-3  # seconds between polls: doubling from the first to the most


class _CommState:
    """What every MPIEngine over one communicator shares: its private communicator, the call count, messages."""

    def __init__(self, comm):
        self.comm, self.ready = comm.Idup()  # completes once every rank has asked for it
        self.seq = 0
        self.early: dict[tuple[int, int, int], dict] = {}  # (tag, source, seq) -> a message of a later call
        # SAFETY: Isend reads its buffer until the request completes; each buffer stays referenced here until
        # then (sends to a rank that never receives may stay here for the life of the process).
        self.sending: list[tuple[Any, bytes]] = []
        self.aborted: dict[int, str] = {}


_COMM_STATES: dict[int, _CommState] = {}
_COMM_STATES_LOCK = threading.Lock()


class _MessageEngine:
    """The calls of an engine whose ranks are processes exchanging messages (MPI, torch.distributed's store):
    arguments checked, values refused before anything is sent, then ``self._call(tag, kind, root, value,
    timeout)``, which the engine implements (the root collects, every other rank waits for its answer)."""

    rank: int
    size: int

    def barrier(self, tag: str, timeout: float) -> None:
        self._call(_check_tag(tag), "barrier", 0, None, _check_timeout(timeout))

    def broadcast(self, obj: Any, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Any:
        root = _check_root(root, self.size)
        timeout = _check_timeout(timeout)
        if self.rank == root:
            _encode(obj, "broadcast")  # refuse before anything is sent
        return self._call("broadcast", "broadcast", root, obj if self.rank == root else None, timeout)

    def gather(self, obj: Any, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> list | None:
        root = _check_root(root, self.size)
        timeout = _check_timeout(timeout)
        _encode(obj, "gather")
        return self._call("gather", "gather", root, obj, timeout)

    def _call(self, tag: str, kind: str, root: int, value: Any, timeout: float) -> Any:
        raise NotImplementedError

    def _collect(self, call: list, value: Any, timeout: float, start: float, arrivals, aborted,
                 poll: tuple[float, float]) -> tuple[dict[int, Any], Exception | None]:
        """The root's wait at a call: ``(values by rank, the call's error or None)`` once every other rank
        arrived, one aborted, or ``timeout`` passed since ``start``. ``arrivals(waiting)`` yields ``(rank,
        body)`` for the arrivals since the last look, ``aborted()`` the aborted ranks (rank -> reason, empty
        when none), ``poll`` the first and the longest pause between looks (doubling)."""
        tag, kind, root = call
        size = self.size
        values, calls = {root: json.loads(json.dumps(value))}, {root: call}
        waiting = set(range(size)) - {root}
        pause, longest = poll
        error: Exception | None = None
        while waiting:
            arrived = False
            for rank, body in arrivals(waiting):
                waiting.discard(rank)
                values[rank], calls[rank] = body.get("value"), body.get("call")
                arrived = True
            if not waiting:
                break
            aborts = aborted()
            if aborts:
                error = _abort_error(aborts, tag, kind, root, timeout, size)
                break
            if time.monotonic() >= start + timeout:
                error = _timeout_error(waiting, tag, kind, root, timeout, size)
                break
            if not arrived:
                time.sleep(pause)
                pause = min(pause * 2, longest)
        return values, error or _out_of_step(calls, call, size)


def _result(kind: str, root: int, values: dict[int, Any], size: int) -> Any:
    """What a call returns on its root: the broadcast value, every rank's value in rank order, or None."""
    if kind == "broadcast":
        return values[root]
    if kind == "gather":
        return [values[r] for r in range(size)]
    return None


def _failure(error: Exception) -> dict:
    """What the root tells the other ranks of a call that failed there."""
    return {"kind": "out of step" if isinstance(error, EngineError) else "missing", "message": str(error),
            "missing": list(getattr(error, "missing", ()))}


def _out_of_step(calls: dict[int, Any], call: list, size: int) -> EngineError | None:
    """The root's error where the ranks' calls (``calls``: rank -> [tag, kind, root]) differ from its ``call``."""
    if all(c == call for c in calls.values()):
        return None
    names = {r: (_call_name(*c) if isinstance(c, list) and len(c) == 3 else repr(c)) for r, c in calls.items()}
    return _out_of_step_error(names, size)


def _released(answer: dict, kind: str, tag: str, timeout: float, size: int) -> Any:
    """A non-root rank's result of a call from the root's answer: the broadcast value, or the root's error."""
    if answer.get("ok"):
        return answer.get("value") if kind == "broadcast" else None
    failure = answer.get("failure", {})
    if failure.get("kind") == "out of step":
        raise EngineError(failure.get("message", "the ranks are out of step"))
    raise BarrierTimeoutError(failure.get("message", "ranks did not arrive"),
                              missing=tuple(failure.get("missing", ())), tag=tag, timeout=timeout, size=size)


class MPIEngine(_MessageEngine):
    """One rank of an MPI job (through mpi4py): ``MPIEngine()`` in each process that ``mpiexec -n N`` starts.

    ``comm`` defaults to ``MPI.COMM_WORLD``. The first engine over a communicator duplicates it without
    waiting (``MPI_Comm_idup``, a collective: every rank makes its first engine at the same point of its
    program); later engines over it share that duplicate, their call count and their messages. The calls
    use only non-blocking point-to-point messages of JSON bytes on the duplicate, polled with short sleeps,
    because MPI's own ``Barrier`` cannot time out. The root of a call (rank 0 for barriers) waits for every
    other rank's arrival, then releases them all; where ranks are missing when its time is up it raises
    :class:`BarrierTimeoutError` naming them and tells the other ranks, which raise the same error (a late
    rank as soon as it arrives). A non-root rank that hears nothing from the root within ``timeout`` plus a
    grace (the timeout, at most 10 s) raises naming the root. One thread at a time may call the engines of
    one communicator.

    Run under ``mpiexec`` (one process per rank); without it MPI makes a job of one process:

    >>> def save_shard(engine):  # in each process: engine = MPIEngine()
    ...     engine.barrier("written", timeout=30)
    ...     return engine.gather({"rank": engine.rank}, root=0, timeout=30)
    >>> save_shard(LocalEngine())  # what rank 0 of a one-rank job returns
    [{'rank': 0}]
    """

    def __init__(self, comm=None):
        from mpi4py import MPI  # the optional dependency: only where MPI is asked for

        self._MPI = MPI
        parent = MPI.COMM_WORLD if comm is None else comm
        self.rank = parent.Get_rank()
        self.size = parent.Get_size()
        with _COMM_STATES_LOCK:
            key = MPI.Comm.py2f(parent)
            if key not in _COMM_STATES:
                _COMM_STATES[key] = _CommState(parent)
            self._state = _COMM_STATES[key]
        self._comm = self._state.comm

    def __repr__(self) -> str:
        return f"<MPIEngine rank {self.rank} of {self.size}>"

    def abort(self, reason: str = "") -> None:
        """Tell every other rank that this one will not arrive: their waits raise at once, naming it.

        Later calls on this engine raise :class:`EngineError`; on the others, :class:`BarrierTimeoutError`.
        """
        state = self._state
        state.aborted[self.rank] = str(reason)
        if not self._ready(time.monotonic()):
            return  # not every rank has an engine yet: their first call fails on its own
        for other in range(self.size):
            if other != self.rank:
                self._send({"rank": self.rank, "reason": str(reason)}, other, _TAG_ABORT)

    # -- messages ---------------------------------------------------------------------------------------------
    def _ready(self, deadline: float) -> bool:
        """Whether the private communicator exists (every rank has made its first engine); polls until ``deadline``."""
        state = self._state
        pause = _POLL_FIRST
        while state.ready is not None:
            if state.ready.Test():
                state.ready = None
            elif time.monotonic() >= deadline:
                return False
            else:
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX)
        return True

    def _send(self, message: dict, dest: int, tag: int) -> Any:
        data = json.dumps(message).encode()
        request = self._comm.Isend([data, self._MPI.BYTE], dest, tag)
        self._state.sending.append((request, data))
        return request

    def _reap(self) -> None:
        self._state.sending = [(request, data) for request, data in self._state.sending if not request.Test()]

    def _receive(self, source: int, tag: int) -> dict | None:
        """A message from ``source`` (or any) with ``tag`` if one has come, else ``None``. Nothing is unpickled."""
        MPI = self._MPI
        status = MPI.Status()
        message = self._comm.Improbe(source, tag, status)
        if message is None:
            return None
        buffer = bytearray(status.Get_count(MPI.BYTE))
        message.Recv([buffer, MPI.BYTE])
        try:
            body = json.loads(buffer.decode())
            body["source"] = status.Get_source()
        except (UnicodeDecodeError, ValueError, TypeError) as exc:
            raise EngineError(f"rank {self.rank}: a message from rank {status.Get_source()} with tag {tag} is "
                              f"not one of fastckpt's ({exc})") from None
        return body

    def _take(self, source: int, tag: int, seq: int) -> dict | None:
        """The message of call ``seq`` with ``tag`` from ``source`` (or any): earlier calls' are dropped."""
        state = self._state
        for key in list(state.early):
            if key[0] == tag and key[2] == seq and source in (self._MPI.ANY_SOURCE, key[1]):
                return state.early.pop(key)
        while (body := self._receive(source, tag)) is not None:
            if body.get("seq") == seq:
                return body
            if isinstance(body.get("seq"), int) and body["seq"] > seq:
                state.early[(tag, body["source"], body["seq"])] = body
            # else: a late message of a call that already ended (it timed out): nothing waits for it.
        return None

    def _check_aborts(self) -> dict[int, str]:
        while (body := self._receive(self._MPI.ANY_SOURCE, _TAG_ABORT)) is not None:
            self._state.aborted[body["source"]] = str(body.get("reason", ""))
        return self._state.aborted

    # -- one collective call ----------------------------------------------------------------------------------
    def _call(self, tag: str, kind: str, root: int, value: Any, timeout: float) -> Any:
        state, rank, size = self._state, self.rank, self.size
        if rank in state.aborted:
            raise _aborted_self_error(rank, size)
        seq, state.seq = state.seq, state.seq + 1
        call = [tag, kind, root]
        start = time.monotonic()
        if not self._ready(start + timeout):
            raise BarrierTimeoutError(
                f"rank {rank} of {size} cannot start {_call_name(tag, kind, root)}: not every rank has made its "
                f"first MPIEngine within {_seconds(timeout)} (MPI does not tell which ranks have not; every rank "
                f"makes its first engine at the same point of its program)", missing=(), tag=tag,
                timeout=timeout, size=size)
        if rank != root:
            return self._call_as_member(seq, call, value, timeout, start)
        return self._call_as_root(seq, call, value, timeout, start)

    def _raise_if_aborted(self, call: list, timeout: float) -> None:
        if self._check_aborts():
            raise _abort_error(dict(self._state.aborted), *call, timeout, self.size)

    def _call_as_member(self, seq: int, call: list, value: Any, timeout: float, start: float) -> Any:
        tag, kind, root = call
        self._raise_if_aborted(call, timeout)
        self._send({"seq": seq, "call": call, "value": value}, root, _TAG_ARRIVE)
        deadline = start + timeout + min(max(timeout, 0.1), 10.0)  # the root decides first; then hear it
        pause = _POLL_FIRST
        while (answer := self._take(root, _TAG_RELEASE, seq)) is None:
            self._raise_if_aborted(call, timeout)
            if time.monotonic() >= deadline:
                self._reap()
                raise BarrierTimeoutError(
                    f"rank {self.rank} of {self.size} had no answer from rank {root} at "
                    f"{_call_name(tag, kind, root)} within {_seconds(timeout)}: rank {root}, which waits for "
                    f"every rank there, did not reach it or stopped (its own error names the ranks that did "
                    f"not arrive)", missing=(root,), tag=tag, timeout=timeout, size=self.size)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
        self._reap()
        return _released(answer, kind, tag, timeout, self.size)

    def _call_as_root(self, seq: int, call: list, value: Any, timeout: float, start: float) -> Any:
        tag, kind, root = call
        size = self.size

        def arrivals(waiting):
            while (body := self._take(self._MPI.ANY_SOURCE, _TAG_ARRIVE, seq)) is not None:
                yield body["source"], body

        values, error = self._collect(call, value, timeout, start, arrivals,
                                      lambda: dict(self._state.aborted) if self._check_aborts() else {},
                                      (_POLL_FIRST, _POLL_MAX))
        if error is not None:
            failure = _failure(error)
            for other in range(size):  # the missing ones too: should they arrive late, they learn at once
                if other != root:
                    self._send({"seq": seq, "ok": False, "failure": failure}, other, _TAG_RELEASE)
            self._reap()
            raise error
        answer = {"seq": seq, "ok": True, "value": values[root] if kind == "broadcast" else None}
        requests = [self._send(answer, other, _TAG_RELEASE) for other in range(size) if other != root]
        # Every rank waits for this answer, so the sends complete at once; waiting for them keeps a large
        # broadcast from stalling while the root computes without calling MPI.
        self._wait_sent(requests, call, timeout)
        return _result(kind, root, values, size)

    def _wait_sent(self, requests: list, call: list, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pause = _POLL_FIRST
        others = [r for r in range(self.size) if r != call[2]]
        while True:
            pending = [other for other, request in zip(others, requests) if not request.Test()]
            if not pending:
                break
            if time.monotonic() >= deadline:
                self._reap()
                raise BarrierTimeoutError(
                    f"{_ranks(tuple(pending))} of {self.size} did not take the answer of "
                    f"{_call_name(*call)} within {_seconds(timeout)} after arriving (stopped or exited?)",
                    missing=tuple(pending), tag=call[0], timeout=timeout, size=self.size)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
        self._reap()


# -- torch.distributed: the engine of a torchrun job ------------------------------------------------------------

_STORE_POLL_FIRST, _STORE_POLL_MAX = 1e-4, 5e-3  # seconds between polls of the store: doubling up to the most
_SEQ: dict[int, list] = {}  # id(store) -> [next call number, aborted ranks]: shared by the engines of one store
_SEQ_LOCK = threading.Lock()


def _prefix(environ=os.environ) -> str:
    """The keys' prefix: a torchrun restart keeps its store, and must not read the keys of the attempt before.

    >>> _prefix({})
    'fastckpt.engine/0/'
    """
    return f"fastckpt.engine/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class TorchDistributedEngine(_MessageEngine):
    """One rank of an initialised ``torch.distributed`` process group: the engine of a job that ``torchrun``
    (or ``torch.multiprocessing``) starts, with the semantics of every engine here.

    Every rank calls ``torch.distributed.init_process_group`` first (any backend: gloo, nccl). The messages go
    through the process group's own key-value store (the one ``init_process_group`` made: the ``TCPStore`` of
    ``torchrun`` or of ``MASTER_ADDR``/``MASTER_PORT``), not through collectives: a collective of gloo or NCCL
    cannot stop waiting at a timeout of its own or say which ranks never came, and it would share the backend's
    stream with the training. A call is numbered; each rank sets its arrival key (with its value) and the
    call's root (rank 0 for barriers), polling the arrivals, either sets the result key once every rank has
    arrived or, when its time is up, a failure naming the ranks that did not. The others wait for that result
    (the timeout plus a grace, at most 10 s, then they raise naming the root). An abort sets a key that every
    waiting rank sees at its next poll. Keys are removed once read.

    >>> import torch.distributed as dist  # doctest: +SKIP
    >>> dist.init_process_group("gloo")  # doctest: +SKIP
    >>> engine = TorchDistributedEngine()  # doctest: +SKIP
    >>> engine.gather({"rank": engine.rank}, timeout=30)  # doctest: +SKIP
    [{'rank': 0}, {'rank': 1}]

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
        pause = _STORE_POLL_FIRST
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
            pause = min(pause * 2, _STORE_POLL_MAX)
        answer = self._get(f"{base}result")
        if self._store.add(f"{base}read", 1) == self.size - 1:  # the last reader removes the call's keys
            for key in (f"{base}result", f"{base}read"):
                self._store.delete_key(key)
        return _released(answer, kind, tag, timeout, self.size)

    def _as_root(self, base: str, call: list, value: Any, timeout: float, start: float) -> Any:
        tag, kind, root = call

        def arrivals(waiting):
            for r in [r for r in sorted(waiting) if self._has(f"{base}arrive/{r}")]:
                body = self._get(f"{base}arrive/{r}")
                self._store.delete_key(f"{base}arrive/{r}")
                yield r, body

        values, error = self._collect(call, value, timeout, start, arrivals,
                                      lambda: dict(self._shared[1]) if self._aborts() else {},
                                      (_STORE_POLL_FIRST, _STORE_POLL_MAX))
        if error is not None:
            self._store.set(f"{base}result", json.dumps({"ok": False, "failure": _failure(error)}))
            raise error
        if self.size > 1:
            self._store.set(f"{base}result", json.dumps({"ok": True, "value": values[root] if kind == "broadcast"
                                                         else None}))
        return _result(kind, root, values, self.size)


# -- choosing an engine ---------------------------------------------------------------------------------------

def default_engine(shard_index: int, shard_num: int) -> Engine:
    """The engine for rank ``shard_index`` of ``shard_num``: :class:`LocalEngine` for one, else
    :class:`TorchDistributedEngine` where ``torch.distributed`` is initialised (a
    ``torchrun`` job), else :class:`MPIEngine`.

    MPI is used where mpi4py imports and ``MPI.COMM_WORLD`` has ``shard_num`` ranks, this process being rank
    ``shard_index``; anything else is an :class:`EngineError` that says how to run the ranks.

    >>> default_engine(0, 1)
    <LocalEngine rank 0 of 1>
    """
    for name, value in (("shard_index", shard_index), ("shard_num", shard_num)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if shard_num < 1 or not 0 <= shard_index < shard_num:
        raise ValueError(f"need 0 <= shard_index < shard_num, got shard_index={shard_index}, shard_num={shard_num}")
    if shard_num == 1:
        return LocalEngine()
    dist = sys.modules.get("torch.distributed")  # torch imported and its group initialised: a torchrun job
    if dist is not None and dist.is_available() and dist.is_initialized():
        engine = TorchDistributedEngine()
        if (engine.size, engine.rank) != (shard_num, shard_index):
            raise EngineError(f"shard {shard_index} of {shard_num} needs an engine to coordinate the ranks, but this "
                              f"process is rank {engine.rank} of {engine.size} of torch.distributed's default "
                              "group; pass the group's rank and size (or engine=...)")
        return engine
    how = (f"Start the {shard_num} ranks with `mpiexec -n {shard_num} python your_script.py` (pip install "
           f"\"fastckpt[mpi]\" installs mpi4py and MPICH's mpiexec), or, for ranks that are threads of one "
           f"process, pass engine=ThreadEngine.group({shard_num})[i] to rank i's thread")
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:  # mpi4py missing, or its MPI library
        raise EngineError(f"shard {shard_index} of {shard_num} needs an engine to coordinate the ranks, and "
                          f"mpi4py is not usable here ({exc}). {how}.") from None
    world = MPI.COMM_WORLD
    if (world.Get_size(), world.Get_rank()) != (shard_num, shard_index):
        raise EngineError(f"shard {shard_index} of {shard_num} needs an engine to coordinate the ranks, but this "
                          f"process is rank {world.Get_rank()} of {world.Get_size()} of MPI.COMM_WORLD. {how}.")
    return MPIEngine()
