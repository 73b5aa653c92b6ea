"""Real write failures for tests: the kernel refuses writes past a file size (EFBIG), as a full disk would."""

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
