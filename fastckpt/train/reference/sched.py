"""Learning-rate schedulers with exact, JSON-safe state: step decay, cosine with warmup, reduce-on-plateau.

A scheduler owns the optimizer's ``lr``: each ``step()`` computes the next rate
from its counters and writes it to ``optimizer.lr``. Its ``state_dict()`` holds
only Python ints, floats, strings and bools, so it goes into ``extra.json`` and
comes back bit for bit (JSON floats round-trip exactly through ``repr``).

>>> from fastckpt.train.reference.model import Parameter
>>> from fastckpt.train.reference.optim import SGD
>>> import numpy as np
>>> opt = SGD([Parameter(np.zeros(1, np.float32))], lr=1.0)
>>> sched = StepLR(opt, step_size=2, gamma=0.5)
>>> for _ in range(3): sched.step()
>>> opt.lr, sched.state_dict()["last_step"]
(0.5, 3)
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LRScheduler", "StepLR", "CosineWarmupLR", "ReduceLROnPlateau"]


class LRScheduler:
    """Base class: ``base_lr``, the step counter ``last_step`` and the current rate ``lr``.

    Subclasses list their hyperparameters in ``_hyper`` and extra counters in
    ``_counters``; all of them are saved.
    """

    _hyper: tuple[str, ...] = ()
    _counters: tuple[str, ...] = ()

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.base_lr = float(optimizer.lr)
        self.last_step = 0
        self.lr = self._compute()
        optimizer.lr = self.lr

    def _compute(self) -> float:
        raise NotImplementedError

    def step(self, metric: float | None = None) -> None:
        """Advance one step and set ``optimizer.lr``."""
        self.last_step += 1
        self.lr = self._compute()
        self.optimizer.lr = self.lr

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: type, base_lr, last_step, lr, counters and hyperparameters."""
        out = {"type": type(self).__name__, "base_lr": self.base_lr, "last_step": self.last_step, "lr": self.lr}
        for name in self._counters + self._hyper:
            out[name] = getattr(self, name)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` output and set ``optimizer.lr`` to the saved rate."""
        name = type(self).__name__
        if state.get("type") != name:
            raise ValueError(f"{name}.load_state_dict: state is for {state.get('type')!r}, not {name!r}")
        missing = {"base_lr", "last_step", "lr", *self._counters, *self._hyper} - set(state)
        if missing:
            raise ValueError(f"{name}.load_state_dict: missing keys {sorted(missing)}")
        self.base_lr = float(state["base_lr"])
        self.last_step = int(state["last_step"])
        self.lr = float(state["lr"])
        for key in self._counters + self._hyper:
            setattr(self, key, state[key])
        self.optimizer.lr = self.lr


class StepLR(LRScheduler):
    """``lr = base_lr * gamma ** (last_step // step_size)``.

    >>> from fastckpt.train.reference.model import Parameter
    >>> from fastckpt.train.reference.optim import SGD
    >>> import numpy as np
    >>> opt = SGD([Parameter(np.zeros(1, np.float32))], lr=0.8)
    >>> s = StepLR(opt, step_size=1, gamma=0.5); s.step(); opt.lr
    0.4
    """

    _hyper = ("step_size", "gamma")

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1) -> None:
        if step_size < 1:
            raise ValueError(f"StepLR: step_size must be >= 1, got {step_size!r}")
        self.step_size = int(step_size)
        self.gamma = float(gamma)
        super().__init__(optimizer)

    def _compute(self) -> float:
        return self.base_lr * self.gamma ** (self.last_step // self.step_size)


class CosineWarmupLR(LRScheduler):
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr`` at ``total_steps``.

    >>> from fastckpt.train.reference.model import Parameter
    >>> from fastckpt.train.reference.optim import SGD
    >>> import numpy as np
    >>> opt = SGD([Parameter(np.zeros(1, np.float32))], lr=1.0)
    >>> s = CosineWarmupLR(opt, warmup_steps=2, total_steps=4); opt.lr
    0.5
    >>> for _ in range(4): s.step()
    >>> opt.lr
    0.0
    """

    _hyper = ("warmup_steps", "total_steps", "min_lr")

    def __init__(self, optimizer, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> None:
        if not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"CosineWarmupLR: need 0 <= warmup_steps <= total_steps, got {warmup_steps!r}, {total_steps!r}")
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.min_lr = float(min_lr)
        super().__init__(optimizer)

    def _compute(self) -> float:
        s = self.last_step
        if s < self.warmup_steps:
            return self.base_lr * (s + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (s - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))


class ReduceLROnPlateau(LRScheduler):
    """Multiply the rate by ``factor`` after ``patience`` steps without improvement of the metric.

    ``step(metric)`` needs the metric (e.g. the loss). The best value starts at
    ±inf, which ``extra.json`` stores as ``{"__float__": "inf"}``.

    >>> from fastckpt.train.reference.model import Parameter
    >>> from fastckpt.train.reference.optim import SGD
    >>> import numpy as np
    >>> opt = SGD([Parameter(np.zeros(1, np.float32))], lr=1.0)
    >>> s = ReduceLROnPlateau(opt, factor=0.5, patience=1)
    >>> for loss in (3.0, 3.0, 3.0): s.step(loss)
    >>> opt.lr
    0.5
    """

    _hyper = ("mode", "factor", "patience", "threshold", "cooldown", "min_lr")
    _counters = ("best", "num_bad_steps", "cooldown_counter")

    def __init__(self, optimizer, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, cooldown: int = 0, min_lr: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceLROnPlateau: mode must be 'min' or 'max', got {mode!r}")
        if not 0.0 < factor < 1.0:
            raise ValueError(f"ReduceLROnPlateau: factor must be in (0, 1), got {factor!r}")
        self.mode = mode
        self.factor = float(factor)
        self.patience = int(patience)
        self.threshold = float(threshold)
        self.cooldown = int(cooldown)
        self.min_lr = float(min_lr)
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_steps = 0
        self.cooldown_counter = 0
        super().__init__(optimizer)

    def _compute(self) -> float:
        return getattr(self, "lr", self.base_lr)

    def _improved(self, metric: float) -> bool:
        if self.mode == "min":
            return metric < self.best * (1.0 - self.threshold) if self.best > 0 else metric < self.best * (1.0 + self.threshold)
        return metric > self.best * (1.0 + self.threshold) if self.best > 0 else metric > self.best * (1.0 - self.threshold)

    def step(self, metric: float | None = None) -> None:
        if metric is None:
            raise TypeError("ReduceLROnPlateau.step needs the metric: call step(loss)")
        metric = float(metric)
        self.last_step += 1
        if self._improved(metric):
            self.best = metric
            self.num_bad_steps = 0
        else:
            self.num_bad_steps += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_steps = 0
        if self.num_bad_steps > self.patience:
            self.lr = max(self.lr * self.factor, self.min_lr)
            self.cooldown_counter = self.cooldown
            self.num_bad_steps = 0
        self.optimizer.lr = self.lr
