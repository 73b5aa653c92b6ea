"""``fastckpt convert SRC DST``: copy every tensor between TensorFlow checkpoints, safetensors and NPZ.

The work is :func:`fastckpt.formats.convert.convert` (its docstring says what is
carried and what is refused); this module adds the arguments and prints the
summary, with what was left out on stderr.

>>> import argparse
>>> parser = add_parser(argparse.ArgumentParser().add_subparsers())
>>> args = parser.parse_args(["run/ckpt-3", "model.safetensors", "--skip-unsupported"])
>>> args.to, args.skip_unsupported, args.shards, args.alignment
(None, True, 1, 1)
"""

from __future__ import annotations

import sys

from fastckpt.formats.convert import FORMATS, convert
from fastckpt.words import command_line_wording, plural

__all__ = ["HELP", "add_parser", "run"]

HELP = "copy every tensor between TensorFlow checkpoints, safetensors and NPZ"


def add_parser(subparsers):
    parser = subparsers.add_parser("convert", help=HELP, description=HELP)
    parser.add_argument("src", help="a TensorFlow checkpoint (prefix, .index or directory), .safetensors or .npz file")
    parser.add_argument("dst", help="the file to write, or a TensorFlow checkpoint prefix such as out/ckpt-1")
    parser.add_argument("--to", choices=FORMATS,
                        help="destination format (default: from DST's suffix: .safetensors, .npz, .index; a "
                             "TensorFlow prefix such as out/ckpt-1 needs --to tf)")
    parser.add_argument("--object-graph", action="store_true",
                        help="TensorFlow destination: store object-based keys and a _CHECKPOINTABLE_OBJECT_GRAPH so "
                             "that tf.train.Checkpoint.restore works")
    parser.add_argument("--skip-unsupported", action="store_true",
                        help="leave out every tensor the destination cannot hold: strings, dtypes it lacks "
                             "(instead of failing)")
    parser.add_argument("--quantized-as-ints", action="store_true",
                        help="safetensors destination: store TensorFlow qint8/quint8/... tensors as their integers, "
                             "each type recorded in the metadata (a conversion back to tf restores it)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--shards", type=int, default=1, help="TensorFlow destination: number of data files")
    parser.add_argument("--alignment", type=int, default=1,
                        help="TensorFlow destination: start every tensor at a multiple of this many bytes")
    return parser


def run(args) -> int:
    from fastckpt.errors import FastCkptError

    try:
        summary = convert(args.src, args.dst, to=args.to, object_graph=args.object_graph,
                          skip_unsupported=args.skip_unsupported, quantized_as_ints=args.quantized_as_ints,
                          overwrite=args.overwrite, num_shards=args.shards,
                          data_alignment=args.alignment, progress=sys.stderr.isatty())
    except (FastCkptError, OSError, TypeError, ValueError) as exc:
        print(f"fastckpt convert: {command_line_wording(str(exc))}", file=sys.stderr)
        return 1
    print(f"{args.src} ({summary['source']}) -> {summary['path']} ({summary['destination']}): "
          f"{plural(summary['tensors'], 'tensor')}")
    for name in summary["dropped"]:
        what = "metadata (a TensorFlow checkpoint/NPZ has no place for it)" if name == "metadata" else \
            f"{name} (bookkeeping; --object-graph rebuilds it when converting back to tf)"
        print(f"  left out: {what}", file=sys.stderr)
    for name in summary["skipped"]:
        print(f"  skipped {name}: {summary['reasons'].get(name, 'not supported by the destination')}", file=sys.stderr)
    for name, qname in summary["quantized"].items():
        how = "stored as integers, type in the metadata" if summary["destination"] == "safetensors" else "restored"
        print(f"  {qname}: {name} ({how})", file=sys.stderr)
    if summary["needs_object_graph"]:
        print("  note: the keys are object-based (.../.ATTRIBUTES/...) but no object graph was written; "
              "tf.train.Checkpoint.restore needs one: convert again with --object-graph", file=sys.stderr)
    return 0
