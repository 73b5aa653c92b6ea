"""The ``torch`` suite: a safetensors file to a PyTorch state_dict that can be trained, against safetensors.

``python -m fastckpt bench --suite torch`` writes one safetensors file
(``--mib``, default 256 MiB, in 64 float32 tensors; the page cache warm) and
times, side by side (:func:`fastckpt.bench.timing.round_robin`):

* ``fastckpt.load_torch(path)``: the file mapped copy-on-write, every tensor a
  writable zero-copy view;
* ``fastckpt.to_torch(fastckpt.open(path).hosts())``: the host path; the
  read-only mapped views are copied (``to_torch``'s default);
* ``fastckpt.to_torch(f.hosts(), copy=False)``: zero-copy read-only tensors
  (writes raise);
* ``safetensors.torch.load_file(path)``, the baseline;

each once as the call alone ("load"), and once followed by one in-place write
to every tensor (``add_(1)``, what an optimizer step does to every parameter:
"load + write"), since a copy-on-write mapping pays its copies at the first
write (the read-only path has no such row: it cannot be written to). Ratios
are against ``safetensors.torch.load_file`` of the same row. The suite needs
torch and safetensors; without them it says so and exits 2.

>>> from fastckpt.cli import main
>>> main(["bench", "--suite", "torch", "--quick"])  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from fastckpt.bench.timing import format_duration, format_ratio, round_robin, table_lines

__all__ = ["configure", "run", "measure"]

TENSORS = 64


def configure(parser) -> None:
    """Add the torch suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> parser.parse_args([]).mib, parser.parse_args([]).repeat, parser.parse_args(["--quick"]).quick
    (256.0, 7, True)
    """
    parser.add_argument("--quick", action="store_true", help="an 8 MiB file and 2 rounds (a smoke run)")
    parser.add_argument("--mib", type=float, default=256.0, help="file size in MiB (default 256), 64 tensors")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (default 7)")


def measure(mib: float, repeat: int) -> dict[str, dict[str, tuple[float, float]]]:
    """``{row: {path: (median, best)}}`` for a file of ``mib`` MiB (rows ``"load"`` and ``"load + write"``)."""
    import safetensors.torch
    import torch

    import fastckpt

    elements = max(1, int(mib * (1 << 20)) // 4 // TENSORS)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-torch-") as tmp:
        path = os.path.join(tmp, "model.safetensors")
        fastckpt.save_safetensors(path, {f"layer.{i}.weight": rng.standard_normal(elements, np.float32)
                                         for i in range(TENSORS)})

        def host_path(copy):
            with fastckpt.open(path) as f:
                return fastckpt.to_torch(f.hosts(), copy=copy)

        loads = {
            "fastckpt.load_torch (copy-on-write map)": lambda: fastckpt.load_torch(path),
            "fastckpt.to_torch(f.hosts()) (copies)": lambda: host_path(None),
            "fastckpt.to_torch(f.hosts(), copy=False) (read-only)": lambda: host_path(False),
            "safetensors.torch.load_file": lambda: safetensors.torch.load_file(path),
        }

        def written(load):
            def run():
                tensors = load()
                with torch.no_grad():
                    for t in tensors.values():
                        t.add_(1)
                return tensors
            return run

        writes = {name: written(fn) for name, fn in loads.items() if "read-only" not in name}
        out = {}
        for row, paths in (("load", loads), ("load + write", writes)):
            out[row] = {name: (t.median, t.best) for name, t in round_robin(paths, repeat).items()}
    return out


def run(args) -> int:
    """Run the suite; prints one markdown table per row kind, returns 0 (2 without torch or safetensors)."""
    if args.quick:
        args.mib, args.repeat = min(args.mib, 8.0), min(args.repeat, 2)
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    try:
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        print(f"the torch suite needs torch and safetensors ({e}); pip install torch safetensors")
        return 2
    results = measure(args.mib, args.repeat)
    print(f"{args.mib:g} MiB safetensors file, {TENSORS} float32 tensors, page cache warm, "
          f"{args.repeat} rounds; ratio: median / safetensors.torch.load_file's median\n")
    for row, paths in results.items():
        base = paths["safetensors.torch.load_file"][0]
        print(f"### {row}\n")
        print("\n".join(table_lines(["path", "median", "best", "vs safetensors"],
                                    [[name, format_duration(med), format_duration(best), format_ratio(med / base)]
                                     for name, (med, best) in paths.items()], "lrrr")))
        print()
    return 0
