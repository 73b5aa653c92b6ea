"""The tensor files the device and formats benchmarks read: both formats, two layouts, written once per run."""

from __future__ import annotations

import os

from fastckpt.bench.formats import random_tensors, save_as

FORMATS = ["safetensors", "npz"]
LAYOUTS = {"64x256KiB": (64, 65536), "1000x4KiB": (1000, 1024)}


def tensors(layout: str) -> dict:
    """The tensors of ``layout`` (deterministic: the same every run)."""
    return random_tensors(*LAYOUTS[layout])


class Files:
    """Benchmarks over every format x layout; ``setup_cache`` writes the files and passes their paths."""

    params = (FORMATS, list(LAYOUTS))
    param_names = ["format", "layout"]

    def setup_cache(self):
        paths = {}
        for fmt in FORMATS:
            for layout in LAYOUTS:
                paths[fmt, layout] = path = os.path.abspath(f"{layout}.{fmt}")
                save_as(path, fmt, tensors(layout))
        return paths
