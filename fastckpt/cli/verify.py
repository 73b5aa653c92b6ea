"""``fastckpt verify DIR``: check a training checkpoint, or a directory of them, without loading it.

The checks, their arguments and the report are :mod:`fastckpt.train.verify`'s;
this module puts them on the command line.

>>> import argparse
>>> parser = add_parser(argparse.ArgumentParser().add_subparsers())
>>> args = parser.parse_args(["--no-hash", "runs/exp1"])
>>> args.directory, args.no_hash, args.quiet
('runs/exp1', True, False)
"""

from __future__ import annotations

__all__ = ["HELP", "add_parser", "run"]

HELP = "check a training checkpoint's manifest, file sizes and sha256 hashes"


def add_parser(subparsers):
    from fastckpt.train.verify import configure

    parser = subparsers.add_parser("verify", help=HELP, description=HELP)
    configure(parser)
    return parser


def run(args) -> int:
    from fastckpt.train.verify import run

    return run(args)
