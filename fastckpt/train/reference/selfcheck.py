"""Round-trip self-check of training checkpoints; writes ``roundtrip_results.json``.

``python -m fastckpt.train.reference.selfcheck OUT_DIR`` trains the reference model a
few steps, saves, reloads into fresh objects and measures — it does not
assume — that:

* every state machine (model, optimizer, scheduler, data iterator, training
  RNG, loss scaler) is byte-equal after the round trip;
* a run checkpointed at step 10 and resumed in fresh objects produces the
  same 20 losses, bit for bit, as a run that never stopped;
* tied weights are stored once (file size against the unique parameter
  bytes) and come back as one array;
* a save interrupted at its rename leaves no checkpoint, and the next save
  succeeds and leaves no temporary behind.

It writes ``OUT_DIR/roundtrip_results.json`` (the fields below), the checkpoint
it made (``OUT_DIR/checkpoint``) and a copy of that checkpoint's manifest
(``OUT_DIR/manifest.json``), and exits 0 only when every check passed.

The builders and comparison helpers here are the ones the test-suite uses.

>>> objs = build_fresh(seed=0)
>>> losses = train_n_steps(objs, 2)
>>> len(losses), byte_equal(capture_full_state(objs), capture_full_state(objs))
(2, True)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from fastckpt.store.commit import atomic_write
from fastckpt.train.checkpoint import SCHEMA_VERSION, WEIGHTS_FILE, apply_checkpoint, load_checkpoint, save_checkpoint
from fastckpt.train.reference.data import ShuffledTokenBatches
from fastckpt.train.reference.model import TinyLM, train_step
from fastckpt.train.reference.optim import SGD, Adam, AdamW
from fastckpt.train.reference.scaler import GradScaler
from fastckpt.train.reference.sched import CosineWarmupLR, ReduceLROnPlateau, StepLR

__all__ = ["TrainObjects", "build_fresh", "train_n_steps", "capture_full_state", "byte_equal", "first_difference",
           "unique_param_bytes", "run_selfcheck", "MACHINES"]

MACHINES = ("model", "optimizer", "scheduler", "data_iter", "train_rng", "scaler")

OPTIMIZERS = {
    "sgd": lambda params: SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda params: Adam(params, lr=1e-2, weight_decay=1e-4),
    "adamw": lambda params: AdamW(params, lr=1e-2, weight_decay=0.05),
}
SCHEDULERS = {
    "step": lambda opt: StepLR(opt, step_size=4, gamma=0.7),
    "cosine": lambda opt: CosineWarmupLR(opt, warmup_steps=5, total_steps=40, min_lr=1e-4),
    "plateau": lambda opt: ReduceLROnPlateau(opt, factor=0.5, patience=1, threshold=0.05),
}


@dataclass
class TrainObjects:
    """The live state machines of one training run."""

    model: TinyLM
    optimizer: Any
    scheduler: Any
    data_iter: ShuffledTokenBatches
    train_rng: np.random.Generator
    scaler: GradScaler

    def save_args(self) -> tuple:
        """Positional arguments of ``save_checkpoint`` / ``apply_checkpoint`` after the model."""
        return (self.model, self.optimizer, self.scheduler, self.data_iter, self.train_rng)


def build_fresh(seed: int = 42, *, optimizer: str = "adamw", scheduler: str = "cosine", tie_weights: bool = True,
                num_tokens: int = 3000, vocab: int = 64, dim: int = 32, hidden: int = 64,
                bit_generator: str = "PCG64") -> TrainObjects:
    """Fresh objects for a run, all derived from ``seed`` (the data itself is fixed).

    The loss scaler starts just above the float32 limit (2**129) so that within
    the first ten steps it both grows and backs off after an overflow (skipping
    steps): a checkpoint at step 10 holds a scaler that went both ways.
    """
    tokens = np.random.default_rng(20240601).integers(0, vocab, num_tokens).astype(np.int32)
    tokens[1::2] = (tokens[::2][: len(tokens[1::2])] * 5 + 3) % vocab  # learnable structure
    model = TinyLM(vocab=vocab, dim=dim, hidden=hidden, tie_weights=tie_weights, dropout=0.1, seed=seed)
    opt = OPTIMIZERS[optimizer](model.parameters())
    sched = SCHEDULERS[scheduler](opt)
    data = ShuffledTokenBatches(tokens, batch_size=8, seq_len=16, seed=seed)
    rng = np.random.Generator(getattr(np.random, bit_generator)(seed))
    scaler = GradScaler(init_scale=2.0**129, growth_interval=2)
    return TrainObjects(model, opt, sched, data, rng, scaler)


def train_n_steps(objs: TrainObjects, n: int) -> list[np.float32]:
    """Run ``n`` training steps; returns the losses (float32, exact)."""
    return [train_step(objs.model, objs.optimizer, objs.scheduler, objs.data_iter, objs.train_rng, objs.scaler)
            for _ in range(n)]


def capture_full_state(objs: TrainObjects) -> dict[str, Any]:
    """Deep copies of every state machine's state, keyed by :data:`MACHINES`."""
    return {
        "model": copy.deepcopy(objs.model.state_dict()),
        "optimizer": copy.deepcopy(objs.optimizer.state_dict()),
        "scheduler": copy.deepcopy(objs.scheduler.state_dict()),
        "data_iter": copy.deepcopy(objs.data_iter.state_dict()),
        "train_rng": copy.deepcopy(objs.train_rng.bit_generator.state),
        "scaler": copy.deepcopy(objs.scaler.state_dict()),
    }


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where ``a`` and ``b`` differ in any bit or type (None when byte-equal)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        # array_equal for values, bytes for the bits (NaN payloads, -0.0).
        if not np.array_equal(a, b) or a.tobytes() != b.tobytes():
            return f"{path}: array contents differ"
        return None
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, float):
        return None if a.hex() == b.hex() or (a != a and b != b) else f"{path}: {a!r} vs {b!r}"
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def byte_equal(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are equal to the last bit (arrays, dicts, lists, scalars)."""
    return first_difference(a, b) is None


def unique_param_bytes(model: TinyLM) -> int:
    """Bytes of the model's parameters, a tied one counted once."""
    return sum(p.data.nbytes for p in model.parameters())


def _roundtrip(work: Path) -> dict[str, Any]:
    live = build_fresh(42)
    train_n_steps(live, 10)
    before = capture_full_state(live)
    out = work / "checkpoint"
    save_checkpoint(*live.save_args(), out, step=10, epoch=live.data_iter.epoch, extra_metrics={}, scaler=live.scaler,
                    seed=42)
    fresh = build_fresh(42)
    state = load_checkpoint(out)
    apply_checkpoint(state, *fresh.save_args(), scaler=fresh.scaler)
    after = capture_full_state(fresh)
    equal = [m for m in MACHINES if byte_equal(before[m], after[m])]
    return {"equal": equal, "differences": {m: first_difference(before[m], after[m]) for m in MACHINES if m not in equal},
            "manifest": state.manifest, "path": out}


def _continuation(work: Path) -> bool:
    ref = build_fresh(42)
    losses_ref = train_n_steps(ref, 20)
    first = build_fresh(42)
    losses_a = train_n_steps(first, 10)
    out = work / "continuation"
    save_checkpoint(*first.save_args(), out, step=10, epoch=first.data_iter.epoch, extra_metrics={}, scaler=first.scaler)
    second = build_fresh(42)
    apply_checkpoint(load_checkpoint(out), *second.save_args(), scaler=second.scaler)
    losses_b = train_n_steps(second, 10)
    return np.array(losses_ref).tobytes() == np.array(losses_a + losses_b).tobytes()


def _tying(work: Path) -> dict[str, Any]:
    live = build_fresh(7, tie_weights=True)
    train_n_steps(live, 3)
    tied_before = live.model.embed.weight.data is live.model.lm_head.weight.data
    out = work / "tying"
    save_checkpoint(*live.save_args(), out, step=3, epoch=0, extra_metrics={})
    size = (out / WEIGHTS_FILE).stat().st_size
    expected = unique_param_bytes(live.model)
    state = load_checkpoint(out)
    fresh = build_fresh(7, tie_weights=True)
    apply_checkpoint(state, *fresh.save_args())
    tied_after = (fresh.model.embed.weight.data is fresh.model.lm_head.weight.data
                  and state.model_weights["embed.weight"] is state.model_weights["lm_head.weight"]
                  and np.array_equal(fresh.model.embed.weight.data, live.model.embed.weight.data))
    return {"size": size, "expected": expected, "preserved": bool(tied_before and tied_after and abs(size - expected) < 4096)}


def _atomic(work: Path) -> bool:
    live = build_fresh(3)
    out = work / "interrupted"
    try:
        # interrupted at its one atomic step: the no-replace rename that publishes the directory
        with mock.patch("fastckpt.store.commit.rename_noreplace", side_effect=KeyboardInterrupt):
            save_checkpoint(*live.save_args(), out, step=0, epoch=0, extra_metrics={})
        return False  # the patched rename never ran
    except KeyboardInterrupt:
        pass
    if out.exists():
        return False
    save_checkpoint(*live.save_args(), out, step=0, epoch=0, extra_metrics={})
    leftovers = [p.name for p in work.iterdir() if p.name.endswith(".partial")]
    return (out / "manifest.json").is_file() and not leftovers


def run_selfcheck(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Run every check, write the results into ``out_dir``; returns the results dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".selfcheck-") as scratch:
        work = Path(scratch)
        rt = _roundtrip(out)
        continuation = _continuation(work)
        tying = _tying(work)
        atomic = _atomic(work)
    results = {
        "byte_equivalent_state_machines": rt["equal"],
        "all_byte_equal": len(rt["equal"]) == len(MACHINES),
        "continuation_test_passed": continuation,
        "weight_tying_preserved": tying["preserved"],
        "atomic_write_resilient": atomic,
        "weights_file_size_bytes": tying["size"],
        "expected_size_bytes_no_tying": tying["expected"],
        "size_delta_pct": round(100.0 * (tying["size"] - tying["expected"]) / tying["expected"], 3),
        "manifest_schema_version": rt["manifest"]["schema_version"],
    }
    if rt["differences"]:
        results["differences"] = rt["differences"]
    with atomic_write(out / "roundtrip_results.json", overwrite=True) as f:
        f.write((json.dumps(results, indent=2) + "\n").encode("utf-8"))
    with atomic_write(out / "manifest.json", overwrite=True) as f:
        f.write((json.dumps(rt["manifest"], indent=1) + "\n").encode("utf-8"))
    return results


def passed(results: dict[str, Any]) -> bool:
    """Every boolean check true and the schema the one this fastckpt writes."""
    return (results["all_byte_equal"] and results["continuation_test_passed"] and results["weight_tying_preserved"]
            and results["atomic_write_resilient"] and results["manifest_schema_version"] == SCHEMA_VERSION)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastckpt.train.reference.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory for roundtrip_results.json, manifest.json and the checkpoint")
    args = parser.parse_args(argv)
    results = run_selfcheck(args.out_dir)
    print(json.dumps(results, indent=2))
    return 0 if passed(results) else 1


if __name__ == "__main__":
    sys.exit(main())
