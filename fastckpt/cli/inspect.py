"""``fastckpt inspect PATH``: what a tensor file or checkpoint holds, for people (a table) or machines (``--json``).

Shows the format, each tensor's dtype, shape, byte offset, size and alignment,
and the file's metadata; ``PATH`` is anything :func:`fastckpt.open` opens (a
training-checkpoint directory lists the tensors of all its files).
TensorFlow checkpoints (a prefix or a directory) are described by
:mod:`fastckpt.tf`.
"""

from __future__ import annotations

import json
import os
import sys

from fastckpt.words import command_line_wording, plural

__all__ = ["HELP", "describe", "add_parser", "run"]

HELP = "list a file's tensors, dtypes, shapes, offsets, alignment and metadata"


def describe(path: str | os.PathLike, *, max_header_size: int | None = None) -> dict:
    """A JSON-safe description of a tensor file (``max_header_size`` as in :func:`fastckpt.open`).

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> fastckpt.save_safetensors(p, {"w": np.zeros(3, np.float32)})
    >>> d = describe(p)
    >>> d["format"], d["tensors"][0]["name"], d["tensors"][0]["offset"] % 4096
    ('safetensors', 'w', 0)
    """
    from fastckpt.formats.tf.dtypes import quantized_name

    path = os.fspath(path)
    tf_describe = _tf_describer(path)
    if tf_describe is not None:
        return tf_describe(path)
    import fastckpt

    with fastckpt.open(path, max_header_size=max_header_size) as f:
        d = {"path": path, "format": f.format}
        if hasattr(f, "data_region"):  # one mapped file; a checkpoint directory spans several
            start, end = f.data_region
            d.update(file_bytes=f.mapped.size, data_region=[start, end])
        d["metadata"] = f.metadata
        d["tensors"] = [
            {
                "name": i.name,
                "dtype": quantized_name(i.dtype) or str(i.dtype),  # TensorFlow's qint8 ... by name
                "shape": list(i.shape),
                "offset": i.offset,
                "nbytes": i.nbytes,
                "alignment": i.alignment,
                "fortran_order": i.fortran_order,
                "compression": i.compression,
            }
            for i in f.infos.values()
        ]
        if getattr(f, "layout", None) == "RecIS":  # RecIS's own layout: its files, and whether it has a manifest
            d["layout"] = f.layout
            d["hashtables"] = f.hashtables()
            d["integrity"] = f.integrity or "none (RecIS checkpoint: no integrity record)"
            d["files"] = {name: os.path.getsize(tf.path) for name, tf in sorted(f.files.items())}
        elif hasattr(f, "hashtables"):  # a sharded checkpoint: its tables, with their id counts
            d["layout"] = "fastckpt"
            d["hashtables"] = f.hashtables()
            d["world_size"] = f.manifest["world_size"]
            d["files"] = {name: entry["size"] for name, entry in sorted(f.manifest["files"].items())}
            d["kind"] = f.manifest.get("kind", "full")
            if d["kind"] == "delta":  # what it holds is applied on its base
                d["base"] = f.manifest["base"]["path"]
                d["chain_length"] = f.manifest["chain_length"]
        return d


def _tf_describer(path: str):
    """``fastckpt.formats.tf.describe`` when ``path`` is a TensorFlow checkpoint, else None."""
    try:
        from fastckpt import tf
    except ImportError:
        return None
    is_tf = getattr(tf, "is_tf_checkpoint", None)
    if is_tf is not None and is_tf(path):
        return tf.describe
    return None


def _format_table(d: dict) -> str:
    lines = [f"{d['path']}: {d['format']}, {plural(len(d['tensors']), 'tensor')}"]
    for name, why in d.get("skipped", {}).items():  # opaque TensorFlow entries: not tensors, listed
        lines.append(f"skipped {name}: {why}")
    if "world_size" in d:  # a sharded checkpoint: its files and their sizes
        lines.append(f"{len(d['files'])} files, {sum(d['files'].values())} bytes, world size {d['world_size']}")
    if "layout" in d:
        lines.append(f"layout: {d['layout']}" + (f", integrity record: {d['integrity']}" if "integrity" in d else ""))
    if d.get("kind") == "delta":
        lines.append(f"delta {d['chain_length']} of a chain, on base {d['base']}")
    for name, t in d.get("hashtables", {}).items():
        change = f" ({t['written']} written, {t['deleted']} deleted since the base)" if "written" in t else ""
        row = t["shape"] if t.get("shape", [t["dim"]]) != [t["dim"]] else t["dim"]  # rows of shape [2, 3], say
        specs = t.get("slot_specs") or {}
        own = {s: f"{specs[s]['dtype']}{specs[s]['shape']}" for s in t["slots"] if s in specs and
               (specs[s]["shape"], specs[s]["dtype"]) != (t.get("shape", [t["dim"]]), t["dtype"])}
        slots = t["slots"] if not own else "[" + ", ".join(f"{s!r} {own[s]}" if s in own else repr(s)
                                                          for s in t["slots"]) + "]"
        lines.append(f"hashtable {name}: {t['ids']} ids x {row} {t['dtype']}, slots {slots}{change}")
    if d.get("metadata"):
        lines.append("metadata: " + json.dumps(d["metadata"], ensure_ascii=False))
    rows = [("name", "dtype", "shape", "offset", "nbytes", "align")]
    for t in d["tensors"]:
        rows.append((t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", str(t.get("offset", "")),
                     str(t.get("nbytes", "")), str(t.get("alignment", ""))))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def add_parser(subparsers):
    parser = subparsers.add_parser("inspect", help=HELP, description=HELP,
                                   epilog="exit status: 0, or 1 when PATH cannot be read (the reason on stderr)")
    parser.add_argument("file", metavar="PATH",
                        help="an NPZ/.netcl or safetensors file, a Hugging Face safetensors directory or index, a "
                             "TensorFlow checkpoint prefix/directory, a training checkpoint directory, or a sharded "
                             "checkpoint directory (fastckpt's or RecIS's layout)")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    parser.add_argument("--max-header-size", type=int, default=None, metavar="N",
                        help="raise the cap on each NPZ member's .npy header (default 10000 characters; "
                             "trusted files only)")
    return parser


def run(args) -> int:
    from fastckpt.errors import FastCkptError

    try:
        d = describe(args.file, max_header_size=getattr(args, "max_header_size", None))
    except (FastCkptError, OSError) as exc:
        print(f"fastckpt inspect: {command_line_wording(str(exc))}", file=sys.stderr)
        return 1
    print(json.dumps(d, indent=2, ensure_ascii=False) if args.json else _format_table(d))
    return 0
