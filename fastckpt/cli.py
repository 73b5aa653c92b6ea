"""The ``fastckpt`` command: one sub-command per module, imported only when run.

Each module named in ``COMMANDS`` provides ``configure(parser)`` (add its
arguments) and ``run(args) -> int`` (the exit status). A module whose
arguments depend on the command line takes it too, as
``configure(parser, argv)``: ``fastckpt bench`` reads ``--suite`` first and
then adds that suite's options (see :mod:`fastckpt.bench`).

>>> main(["--version"])  # doctest: +SKIP
fastckpt 0.1.0
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

# sub-command -> (module, one-line help)
COMMANDS = {
    "demo": ("fastckpt.demo", "save and load a small model on the default device, with timings"),
    "inspect": ("fastckpt.inspect", "list a file's tensors, dtypes, shapes, offsets, alignment and metadata"),
    "convert": ("fastckpt.convert", "copy every tensor between TensorFlow checkpoints, safetensors and NPZ"),
    "bench": ("fastckpt.bench", "benchmark suites (--suite device|formats|model|tf|train|stateful; default device: "
                                "file-to-device loads) against the usual ways; markdown tables"),
    "verify": ("fastckpt.train.verify", "check a training checkpoint's manifest, file sizes and sha256 hashes"),
}


def build_parser(command: str | None = None, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``command``'s module is imported to add its arguments.

    ``argv`` is the command line, for a module whose arguments depend on it
    (``bench``: which ``--suite``).

    >>> build_parser("bench", ["bench", "--suite", "train"]).parse_args(["bench", "--suite", "train"]).runs
    5
    """
    from fastckpt import __version__

    parser = argparse.ArgumentParser(prog="fastckpt", description="Fast, exact checkpoints.")
    parser.add_argument("--version", action="version", version=f"fastckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            configure = importlib.import_module(module).configure
            if "argv" in inspect.signature(configure).parameters:
                configure(p, argv)
            else:
                configure(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``fastckpt`` command line with ``argv`` (default: ``sys.argv[1:]``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None, argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
