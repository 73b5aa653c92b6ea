"""The ``fastckpt`` command: one module per sub-command, ``fastckpt.cli.<command>``.

Each command module provides ``HELP`` (its one-line help), ``add_parser(subparsers)``
(adds its sub-parser with its arguments, and returns it) and ``run(args) -> int``
(the exit status). The command modules are light to import: what a command
needs is imported when it is configured or run, so ``fastckpt inspect`` never
imports the benchmarks. Only the command being run
gets its arguments; the others are listed with their help. A command whose
arguments depend on the command line takes it too, as
``add_parser(subparsers, argv)``: ``fastckpt bench`` reads ``--suite`` first
and then adds that suite's options (see :mod:`fastckpt.bench`).

>>> sorted(COMMANDS)
['bench', 'compact', 'convert', 'demo', 'inspect', 'reshard', 'verify']
>>> main(["--version"])  # doctest: +SKIP
fastckpt 0.5.0
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from inspect import signature

from fastckpt.cli import bench, compact, convert, demo, inspect, reshard, verify

__all__ = ["COMMANDS", "build_parser", "main"]

_python_showwarning = warnings.showwarning

# sub-command -> its module (HELP, add_parser(subparsers), run(args)), in the order `fastckpt --help` lists them
COMMANDS = {"demo": demo, "inspect": inspect, "convert": convert, "reshard": reshard, "compact": compact,
            "bench": bench, "verify": verify}


def build_parser(command: str | None = None, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``command``'s module adds its arguments (and imports what they need).

    ``argv`` is the command line, for a module whose arguments depend on it
    (``bench``: which ``--suite``).

    >>> build_parser("bench", ["bench", "--suite", "train"]).parse_args(["bench", "--suite", "train"]).runs
    5
    >>> build_parser("inspect").parse_args(["inspect", "--json", "m.npz"]).json
    True
    """
    from fastckpt import __version__

    parser = argparse.ArgumentParser(prog="fastckpt", description="Fast, exact checkpoints.")
    parser.add_argument("--version", action="version", version=f"fastckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if name != command:
            p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        elif "argv" in signature(module.add_parser).parameters:
            p = module.add_parser(sub, argv)
        else:
            p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``fastckpt`` command line with ``argv`` (default: ``sys.argv[1:]``).

    fastckpt's own warnings (a compressed NPZ member copied instead of mapped
    ...) print as one ``fastckpt: warning: ...`` line on stderr, without
    Python's file and line; output cut short by its reader (``fastckpt
    inspect m.npz | head -1``) ends the command quietly, as ``head`` expects.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None, argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            status = int(args._run(args) or 0)
            sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        except BrokenPipeError:
            # The reader has gone: later writes (and the exit's flush) must not fail again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 141  # 128 + SIGPIPE, what a shell reports for a command its pipe closed
    return status


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """fastckpt's warnings as a command's one line; anything else as Python prints it."""
    from fastckpt.errors import FastCkptWarning

    if not issubclass(category, FastCkptWarning):
        _python_showwarning(message, category, filename, lineno, file, line)
        return
    print(f"fastckpt: warning: {message}", file=file or sys.stderr)
