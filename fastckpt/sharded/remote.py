"""Sharded checkpoints at a URL (``s3://bucket/ckpt``, any fsspec URL): every rank uploads its files, rank 0
commits with the manifest, uploaded last.

``Saver(path=url).save()`` and ``Loader(url).load()`` come here. A save: rank 0 clears the prefix (a committed
checkpoint there loses its ``manifest.json`` first; ``overwrite=True`` is needed to replace one) and tells the
ranks to start; each rank writes its tensor files into a local temporary directory, as a local save does, and
uploads them (in parallel, :func:`fastckpt.formats.remote.put_directory`); the engine's gather is the barrier
after every upload; then rank 0 writes ``index.json``, ``tensorkey.json`` and the descriptions, uploads them,
and uploads ``manifest.json`` last: the commit. A failure on any rank leaves the prefix without a manifest:
uncommitted, refused by loaders, replaced by the next save. A load downloads the committed prefix into a
temporary directory (files and 16 MiB ranges in parallel) and loads from there; with ``verify=False`` only the
byte ranges this rank reads (:func:`fetch_share`: of a dense tensor the rows it takes, of a table the slice groups
that meet its slice). Ranks loading one URL as threads of one process fetch each file once between them; in a
verified load the rank that fetched a file hashes it as soon as it is in place, for all of them, and their local
copies go when the last of them is done.

Incremental (delta) saves need a local directory: a delta names its base by path.

>>> import numpy as np
>>> from fastckpt.sharded import HashTable, Loader, Saver
>>> t = HashTable(dim=1); t.insert(np.arange(4), np.arange(4, dtype=np.float32)[:, None])
>>> Saver(path="memory://doc/sharded", parallel=2, hashtables={"emb": t}, tensors={"w": np.eye(2)}).save()
'memory://doc/sharded'
>>> tables, tensors = Loader("memory://doc/sharded").load()
>>> tables["emb"].ids().tolist(), tensors["w"].tolist()
([0, 1, 2, 3], [[1.0, 0.0], [0.0, 1.0]])
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable

from fastckpt._native.safetensors import MAX_HEADER_SIZE
from fastckpt.errors import FormatError
from fastckpt.formats import remote
from fastckpt.formats.stream import GAP
from fastckpt.store.commit import link_over
from fastckpt.store.manifest import MAX_JSON_BYTES, parse_json, read_json
from fastckpt.sharded.engine import error_info as _error_info
from fastckpt.sharded.engine import raise_from_root as _raise_from_root
from fastckpt.sharded.flights import Flights
from fastckpt.sharded.format import DESCRIPTION_FILE, INDEX_FILE, MANIFEST_FILE, TENSORKEY_FILE, part_rows

__all__ = ["save", "load"]


def save(saver) -> str:
    """Run :meth:`fastckpt.sharded.Saver.save` for a URL (see the module docstring); returns the URL."""
    url, options = saver.path.rstrip("/"), saver.storage_options
    if saver.policy is not None:
        raise ValueError(f"{url}: incremental saves need a local directory (a delta names its base by path); "
                         "save full checkpoints to a URL (incremental=False)")
    engine = saver._engine()
    root = engine.rank == 0
    start: dict = {}
    start_error = None
    if root:
        try:
            if not saver.overwrite and remote.committed(url, MANIFEST_FILE, options):
                raise FileExistsError(errno.EEXIST, "already exists; pass overwrite=True to replace it", url)
            remote.clear(url, MANIFEST_FILE, options)  # an old checkpoint, or a save that never committed
            start = {"ok": True}
        except Exception as exc:
            start, start_error = _error_info(exc), exc
    start = engine.broadcast(start, root=0, timeout=saver.timeout)
    if "error" in start:
        if start_error is not None:
            raise start_error  # rank 0's own: FileExistsError stays FileExistsError
        _raise_from_root(start, f"sharded save to {url}: rank 0 could not start it")
    saver.kind = "full"
    tmp = Path(tempfile.mkdtemp(prefix="fastckpt-shard-"))
    try:
        staging = tmp / "staging"
        staging.mkdir()
        error = None
        try:
            report = saver._write_files(staging, saver._filtered())
            remote.put_directory(staging, url, MANIFEST_FILE, options, files=list(report["files"]), replace=False,
                                 commit=False)
        except Exception as exc:
            report, error = {"error": f"rank {saver.shard_index}: {type(exc).__name__}: {exc}"}, exc

        def commit(reports: list) -> str:  # every rank has uploaded: the metadata, the manifest last
            final = tmp / "final"
            digest = saver._commit(staging, final, reports, {"kind": "full"})
            remote.put_directory(final, url, MANIFEST_FILE, options, replace=False,
                                 files=[INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE, MANIFEST_FILE])
            return digest

        # an uncommitted prefix is left for the next save to remove
        status, commit_error = saver._commit_on_root(engine, report, commit)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saver._settle(error, commit_error, status, report, url, url)
    return saver.path


def load(loader):
    """Run :meth:`fastckpt.sharded.Loader.load` for a URL, fetching only this rank's share (see :func:`fetch_share`).

    A directory in RecIS's layout (with or without fastckpt's manifest; without it, RecIS's ``index`` marks it
    complete) is fetched by RecIS's slice rule. A delta or an encoded checkpoint (whose parts a rank cannot
    select by rows) is downloaded whole first.
    """
    url = loader.checkpoint_path
    tmp = tempfile.mkdtemp(prefix="fastckpt-share-")
    ahead: list = []  # the files this load fetched whole, being hashed for every rank's reader (fetch_share)
    with _leaving_lock:
        _leaving.setdefault(url, [0, []])[0] += 1
    try:
        with remote.naming_url(tmp, url):
            share = fetch_share(loader, tmp, ahead)
            if not share:  # verified, a delta, an encoded table; or nothing committed, which local_copy reports
                shutil.rmtree(tmp, ignore_errors=True)
                with remote.local_copy(url, MANIFEST_FILE, loader.storage_options) as local:
                    return _load_from(loader, local)
            if share["layout"] == "recis" and not share["manifest"]:
                return _load_recis(loader, tmp, url)
            return _load_from(loader, tmp)
    finally:
        for release in ahead:  # this load is done: its readers, and those of the ranks it fetched for, hold their own
            release()
        # Its local copy goes once no load of this URL runs in this process: removing a link to a file fetched
        # once between the loads changes the file's ctime, part of the identity its hash is shared by, and a load
        # that opened it after that hashed it again.
        with _leaving_lock:
            entry = _leaving[url]
            entry[0] -= 1
            entry[1].append(tmp)
            gone = _leaving.pop(url)[1] if entry[0] == 0 else []
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)


# The local copies of the loads of a URL running now in this process, removed when the last of them is done
# (:func:`load`): {URL: [loads running, local copies left]}.
_leaving: dict[str, list] = {}
_leaving_lock = threading.Lock()


def _load_recis(loader, local: str, url: str):
    """A RecIS directory without a manifest, downloaded to ``local``: its warning names the URL (once per URL)."""
    import warnings

    from fastckpt.sharded import recis

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", recis.RecisWarning)
        result = _load_from(loader, local)
    for warning in caught:
        if issubclass(warning.category, recis.RecisWarning):
            recis._warned.discard(local)
            if url not in recis._warned:
                recis._warned.add(url)
                warnings.warn(str(warning.message).replace(local, url), recis.RecisWarning, stacklevel=4)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return result


def _load_from(loader, local: str):
    url = loader.checkpoint_path
    loader.checkpoint_path = local
    try:
        return loader.load()
    finally:
        loader.checkpoint_path = url


_HEAD = 8 << 10  # the first bytes fetched of every tensor file: its safetensors header, mostly whole


# The metadata files of a URL being fetched in a load's first round (:func:`_first_round`), by URL: shared by the
# loads that ask while it runs; a Future of {file: its bytes, or None where it is missing}.
_metadata = Flights()
# Tensor-file headers being fetched, by (URL, the manifest's BLAKE3, file) (:meth:`_Share.shared_headers`): shared
# by the loads that run at the same time and read that file; a Future of the header's bytes (8 + its length).
_heads = Flights()
# Whole tensor files being fetched, by (URL, the manifest's BLAKE3, file) (:meth:`_Share.fetch_whole`); a Future of
# (the local path of the load that fetched it, the paths it linked it to).
_wholes = Flights()


def _nothing() -> None:
    pass


class _Share:
    """The local sparse copy of a checkpoint prefix that :func:`fetch_share` fills, and what it fetched."""

    def __init__(self, fs, url: str, path: str, local: str, sizes: dict[str, int], ahead: list | None = None):
        import os

        self.fs, self.url, self.path, self.local, self.sizes = fs, url, path, local, sizes
        # where given: the files fetched whole are hashed as soon as they are in place (_hash_ahead), and the
        # functions that let go of those hashes are put here
        self.ahead, self._hashing = (ahead if ahead is not None else []), ahead is not None
        self.bytes, self.requests = 0, 0
        self.headed: set[str] = set()  # the tensor files whose header this load has (fetched, or another load's)
        self.manifest_hash = ""  # the BLAKE3 of the manifest's bytes: what the metadata fetched belongs to
        self.metadata: dict[str, bytes | None] = {}  # the metadata files the first round brought (_first_round)
        for name, size in sizes.items():
            with open(os.path.join(local, name), "wb") as f:
                f.truncate(size)  # sparse: only the ranges fetched take space

    def fetch(self, spans: dict[str, list[tuple[int, int]]]) -> None:
        """Fetch these byte ranges of these files (merged, in parallel ranged reads) into the local files."""
        import os

        work = [(f"{self.path}/{name}", os.path.join(self.local, name), remote._merged(sorted(ranges)))
                for name, ranges in spans.items() if ranges]
        self.bytes += sum(e - b for *_, ranges in work for b, e in ranges)
        self.requests += sum(len(ranges) for *_, ranges in work)
        remote._fetch_into(self.fs, self.url, work)

    def json(self, name: str):
        """The JSON value of fetched file ``name``, read bounded (:func:`fastckpt.store.manifest.read_json`)."""
        import os

        return read_json(os.path.join(self.local, name), where=f"{self.url}/{name}")

    def headers(self, names: list[str], also: dict | None = None) -> dict[str, tuple[str, int, int, list]]:
        """``{stored key: (file, begin, end, shape)}`` from the safetensors headers of ``names`` (fetched here,
        with the ranges ``also`` in the same round of requests; headers longer than the first bytes fetched of
        every file are fetched on in one more round, all of them together)."""
        self._fetch_heads(names, also)
        return self._parse_headers(names)

    def _fetch_heads(self, names: list[str], also: dict | None = None) -> None:
        """The headers of ``names`` into the local files (see :meth:`headers`)."""
        self.headed.update(names)

        self.fetch({**(also or {}), **{name: [(0, min(_HEAD, self.sizes[name]))] for name in names}})
        self._rest_of_heads({name: _HEAD for name in names})

    def _rest_of_heads(self, have: dict[str, int]) -> None:
        """Fetch, in one round, the rest of each header of which only the first ``have[file]`` bytes were fetched
        (a header longer than that, as its first 8 bytes give it)."""
        import os

        longer = {}
        for name, fetched in have.items():
            with open(os.path.join(self.local, name), "rb") as f:
                length = _header_length(f)
            if fetched < 8 + length <= self.sizes[name] and length <= MAX_HEADER_SIZE:
                longer[name] = [(fetched, 8 + length)]
        self.fetch(longer)

    def _parse_headers(self, names: list[str]) -> dict[str, tuple[str, int, int, list]]:
        """``{stored key: (file, begin, end, shape)}`` from the headers of ``names`` in the local files."""
        import os

        out = {}
        for name in names:
            with open(os.path.join(self.local, name), "rb") as f:
                length = _header_length(f)
                if length > MAX_HEADER_SIZE:
                    raise FormatError(f"{self.url}/{name}: header length {length} is larger than the safetensors "
                                      f"limit of {MAX_HEADER_SIZE} bytes (not a safetensors file, or damaged)")
                header = parse_json(f.read(length), f"{self.url}/{name}", what="its safetensors header")
            for key, entry in header.items():
                if key != "__metadata__":
                    begin, end = entry["data_offsets"]
                    out[key] = (name, 8 + length + begin, 8 + length + end, list(entry["shape"]))
        return out

    def shared_headers(self, names: list[str]) -> dict[str, tuple[str, int, int, list]]:
        """:meth:`headers` of the tensor files ``names`` (those this load reads), each fetched once among the loads
        of this prefix and manifest that run at the same time in this process and read it (the ranks of a load run
        as threads): a header another load is fetching is waited for and its bytes written into this load's local
        copy (an unchanged manifest names unchanged tensor files, by their BLAKE3 and size), the rest fetched here
        in one round. A header whose fetch failed in another load is fetched here."""
        self._header_round(names, self._fetch_heads)
        return self._parse_headers(list(names))

    def with_headers(self, names: list[str], layout: dict[str, tuple[str, int, int, list]],
                     spans: Callable[[dict], dict[str, list[tuple[int, int]]]]) -> dict[str, tuple]:
        """Fetch the ranges ``spans(offsets)`` gives and the headers of the tensor files ``names`` in one round,
        where ``layout`` (:func:`_layout`) says where fastckpt's writer put every part of those files; returns the
        places the headers give (:meth:`headers`' form).

        A header is the bytes before its file's first part, so a range that starts at a file's first part (or within
        64 KiB of it) and the header come in one request. Each header is fetched once among the loads of this prefix
        and manifest that run at the same time in this process (ranks as threads, :meth:`shared_headers`): a load
        that is not the first to ask for one takes the other's bytes once its own ranges are in, unless its first
        range joins the header anyway. Where a header says otherwise than ``layout`` (a file not laid out by
        fastckpt's writer), the ranges its own places give are fetched in one more round: what this load reads is
        always where the headers place it."""
        starts = {}  # file -> its first part's byte, the header's end as the layout has it
        for name, begin, _, _ in layout.values():
            starts[name] = min(begin, starts.get(name, begin))
        plan = {name: list(ranges) for name, ranges in spans(layout).items()}
        joined = set()  # the headers that come with a range of this load's anyway
        for name in names:
            first = min((b for b, e in plan.get(name, ()) if e > b), default=None)
            if first is not None and first - starts[name] <= GAP:
                joined.add(name)

        def fetch_own(mine: list[str]) -> None:  # the ranges and every header fetched here, in one round
            for name in names:
                if name in joined or name in mine:
                    plan.setdefault(name, []).append((0, starts[name]))
            self.fetch(plan)
            self._rest_of_heads({name: starts[name] for name in mine})

        self.headed.update(names)
        mine = self._header_round(names, fetch_own, joined)
        # a joined header another load fetches too: complete where it is longer than the layout says
        self._rest_of_heads({name: starts[name] for name in names if name in joined and name not in mine})
        offsets = self._parse_headers(list(names))
        if offsets != layout:
            self.fetch(spans(offsets))  # laid out otherwise: what the headers place, fetched now
        return offsets

    def _header_round(self, names: list[str], fetch_own: Callable[[list[str]], None],
                      joined: set = frozenset()) -> list[str]:
        """Put the headers of the tensor files ``names`` into the local copy, each fetched once among the loads of
        this prefix and manifest that run at the same time in this process (:meth:`shared_headers`): this load's
        own, those no other load is fetching, by ``fetch_own(own)`` (with whatever else goes in its round), each
        then handed to the loads waiting for it; another load's waited for and its bytes written here, or fetched
        here where that fetch failed. A header in ``joined`` comes with ``fetch_own``'s round whoever fetches it,
        and is not waited for. Returns this load's own."""
        import os

        own, others = [], []
        for name in names:
            flight, future, mine = _heads.join((self.url, self.manifest_hash, name))
            (own if mine else others).append((name, flight, future))
        try:
            try:
                fetch_own([name for name, _, _ in own])
            except BaseException as exc:
                for _, flight, future in own:
                    _heads.fail(flight, future, exc)
                raise
            for name, _, future in own:
                with open(os.path.join(self.local, name), "rb") as f:
                    length = _header_length(f)
                    f.seek(0)
                    future.set_result(f.read(8 + min(length, MAX_HEADER_SIZE)))  # the 8 bytes, then the header
            again = []
            for name, _, future in others:
                if name in joined:
                    continue
                try:
                    data = future.result()
                except Exception:  # noqa: BLE001 - the fetching load raises its own error; this one fetches again
                    again.append(name)
                    continue
                with open(os.path.join(self.local, name), "r+b") as f:
                    f.write(data)
                self.headed.add(name)
            self._fetch_heads(again)
        finally:
            for name, flight, _ in [*own, *others]:
                _heads.leave((self.url, self.manifest_hash, name), flight)
        return [name for name, _, _ in own]

    def take_metadata(self, fetched: dict[str, bytes | None], manifest: dict) -> None:
        """Put the metadata files the first round brought (:func:`_first_round`) into the local copy, each where it
        is the one ``manifest`` lists (its size and BLAKE3: that round asks for the manifest and the metadata at
        once, so another save may have committed between); fetch the others whole now."""
        import os

        import blake3

        files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
        again = {}
        for name, data in fetched.items():
            if name not in self.sizes:
                continue
            entry = files.get(name)
            if data is not None and isinstance(entry, dict) and entry.get("size") == len(data) \
                    and entry.get("blake3") == blake3.blake3(data).hexdigest():
                with open(os.path.join(self.local, name), "r+b") as f:
                    f.write(data)
            else:
                again[name] = [(0, self.sizes[name])]
        self.fetch(again)

    def fetch_whole(self, names: list[str]) -> None:
        """Fetch files ``names`` whole, each once among the loads of this prefix and manifest that run at the same
        time in this process: a file another load is fetching is waited for and hard-linked into this load's
        local copy (read-only from then on; each load's reader hashes it against the manifest, once between them,
        by file identity), the rest fetched here in one round. The fetching load makes the links of the loads
        waiting for it before any of them opens the file: a link changes the file's ctime, which is part of its
        identity, so a link made after another load opened it would have it hashed again. A load that comes once
        the links are made links for itself; a link that cannot be made (another file system, the other load
        gone) is a fetch of its own."""
        import os

        base = (self.url, self.manifest_hash)
        own, others = [], []
        for name in names:  # a waiting load leaves its target, which the fetching load links before it is done
            flight, future, mine = _wholes.join((*base, name), waiter=os.path.join(self.local, name))
            (own if mine else others).append((name, flight, future))
        try:
            try:
                self.fetch({name: [(0, self.sizes[name])] for name, _, _ in own})
            except BaseException as exc:
                for _, flight, future in own:
                    _wholes.fail(flight, future, exc)
                self._let_go(others)
                raise
            for name, flight, future in own:
                source, linked = os.path.join(self.local, name), set()
                for target in _wholes.take_waiting(flight):  # a load that comes after this links for itself
                    with contextlib.suppress(OSError):  # that load links or fetches for itself
                        link_over(source, target)
                        linked.add(target)
                # hashed now (after the links: each changes the file's ctime), held for this load and each linked
                releases = self._hash_ahead(source, 1 + len(linked))
                future.set_result((source, linked, dict(zip(sorted(linked), releases[1:]))))
                self.ahead.extend(releases[:1])
            again = []
            for name, _, future in others:
                target = os.path.join(self.local, name)
                try:
                    source, linked, releases = future.result()
                    if target in linked:  # its hash is held for this load until it is done
                        self.ahead.append(releases.get(target, _nothing))
                    else:  # came after the links were made: the file's ctime changes here, so the hash made
                        link_over(source, target)  # before does not serve the readers to come
                        self.ahead.extend(self._hash_ahead(target))
                except Exception:  # noqa: BLE001 - failed there, or cannot be linked: fetched here
                    again.append(name)
            self.fetch({name: [(0, self.sizes[name])] for name in again})
            for name in again:
                self.ahead.extend(self._hash_ahead(os.path.join(self.local, name)))
        finally:
            for name, flight, _ in [*own, *others]:
                _wholes.leave((*base, name), flight)

    def _let_go(self, others: list) -> None:
        """This load failed before it took the files other loads fetch for it: once their fetches end, let go of
        the hashes they hold for its links (else held until the process ends, for files that are gone)."""
        import os

        for name, _flight, future in others:
            try:
                _source, linked, releases = future.result()
            except BaseException:  # noqa: BLE001 - that fetch failed: nothing was held for this load
                continue
            if os.path.join(self.local, name) in linked:
                releases.get(os.path.join(self.local, name), _nothing)()

    def _hash_ahead(self, path: str, holders: int = 1) -> list:
        """Hash file ``path`` (fetched whole, its links made) on a worker thread now, beside the fetches still
        running, for every reader that opens it while one of ``holders`` loads holds it (the functions returned
        let go, one a load: :func:`fastckpt.sharded.reader.hash_ahead`): the files a verified N -> M load reads are
        hashed by the ranks that fetched them, each as soon as it is in place, not by whichever rank's reader came
        to a file first (with 4 -> 3, two ranks hashed 15 of the 16 files, one after another). Nothing (an empty
        list where no ``ahead`` was given to :func:`fetch_share`) where the file cannot be opened: its reader
        says why."""
        if not self._hashing:
            return [_nothing] * holders
        from fastckpt.sharded.reader import hash_ahead
        from fastckpt.sharded.workers import Lane

        if not hasattr(self, "_lane"):
            self._lane = Lane("verify", 1)  # one file at a time (BLAKE3 on every core), as a load hashes them
        try:
            return hash_ahead(path, self._lane.submit, holders)
        except OSError:  # gone or unreadable: its reader says so
            return [_nothing] * holders

    def ids(self, where: tuple):
        """The int64 ids of the block at ``where`` (fetched before)."""
        import os

        import numpy as np

        name, begin, end, _ = where
        return np.fromfile(os.path.join(self.local, name), np.int64, (end - begin) // 8, offset=begin)


def _header_length(f) -> int:
    """The safetensors header length that the first 8 bytes of file object ``f`` (read from where it stands, its
    start) give; 0 where it holds fewer."""
    head = f.read(8)
    return int.from_bytes(head, "little") if len(head) == 8 else 0


def _row_spans(mine, n_rows: int, where: tuple) -> list[tuple[int, int]]:
    """The byte ranges of rows ``mine`` (ascending positions) of a block of ``n_rows`` rows at ``where``."""
    import numpy as np

    _, begin, end, _ = where
    row = (end - begin) // n_rows
    starts = np.flatnonzero(np.diff(mine, prepend=-2) != 1)  # runs of consecutive owned rows
    return [(begin + int(mine[a]) * row, begin + (int(mine[b - 1]) + 1) * row)
            for a, b in zip(starts, [*starts[1:], len(mine)])]


def _first_round(fs, url: str, path: str, manifest_only: bool) -> tuple[bytes | None, dict, tuple[int, int]]:
    """A load's first round of requests: ``(the manifest's bytes or None where there is none, {metadata file: its
    bytes or None}, (bytes, requests) this load fetched))``, each read bounded (one byte past
    :data:`~fastckpt.store.manifest.MAX_JSON_BYTES` says a file is larger: a :class:`~fastckpt.errors.FormatError`).

    The manifest and fastckpt's three metadata files are asked for at once (not the manifest first, then the files
    it lists), so that the headers of the files a rank reads, which the metadata names, come in the second round.
    The metadata is fetched once among the loads of the URL that ask while it is being fetched (the ranks of a load
    run as threads); each load fetches its own manifest in that round (the commit it loads), and
    :meth:`_Share.take_metadata` takes only metadata whose size and BLAKE3 that manifest lists. ``manifest_only``:
    the manifest alone (a load that reads the whole prefix).
    """
    names = [MANIFEST_FILE] if manifest_only else None
    flight = future = None
    if names is None:
        flight, future, mine = _metadata.join(url)
        names = [MANIFEST_FILE, *_METADATA] if mine else [MANIFEST_FILE]
    try:
        try:
            got = _bounded(fs, url, path, names)
        except BaseException as exc:
            if future is not None and len(names) > 1:
                _metadata.fail(flight, future, exc)
            raise
        metadata: dict = {}
        if future is not None:
            if len(names) > 1:
                metadata = {name: got[name] for name in _METADATA}
                future.set_result(metadata)
            else:
                try:
                    metadata = future.result()
                except Exception:  # noqa: BLE001 - that load raises its own error; this one fetches what it needs
                    metadata = {}
        fetched = sum(len(data) for data in got.values() if data is not None), sum(v is not None for v in got.values())
        return got[MANIFEST_FILE], metadata, fetched
    finally:
        if flight is not None:
            _metadata.leave(url, flight)


_METADATA = (INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE)


def _bounded(fs, url: str, path: str, names: list[str]) -> dict[str, bytes | None]:
    """``{name: its bytes, or None where there is no such file}`` for files ``names`` of the prefix, asked for at
    once, each read up to one byte past :data:`~fastckpt.store.manifest.MAX_JSON_BYTES` (a larger one is a
    :class:`~fastckpt.errors.FormatError` naming it)."""
    limit = MAX_JSON_BYTES + 1
    answers = fs.cat_ranges([f"{path}/{name}" for name in names], [0] * len(names), [limit] * len(names),
                            on_error="return")
    out = {}
    for name, answer in zip(names, answers):
        if isinstance(answer, FileNotFoundError):
            answer = None
        elif isinstance(answer, BaseException):
            raise answer
        elif len(answer) > MAX_JSON_BYTES:
            raise FormatError(f"{url}/{name}: more than the {MAX_JSON_BYTES} bytes a checkpoint's metadata file may "
                              "have")
        out[name] = answer
    return out


def fetch_share(loader, local: str, ahead: list | None = None) -> dict | bool:
    """Fetch into ``local`` the bytes of the checkpoint at ``loader.checkpoint_path`` that ``loader``'s rank loads.

    The manifest and the metadata files whole, in one round (:func:`_first_round`); then the headers of the tensor
    files holding a part this rank reads (``index.json``, or RecIS's ``index``, names them), then each dense part
    this rank takes and the hashtable id parts it needs (every one; under the slice rule, only those whose slice
    meets the rank's); then, for the ids this rank owns, only the byte ranges of their rows in the embedding and
    slot parts (runs of rows; ranges less than 64 KiB apart merged), in parallel ranged reads. In fastckpt's layout
    the metadata places every part of the files (:func:`_layout`), so the headers come in the round of the ranges
    (:meth:`_Share.with_headers`; under the slice rule that is every range: two rounds in all). The tensor files are
    sparse local files of their full size, so the Loader reads them as it reads any directory. Returns ``{"bytes":
    fetched, "requests": ranges, "layout", "manifest": bool, "headers": tensor files whose header it has}``, or
    False for a checkpoint that must be downloaded whole: one with a manifest loaded with ``verify=True`` (its
    BLAKE3 hashes cover whole files, so only whole files can be checked; but a full, unencoded checkpoint of format
    version 4 under its slice rule fetches whole only the files whose parts this rank reads), a delta, an encoded
    table; or neither a manifest nor RecIS's ``index``, which the whole-prefix path reports. Loads of the same
    prefix running at the same time in this process (ranks as threads) fetch the metadata, the headers and the whole
    files alike once between them (:func:`_first_round`, :meth:`_Share.shared_headers`, :meth:`_Share.fetch_whole`).
    With ``ahead`` (a list), each file this load fetches whole is hashed on a worker thread as soon as it is in
    place, for every reader that opens it meanwhile: ``ahead`` receives for each the function that lets go of its
    hash (:func:`fastckpt.sharded.reader.hash_ahead`; :func:`load` calls each once its load is done).
    """

    from fastckpt.sharded import recis

    url, options = loader.checkpoint_path.rstrip("/"), loader.storage_options
    fs, path = remote.filesystem(url, options)
    path = path.rstrip("/")
    # Another owner rule, verified, reads the whole prefix (below): the manifest alone decides that.
    manifest_bytes, metadata, fetched = _first_round(fs, url, path, loader.verify and loader.owner is not None)
    manifest = parse_json(manifest_bytes, f"{url}/{MANIFEST_FILE}") if manifest_bytes is not None else None
    if manifest is not None and loader.verify and not _sliced(loader, manifest):
        # The manifest hashes whole files: a file fetched in part cannot be checked against it, so a verified load
        # (the default) fetches the files whole; verify=False takes this rank's share alone. A version-4 checkpoint
        # under its slice rule: the files this rank reads are fetched whole (the others not at all).
        return False
    if manifest is None or manifest.get("format") == recis.FORMAT:
        if not fs.exists(f"{path}/{recis.INDEX_FILE}"):
            return False
        layout, plan = "recis", _recis_plan
    elif manifest.get("format") != "fastckpt.sharded" or manifest.get("kind", "full") != "full" \
            or any("encoding" in t for t in manifest.get("hashtables", {}).values()):
        return False  # a delta, an encoded table
    else:
        layout, plan = "fastckpt", _fastckpt_plan
    if manifest is not None:
        sizes = {name: entry["size"] for name, entry in manifest["files"].items()}
    else:  # RecIS wrote no manifest: the listing gives the sizes
        base = path.strip("/") + "/"
        sizes = {key.strip("/")[len(base):]: int(entry.get("size") or 0)
                 for key, entry in fs.find(path, withdirs=False, detail=True).items()
                 if "/" not in key.strip("/")[len(base):]}
    sizes.pop(MANIFEST_FILE, None)
    share = _Share(fs, url, path, local, sizes, ahead)
    if manifest_bytes is not None:
        import blake3

        share.manifest_hash = blake3.blake3(manifest_bytes).hexdigest()
        with open(f"{local}/{MANIFEST_FILE}", "wb") as f:
            f.write(manifest_bytes)
        share.bytes, share.requests = fetched
        share.metadata = metadata
    plan(loader, share, manifest)
    return {"bytes": share.bytes, "requests": share.requests, "layout": layout, "manifest": manifest is not None,
            "headers": len(share.headed)}


def _sliced(loader, manifest: dict) -> bool:
    """A full, unencoded checkpoint of format version 4 loaded by its own slice rule."""
    tables = manifest.get("hashtables", {})
    return (manifest.get("format") == "fastckpt.sharded" and manifest.get("kind", "full") == "full"
            and loader.owner is None and isinstance(tables, dict) and bool(tables)
            and all(isinstance(t, dict) and "partition" in t and "encoding" not in t for t in tables.values()))


def _fastckpt_plan(loader, share: _Share, manifest: dict) -> None:
    """fastckpt's layout: dense parts by rows, the id parts, then the owned rows (:meth:`Loader.owner_rule`). Under
    format version 4's slice rule, in one round, the rows of the slice groups that meet the rank's slice (its run of
    rows lies in them) of the ids, the embedding and every slot; under another rule every id part whole, then the
    rows it owns. Which parts the rank reads comes from the descriptions, and which files hold them from
    ``index.json``: only those files' headers are fetched (with ``verify``, no header: those files whole)."""
    import numpy as np

    from fastckpt.sharded.format import group_rows, rows_of

    metadata = [INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE]
    share.take_metadata({name: share.metadata.get(name) for name in metadata}, manifest)
    descriptions = share.json(DESCRIPTION_FILE)
    dense_wanted = set(loader.tensors) or set(manifest.get("tensors", {}))
    tables_wanted = set(loader.hashtables) or set(manifest.get("hashtables", {}))
    dense_rows: dict[str, tuple[int, int]] = {}  # dense part -> the rows of the tensor this rank takes
    id_parts = []
    ranges: dict[str, tuple[int, int]] = {}  # version-4 id part -> the rows of the groups fetched
    for key, desc in descriptions.items():
        if desc.get("dense") and desc.get("tensor") in dense_wanted:
            rows = desc["global_shape"][0] if desc.get("global_shape") else 0
            lo, hi = (0, rows) if loader.dense == "replicated" or not rows else \
                rows_of(loader.shard_index, loader.shard_num, rows)
            if part_rows(desc.get("row_start", 0), desc["shape"], lo, hi) is not None:
                dense_rows[key] = (lo, hi)
        elif desc.get("role") == "id" and desc.get("table") in tables_wanted:
            partition = manifest["hashtables"].get(desc["table"], {}).get("partition")
            if loader.owner is None and partition is not None and "slices" in desc and loader.shard_num > 1:
                # version 4: only the ids of the slice groups that meet this rank's slice
                r0, r1 = group_rows(desc["slices"]["rows"], partition["slice_size"], loader.shard_index,
                                    loader.shard_num)
                if r0 == r1:
                    continue
                ranges[key] = (r0, r1)
            id_parts.append(key)
    parts = {(descriptions[key]["table"], tuple(descriptions[key].get("part", ()))) for key in id_parts}
    beside = [key for key, d in descriptions.items() if not d.get("dense") and d.get("role") in ("embedding", "slot")
              and (d.get("table"), tuple(d.get("part", ()))) in parts]
    tensor_files = set(share.sizes) - set(metadata)
    index = share.json(INDEX_FILE)
    files = _files_holding(index, tensor_files, [*dense_rows, *id_parts, *beside], tensor_files)
    if loader.verify:  # a verified version-4 load (_sliced): the files it reads whole, for their hashes
        share.fetch_whole(files)
        return

    def spans(offsets: dict) -> dict[str, list[tuple[int, int]]]:
        """The first round's ranges where the parts are at ``offsets``: the dense rows, the id parts (of version 4
        under its slice rule, the rows of the groups that meet the rank's slice, and those of the embedding and
        slots: the rank's run lies in them, and the Loader reads that run and checks the ids; no second round)."""
        first: dict[str, list[tuple[int, int]]] = {}
        for key, (lo, hi) in dense_rows.items():
            where = offsets.get(key)
            span = None if where is None else _dense_span(descriptions[key], where, lo, hi)
            if span is not None:
                first.setdefault(where[0], []).append(span)
        for key in id_parts:
            where = offsets.get(key)
            if where is None:  # the Loader names a part no header places
                continue
            if key in ranges:
                r0, r1 = ranges[key]
                first.setdefault(where[0], []).append((where[1] + 8 * r0, where[1] + 8 * r1))
                for other in _part_tensors(descriptions, key, offsets):
                    first.setdefault(offsets[other][0], []).extend(
                        _row_spans(np.arange(r0, r1), descriptions[key]["shape"][0], offsets[other]))
            else:
                first.setdefault(where[0], []).append(where[1:3])
        return first

    layout = _layout(index, descriptions, share.sizes, files)
    if layout is not None:  # the headers come with the ranges, in one round
        offsets = share.with_headers(files, layout, spans)
    else:
        offsets = share.shared_headers(files)
        share.fetch(spans(offsets))
    id_parts = [key for key in id_parts if key in offsets]
    rows_plan: dict[str, list[tuple[int, int]]] = {}
    for key in id_parts:
        if key in ranges:
            continue
        entry = manifest["hashtables"].get(descriptions[key]["table"], {})
        ids = share.ids(offsets[key])
        mine = np.flatnonzero(np.asarray(loader.owner_rule(entry)(ids, loader.shard_num)) == loader.shard_index) \
            if len(ids) else ids
        if not len(mine):
            continue
        for other in _part_tensors(descriptions, key, offsets):
            rows_plan.setdefault(offsets[other][0], []).extend(_row_spans(mine, len(ids), offsets[other]))
    share.fetch(rows_plan)


def _files_holding(index, names: set[str], keys: list[str], otherwise) -> list[str]:
    """The files among ``names`` that ``index`` (``index.json``'s value, or RecIS's ``index``: a ``block_index`` of
    stored keys and a ``file_index`` of file names, both to file numbers) places stored keys ``keys`` in, sorted;
    ``otherwise``, sorted, where the index is not of that form or places one of them in no file of ``names`` (the
    reader then names what is wrong).

    >>> index = {"block_index": {"a": 0, "b": 1}, "file_index": {"f0": 0, "f1": 1}}
    >>> _files_holding(index, {"f0", "f1"}, ["b"], ["f1", "f0"]), _files_holding(index, {"f0"}, ["b"], ["f1", "f0"])
    (['f1'], ['f0', 'f1'])
    """
    if isinstance(index, dict) and isinstance(index.get("block_index"), dict) \
            and isinstance(index.get("file_index"), dict):
        by_number = {number: name for name, number in index["file_index"].items() if name in names}
        try:
            files = {by_number.get(index["block_index"].get(key)) for key in keys}
        except TypeError:  # an unhashable number
            files = {None}
        if None not in files:
            return sorted(files)
    return sorted(otherwise)


def _layout(index, descriptions: dict, sizes: dict[str, int], names: list[str]) -> dict | None:
    """Where fastckpt's writer put every part of the tensor files ``names``, from the metadata alone: ``{stored
    key: (file, begin, end, shape)}`` (:meth:`_Share.headers`' form), or None where the metadata cannot say (an
    index not of fastckpt's form, a part without a plain dtype and shape, a file whose size leaves no room for a
    header).

    The writer (:func:`fastckpt.formats.safetensors.save_safetensors`) puts the parts in the safetensors reference
    order (dtype rank descending, then name) one after another, ending at the file's end, with the header before
    them: a file's first part starts at its size less the bytes of the parts ``index.json`` places in it. What the
    headers say decides (:meth:`_Share.with_headers`); this only lets them come with the ranges.

    >>> index = {"block_index": {"t.id/part_0_1": 0, "w/part_0_1": 0}, "file_index": {"f": 0}}
    >>> descriptions = {"t.id/part_0_1": {"dtype": "int64", "shape": [2]}, "w/part_0_1": {"dtype": "float32",
    ...                 "shape": [2, 2]}}
    >>> _layout(index, descriptions, {"f": 4096 + 32}, ["f"])
    {'t.id/part_0_1': ('f', 4096, 4112, [2]), 'w/part_0_1': ('f', 4112, 4128, [2, 2])}
    """
    from fastckpt._native.safetensors import DTYPE_RANK, NUMPY_DTYPES
    from fastckpt.formats.safetensors import dtype_to_safetensors
    from fastckpt.sharded.format import dtype_of

    try:
        numbers = {index["file_index"][name]: name for name in names}
        parts: dict[str, list] = {name: [] for name in names}
        for key, number in index["block_index"].items():
            name = numbers.get(number)
            if name is None:
                continue
            desc = descriptions[key]
            dtype = dtype_to_safetensors(dtype_of(desc["dtype"], key))
            shape = desc["shape"]
            if dtype not in NUMPY_DTYPES or type(shape) is not list or any(type(d) is not int or d < 0 for d in shape):
                return None  # packed, or not a shape
            count = 1
            for d in shape:
                count *= d
            parts[name].append((-DTYPE_RANK[dtype], key, shape, count * NUMPY_DTYPES[dtype].itemsize))
        out = {}
        for name in names:
            begin = sizes[name] - sum(nbytes for *_, nbytes in parts[name])
            if not parts[name] or not 8 <= begin <= 8 + MAX_HEADER_SIZE:
                return None
            for _, key, shape, nbytes in sorted(parts[name]):
                out[key] = (name, begin, begin + nbytes, shape)
                begin += nbytes
        return out
    except (KeyError, TypeError, ValueError, AttributeError, FormatError):
        return None


def _dense_span(desc: dict, where: tuple, lo: int, hi: int) -> tuple[int, int] | None:
    """The byte range of rows ``[lo, hi)`` of a dense tensor that its part (description ``desc``, stored at
    ``where``) holds: only those rows, which the Loader reads (``_load_dense``); the whole of a scalar; None where
    the part holds none of them.

    >>> _dense_span({"shape": [4, 2], "row_start": 8}, ("f", 100, 164, [4, 2]), 9, 20)
    (116, 164)
    >>> _dense_span({"shape": [4, 2], "row_start": 8}, ("f", 100, 164, [4, 2]), 0, 8) is None
    True
    """
    _, begin, end, _ = where
    if not desc["shape"]:
        return begin, end
    held = part_rows(desc.get("row_start", 0), desc["shape"], lo, hi)
    if held is None:
        return None
    row = (end - begin) // desc["shape"][0]
    return begin + held[0] * row, begin + held[1] * row


def _part_tensors(descriptions: dict, id_key: str, offsets: dict) -> list[str]:
    """The stored keys of the embedding and slot parts beside id part ``id_key`` (those the headers place)."""
    from fastckpt.sharded.format import parse_part_key

    table, part = descriptions[id_key]["table"], parse_part_key(id_key)[1:]
    return [key for key, desc in descriptions.items()
            if desc.get("table") == table and desc.get("role") in ("embedding", "slot")
            and parse_part_key(key)[1:] == part and key in offsets]


def _recis_plan(loader, share: _Share, manifest: dict | None) -> None:
    """RecIS's layout: dense blocks by rows; under RecIS's slice rule only the id parts whose slice meets the
    rank's and the rows of its slice (with another ``loader.owner``: every id part, the rows it owns). Of the
    tensor files, only the headers of those holding a block the rank reads (RecIS's ``index`` names them)."""
    import numpy as np

    from fastckpt.sharded import recis
    from fastckpt.sharded.format import owner_mod, rows_of

    metadata = [name for name in (recis.INDEX_FILE, recis.TENSORKEY_FILE, recis.DESCRIPTION_FILE)
                if name in share.sizes]
    share.fetch({name: [(0, share.sizes[name])] for name in metadata})
    index, tensorkey = share.json(recis.INDEX_FILE), share.json(recis.TENSORKEY_FILE)
    blocks: dict[str, dict[str, str]] = {}  # tensor -> {slice: stored key}
    for key in index.get("block_index", {}):
        tokens = [t for t in tensorkey.get(key, key).split("^") if t]
        if len(tokens) == 2:
            blocks.setdefault(tokens[0], {})[tokens[1]] = key
    dense_wanted = set(loader.tensors) or {t for t, b in blocks.items() if " " in b}
    tables = {t[:-3] for t in blocks if t.endswith("@id") and f"{t[:-3]}@embedding" in blocks}
    tables_wanted = set(loader.hashtables) or tables
    slice_rule = loader.owner in (None, owner_mod)
    # The blocks this rank reads, from the index and tensorkey.json alone: only their files' headers are fetched.
    read = []
    for tensor, by_slice in blocks.items():
        if " " in by_slice and tensor in dense_wanted:
            read.append(by_slice[" "])
        elif tensor.endswith("@id") and tensor[:-3] in tables_wanted:
            for piece, key in by_slice.items():
                part = recis.parse_slice(piece, key)
                mine = recis.gen_slice(loader.shard_index, loader.shard_num, part[2])
                if slice_rule and not (part[0] < mine[1] and mine[0] < part[1]):
                    continue
                read += [b[piece] for t, b in blocks.items() if t.startswith(f"{tensor[:-3]}@") and piece in b]
    files = _files_holding(index, set(share.sizes) - set(metadata), read,
                           [name for name in index.get("file_index", {}) if name in share.sizes])
    offsets = share.headers(files)
    blocks = {t: {piece: key for piece, key in b.items() if key in offsets} for t, b in blocks.items()}
    first: dict[str, list[tuple[int, int]]] = {}
    id_parts = []
    for tensor, by_slice in blocks.items():
        if " " in by_slice and tensor in dense_wanted:
            name, begin, end, shape = offsets[by_slice[" "]]
            if shape and loader.dense == "rows":
                lo, hi = rows_of(loader.shard_index, loader.shard_num, shape[0])
                row = (end - begin) // max(1, shape[0])
                begin, end = begin + lo * row, begin + hi * row
            first.setdefault(name, []).append((begin, end))
        elif tensor.endswith("@id") and tensor[:-3] in tables_wanted:
            for piece, key in by_slice.items():
                part = recis.parse_slice(piece, key)
                mine = recis.gen_slice(loader.shard_index, loader.shard_num, part[2])
                if slice_rule and not (part[0] < mine[1] and mine[0] < part[1]):
                    continue  # RecIS's loader never reads a part whose slice misses its own
                first.setdefault(offsets[key][0], []).append(offsets[key][1:3])
                id_parts.append((tensor[:-3], piece, key, mine))
    share.fetch(first)
    rows_plan: dict[str, list[tuple[int, int]]] = {}
    for table, piece, key, (begin, end, size) in id_parts:
        ids = share.ids(offsets[key])
        if not len(ids):
            continue
        if slice_rule:
            pos = recis._slice_positions(ids, size)
            mine = np.flatnonzero((pos >= begin) & (pos < end))
        else:
            mine = np.flatnonzero(recis.owners(loader.owner, ids, loader.shard_num, size) == loader.shard_index)
        if not len(mine):
            continue
        for tensor, by_slice in blocks.items():
            if tensor.startswith(f"{table}@") and tensor != f"{table}@id" and piece in by_slice:
                where = offsets[by_slice[piece]]
                rows_plan.setdefault(where[0], []).extend(_row_spans(mine, len(ids), where))
    share.fetch(rows_plan)
