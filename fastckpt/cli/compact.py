"""``fastckpt compact SRC DST``: fold a chain of delta checkpoints into one full sharded checkpoint.

>>> import argparse
>>> parser = add_parser(argparse.ArgumentParser().add_subparsers())
>>> args = parser.parse_args(["ckpt/step-9", "ckpt/full-9"])
>>> args.src, args.dst, args.shards, args.parallel
('ckpt/step-9', 'ckpt/full-9', None, None)
"""

from __future__ import annotations

import sys

from fastckpt.words import command_line_wording

__all__ = ["HELP", "add_parser", "run"]

HELP = "write the state at a delta checkpoint (its whole chain applied) as one full sharded checkpoint"


def add_parser(subparsers):
    parser = subparsers.add_parser("compact", help=HELP, description=HELP)
    parser.add_argument("src", help="a sharded checkpoint: the head of a chain of deltas, or a full one")
    parser.add_argument("dst", help="where to write the full checkpoint")
    parser.add_argument("--shards", type=int, default=None, metavar="M",
                        help="the number of ranks to write for (default: the source's)")
    parser.add_argument("--parallel", type=int, default=None, metavar="P",
                        help="files per rank (default: the source's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at DST")
    return parser


def run(args) -> int:
    from fastckpt.errors import FastCkptError
    from fastckpt.sharded.chain import resolve_chain
    from fastckpt.sharded.reshard import compact

    try:
        links = len(resolve_chain(args.src))
        out = compact(args.src, args.dst, shards=args.shards, parallel=args.parallel, overwrite=args.overwrite,
                      progress=sys.stderr.isatty())
    except (FastCkptError, OSError, ValueError, RuntimeError) as exc:
        print(f"fastckpt compact: {command_line_wording(str(exc))}", file=sys.stderr)
        return 1
    print(f"{out}: one full checkpoint from a chain of {links}")
    return 0
