"""Training checkpoints at a URL (``s3://bucket/run/step-10``, any fsspec URL): save, load, and the manager.

A checkpoint is built by the local writer in a temporary directory on this machine, byte for byte what
:func:`~fastckpt.train.checkpoint.save_checkpoint` writes locally, then uploaded by
:func:`fastckpt.formats.remote.put_directory`: the tensor files and ``extra.json`` in parallel, then
``manifest.json`` alone, last. The manifest is the commit marker: a prefix without one is an uncommitted save
(cut short by a crash or a dropped connection); :func:`load_checkpoint` refuses it,
:class:`RemoteCheckpointManager` does not count it, and its next save removes it. Loading downloads the
committed prefix into a temporary directory (files and 16 MiB ranges in parallel) and reads it there, hashes
checked as for a local checkpoint.

``fastckpt.train.save_checkpoint``, ``load_checkpoint`` and ``CheckpointManager`` come here for a URL.

>>> from fastckpt.train import TinyLM, CheckpointManager
>>> model = TinyLM(vocab=8, dim=4, hidden=8)
>>> mgr = CheckpointManager("memory://doc/train-run", max_to_keep=2)
>>> for step in (10, 20, 30):
...     _ = mgr.save(step, model)
>>> mgr.all_steps(), mgr.latest()
([20, 30], 'memory://doc/train-run/step-00000030')
>>> mgr.restore_latest(TinyLM(vocab=8, dim=4, hidden=8)).step
30
"""

from __future__ import annotations

import errno
import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.formats import remote
from fastckpt.train.format import DEFAULT_HASH, MANIFEST_FILE
from fastckpt.train.manager import CheckpointManager

__all__ = ["write_snapshot", "load_checkpoint", "RemoteCheckpointManager"]

_log = logging.getLogger(__name__)

RECORD_FILE = ".fastckpt-manager.json"
RECORD_FORMAT = "fastckpt.train.manager"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def write_snapshot(snap, url: str, *, overwrite: bool, hash: str = DEFAULT_HASH, progress=False,
                   storage_options: dict | None = None) -> str:
    """Write ``snap`` as a checkpoint at the prefix ``url``: built locally, uploaded, the manifest last.

    >>> from fastckpt.train import TinyLM, save_checkpoint, load_checkpoint
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, "memory://doc/c", step=3)
    >>> load_checkpoint("memory://doc/c").step
    3
    """
    from fastckpt.train import checkpoint

    if not overwrite and remote.committed(url, MANIFEST_FILE, storage_options):
        raise FileExistsError(errno.EEXIST, "a checkpoint already exists here; pass overwrite=True to replace it", url)
    with tempfile.TemporaryDirectory(prefix="fastckpt-up-") as tmp:
        local = Path(tmp) / "checkpoint"
        digest = checkpoint.write_snapshot(snap, local, overwrite=False, fsync=False, hash=hash, progress=progress)
        remote.put_directory(local, url, MANIFEST_FILE, storage_options)
    return digest


def load_checkpoint(url: str, *, verify: bool = True, progress=False, storage_options: dict | None = None):
    """Download the committed checkpoint at ``url`` and read it as :func:`fastckpt.train.load_checkpoint` does.

    The state's ``path`` is ``url``. An uncommitted or missing prefix is a
    :class:`~fastckpt.errors.CheckpointNotFoundError`.

    >>> load_checkpoint("memory://doc/no-such-checkpoint")
    Traceback (most recent call last):
    ...
    fastckpt.errors.CheckpointNotFoundError: memory://doc/no-such-checkpoint: no committed checkpoint (nothing there); expected memory://doc/no-such-checkpoint/manifest.json
    """
    from fastckpt.train import checkpoint

    with remote.local_copy(url, MANIFEST_FILE, storage_options) as local:
        state = checkpoint.load_checkpoint(local, verify=verify, progress=progress)
    state.path = url
    return state


class RemoteCheckpointManager:
    """:class:`~fastckpt.train.CheckpointManager` for a URL: ``step-<N>`` prefixes under it, the same retention.

    ``CheckpointManager(url, ...)`` returns one. Saves block (``blocking=False`` is refused: the upload is the
    slow part, and a second save must not start before the first has committed). ``latest()`` and
    ``path_for()`` are URLs. Only committed prefixes (with their ``manifest.json``) count; each save first
    removes the uncommitted ones (saves that never finished), so one manager may write under ``url`` at a time.
    Retention deletes only checkpoints recorded in ``<url>/.fastckpt-manager.json`` (as the local manager
    does); a deleted checkpoint loses its manifest first, so an interrupted deletion leaves an uncommitted
    prefix, never a checkpoint with missing files.

    >>> mgr = RemoteCheckpointManager("memory://doc/empty-run")
    >>> mgr.all_steps(), mgr.latest(), mgr.path_for(7)
    ([], None, 'memory://doc/empty-run/step-00000007')
    """

    def __init__(self, url: str, *, max_to_keep: int | None = None, keep_best: tuple | None = None,
                 keep_every_n_steps: int | None = None, fsync: bool = True, hash: str = DEFAULT_HASH,
                 storage_options: dict | None = None) -> None:
        from fastckpt.train.checkpoint import check_hash

        # The local manager checks and normalises the retention options; its directory is not used.
        with tempfile.TemporaryDirectory(prefix="fastckpt-options-") as tmp:
            checked = CheckpointManager(tmp, max_to_keep=max_to_keep, keep_best=keep_best,
                                        keep_every_n_steps=keep_every_n_steps, fsync=False, hash=hash)
        self.directory = url.rstrip("/")
        self.max_to_keep, self.keep_best, self.keep_every_n_steps = (checked.max_to_keep, checked.keep_best,
                                                                     checked.keep_every_n_steps)
        self.fsync = fsync  # uploads are durable once acknowledged; kept for the same signature
        self.hash = check_hash(hash)
        self.storage_options = storage_options

    # -- naming and discovery ----------------------------------------------------------------------
    def path_for(self, step: int) -> str:
        """The URL of ``step``'s checkpoint (whether or not it exists)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return remote.join(self.directory, f"step-{int(step):08d}")

    def _complete(self) -> dict[int, str]:
        found: dict[int, str] = {}
        for name in remote.committed_prefixes(self.directory, MANIFEST_FILE, self.storage_options):
            m = _STEP_DIR.match(name)
            if m:
                step = int(m.group(1))
                if step not in found or name == f"step-{step:08d}":
                    found[step] = remote.join(self.directory, name)
        return found

    # The local manager's discovery, retention policy and lifetime, over this class's _complete, _manifest,
    # wait and restore: the same steps and the same choices; only the storage differs.
    all_steps = CheckpointManager.all_steps
    latest_step = CheckpointManager.latest_step
    latest = CheckpointManager.latest
    _metric = CheckpointManager._metric
    _to_delete = CheckpointManager._to_delete
    restore_latest = CheckpointManager.restore_latest
    __enter__ = CheckpointManager.__enter__
    __exit__ = CheckpointManager.__exit__

    # -- the record and retention -------------------------------------------------------------------
    def _fs(self):
        return remote.filesystem(self.directory, self.storage_options)

    def _read_record(self) -> list[str]:
        fs, path = self._fs()
        key = f"{path.rstrip('/')}/{RECORD_FILE}"
        fs.invalidate_cache(path)
        if not fs.isfile(key):
            return []
        try:
            record = json.loads(fs.cat_file(key).decode("utf-8"))
            names = record["written"]
            if record.get("format") != RECORD_FORMAT or not all(isinstance(n, str) for n in names):
                raise ValueError("unexpected content")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise FormatError(f"{self.directory}/{RECORD_FILE}: unreadable record of the checkpoints this manager "
                              f"wrote ({e}); delete it to start a new record") from None
        return list(names)

    def _write_record(self, names: list[str]) -> None:
        fs, path = self._fs()
        body = json.dumps({"format": RECORD_FORMAT, "version": 1, "written": names}, indent=1).encode("utf-8")
        fs.pipe_file(f"{path.rstrip('/')}/{RECORD_FILE}", body)  # one PUT: atomic on an object store

    def _manifest(self, url: str) -> dict:
        """The manifest at ``url``; ``{}`` (no metrics) only when it is missing or not JSON. Any other failure to
        read it (a dropped connection) raises, so that retention never ranks a checkpoint it could not read."""
        fs, path = remote.filesystem(url, self.storage_options)
        try:
            return json.loads(fs.cat_file(f"{path.rstrip('/')}/{MANIFEST_FILE}").decode("utf-8"))
        except (FileNotFoundError, ValueError):
            return {}

    def _apply_retention(self) -> list[int]:
        names = self._read_record()
        recorded = set(names)
        managed = {s: u for s, u in self._complete().items() if u.rsplit("/", 1)[1] in recorded}
        doomed = self._to_delete(managed)
        fs, _ = self._fs()
        for step in doomed:  # the manifest first (uncommitted from then on), then the checkpoint's files only
            remote.clear(managed[step], MANIFEST_FILE, self.storage_options)
        gone = {managed[s].rsplit("/", 1)[1] for s in doomed}
        kept = [n for n in names if n not in gone]
        if kept != names:
            self._write_record(kept)
        return doomed

    # -- saving and restoring ------------------------------------------------------------------------
    def save(self, step: int, model: Any, optimizer: Any = None, scheduler: Any = None, data_iter: Any = None,
             train_rng: Any = None, *, epoch: int = 0, metrics: dict | None = None, scaler: Any = None,
             blocking: bool = True, overwrite: bool = False, seed: int | None = None, config: Any = None,
             data_manifest: Any = None, progress=False) -> str:
        """Save ``step`` (see :meth:`fastckpt.train.CheckpointManager.save`); returns the digest."""
        from fastckpt.train.snapshot import take_snapshot

        if not blocking:
            raise ValueError(f"{self.directory}: blocking=False is for local directories; a save to a URL blocks "
                             "until its manifest is uploaded")
        url = self.path_for(step)
        if not overwrite and remote.committed(url, MANIFEST_FILE, self.storage_options):
            raise FileExistsError(errno.EEXIST, f"step {step} is already saved; pass overwrite=True to replace it",
                                  url)
        remote.remove_uncommitted(self.directory, MANIFEST_FILE, self.storage_options,
                                  select=lambda name: _STEP_DIR.match(name) is not None)
        snap = take_snapshot(model, optimizer, scheduler, data_iter, train_rng, step=step, epoch=epoch,
                             metrics=metrics, scaler=scaler, seed=seed, config=config, data_manifest=data_manifest)
        names = self._read_record()
        name = url.rsplit("/", 1)[1]
        if name not in names:
            self._write_record(names + [name])  # before the write, so no checkpoint is ever unrecorded
        digest = write_snapshot(snap, url, overwrite=True, hash=self.hash, progress=progress,
                                storage_options=self.storage_options)
        try:
            self._apply_retention()
        except OSError as e:  # the step is committed; a store that failed to answer must not delete by guesswork
            _log.warning("%s: step %d saved; retention skipped this time (the store failed: %s)", self.directory,
                         step, e)
        return digest

    def wait(self) -> None:
        """Nothing is ever in flight (saves to a URL block); kept for the local manager's interface."""

    def restore(self, step: int, model: Any, optimizer: Any = None, scheduler: Any = None, data_iter: Any = None,
                train_rng: Any = None, *, scaler: Any = None, verify: bool = True, progress=False):
        """Load ``step`` and apply it to the given objects (see :meth:`fastckpt.train.CheckpointManager.restore`)."""
        from fastckpt.train.checkpoint import apply_checkpoint

        complete = self._complete()
        if step not in complete:
            raise CheckpointNotFoundError(
                f"{self.directory}: no committed checkpoint for step {step} (committed steps: {sorted(complete)})")
        state = load_checkpoint(complete[step], verify=verify, progress=progress,
                                storage_options=self.storage_options)
        apply_checkpoint(state, model, optimizer, scheduler, data_iter, train_rng, scaler=scaler)
        return state

    def close(self) -> None:
        """Nothing to release; kept for the local manager's interface."""

    def __repr__(self) -> str:
        return f"<CheckpointManager {self.directory!r} steps={self.all_steps()}>"
