"""Training-state checkpoints that resume byte for byte: save, load, apply, verify (the format: ``train.format``).

A checkpoint holds the five state machines of a training run — the model
weights, the optimizer, the learning-rate scheduler, the data iterator and the
training RNG — plus, optionally, a dynamic loss scaler, so that a run restored
from it continues with exactly the losses the uninterrupted run would have
produced.

The directory format (byte-level specification, tree encoding, manifest) is
in :mod:`fastckpt.train.format`; how the state is taken from the objects, in
:mod:`fastckpt.train.snapshot`.

Writing
=======
The directory is built under a temporary name in the same parent
(``.<name>.<pid>.<random>.partial``) and renamed into place only when every
file, manifest last, is written and fsynced (each file is itself written to a
temporary name and renamed). Readers therefore see either no checkpoint or a
complete one, never a torn one. Leftovers of a process that died while saving
are removed by the next save into the same parent (only once that process is
gone). Replacing an existing checkpoint directory swaps it out after the new
one is complete; if that final swap fails, the old checkpoint is put back. A
directory that exists and is not a checkpoint (non-empty, no
``manifest.json``) is never replaced.

Example
=======
>>> import numpy as np, tempfile, os
>>> from fastckpt.train import TinyLM, AdamW, StepLR, ShuffledTokenBatches
>>> model = TinyLM(vocab=16, dim=8, hidden=16); opt = AdamW(model.parameters(), lr=1e-2)
>>> sched = StepLR(opt, step_size=10); rng = np.random.default_rng(0)
>>> data = ShuffledTokenBatches(np.arange(400) % 16, batch_size=4, seq_len=8, seed=1)
>>> out = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> digest = save_checkpoint(model, opt, sched, data, rng, out, step=0, epoch=0, extra_metrics={"loss": 2.5})
>>> state = load_checkpoint(out)
>>> w = state.model_weights
>>> state.manifest["weights_digest"] == digest, w["lm_head.weight"] is w["embed.weight"]
(True, True)
>>> digest.startswith("blake3:")
True
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import os
import reprlib
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.store.commit import Commit, fsync_file, overwrite_flag, write_file
from fastckpt.formats.hashing import HASH_ALGORITHMS, new_hasher
from fastckpt.formats import remote as remote_storage
from fastckpt.formats.remote import is_url
from fastckpt.progress import part_of_a_save, progress_from
from fastckpt.train.format import (
    ALIGNMENT,
    DEFAULT_HASH,
    EXTRA_FILE,
    MANIFEST_FILE,
    OPTIM_FILE,
    SCHEMA_VERSION,
    WEIGHTS_FILE,
    _check_file,
    _check_view,
    _integrity_error,
    _table_metadata,
    _TensorSource,
    _walk_refs,
    decode_tree,
    file_hash,
    read_extra,
    read_manifest,
    weights_digest,
)
from fastckpt.train.snapshot import RestoreReport, Snapshot, apply_restore, plan_restore, take_snapshot

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointState",
    "save_checkpoint",
    "load_checkpoint",
    "apply_checkpoint",
    "RestoreReport",
    "read_manifest",
    "verify_checkpoint",
    "weights_digest",
]

_log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def _existing_is_replaceable(out: Path) -> bool:
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    names = {p.name for p in out.iterdir()}
    return not names or MANIFEST_FILE in names


def check_hash(hash: str) -> str:
    """``hash`` when it names a file hash a manifest may use (``"blake3"``, ``"sha256"``), else ValueError."""
    if hash not in HASH_ALGORITHMS:
        raise ValueError(f"hash={hash!r}: training checkpoints hash their files with one of "
                         f"{', '.join(repr(a) for a in HASH_ALGORITHMS)} ({DEFAULT_HASH!r} is the default)")
    return hash


def write_snapshot(snap: Snapshot, out_dir: str | os.PathLike, *, overwrite: bool, fsync: bool = True,
                   hash: str = DEFAULT_HASH, progress=False) -> str:
    """Write ``snap`` as a checkpoint directory at ``out_dir`` (atomically); returns the weights' ``"<hash>:<hex>"``.

    With ``overwrite=False`` an existing ``out_dir`` is refused, at the start
    and again by the commit's no-replace rename (:mod:`fastckpt.store.commit`),
    so a checkpoint another writer commits meanwhile is never replaced: this
    save raises :class:`FileExistsError` naming ``out_dir`` and leaves nothing.
    """
    check_hash(hash)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(errno.EEXIST, "a checkpoint already exists here; pass overwrite=True to replace it",
                              str(out))
    if not _existing_is_replaceable(out):
        raise FileExistsError(errno.EEXIST, f"exists and is not a fastckpt checkpoint (no {MANIFEST_FILE}); refusing "
                              "to replace it — choose an empty or new directory", str(out))
    started = time.perf_counter()
    tables = [t for t in (snap.weights, snap.optim) if t is not None]
    nbytes = sum(a.nbytes for t in tables for a in t.tensors.values())
    with progress_from(progress, nbytes, "save checkpoint") as report:
        digest = _write_directory(snap, out, fsync, hash, report, overwrite)
    _log.info("saved checkpoint %s: step %s, %d tensors, %d bytes in %.3f s", out, snap.manifest.get("step"),
              sum(len(t.tensors) for t in tables), nbytes, time.perf_counter() - started)
    return digest


def _write_directory(snap: Snapshot, out: Path, fsync: bool, hash: str, report=False, overwrite: bool = False) -> str:
    from fastckpt.formats.safetensors import save_safetensors

    with concurrent.futures.ThreadPoolExecutor(max_workers=3, thread_name_prefix="fastckpt-save") as pool, \
            Commit(out, overwrite=overwrite, fsync=fsync, sync_files=False) as commit:
        # the files are fsynced here, in the background; the commit syncs the directories and publishes
        tmp = commit.staging
        files: dict[str, dict] = {}
        syncs: list[concurrent.futures.Future] = []

        def finished(name: str, hasher) -> None:
            # The hash was taken from the bytes as they were written; fsync in the background
            # while the next file is written.
            files[name] = {hash: hasher.hexdigest(), "bytes": (tmp / name).stat().st_size}
            if fsync:
                syncs.append(pool.submit(fsync_file, tmp / name))

        for name, table, tree, fmt in ((WEIGHTS_FILE, snap.weights, snap.weights_tree, "fastckpt.train.weights"),
                                       (OPTIM_FILE, snap.optim, snap.optim_tree, "fastckpt.train.optim")):
            if table is None:
                continue
            hasher = new_hasher(hash)
            with part_of_a_save():  # this save logs its own line
                # a file of the staging directory (this save's alone): written in place, no rename of its own
                save_safetensors(tmp / name, table.tensors, _table_metadata(table, tree, fmt), alignment=ALIGNMENT,
                                 fsync=False, hasher=hasher, progress=report, staged=True)
            finished(name, hasher)
        hasher = new_hasher(hash)
        hasher.update(snap.extra_json)
        write_file(tmp / EXTRA_FILE, snap.extra_json, fsync=False)
        finished(EXTRA_FILE, hasher)
        for fut in syncs:
            fut.result()
        digest = f"{hash}:{files[WEIGHTS_FILE][hash]}"
        manifest = dict(snap.manifest, weights_digest=digest, files=files)
        # The manifest goes last: its presence marks the directory complete. write_file fsyncs it when fsync
        # is on; the publish fsyncs the staging directory before its rename (publish_directory).
        write_file(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1, ensure_ascii=False,
                                                   allow_nan=False).encode("utf-8"), fsync=fsync)
    return digest


def save_checkpoint(model: Any, optimizer: Any, scheduler: Any, data_iter: Any, train_rng: Any,
                    out_dir: str | os.PathLike, step: int, epoch: int = 0,
                    extra_metrics: Mapping[str, Any] | None = None, *, scaler: Any = None,
                    seed: int | None = None, config: Any = None, data_manifest: Any = None,
                    overwrite: bool = False, fsync: bool = True, hash: str = DEFAULT_HASH, progress=False,
                    storage_options: dict | None = None) -> str:
    """Save the whole training state to the directory ``out_dir``; returns the checkpoint's digest.

    The digest is ``"<hash>:<hex>"``, the hash of ``weights.safetensors``
    (``"blake3:9c1e..."``), as the manifest's ``weights_digest`` records it.
    Every file is hashed with ``hash`` (``"blake3"``, the default, or
    ``"sha256"``) from its bytes as they are written, never read back.

    Any of ``optimizer``, ``scheduler``, ``data_iter``, ``train_rng`` and
    ``scaler`` may be None. Objects follow the ``state_dict()`` /
    ``load_state_dict()`` protocol (a ``numpy.random.Generator`` is saved
    through ``bit_generator.state``); arrays may be numpy arrays, fastckpt
    Tensors (``to_host()``), PyTorch tensors or anything with DLPack,
    ``__array__`` or the buffer protocol (:mod:`fastckpt.arrays`). ``config`` and ``data_manifest`` (JSON-like) are hashed into
    the manifest. An existing checkpoint at ``out_dir`` is replaced, after the
    new one is complete, only with ``overwrite=True`` (docs/overwrite.md); a directory that
    is not a checkpoint is never replaced, nor one that another writer
    commits while this one writes unless ``overwrite=True``. ``progress`` (``True`` for a bar, or
    ``callback(done, total, item)``: :mod:`fastckpt.progress`) counts the
    arrays' bytes as they are written. ``out_dir`` may be a URL
    (``s3://bucket/run/step-10``, with ``storage_options``): the same files,
    uploaded with the manifest last (:mod:`fastckpt.train.remote`).

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.train import TinyLM, SGD
    >>> m = TinyLM(vocab=8, dim=4, hidden=8); out = os.path.join(tempfile.mkdtemp(), "c")
    >>> digest = save_checkpoint(m, SGD(m.parameters(), lr=0.1), None, None, None, out, step=1)
    >>> digest[:7], len(digest)
    ('blake3:', 71)
    >>> save_checkpoint(m, None, None, None, None, out, step=1, hash="sha256", overwrite=True)[:7]
    'sha256:'
    """
    check_hash(hash)
    overwrite = overwrite_flag(overwrite)
    snap = take_snapshot(model, optimizer, scheduler, data_iter, train_rng, step=step, epoch=epoch,
                         metrics=extra_metrics, scaler=scaler, seed=seed, config=config, data_manifest=data_manifest)
    if is_url(out_dir):  # object storage and remote filesystems: built locally, uploaded, the manifest last
        return write_snapshot_to_url(snap, out_dir, overwrite=overwrite, hash=hash, progress=progress,
                                     storage_options=storage_options)
    return write_snapshot(snap, out_dir, overwrite=overwrite, fsync=fsync, hash=hash, progress=progress)


# -- at a URL (fastckpt.train.remote says how) -------------------------------------------------
def write_snapshot_to_url(snap, url: str, *, overwrite: bool, hash: str = DEFAULT_HASH, progress=False,
                   storage_options: dict | None = None) -> str:
    """Write ``snap`` as a checkpoint at the prefix ``url``: built locally, uploaded, the manifest last.

    >>> from fastckpt.train import TinyLM
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, "memory://doc/c", step=3)
    >>> load_checkpoint_from_url("memory://doc/c").step
    3
    """
    if not overwrite and remote_storage.committed(url, MANIFEST_FILE, storage_options):
        raise FileExistsError(errno.EEXIST, "a checkpoint already exists here; pass overwrite=True to replace it", url)
    with tempfile.TemporaryDirectory(prefix="fastckpt-up-") as tmp:
        local = Path(tmp) / "checkpoint"
        digest = write_snapshot(snap, local, overwrite=False, fsync=False, hash=hash, progress=progress)
        remote_storage.put_directory(local, url, MANIFEST_FILE, storage_options)
    return digest


def load_checkpoint_from_url(url: str, *, verify: bool = True, progress=False, storage_options: dict | None = None):
    """Download the committed checkpoint at ``url`` and read it as :func:`fastckpt.train.load_checkpoint` does.

    The state's ``path`` is ``url``. An uncommitted or missing prefix is a
    :class:`~fastckpt.errors.CheckpointNotFoundError`.

    >>> load_checkpoint_from_url("memory://doc/no-such-checkpoint")
    Traceback (most recent call last):
    ...
    fastckpt.errors.CheckpointNotFoundError: memory://doc/no-such-checkpoint: no committed checkpoint (nothing there); expected memory://doc/no-such-checkpoint/manifest.json
    """
    with remote_storage.local_copy(url, MANIFEST_FILE, storage_options) as local:
        state = load_checkpoint(local, verify=verify, progress=progress)
    state.path = url
    return state



# ---------------------------------------------------------------------------------------------
# Reading
_STATE_FIELDS = ("model_weights", "optim_state", "scheduler_state", "data_iter_state", "train_rng_state",
                 "scaler_state")


def _arrays_in(value: Any) -> tuple[int, int]:
    """(arrays, bytes) anywhere inside ``value``'s dicts, lists and tuples; an array tied under two names counts
    once."""
    seen: set[int] = set()
    count = nbytes = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "nbytes") and hasattr(item, "dtype") and id(item) not in seen:
            seen.add(id(item))
            count += 1
            nbytes += int(item.nbytes)
    return count, nbytes


# ---------------------------------------------------------------------------------------------
@dataclass(repr=False)
class CheckpointState:
    """Everything :func:`load_checkpoint` read, ready for :func:`apply_checkpoint`.

    Arrays are private writable copies; tied weights are one array object under
    each of their names.

    >>> CheckpointState({}, None, None, None, None, {}).scaler_state is None
    True
    """

    model_weights: Any
    optim_state: Any
    scheduler_state: Any
    data_iter_state: Any
    train_rng_state: Any
    manifest: dict[str, Any]
    scaler_state: Any = None
    path: Path | None = field(default=None, compare=False)
    #: What the last :func:`apply_checkpoint` of this state restored, and what was missing or unexpected.
    report: RestoreReport | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        """Where the state came from and how much it holds, never the arrays (a model's repr ran to 91,142
        characters).

        >>> import numpy as np
        >>> CheckpointState({"w": np.zeros((2, 3), np.float32)}, {"m": [np.zeros(6, np.float32)]}, None, None, None,
        ...                 {"step": 3, "epoch": 0})
        CheckpointState(step=3, epoch=0, path=None, 2 arrays of 48 bytes: model_weights 1, optim_state 1)
        """
        counts = {name: _arrays_in(getattr(self, name)) for name in _STATE_FIELDS}
        total = sum(n for n, _ in counts.values())
        nbytes = sum(b for _, b in counts.values())
        held = ", ".join(f"{name} {n}" for name, (n, _) in counts.items() if n)
        metrics = reprlib.repr(self.metrics) if self.manifest.get("metrics") else None
        return (f"CheckpointState(step={self.manifest.get('step')!r}, epoch={self.manifest.get('epoch')!r}, "
                f"path={None if self.path is None else str(self.path)!r}, {total} arrays of {nbytes:,} bytes"
                + (f": {held}" if held else "") + (f", metrics={metrics}" if metrics else "") + ")")

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def epoch(self) -> int:
        return int(self.manifest["epoch"])

    @property
    def metrics(self) -> dict[str, Any]:
        return decode_tree(self.manifest.get("metrics", {}), None, "manifest metrics")


def load_checkpoint(in_dir: str | os.PathLike, *, verify: bool = True, progress=False,
                    storage_options: dict | None = None) -> CheckpointState:
    """Read a checkpoint directory: manifest first, then every file, hashes checked unless ``verify=False``.

    Raises :class:`~fastckpt.errors.CheckpointNotFoundError` for a missing or
    incomplete checkpoint, :class:`~fastckpt.errors.FormatError` for a bad
    manifest or file, :class:`~fastckpt.errors.IntegrityError` (naming the
    file, the expected and the actual hash) when a file changed. ``progress``
    (``True`` for a bar, or ``callback(done, total, item)``:
    :mod:`fastckpt.progress`) counts the arrays' bytes as they are copied out.
    A URL (with ``storage_options``) is downloaded first, in parallel
    (:mod:`fastckpt.train.remote`); an uncommitted one (no manifest) is not found.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.train import TinyLM
    >>> out = os.path.join(tempfile.mkdtemp(), "c")
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=3)
    >>> load_checkpoint(out).step
    3
    """
    if is_url(in_dir):  # object storage and remote filesystems: downloaded, then read here
        return load_checkpoint_from_url(in_dir, verify=verify, progress=progress, storage_options=storage_options)
    started = time.perf_counter()
    d = Path(in_dir)
    manifest = read_manifest(d)
    files = manifest["files"]
    tables = {WEIGHTS_FILE: "fastckpt.train.weights", OPTIM_FILE: "fastckpt.train.optim"}
    report = None
    decoded: dict[str, Any] = {}
    extra: Any = None
    read_error: BaseException | None = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(files)), thread_name_prefix="fastckpt-verify") as pool:
        # Each safetensors file is mapped once: a background thread hashes the mapping while this
        # thread copies the tensors out of it, so verification costs one extra pass over memory
        # that is already resident, not a second read of the file.
        checks = []
        sources = {}
        for name, entry in files.items():
            if name in tables and read_error is None:
                try:
                    sources[name] = _TensorSource(d / name, tables[name])
                except (FormatError, OSError) as e:
                    read_error = e
                else:
                    # SAFETY: the view is taken here, before the source is closed below, and keeps
                    # the mapping alive until the hashing thread drops it; a view requested after
                    # close() would raise instead.
                    mapped = sources[name].file.mapped
                    checks.append(pool.submit(_check_view, sources[name].path, mapped.view(0, mapped.size), entry,
                                              verify, mapped.guard("it for its hash")))
                    continue
            checks.append(pool.submit(_check_file, d, name, entry, verify))
        try:
            if read_error is None:
                report = progress_from(progress, sum(i.nbytes for src in sources.values()
                                                     for i in src.file.infos.values()), "load checkpoint")
                for name, src in sources.items():
                    try:
                        with src.file.mapped.guard("its tensors"):  # a truncated file: FormatError, not SIGBUS
                            decoded[name] = decode_tree(src.tree(), _counted(src, report) if report.enabled else src,
                                                        str(src.path))
                    except RecursionError:
                        raise FormatError(f"{src.path}: the state tree is nested too deeply") from None
                extra = read_extra(d)
        except (FormatError, OSError) as e:
            read_error = e
        finally:
            for src in sources.values():
                src.close()  # the views handed to the hashing threads stay valid
            if report is not None:
                report.close()
        problems = [p for p in (f.result() for f in checks) if p]
    weights = decoded.get(WEIGHTS_FILE)
    optim = decoded.get(OPTIM_FILE)
    if problems:
        raise _integrity_error(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    if read_error is not None:
        raise read_error
    if not isinstance(extra, dict) or extra.get("format") != "fastckpt.train.extra":
        raise FormatError(f"{d / EXTRA_FILE}: not a fastckpt extra.json ('format' is {extra.get('format') if isinstance(extra, dict) else None!r})")
    ex = lambda key: decode_tree(extra.get(key), None, f"{d / EXTRA_FILE}[{key!r}]")  # noqa: E731
    _log.info("loaded checkpoint %s: step %s, %d files, %d bytes in %.3f s%s", d, manifest.get("step"), len(files),
              sum(e.get("bytes", 0) for e in files.values()), time.perf_counter() - started,
              "" if verify else ", hashes not checked")
    return CheckpointState(
        model_weights=weights,
        optim_state=optim,
        scheduler_state=ex("scheduler"),
        data_iter_state=ex("data_iter"),
        train_rng_state=ex("train_rng"),
        manifest=manifest,
        scaler_state=ex("scaler"),
        path=d,
    )


def _counted(src, report):
    """``src`` as a tensor sink that reports each stored tensor's bytes when it is first copied out."""
    def tensor(name: str):
        target = src.resolve(name)
        new = target not in src.cache
        arr = src(name)
        if new:
            report.advance(arr.nbytes, target)
        return arr
    return tensor


def apply_checkpoint(state: CheckpointState, model: Any, optimizer: Any = None, scheduler: Any = None,
                     data_iter: Any = None, train_rng: Any = None, *, scaler: Any = None,
                     strict: bool = True) -> RestoreReport:
    """Restore every given state machine in place, all or nothing; returns what was restored, missing or extra.

    Each slot takes what :func:`save_checkpoint` took: an object, a dict or
    list of them (several models, optimizers, an EMA copy by its name), or a
    pytree of arrays and numbers, which is restored into (arrays copied into
    in place, other entries replaced). Pass None for a slot you do not restore.
    An RNG continues the saved stream (it is never reseeded).

    All or nothing: every state is decoded and checked first (a model's names
    and shapes, every RNG state tried on a fresh generator, the structure of
    dicts and lists), and nothing is changed when one does not fit. Then the
    states are applied, models' weights last; if an object still refuses its
    state, those applied before it are put back from copies taken just before
    (so a restore holds a copy of the optimizer and other states while it
    runs, not of the model weights). The error says which state and which
    checkpoint.

    ``strict=False`` restores what the objects and the checkpoint both have
    (fine-tuning from a checkpoint with another head, a new EMA): names the
    objects have and the checkpoint lacks keep their values (``missing``),
    names only the checkpoint has are left (``unexpected``), a slot given
    that the checkpoint does not hold is left as it is; the returned
    :class:`~fastckpt.train.snapshot.RestoreReport` (also ``state.report``)
    lists them. Shapes must still match.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.train import TinyLM
    >>> out = os.path.join(tempfile.mkdtemp(), "c"); rng = np.random.default_rng(1); _ = rng.random(5)
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, rng, out, step=0)
    >>> rng2 = np.random.default_rng(99)
    >>> apply_checkpoint(load_checkpoint(out), TinyLM(vocab=8, dim=4, hidden=8), train_rng=rng2).restored
    ['model', 'train_rng']
    >>> rng2.random() == rng.random()
    True
    """
    slots = [("model", model, state.model_weights), ("optimizer", optimizer, state.optim_state),
             ("scheduler", scheduler, state.scheduler_state), ("data_iter", data_iter, state.data_iter_state),
             ("train_rng", train_rng, state.train_rng_state), ("scaler", scaler, state.scaler_state)]
    where = f"checkpoint {state.path or '(not from a directory)'}"
    try:
        steps, report = plan_restore(slots, strict)
    except (TypeError, ValueError, KeyError) as exc:
        exc.add_note(f"while checking the states of {where}; nothing was changed")
        raise
    try:
        apply_restore(steps)
    except Exception as exc:
        exc.add_note(f"while applying the states of {where}")
        raise
    state.report = report
    return report


# ---------------------------------------------------------------------------------------------
# Verification without loading
# ---------------------------------------------------------------------------------------------
def verify_checkpoint(in_dir: str | os.PathLike, *, hashes: bool = True, progress=False) -> list[str]:
    """Every problem found in a checkpoint directory, as sentences naming the file (empty: all good).

    Checks the manifest, every listed file's size and (unless ``hashes=False``)
    hash, with the algorithm its entry names (BLAKE3, or sha256 in
    checkpoints saved with ``hash="sha256"`` and in those of schema 1.0), and
    that the safetensors trees and aliases resolve. ``progress`` (``True`` for
    a bar, or ``callback(done, total, item)``: :mod:`fastckpt.progress`)
    counts the files' bytes (the manifest's sizes) as each file is checked.

    >>> import tempfile, os
    >>> from fastckpt.train import TinyLM
    >>> out = os.path.join(tempfile.mkdtemp(), "c")
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=0)
    >>> verify_checkpoint(out)
    []
    """
    d = Path(in_dir)
    try:
        manifest = read_manifest(d)
    except (FormatError, CheckpointNotFoundError, OSError) as e:
        return [str(e)]
    problems = []
    files = manifest["files"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(files))) as pool, \
            progress_from(progress, sum(e.get("bytes", 0) for e in files.values()), "verify checkpoint") as report:
        for (name, entry), p in zip(files.items(),
                                    pool.map(lambda item: _check_file(d, item[0], item[1], hashes), files.items())):
            report.advance(entry.get("bytes", 0), name)
            if p:
                problems.append(p)
    algorithm, weights_hex = file_hash(files[WEIGHTS_FILE])
    if weights_digest(manifest) != f"{algorithm}:{weights_hex}":
        key = "weights_digest" if "weights_digest" in manifest else "weights_sha256"
        problems.append(f"{d / MANIFEST_FILE}: {key} {manifest[key]} differs from the files entry of {WEIGHTS_FILE} "
                        f"({algorithm}:{weights_hex})")
    if problems:
        return problems
    for name, fmt in ((WEIGHTS_FILE, "fastckpt.train.weights"), (OPTIM_FILE, "fastckpt.train.optim")):
        if name not in files:
            continue
        try:
            src = _TensorSource(d / name, fmt)
            try:
                _walk_refs(src.tree(), src.resolve)
            finally:
                src.close()
        except (FormatError, OSError) as e:
            problems.append(str(e))
    try:
        extra = read_extra(d)
        if not isinstance(extra, dict) or extra.get("format") != "fastckpt.train.extra":
            problems.append(f"{d / EXTRA_FILE}: not a fastckpt extra.json")
        else:
            for key in ("scheduler", "data_iter", "train_rng", "scaler"):
                decode_tree(extra.get(key), None, f"{d / EXTRA_FILE}[{key!r}]")
    except FormatError as e:  # names the file
        problems.append(str(e))
    except (ValueError, OSError) as e:
        problems.append(f"{d / EXTRA_FILE}: unreadable ({e})")
    return problems
