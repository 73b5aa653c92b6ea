"""``fastckpt bench [--suite SUITE] [suite options]``: the benchmark suites of :mod:`fastckpt.bench`.

The suite is read from the command line first, because each suite has options
of its own: ``add_parser(subparsers, argv)`` adds ``--suite`` and that suite's
options, and ``run(args)`` runs it (see :func:`fastckpt.bench.configure`).

>>> import argparse
>>> parser = add_parser(argparse.ArgumentParser().add_subparsers(), ["bench", "--suite", "train"])
>>> args = parser.parse_args(["--suite", "train", "--mib", "2"])
>>> args.suite, args.mib, args.runs
('train', 2.0, 5)
"""

from __future__ import annotations

__all__ = ["HELP", "add_parser", "run"]

HELP = ("benchmark suites (--suite device|formats|model|tf|train|stateful|sharded|incremental|s3|memory|torch|link|"
        "cold; "
        "default device: file-to-device loads) against the usual ways; markdown tables")


def add_parser(subparsers, argv: list[str] | None = None):
    """Add ``bench`` with ``--suite`` and the options of the suite that ``argv`` (default: ``sys.argv[1:]``) names."""
    from fastckpt.bench import configure

    parser = subparsers.add_parser("bench", help=HELP, description=HELP)
    configure(parser, argv)
    return parser


def run(args) -> int:
    from fastckpt.bench import run

    return run(args)
