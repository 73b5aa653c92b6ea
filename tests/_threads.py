"""Helpers for tests that run one function on many threads at once."""

import threading


def run_in_threads(target, count: int, timeout: float | None = None) -> list:
    """Run ``target(k)`` for ``k`` in ``range(count)``, each on a thread of its own, all started before any is
    joined; return the exceptions they raised (an empty list when none did), in thread order. ``timeout``: seconds
    each join waits at most; a thread still running then fails the test (``AssertionError`` naming it).

    >>> run_in_threads(lambda k: 1 / k, 3)
    [ZeroDivisionError('division by zero')]
    """
    raised: list = [None] * count

    def run(k: int) -> None:
        try:
            target(k)
        except BaseException as exc:  # reported to the caller
            raised[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    running = [k for k, t in enumerate(threads) if t.is_alive()]
    assert not running, f"threads {running} of {count} still running after {timeout} s"
    return [exc for exc in raised if exc is not None]
