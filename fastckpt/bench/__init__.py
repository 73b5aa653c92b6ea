"""Benchmarks of fastckpt against the usual ways of doing the same work, one suite per area.

Every suite is started the same way::

    python -m fastckpt bench [--suite SUITE] [suite options]     # or: fastckpt bench ...

``--suite`` (default ``device``) picks one of:

* ``device`` (:mod:`fastckpt.bench.device`): file -> OpenCL device loads, pooled
  and zero-copy, against ``enqueue_copy`` from RAM, safetensors and ``np.load``;
* ``formats`` (:mod:`fastckpt.bench.formats`): host-side open + views and saves
  of safetensors and NPZ files against ``np.load``, safetensors and raw writes;
* ``model`` (:mod:`fastckpt.bench.model`): ``load_model`` of model files against
  ``np.load`` and safetensors plus new buffers;
* ``tf`` (:mod:`fastckpt.bench.tf`): reading every tensor of a TensorFlow
  checkpoint against TensorFlow itself (its row left out without ``tensorflow``);
* ``train`` (:mod:`fastckpt.bench.train`): training checkpoint saves (sync and
  async) against a raw write + fsync, and verified loads;
* ``stateful`` (:mod:`fastckpt.bench.stateful`): reader throughput, state
  capture and checkpoint save/load of :mod:`fastckpt.stateful`;
* ``sharded`` (:mod:`fastckpt.bench.sharded`): sharded saves and loads of
  :mod:`fastckpt.sharded` (ranks as threads) against raw writes and reads of
  the same bytes, resharding, ``HashTable`` export/import, peak memory;
* ``incremental`` (:mod:`fastckpt.bench.incremental`): delta checkpoints of a
  sparse table against full saves (bytes, time) and chain restores against
  full restores;
* ``link`` (:mod:`fastckpt.bench.link`): the staged (discrete-GPU) load path
  over a simulated DMA link, against min(fill rate, link rate), and the sweep
  of its buffer count and chunk;
* ``s3`` (:mod:`fastckpt.bench.s3`): a safetensors file saved to and loaded
  from S3 (moto's server on loopback) against s3fs's own ``put``/``get``;
* ``torch`` (:mod:`fastckpt.bench.torchload`): a file to a trainable PyTorch
  state_dict (``load_torch``, ``to_torch``) against ``safetensors.torch.load_file``;
* ``cold`` (:mod:`fastckpt.bench.cold`): loads from files not in the page
  cache, a fresh process per measurement, against the plain read's bound and
  the peers that import (safetensors, fastsafetensors, Run:ai Model Streamer).

``python -m fastckpt bench --suite SUITE --help`` lists a suite's options. Each
suite module provides ``configure(parser)`` (its options) and ``run(args)``
(prints its tables, returns the exit status), and times its paths with
:func:`fastckpt.bench.timing.round_robin`: every path once per round, in a
shuffled order, so that changes in a shared machine's load hit every path alike.

>>> sorted(SUITES)  # doctest: +NORMALIZE_WHITESPACE
['cold', 'device', 'formats', 'incremental', 'link', 'memory', 'model', 'ranks', 's3', 'sharded', 'stateful', 'tf',
 'torch', 'train']
>>> main(["--suite", "stateful", "--quick", "--repeats", "1"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["SUITES", "DEFAULT_SUITE", "configure", "run", "main"]

# suite name -> the module that provides its configure(parser) and run(args)
SUITES = {
    "device": "fastckpt.bench.device",
    "formats": "fastckpt.bench.formats",
    "model": "fastckpt.bench.model",
    "tf": "fastckpt.bench.tf",
    "train": "fastckpt.bench.train",
    "stateful": "fastckpt.bench.stateful",
    "sharded": "fastckpt.bench.sharded",
    "ranks": "fastckpt.bench.ranks",
    "incremental": "fastckpt.bench.incremental",
    "s3": "fastckpt.bench.s3",
    "cold": "fastckpt.bench.cold",
    "memory": "fastckpt.bench.memory",
    "torch": "fastckpt.bench.torchload",
    "link": "fastckpt.bench.link",
}
DEFAULT_SUITE = "device"


def suite_of(argv: list[str] | None) -> str:
    """The suite a command line asks for (``--suite``), without looking at the other options.

    >>> suite_of(["bench", "--suite", "model", "--repeats", "3"]), suite_of(["--quick"])
    ('model', 'device')
    """
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--suite", default=DEFAULT_SUITE)
    known, _rest = peek.parse_known_args(sys.argv[1:] if argv is None else argv)
    return known.suite


def configure(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> None:
    """Add ``--suite`` and the options of the suite that ``argv`` (default: ``sys.argv[1:]``) names.

    The suite is read first because each suite has options of its own; an
    unknown suite adds none, and parsing then reports the bad ``--suite``.

    >>> parser = argparse.ArgumentParser()
    >>> configure(parser, ["--suite", "train", "--mib", "2"])
    >>> args = parser.parse_args(["--suite", "train", "--mib", "2"])
    >>> args.suite, args.mib, args.runs
    ('train', 2.0, 5)
    """
    parser.add_argument("--suite", choices=list(SUITES), default=DEFAULT_SUITE,
                        help=f"which benchmark to run (default {DEFAULT_SUITE}); the options below are that "
                             "suite's: --suite SUITE --help lists another's")
    suite = suite_of(argv)
    if suite in SUITES:
        importlib.import_module(SUITES[suite]).configure(parser)


def run(args: argparse.Namespace) -> int:
    """Run the suite ``args.suite`` with the options parsed for it; returns the exit status.

    >>> parser = argparse.ArgumentParser()
    >>> configure(parser, ["--suite", "stateful"])
    >>> run(parser.parse_args(["--suite", "stateful", "--quick", "--repeats", "1"]))  # doctest: +SKIP
    0
    """
    return int(importlib.import_module(SUITES[args.suite]).run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run a benchmark suite from a command line (``--suite`` and its options); the same as ``fastckpt bench``.

    >>> main(["--suite", "formats", "--quick", "--repeat", "1", "--case", "b"])  # doctest: +SKIP
    0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m fastckpt bench", description=__doc__.splitlines()[0])
    configure(parser, argv)
    return run(parser.parse_args(argv))
