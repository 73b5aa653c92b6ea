"""Dynamic loss scaling (GradScaler) with exact state: scale, growth tracker, hyperparameters.

Mixed-precision training multiplies the loss by ``scale`` so small gradients
survive; the scaler divides the gradients back before the optimizer step,
skips the step when any gradient is inf/NaN (and backs the scale off), and
grows the scale after ``growth_interval`` clean steps. The scale stays a power
of two times ``init_scale``, so scaling and unscaling are exact in binary
floating point.

Call order per iteration (as in PyTorch): ``loss * scaler.scale`` → backward →
``scaler.step(optimizer)`` → ``scaler.update()``. Save between iterations.

>>> import numpy as np
>>> from fastckpt.train.reference.model import Parameter
>>> from fastckpt.train.reference.optim import SGD
>>> p = Parameter(np.zeros(1, np.float32)); opt = SGD([p], lr=1.0)
>>> s = GradScaler(init_scale=4.0, growth_interval=1)
>>> p.grad = np.array([8.0], np.float32)   # = 2.0 * scale
>>> _ = s.step(opt); s.update(); p.data.tolist(), s.scale
([-2.0], 8.0)
>>> p.grad = np.array([np.inf], np.float32)
>>> _ = s.step(opt); s.update(); p.data.tolist(), s.scale
([-2.0], 4.0)
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["GradScaler"]


class GradScaler:
    """Loss scaler; ``state_dict()`` is JSON-safe (floats, ints, bool)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"GradScaler: need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor!r}, {backoff_factor!r}")
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.enabled = bool(enabled)
        self.growth_tracker = 0
        # Per-iteration flags; reset by update(), never saved.
        self._unscaled = False
        self._found_inf = False

    def scale_loss(self, loss: Any) -> Any:
        """``loss * scale`` (the caller back-propagates this)."""
        return loss * self.scale if self.enabled else loss

    def unscale_(self, optimizer: Any) -> bool:
        """Divide every gradient by the scale in place; returns True when all are finite."""
        if self._unscaled:
            raise RuntimeError("GradScaler.unscale_ called twice in one iteration; call update() first")
        self._unscaled = True
        if not self.enabled:
            return True
        inv = 1.0 / self.scale
        found_inf = False
        for p in optimizer.params:
            if p.grad is None:
                continue
            p.grad *= inv
            if not np.isfinite(p.grad).all():
                found_inf = True
        self._found_inf = found_inf
        return not found_inf

    def step(self, optimizer: Any) -> bool:
        """Unscale (if not yet done) and run ``optimizer.step()`` unless a gradient overflowed."""
        if not self._unscaled:
            self.unscale_(optimizer)
        if self._found_inf:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps; end the iteration."""
        if self.enabled:
            if self._found_inf:
                self.scale *= self.backoff_factor
                self.growth_tracker = 0
            else:
                self.growth_tracker += 1
                if self.growth_tracker == self.growth_interval:
                    self.scale *= self.growth_factor
                    self.growth_tracker = 0
        self._unscaled = False
        self._found_inf = False

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state."""
        return {
            "type": "GradScaler",
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "enabled": self.enabled,
            "growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` output."""
        if state.get("type") != "GradScaler":
            raise ValueError(f"GradScaler.load_state_dict: state is for {state.get('type')!r}, not 'GradScaler'")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "enabled", "growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"GradScaler.load_state_dict: missing keys {sorted(missing)}")
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.enabled = bool(state["enabled"])
        self.growth_tracker = int(state["growth_tracker"])
        self._unscaled = False
        self._found_inf = False
