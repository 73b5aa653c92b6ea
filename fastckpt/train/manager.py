"""A directory of step-numbered training checkpoints: save, find the latest, restore, prune.

``CheckpointManager(directory)`` keeps checkpoints as ``directory/step-<N>``
(``N`` zero-padded to 8 digits, longer when needed), each in the format of
:mod:`fastckpt.train.checkpoint`.

What counts as a checkpoint
    A ``step-<N>`` directory whose ``manifest.json`` parses and whose listed
    files all exist with their recorded sizes. Directories appear only by an
    atomic rename once complete, so a save cut short (even by ``kill -9``)
    leaves nothing that :meth:`latest` returns; its temporary
    (``.step-<N>.@<host>~<ns>.<pid>.<hex>.partial``) is removed by the next
    manager or save once that process is gone (another host's only after
    :data:`fastckpt.store.commit.STALE_AFTER`, an hour). ``latest()`` does not hash files;
    ``restore_latest`` does (``verify=True``).

What it deletes
    Only checkpoints it wrote. Before writing ``step-<N>`` it records the name
    in ``directory/.fastckpt-manager.json`` (written atomically); retention
    considers only recorded checkpoints, so checkpoints copied in by hand or
    written by other tools are never deleted. Every change of the record is
    a read-modify-write under an exclusive ``flock`` of
    ``directory/.fastckpt-manager.lock``, so any number of managers (threads,
    processes, hosts on NFS) on one directory lose no name; a name leaves the
    record only when its checkpoint is deleted. A checkpoint is deleted by
    renaming it to a temporary name first and then removing it, so an
    interrupted deletion never leaves a half-deleted ``step-<N>``.

Retention (policies compose: a checkpoint survives if *any* policy keeps it)
    * the newest checkpoint is always kept;
    * ``max_to_keep=K``: the K newest are kept;
    * ``keep_best=(metric, mode)`` or ``(metric, mode, K)``: the K (default 1)
      best by ``metrics[metric]`` (``mode`` ``"min"`` or ``"max"``; ties go to
      the newer step) are kept; checkpoints without a finite numeric value of
      the metric are not kept by this policy;
    * ``keep_every_n_steps=N``: every checkpoint whose step is a multiple of N
      is kept;
    * with no policy at all, every checkpoint is kept.

Hashes
    Every file is hashed as it is written, with ``hash`` (``"blake3"``, the
    default, or ``"sha256"``); see :mod:`fastckpt.train.format`.

Two managers saving the same step: the first to commit wins, the other gets
:class:`FileExistsError` naming the step's directory (unless it passed
``overwrite=True``) and leaves nothing behind.

A URL (``CheckpointManager("s3://bucket/run", storage_options=...)``) gives a
:class:`RemoteCheckpointManager`: the same steps and
retention over prefixes whose manifest, uploaded last, commits them.

>>> import numpy as np, tempfile
>>> from fastckpt.train import TinyLM, SGD
>>> model = TinyLM(vocab=8, dim=4, hidden=8); opt = SGD(model.parameters(), lr=0.1)
>>> mgr = CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
>>> for step in (10, 20, 30):
...     _ = mgr.save(step, model, opt, metrics={"loss": 1.0 / step})
>>> mgr.all_steps(), mgr.latest().name
([20, 30], 'step-00000030')
>>> mgr.restore_latest(TinyLM(vocab=8, dim=4, hidden=8)).step
30
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator


from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.store.commit import atomic_write, remove_stale_partials_in, retire_directory
from fastckpt.formats import remote
from fastckpt.formats.remote import is_url
from fastckpt.store.manifest import parse_json
from fastckpt.store.names import parse_step, step_name
from fastckpt.train.asyncsave import AsyncCheckpointer, SaveHandle
from fastckpt.train.checkpoint import (
    CheckpointState,
    apply_checkpoint,
    check_hash,
    load_checkpoint,
    load_checkpoint_from_url,
    read_manifest,
    write_snapshot,
    write_snapshot_to_url,
)
from fastckpt.train.format import _MAX_MANIFEST_DEPTH, DEFAULT_HASH, MANIFEST_FILE
from fastckpt.train.snapshot import take_snapshot

__all__ = ["CheckpointManager", "RemoteCheckpointManager"]

RECORD_FILE = ".fastckpt-manager.json"
LOCK_FILE = ".fastckpt-manager.lock"
RECORD_FORMAT = "fastckpt.train.manager"
_log = logging.getLogger(__name__)



def _record_bytes(names: list[str]) -> bytes:
    """A manager's record file holding ``names``: what :func:`_parse_record` reads."""
    return json.dumps({"format": RECORD_FORMAT, "version": 1, "written": names}, indent=1).encode("utf-8")


def _parse_record(data: bytes, where: str, way_out: str) -> list[str]:
    """The names in a manager's record file (``{"format": RECORD_FORMAT, "written": [...]}``), read bounded
    (:func:`fastckpt.store.manifest.parse_json`); a FormatError naming ``where`` and ``way_out`` otherwise."""
    try:
        record = parse_json(data, where)
        names = record["written"]
        if record.get("format") != RECORD_FORMAT or not all(isinstance(n, str) for n in names):
            raise ValueError("unexpected content")
    except (ValueError, KeyError, TypeError) as e:  # FormatError is a ValueError
        raise FormatError(f"{where}: unreadable record of the checkpoints this manager wrote ({e}); {way_out}") from None
    return list(names)

class CheckpointManager:
    """Step-numbered checkpoints in one directory with composable retention; see the module docstring.

    >>> import tempfile
    >>> from fastckpt.train import TinyLM
    >>> model = TinyLM(vocab=8, dim=4, hidden=8)
    >>> with CheckpointManager(tempfile.mkdtemp(), keep_every_n_steps=2, fsync=False) as mgr:
    ...     for step in (1, 2, 3):
    ...         _ = mgr.save(step, model, blocking=step == 3)
    ...     mgr.all_steps(), mgr.latest_step(), mgr.path_for(3).name
    ([2, 3], 3, 'step-00000003')
    """

    def __new__(cls, directory: str | os.PathLike = "", *args, **kwargs):
        if cls is CheckpointManager and is_url(directory):  # step prefixes in object storage
            return RemoteCheckpointManager(directory, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
                 keep_best: tuple | None = None, keep_every_n_steps: int | None = None, fsync: bool = True,
                 hash: str = DEFAULT_HASH) -> None:
        if max_to_keep is not None and (type(max_to_keep) is not int or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        if keep_every_n_steps is not None and (type(keep_every_n_steps) is not int or keep_every_n_steps < 1):
            raise ValueError(f"keep_every_n_steps must be a positive int or None, got {keep_every_n_steps!r}")
        if keep_best is not None:
            if not isinstance(keep_best, tuple) or len(keep_best) not in (2, 3):
                raise ValueError(f"keep_best must be (metric, mode) or (metric, mode, count), got {keep_best!r}")
            metric, mode, *count = keep_best
            count = count[0] if count else 1
            if not isinstance(metric, str) or mode not in ("min", "max") or type(count) is not int or count < 1:
                raise ValueError(f"keep_best: need (str metric, 'min'|'max', positive count), got {keep_best!r}")
            keep_best = (metric, mode, count)
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.keep_best = keep_best
        self.keep_every_n_steps = keep_every_n_steps
        self.fsync = fsync
        self.hash = check_hash(hash)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._saver: AsyncCheckpointer | None = None
        self._lock = threading.RLock()  # the record and deletions; the background thread takes it too
        self._manifests: dict[str, tuple] = {}  # name -> (manifest stat key, manifest)
        self._sweep_partials()

    # -- naming and discovery ----------------------------------------------------------------------
    def path_for(self, step: int) -> Path:
        """The directory of ``step``'s checkpoint (whether or not it exists)."""
        return self.directory / step_name(step)

    def _sweep_partials(self) -> None:
        remove_stale_partials_in(self.directory)

    @contextlib.contextmanager
    def _record_lock(self) -> Iterator[None]:
        """This manager's threads, then every manager of the directory (an ``flock`` of :data:`LOCK_FILE`)."""
        with self._lock:
            try:
                import fcntl
            except ImportError:  # no fcntl (Windows): one manager per directory
                yield
                return
            fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # and with it the lock

    def _manifest(self, path: Path) -> dict | None:
        """The manifest of a complete checkpoint at ``path``, else None (sizes checked on every call)."""
        try:
            st = (path / "manifest.json").stat()
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._manifests.get(path.name)
        if cached is not None and cached[0] == key:
            manifest = cached[1]
        else:
            try:
                manifest = read_manifest(path)
            except (CheckpointNotFoundError, FormatError, OSError):
                return None
            self._manifests[path.name] = (key, manifest)
        for name, entry in manifest["files"].items():
            try:
                if (path / name).stat().st_size != entry["bytes"]:
                    return None
            except OSError:
                return None
        return manifest

    def _complete(self) -> dict[int, Path]:
        found: dict[int, Path] = {}
        for entry in self.directory.iterdir():
            step = parse_step(entry.name)
            if step is not None and entry.is_dir() and self._manifest(entry) is not None:
                # step-10 and step-00000010 are one step; the canonical name wins.
                if step not in found or entry.name == self.path_for(step).name:
                    found[step] = entry
        return found

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint in the directory, ascending."""
        return sorted(self._complete())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def latest(self) -> Path | None:
        """The newest complete checkpoint's directory (its URL for a manager of a URL), or None."""
        complete = self._complete()
        return complete[max(complete)] if complete else None

    # -- the record of what this manager wrote -----------------------------------------------------
    def _read_record(self) -> list[str]:
        path = self.directory / RECORD_FILE
        if not path.exists():
            return []
        return _parse_record(path.read_bytes(), str(path), "delete the file to start a new record (the manager "
                             "then deletes none of the existing checkpoints)")

    def _write_record(self, names: list[str]) -> None:
        body = _record_bytes(names)
        with atomic_write(self.directory / RECORD_FILE, fsync=self.fsync, overwrite=True) as f:
            f.write(body)

    def _record_intent(self, name: str) -> None:
        with self._record_lock():
            names = self._read_record()
            if name not in names:
                # Recorded before the write, so a checkpoint can never exist unrecorded and leak.
                self._write_record(names + [name])

    # -- retention -----------------------------------------------------------------------------------
    def _metric(self, manifest: dict) -> float | None:
        value = manifest.get("metrics", {}).get(self.keep_best[0])
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    def _to_delete(self, managed: dict[int, Path]) -> list[int]:
        steps = sorted(managed)
        if not steps or (self.max_to_keep is None and self.keep_best is None and self.keep_every_n_steps is None):
            return []
        keep = {steps[-1]}
        if self.max_to_keep is not None:
            keep.update(steps[-self.max_to_keep:])
        if self.keep_best is not None:
            _, mode, count = self.keep_best
            scored = []
            for s in steps:
                value = self._metric(self._manifest(managed[s]) or {})
                if value is not None:
                    scored.append((value if mode == "min" else -value, -s, s))
            keep.update(s for *_, s in sorted(scored)[:count])
        if self.keep_every_n_steps is not None:
            keep.update(s for s in steps if s % self.keep_every_n_steps == 0)
        return [s for s in steps if s not in keep]

    def _apply_retention(self) -> list[int]:
        with self._record_lock():
            names = self._read_record()
            recorded = set(names)
            complete = self._complete()
            managed = {s: p for s, p in complete.items() if p.name in recorded}
            doomed = self._to_delete(managed)
            for step in doomed:
                path = managed[step]
                # Renamed first: an interrupted removal leaves a temporary the next sweep deletes,
                # never a half-deleted step directory.
                retire_directory(path, fsync=False)
                self._manifests.pop(path.name, None)
            gone = {managed[s].name for s in doomed}
            # A recorded name whose directory does not exist yet may be another manager's save in flight:
            # it stays, or that checkpoint would never be pruned.
            kept = [n for n in names if n not in gone]
            if kept != names:
                self._write_record(kept)
            return doomed

    # -- saving --------------------------------------------------------------------------------------
    def save(self, step: int, model: Any, optimizer: Any = None, scheduler: Any = None, data_iter: Any = None,
             train_rng: Any = None, *, epoch: int = 0, metrics: dict | None = None, scaler: Any = None,
             blocking: bool = True, overwrite: bool = False, seed: int | None = None, config: Any = None,
             data_manifest: Any = None, progress=False) -> str | SaveHandle:
        """Save ``step``; returns the checkpoint's digest (``"blake3:<hex>"``), or (non-blocking) a :class:`SaveHandle`.

        Waits for a save still in flight first (raising its error, and saving
        nothing, if it failed and nobody has seen the error yet). Non-blocking saves return
        once every state is copied; the trainer may then change everything.
        Retention runs after each successful save. An existing ``step`` is an
        error unless ``overwrite=True``. ``progress`` (``True`` for a bar, or
        ``callback(done, total, item)``: :mod:`fastckpt.progress`) counts the
        arrays' bytes as they are written (from the background thread when
        ``blocking=False``).
        """
        path = self.path_for(step)
        if self._saver is not None:
            self._saver.wait()
        if path.exists() and not overwrite:
            raise FileExistsError(errno.EEXIST, f"step {step} is already saved; pass overwrite=True to replace it",
                                  str(path))
        self._sweep_partials()
        kwargs = dict(step=step, epoch=epoch, metrics=metrics, scaler=scaler, seed=seed, config=config,
                      data_manifest=data_manifest)
        if blocking:
            snap = take_snapshot(model, optimizer, scheduler, data_iter, train_rng, **kwargs)
            self._record_intent(path.name)
            digest = write_snapshot(snap, path, overwrite=overwrite, fsync=self.fsync, hash=self.hash,
                                    progress=progress)
            self._manifests.pop(path.name, None)
            self._apply_retention()
            return digest
        if self._saver is None:
            self._saver = AsyncCheckpointer(fsync=self.fsync, hash=self.hash)

        def before() -> None:
            self._record_intent(path.name)
            self._manifests.pop(path.name, None)

        return self._saver.save(path, model, optimizer, scheduler, data_iter, train_rng, overwrite=overwrite,
                                before_write=before, after_write=self._apply_retention, progress=progress, **kwargs)

    def wait(self) -> None:
        """Wait for a save in flight; raises its error if it failed (once)."""
        if self._saver is not None:
            self._saver.wait()

    # -- restoring -----------------------------------------------------------------------------------
    def restore(self, step: int, model: Any, optimizer: Any = None, scheduler: Any = None, data_iter: Any = None,
                train_rng: Any = None, *, scaler: Any = None, verify: bool = True,
                progress=False, strict: bool = True) -> CheckpointState:
        """Load ``step`` (hashes checked unless ``verify=False``) and apply it to the given objects, all or nothing.

        Slots take any training-state shape and ``strict=False`` restores a
        subset, as :func:`~fastckpt.train.checkpoint.apply_checkpoint` says;
        the returned state's ``report`` lists what was restored, missing and
        unexpected. ``progress`` (``True`` for a bar, or ``callback(done,
        total, item)``: :mod:`fastckpt.progress`) counts the arrays' bytes as
        they are read.
        """
        self.wait()
        complete = self._complete()
        if step not in complete:
            raise CheckpointNotFoundError(
                f"{self.directory}: no complete checkpoint for step {step} (complete steps: {sorted(complete)})"
            )
        state = load_checkpoint(complete[step], verify=verify, progress=progress)
        apply_checkpoint(state, model, optimizer, scheduler, data_iter, train_rng, scaler=scaler, strict=strict)
        return state

    def restore_latest(self, model: Any, optimizer: Any = None, scheduler: Any = None, data_iter: Any = None,
                       train_rng: Any = None, *, scaler: Any = None, verify: bool = True,
                       strict: bool = True) -> CheckpointState | None:
        """Restore the newest complete checkpoint into the objects (as :meth:`restore`); None (nothing changed)
        when there is none."""
        self.wait()
        step = self.latest_step()
        if step is None:
            return None
        return self.restore(step, model, optimizer, scheduler, data_iter, train_rng, scaler=scaler, verify=verify,
                            strict=strict)

    # -- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for a save in flight (raising its error) and free the async staging buffers."""
        if self._saver is not None:
            saver, self._saver = self._saver, None
            saver.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<CheckpointManager {str(self.directory)!r} steps={self.all_steps()}>"


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
        return remote.join(self.directory, step_name(step))

    def _complete(self) -> dict[int, str]:
        found: dict[int, str] = {}
        for name in remote.committed_prefixes(self.directory, MANIFEST_FILE, self.storage_options):
            step = parse_step(name)
            if step is not None:
                if step not in found or name == step_name(step):
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
        return _parse_record(fs.cat_file(key), f"{self.directory}/{RECORD_FILE}", "delete it to start a new record")

    def _write_record(self, names: list[str]) -> None:
        fs, path = self._fs()
        body = _record_bytes(names)
        fs.pipe_file(f"{path.rstrip('/')}/{RECORD_FILE}", body)  # one PUT: atomic on an object store

    def _manifest(self, url: str) -> dict:
        """The manifest at ``url``; ``{}`` (no metrics) only when it is missing or not JSON. Any other failure to
        read it (a dropped connection) raises, so that retention never ranks a checkpoint it could not read."""
        fs, path = remote.filesystem(url, self.storage_options)
        try:
            return parse_json(fs.cat_file(f"{path.rstrip('/')}/{MANIFEST_FILE}"), url, max_depth=_MAX_MANIFEST_DEPTH)
        except (FileNotFoundError, ValueError):  # FormatError is a ValueError
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
                                  select=lambda name: parse_step(name) is not None)
        snap = take_snapshot(model, optimizer, scheduler, data_iter, train_rng, step=step, epoch=epoch,
                             metrics=metrics, scaler=scaler, seed=seed, config=config, data_manifest=data_manifest)
        names = self._read_record()
        name = url.rsplit("/", 1)[1]
        if name not in names:
            self._write_record(names + [name])  # before the write, so no checkpoint is ever unrecorded
        digest = write_snapshot_to_url(snap, url, overwrite=True, hash=self.hash, progress=progress,
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
                train_rng: Any = None, *, scaler: Any = None, verify: bool = True, progress=False,
                strict: bool = True):
        """Load ``step`` and apply it to the given objects (see :meth:`fastckpt.train.CheckpointManager.restore`)."""
        complete = self._complete()
        if step not in complete:
            raise CheckpointNotFoundError(
                f"{self.directory}: no committed checkpoint for step {step} (committed steps: {sorted(complete)})")
        state = load_checkpoint_from_url(complete[step], verify=verify, progress=progress,
                                storage_options=self.storage_options)
        apply_checkpoint(state, model, optimizer, scheduler, data_iter, train_rng, scaler=scaler, strict=strict)
        return state

    def close(self) -> None:
        """Nothing to release; kept for the local manager's interface."""

    def __repr__(self) -> str:
        return f"<CheckpointManager {self.directory!r} steps={self.all_steps()}>"
