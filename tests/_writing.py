"""Helpers for tests of writers: real write failures from the kernel, and callers that reuse one buffer."""

import contextlib
import resource
import signal


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Within the block, this process may not write past byte ``nbytes`` of any file (``RLIMIT_FSIZE``).

    A ``write``/``writev`` that crosses the limit writes up to it and returns a
    short count; the next one fails with ``EFBIG``. ``SIGXFSZ``, which would
    kill the process, is ignored meanwhile.
    """
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


class RefilledBuffer:
    """An array-like whose conversion fills one shared buffer with ``value`` and returns that buffer.

    As a device download into a reused staging buffer does: a writer that keeps
    the returned array and writes it later saves the last value under every name.
    """

    def __init__(self, shared, value):
        self.shared, self.value = shared, value

    def __array__(self, dtype=None, copy=None):
        self.shared[:] = self.value
        return self.shared


class StateModel:
    """A model whose state is the dict it was given: ``state_dict()`` returns it, ``load_state_dict`` replaces it."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state
