"""A training data iterator over a token array: shuffled per epoch, resumable mid-epoch.

The dataset is one 1-D integer array of tokens cut into ``num_samples``
non-overlapping windows of ``seq_len + 1`` tokens (inputs and next-token
targets). Each epoch visits the windows in the order
:func:`fastckpt.stateful.epoch_order` gives for ``(seed, epoch)`` — the order
the stateful readers use, defined by a bit generator's raw stream and so the
same on every numpy version — so the state is four integers — ``seed``,
``epoch``, ``position`` (batches already served this epoch) and the shape of
the data — and never the permutation itself. The last incomplete batch of an
epoch is dropped, so every batch has ``batch_size`` rows.

The state also carries the sha256 of the token bytes: restoring onto a
different dataset is refused instead of silently serving other batches.

>>> import numpy as np
>>> tokens = np.arange(101, dtype=np.int32)
>>> it = ShuffledTokenBatches(tokens, batch_size=2, seq_len=10, seed=0)
>>> x, y = next(it); x.shape, bool((y == x + 1).all())
((2, 10), True)
>>> it2 = ShuffledTokenBatches(tokens, batch_size=2, seq_len=10, seed=0)
>>> it2.load_state_dict(it.state_dict())
>>> np.array_equal(next(it)[0], next(it2)[0])
True
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from fastckpt.stateful.readers import epoch_order

__all__ = ["ShuffledTokenBatches"]


class ShuffledTokenBatches:
    """Infinite iterator of ``(inputs, targets)`` int64 batches of shape ``(batch_size, seq_len)``.

    ``epoch`` and ``position`` say where it stands; crossing an epoch boundary
    draws the next permutation.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"ShuffledTokenBatches: tokens must be a 1-D integer array, got {tokens.dtype}{list(tokens.shape)}")
        self.tokens = tokens
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.num_samples = (len(tokens) - 1) // self.seq_len
        self.batches_per_epoch = self.num_samples // self.batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"ShuffledTokenBatches: {len(tokens)} tokens give {self.num_samples} windows of {self.seq_len + 1}, "
                f"fewer than one batch of {self.batch_size}; use a smaller batch_size or seq_len"
            )
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None
        self._sha256: str | None = None

    @property
    def data_sha256(self) -> str:
        """sha256 of the token bytes (computed once)."""
        if self._sha256 is None:
            self._sha256 = hashlib.sha256(np.ascontiguousarray(self.tokens).view(np.uint8)).hexdigest()
        return self._sha256

    def data_manifest(self) -> dict[str, Any]:
        """What identifies the data; its hash goes into a checkpoint's manifest."""
        return {"num_tokens": int(self.tokens.size), "dtype": self.tokens.dtype.str, "sha256": self.data_sha256}

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = epoch_order(self.num_samples, self.epoch, shuffle=True, seed=self.seed)
            self._perm_epoch = self.epoch
        return self._perm

    def __iter__(self) -> "ShuffledTokenBatches":
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        rows = self._permutation()[self.position * self.batch_size : (self.position + 1) * self.batch_size]
        self.position += 1
        starts = rows * self.seq_len
        window = starts[:, None] + np.arange(self.seq_len + 1)
        chunk = self.tokens[window].astype(np.int64)
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: where the iterator stands and what data it runs over."""
        return {
            "type": "ShuffledTokenBatches",
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_samples": self.num_samples,
            "data_sha256": self.data_sha256,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state taken over other data or another batch layout."""
        if state.get("type") != "ShuffledTokenBatches":
            raise ValueError(f"ShuffledTokenBatches.load_state_dict: state is for {state.get('type')!r}")
        for key in ("batch_size", "seq_len", "num_samples", "data_sha256"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"ShuffledTokenBatches.load_state_dict: {key} is {state.get(key)!r} in the state but "
                    f"{getattr(self, key)!r} here; build the iterator over the same data and batch shape to resume"
                )
        position = int(state["position"])
        if not 0 <= position <= self.batches_per_epoch:
            raise ValueError(f"ShuffledTokenBatches.load_state_dict: position {position} outside 0..{self.batches_per_epoch}")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = position
        self._perm_epoch = -1
