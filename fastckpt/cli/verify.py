"""``fastckpt verify PATH``: check a checkpoint, a directory of them, or a tensor file, without loading it.

For one checkpoint (a directory holding ``manifest.json``) it checks the
manifest (format, schema version, required keys), that every listed file
exists with its recorded size and hash (BLAKE3, or sha256 where the
manifest names it: saves with ``hash="sha256"`` and checkpoints of schema
1.0), that the weights and optimizer trees and their ``ALIAS(...)`` entries
resolve, and that ``extra.json`` decodes (:func:`fastckpt.train.verify_checkpoint`). For a directory of
``step-<N>`` checkpoints (a :class:`~fastckpt.train.CheckpointManager`
directory) it checks each one and lists leftovers of interrupted saves. It
prints one line per problem and exits 1 when there is any, 0 otherwise. A
sharded checkpoint (:mod:`fastckpt.sharded`) is checked against its manifest:
the manifest's own checksum (format version 3), every file's size and BLAKE3
hash, the index, key and description files against each other and against
the tensor files' headers (every dense row stored once, shapes, dtypes and
counts); for a checkpoint of an older version it says what it could not check.
A Hugging Face safetensors directory (or the path of its index) is checked
shard by shard: every header parses, every file ends where its header's data
section ends, every name of the index is in the shard it names, and no shard
holds tensors the index leaves out. One tensor file is checked as
:func:`fastckpt.open` checks it, and then by the checksums its format carries
(NPZ: each member's CRC-32; a TensorFlow checkpoint: each tensor's CRC32C).

>>> import tempfile, os
>>> from fastckpt.train import TinyLM, save_checkpoint
>>> out = os.path.join(tempfile.mkdtemp(), "c")
>>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=0)
>>> from fastckpt.cli import main
>>> main(["verify", "--quiet", out])
0
"""

from __future__ import annotations

import argparse
import os
import json
import sys
from pathlib import Path

from fastckpt.store.names import parse_step
from fastckpt.words import plural

__all__ = ["HELP", "add_parser", "run"]

HELP = ("check a training or sharded checkpoint's manifest, file sizes and file hashes "
        "(BLAKE3, or sha256 where the manifest names it), a Hugging Face directory, a TensorFlow checkpoint "
        "(every tensor's CRC32C) or a tensor file")
_EPILOG = "exit status: 0 when every check passed, 1 when a problem was found (each printed under FAIL)"


def add_parser(subparsers):
    parser = subparsers.add_parser("verify", help=HELP, description=HELP, epilog=_EPILOG)
    _arguments(parser)
    return parser


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="PATH",
                        help="a training or sharded (fastckpt or RecIS layout) checkpoint directory, a directory of "
                             "step-<N> checkpoints, a Hugging Face safetensors directory or index, a TensorFlow "
                             "checkpoint prefix, .index or directory, or one tensor file (NPZ, safetensors)")
    parser.add_argument("--no-hash", action="store_true", help="check sizes and structure only, skip each file's hash")
    parser.add_argument("-q", "--quiet", action="store_true", help="print problems only")


def _verify_one(path: Path, hashes: bool, quiet: bool, out) -> int:
    from fastckpt.train.checkpoint import read_manifest, verify_checkpoint, weights_digest

    problems = verify_checkpoint(path, hashes=hashes, progress=sys.stderr.isatty())
    if problems or quiet:
        return _report(path, problems, "", out)
    m = read_manifest(path)
    return _report(path, [], f"step={m['step']} epoch={m['epoch']} weights={weights_digest(m)}"
                             f"{'' if hashes else ' (hashes not checked)'}", out)


def _report(path: Path, problems: list[str], ok: str, out) -> int:
    """``FAIL`` and one line per problem (1), else ``OK`` with ``ok`` when it says something (0)."""
    if problems:
        print(f"FAIL {path}", file=out)
        for p in problems:
            print(f"  - {p}", file=out)
        return 1
    if ok:
        print(f"OK   {path}  {ok}", file=out)
    return 0


def _verify_sharded(path: Path, hashes: bool, quiet: bool, out) -> int:
    """A sharded checkpoint, and for a delta every checkpoint of its chain (the links and their files)."""
    from fastckpt.errors import FastCkptError
    from fastckpt.sharded.chain import resolve_chain
    from fastckpt.sharded.format import MANIFEST_FILE
    from fastckpt.sharded.reader import CheckpointReader

    problems, chain, unchecked = [], [], []
    try:
        chain = resolve_chain(path)
        for link, _ in chain:
            where = "" if Path(link) == path.absolute() else f"{link}: "
            with CheckpointReader(link, verify=False) as reader:  # opening checks the metadata
                if not hashes:  # every tensor file's size and header against it (verify() does so as it hashes)
                    list(reader.files.values())
                problems += [where + p for p in (reader.verify(progress=sys.stderr.isatty()) if hashes else [])]
                unchecked += [where + u for u in reader.unchecked]
                stray = sorted(set(os.listdir(link)) - set(reader.manifest["files"]) - {MANIFEST_FILE})
                if stray:
                    problems.append(f"{where}holds {len(stray)} file(s) its manifest does not list: {stray[:4]} "
                                    "(not part of the checkpoint: left by another save, or copied in)")
    except (FastCkptError, OSError) as exc:
        problems.append(str(exc))
    if problems or quiet:
        return _report(path, problems, "", out)
    m = chain[-1][1]
    kind = f" delta on a chain of {len(chain)} checkpoints" if len(chain) > 1 else ""
    status = _report(path, [], f"sharded{kind}: format version {m['format_version']} world_size={m['world_size']} "
                               f"parallel={m['parallel']} files={len(m['files'])}"
                               f"{'' if hashes else ' (hashes not checked)'}", out)
    for note in unchecked:
        print(f"  not checked: {note}", file=out)
    return status


_HF_MARKERS = ("model.safetensors", "model.safetensors.index.json")
_HF_INDEX_SUFFIX = ".safetensors.index.json"


def _opened(path: Path, problems: list[str]):
    """``fastckpt.open(path)``, its warnings (tensors the index leaves out, a wrong total_size) added to
    ``problems``; None, the error added, when it does not open."""
    import warnings

    import fastckpt
    from fastckpt.errors import FastCkptError, FastCkptWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FastCkptWarning)
        try:
            reader = fastckpt.open(path)
        except (FastCkptError, OSError) as exc:
            reader = None
            problems.append(str(exc))
    problems += [str(w.message) for w in caught if issubclass(w.category, FastCkptWarning)]
    return reader


def _verify_hf(path: Path, quiet: bool, out) -> int:
    """A Hugging Face safetensors directory (or its index file): every shard's header and size, the index's names."""
    problems: list[str] = []
    reader = _opened(path, problems)
    if reader is None:
        return _report(path, problems, "", out)
    with reader:  # opening parsed every shard's header and checked its size against it
        summary = (f"hugging face safetensors: {plural(len(reader.files), 'file')}, "
                   f"{plural(len(reader.infos), 'tensor')} "
                   f"({reader.index_path or 'one file'}); headers, sizes and the index's names checked "
                   "(safetensors stores no checksums)")
    return _report(path, problems, "" if quiet else summary, out)


def _verify_file(path: Path, hashes: bool, quiet: bool, out) -> int:
    """One tensor file: what ``fastckpt.open`` checks, then the checksums the format carries (NPZ's CRC-32 per
    member, TensorFlow's CRC32C per tensor) unless ``--no-hash``."""
    from fastckpt.errors import FastCkptError

    if path.name.endswith(_HF_INDEX_SUFFIX):
        return _verify_hf(path, quiet, out)
    problems: list[str] = []
    reader = _opened(path, problems)
    if reader is None:
        return _report(path, problems, "", out)
    checked = "header and sizes checked"
    with reader:
        try:
            if reader.format == "npz" and hashes:
                from fastckpt.formats.npz import verify_member

                for info in reader.infos.values():
                    verify_member(reader.mapped, info)
                checked = "every member's CRC-32 checked"
            elif reader.format == "tensorflow" and hashes:
                for name in reader.keys():
                    reader.read_tensor(name)  # checks the tensor's CRC32C
                checked = "every tensor's CRC32C checked"
            elif reader.format == "safetensors":
                checked += " (safetensors stores no checksums)"
        except (FastCkptError, OSError) as exc:
            problems.append(str(exc))
        summary = f"{reader.format}: {plural(len(reader.keys()), 'tensor')}, {checked}"
    return _report(path, problems, "" if quiet else summary, out)


def _verify_recis(path: Path, hashes: bool, quiet: bool, out) -> int:
    """A directory in RecIS's layout: its structure (index, tensorkey.json, every file's header), and its files
    against fastckpt's manifest where a ``layout="recis"`` save left one (RecIS itself writes none)."""
    import warnings

    from fastckpt.errors import FastCkptError
    from fastckpt.sharded.recis import NO_INTEGRITY, RecisCheckpointReader, RecisWarning

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecisWarning)  # said below, on the result line
            with RecisCheckpointReader(path) as reader:
                if not hashes:  # every tensor file's header against the metadata (verify() does so as it hashes)
                    list(reader.files.values())
                problems = reader.verify(progress=sys.stderr.isatty()) if hashes else []
                files, manifest = len(reader.files), reader.manifest
    except (FastCkptError, OSError) as exc:
        return _report(path, [str(exc)], "", out)
    if problems or quiet:
        return _report(path, problems, "", out)
    if manifest is None:
        return _report(path, [], f"sharded, RecIS layout: {files} tensor files; {NO_INTEGRITY} (structure "
                                 "checked, no hashes to check)", out)
    return _report(path, [], f"sharded, RecIS layout with fastckpt's manifest: world_size={manifest['world_size']} "
                             f"parallel={manifest['parallel']} files={len(manifest['files'])}"
                             f"{'' if hashes else ' (hashes not checked)'}", out)


def _manifest_format(manifest: Path):
    """The ``format`` a ``manifest.json`` names, or None: a sharded or RecIS-layout checkpoint that lost one of
    its own files is verified (and the loss reported) as what it is, not as a training checkpoint."""
    try:
        with open(manifest, "rb") as f:
            head = f.read(64 << 20)  # as train.format bounds a manifest
        return json.loads(head.decode("utf-8")).get("format")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


def run(args: argparse.Namespace, out=None) -> int:
    from fastckpt.sharded.format import DESCRIPTION_FILE
    from fastckpt.train.format import MANIFEST_FILE

    out = out or sys.stdout
    d = Path(args.directory)
    if d.is_file() or (not d.exists() and Path(str(d) + ".index").is_file()):
        return _verify_file(d, not args.no_hash, args.quiet, out)
    if not d.is_dir():
        print(f"FAIL {d}: no such file or directory", file=out)
        return 1
    if any((d / marker).is_file() for marker in _HF_MARKERS) or any(d.glob(f"*{_HF_INDEX_SUFFIX}")):
        return _verify_hf(d, args.quiet, out)
    from fastckpt.sharded import recis
    from fastckpt.sharded.format import FORMAT as SHARDED

    said = _manifest_format(d / MANIFEST_FILE)
    if recis.is_recis_directory(d) or said == recis.FORMAT:
        return _verify_recis(d, not args.no_hash, args.quiet, out)
    if (d / DESCRIPTION_FILE).exists() or said == SHARDED:
        return _verify_sharded(d, not args.no_hash, args.quiet, out)
    if (d / MANIFEST_FILE).exists():
        return _verify_one(d, not args.no_hash, args.quiet, out)
    if (d / "checkpoint").is_file() or any(d.glob("*.index")):  # a TensorFlow checkpoint's directory
        return _verify_file(d, not args.no_hash, args.quiet, out)
    steps = sorted((step, e) for e in d.iterdir() if (step := parse_step(e.name)) is not None and e.is_dir())
    if not steps:
        print(f"FAIL {d}: neither a checkpoint ({MANIFEST_FILE} missing) nor a directory of step-<N> checkpoints", file=out)
        return 1
    status = 0
    for _, path in steps:
        status |= _verify_one(path, not args.no_hash, args.quiet, out)
    partials = sorted(e.name for e in d.iterdir() if e.name.endswith(".partial"))
    if partials and not args.quiet:
        print(f"note: {len(partials)} leftover(s) of interrupted saves or deletions (removed by the next save "
              f"once their process is gone): {', '.join(partials)}", file=out)
    return status
