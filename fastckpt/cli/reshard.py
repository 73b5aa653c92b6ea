"""``fastckpt reshard SRC DST --shards M``: rewrite a sharded checkpoint as saved by M ranks.

>>> import argparse
>>> parser = add_parser(argparse.ArgumentParser().add_subparsers())
>>> args = parser.parse_args(["ckpt/a", "ckpt/b", "--shards", "3"])
>>> args.src, args.dst, args.shards, args.parallel
('ckpt/a', 'ckpt/b', 3, None)
"""

from __future__ import annotations

import sys

from fastckpt.words import command_line_wording

__all__ = ["HELP", "add_parser", "run"]

HELP = ("rewrite a sharded checkpoint for another number of ranks (ids by their key-space slice, format version 4; "
        "dense rows split again)")


def add_parser(subparsers):
    parser = subparsers.add_parser("reshard", help=HELP, description=HELP)
    parser.add_argument("src", help="a sharded checkpoint directory")
    parser.add_argument("dst", help="where to write the resharded checkpoint")
    parser.add_argument("--shards", type=int, required=True, metavar="M", help="the number of ranks to write for")
    parser.add_argument("--parallel", type=int, default=None, metavar="P",
                        help="files per rank (default: the source's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at DST")
    parser.add_argument("--layout", choices=("fastckpt", "recis"), default=None,
                        help="the layout to write: fastckpt's, or RecIS's own (default: the source's)")
    parser.add_argument("--slice-size", type=int, default=None, metavar="S",
                        help="with --layout recis from fastckpt's layout: RecIS's key space (default: each table's "
                             "own, 65536 for format versions 1-3; a RecIS source keeps its tables' own)")
    return parser


def run(args) -> int:
    from fastckpt.errors import FastCkptError
    from fastckpt.sharded.reshard import reshard

    try:
        out = reshard(args.src, args.dst, args.shards, parallel=args.parallel, overwrite=args.overwrite,
                      progress=sys.stderr.isatty(), layout=getattr(args, "layout", None),
                      slice_size=getattr(args, "slice_size", None))
    except (FastCkptError, OSError, ValueError, RuntimeError) as exc:
        print(f"fastckpt reshard: {command_line_wording(str(exc))}", file=sys.stderr)
        return 1
    print(f"{out}: {args.shards} shards")
    return 0
