"""Reference optimizers whose whole state round-trips exactly: SGD (momentum), Adam, AdamW.

Every update runs in the parameters' dtype (float32 for the reference model),
with Python floats as weak scalars, so a run is bit-for-bit repeatable on one
machine and a resumed run continues exactly where the saved one stopped.

A parameter is any object with ``.data`` (an ndarray updated in place) and
``.grad`` (an ndarray of the same shape, or None to skip it this step).
Parameters passed twice (tied weights) are updated once.

``state_dict()`` returns plain Python scalars plus one dict of ndarrays per
parameter, in ``params`` order; ``load_state_dict`` validates everything before
it changes anything.

>>> import numpy as np
>>> from fastckpt.train.reference.model import Parameter
>>> p = Parameter(np.ones(3, np.float32))
>>> opt = Adam([p], lr=0.1)
>>> p.grad = np.full(3, 0.5, np.float32)
>>> opt.step()
>>> opt.t, p.data.tolist()
(1, [0.8999999761581421, 0.8999999761581421, 0.8999999761581421])
>>> opt2 = Adam([Parameter(np.ones(3, np.float32))], lr=0.1)
>>> opt2.load_state_dict(opt.state_dict())
>>> opt2.t, np.array_equal(opt2.state[0]["m"], opt.state[0]["m"])
(1, True)
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from fastckpt.words import plural

__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]


def _unique(params: Iterable[Any]) -> list[Any]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class Optimizer:
    """Base class: the step counter ``t``, ``lr``, hyperparameters and per-parameter buffers.

    Subclasses name their buffers in ``_buffers`` and their hyperparameters in
    ``_hyper``; both are saved and restored.
    """

    _buffers: tuple[str, ...] = ()
    _hyper: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], lr: float) -> None:
        self.params = _unique(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__}: got no parameters to optimize")
        self.lr = float(lr)
        self.t = 0
        # Buffers exist from the start, so state_dict() is complete before the first step.
        self.state: list[dict[str, np.ndarray]] = [
            {name: np.zeros_like(p.data) for name in self._buffers} for p in self.params
        ]

    def __repr__(self) -> str:
        """The optimizer's hyperparameters, step and parameter count, not its buffers.

        >>> from fastckpt.train.reference.model import Parameter
        >>> SGD([Parameter(np.zeros(3, np.float32))], lr=0.1, momentum=0.9)
        SGD(lr=0.1, momentum=0.9, dampening=0, weight_decay=0, nesterov=False, t=0, 1 parameter)
        """
        hyper = "".join(f", {name}={getattr(self, name):g}" if isinstance(getattr(self, name), float)
                        else f", {name}={getattr(self, name)!r}" for name in self._hyper)
        return f"{type(self).__name__}(lr={self.lr:g}{hyper}, t={self.t}, {plural(len(self.params), 'parameter')})"

    def zero_grad(self) -> None:
        """Drop every parameter's gradient."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Apply one update to every parameter that has a gradient."""
        self.t += 1
        for p, buffers in zip(self.params, self.state):
            if p.grad is not None:
                self._update(p.data, p.grad, buffers)

    def _update(self, w: np.ndarray, g: np.ndarray, buffers: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: type, lr, t, hyperparameters, buffers (not copied)."""
        return {
            "type": type(self).__name__,
            "lr": self.lr,
            "t": self.t,
            "hyper": {name: getattr(self, name) for name in self._hyper},
            "state": [dict(b) for b in self.state],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` output (arrays are copied in); validates before changing anything."""
        name = type(self).__name__
        if state.get("type") != name:
            raise ValueError(f"{name}.load_state_dict: state is for {state.get('type')!r}, not {name!r}")
        buffers = state["state"]
        if len(buffers) != len(self.params):
            raise ValueError(f"{name}.load_state_dict: state has {len(buffers)} parameters, optimizer has {len(self.params)}")
        for i, (b, p) in enumerate(zip(buffers, self.params)):
            if set(b) != set(self._buffers):
                raise ValueError(f"{name}.load_state_dict: parameter {i} has buffers {sorted(b)}, expected {sorted(self._buffers)}")
            for key, arr in b.items():
                arr = np.asarray(arr)
                if arr.shape != p.data.shape or arr.dtype != p.data.dtype:
                    raise ValueError(
                        f"{name}.load_state_dict: parameter {i} buffer {key!r} is {arr.dtype}{list(arr.shape)}, "
                        f"expected {p.data.dtype}{list(p.data.shape)}"
                    )
        missing = set(self._hyper) - set(state.get("hyper", {}))
        if missing:
            raise ValueError(f"{name}.load_state_dict: missing hyperparameters {sorted(missing)}")
        for b, own in zip(buffers, self.state):
            for key, arr in b.items():
                np.copyto(own[key], arr)
        for key in self._hyper:
            setattr(self, key, state["hyper"][key])
        self.lr = float(state["lr"])
        self.t = int(state["t"])


class SGD(Optimizer):
    """SGD with (optionally Nesterov) momentum and L2 weight decay, as in PyTorch.

    >>> import numpy as np
    >>> from fastckpt.train.reference.model import Parameter
    >>> p = Parameter(np.zeros(2, np.float32)); p.grad = np.ones(2, np.float32)
    >>> opt = SGD([p], lr=0.5, momentum=0.9); opt.step(); opt.step()
    >>> p.data.tolist()
    [-1.4500000476837158, -1.4500000476837158]
    """

    _buffers = ("momentum_buffer",)
    _hyper = ("momentum", "dampening", "weight_decay", "nesterov")

    def __init__(self, params, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, lr)
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)

    def _update(self, w, g, buffers):
        if self.weight_decay:
            g = g + self.weight_decay * w
        if self.momentum:
            buf = buffers["momentum_buffer"]
            if self.t == 1:
                np.copyto(buf, g)
            else:
                buf *= self.momentum
                buf += (1.0 - self.dampening) * g
            g = g + self.momentum * buf if self.nesterov else buf
        w -= self.lr * g


class Adam(Optimizer):
    """Adam with bias correction (uses the step count ``t``) and optional L2 weight decay.

    >>> import numpy as np
    >>> from fastckpt.train.reference.model import Parameter
    >>> p = Parameter(np.zeros(1, np.float32)); p.grad = np.ones(1, np.float32)
    >>> opt = Adam([p], lr=0.01); opt.step(); float(p.data[0])
    -0.010000000707805157
    """

    _buffers = ("m", "v")
    _hyper = ("beta1", "beta2", "eps", "weight_decay")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)

    def _decay(self, w, g):
        return g + self.weight_decay * w if self.weight_decay else g

    def _update(self, w, g, buffers):
        g = self._decay(w, g)
        m, v = buffers["m"], buffers["v"]
        m *= self.beta1
        m += (1.0 - self.beta1) * g
        v *= self.beta2
        v += (1.0 - self.beta2) * (g * g)
        # Bias corrections depend on t: a checkpoint that lost t would resume with wrong steps.
        c1 = 1.0 - self.beta1**self.t
        c2 = 1.0 - self.beta2**self.t
        denom = np.sqrt(v / c2)
        denom += self.eps
        w -= (self.lr / c1) * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), applied before the Adam step.

    >>> import numpy as np
    >>> from fastckpt.train.reference.model import Parameter
    >>> p = Parameter(np.ones(1, np.float32)); p.grad = np.zeros(1, np.float32)
    >>> opt = AdamW([p], lr=0.1, weight_decay=0.5); opt.step(); float(p.data[0])
    0.949999988079071
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)

    def _decay(self, w, g):
        if self.weight_decay:
            w *= 1.0 - self.lr * self.weight_decay
        return g


