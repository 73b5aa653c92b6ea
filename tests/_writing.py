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


class StagedWrites:
    """What a save did with its files, recorded by :func:`record_staged_writes`: the names opened through
    ``staged_file`` (``opened``), the ``(source, destination)`` of every rename (``renamed``) and the names of
    the files and directories fsynced (``synced``), in order."""

    def __init__(self):
        self.opened, self.renamed, self.synced = [], [], []

    def renamed_into(self):
        """The directories the renames put their names into, in order."""
        import os

        return [os.path.dirname(os.path.abspath(dst)) for _src, dst in self.renamed]


def record_staged_writes(monkeypatch) -> StagedWrites:
    """Record, for the rest of the test, every ``staged_file`` open (also through ``write_file``,
    ``save_safetensors(staged=True)`` and ``save_npz(staged=True)``), every rename (``os.rename``,
    ``os.replace``, the commit's no-replace rename) and every ``fsync``. A file written inside a staging directory that is published whole is opened
    once under its own name and renamed never: only the publish renames."""
    import os
    from pathlib import Path

    import fastckpt.formats.npz as npz_module
    import fastckpt.formats.safetensors as safetensors_module
    import fastckpt.store.commit as commit_module

    seen = StagedWrites()
    real_open, real_fsync = commit_module.staged_file, os.fsync

    def staged_file(path, **kwargs):
        seen.opened.append(Path(path).name)
        return real_open(path, **kwargs)

    def fsync(fd):
        seen.synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def recording(real):
        def rename(src, dst, *args, **kwargs):
            seen.renamed.append((os.fspath(src), os.fspath(dst)))
            return real(src, dst, *args, **kwargs)
        return rename

    for module in (commit_module, safetensors_module, npz_module):
        monkeypatch.setattr(module, "staged_file", staged_file, raising=False)  # a writer that has it
    monkeypatch.setattr(commit_module, "rename_noreplace", recording(commit_module.rename_noreplace))
    monkeypatch.setattr(os, "rename", recording(os.rename))
    monkeypatch.setattr(os, "replace", recording(os.replace))
    monkeypatch.setattr(os, "fsync", fsync)
    return seen
