"""A small trainable language model in numpy float32, for tests and examples of exact resume.

``TinyLM`` embeds each token, runs a one-hidden-layer MLP with dropout and a
residual connection, and predicts the next token through an LM head that is
*tied* to the embedding (the very same :class:`Parameter` object, so
``model.embed.weight.data is model.lm_head.weight.data``). Forward and backward
are written out by hand in float32; dropout draws from the training RNG passed
in, so a run is a pure function of the initial state, the data order and that
RNG — bit for bit on one machine.

:func:`train_step` is the reference training iteration over all five state
machines (model + optimizer, scheduler, loss scaler, data iterator, RNG).

>>> import numpy as np
>>> from fastckpt.train.reference.optim import AdamW
>>> model = TinyLM(vocab=16, dim=8, hidden=16, seed=0)
>>> model.embed.weight.data is model.lm_head.weight.data
True
>>> x = np.array([[1, 2, 3]]); y = np.array([[2, 3, 4]])
>>> loss = model.forward_backward(x, y, np.random.default_rng(0))
>>> loss.dtype, model.embed.weight.grad.shape
(dtype('float32'), (16, 8))
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np

from fastckpt.words import plural

__all__ = ["Parameter", "TinyLM", "train_step"]


class Parameter:
    """A trainable array: ``data`` (updated in place by optimizers) and ``grad``.

    >>> p = Parameter(np.zeros(2, np.float32)); p.data.shape, p.grad
    ((2,), None)
    """

    __slots__ = ("data", "grad")

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.grad: np.ndarray | None = None

    def __repr__(self) -> str:
        return f"Parameter({self.data.dtype}{list(self.data.shape)})"


class TinyLM:
    """Embedding + MLP next-token model; LM head tied to the embedding unless ``tie_weights=False``.

    ``state_dict()`` maps dotted names to the live parameter arrays (no copy);
    with tying, ``"lm_head.weight"`` and ``"embed.weight"`` are the same array
    object. ``load_state_dict`` copies into the existing arrays, so tying and
    any outside references to the parameters survive a restore.
    """

    def __init__(self, vocab: int, dim: int, hidden: int, *, tie_weights: bool = True,
                 dropout: float = 0.1, seed: int = 0) -> None:
        init = np.random.default_rng(seed)

        def param(*shape: int, scale: float) -> Parameter:
            return Parameter((init.standard_normal(shape) * scale).astype(np.float32))

        self.vocab, self.dim, self.hidden = vocab, dim, hidden
        self.dropout = float(dropout)
        self.training = True
        self.embed = SimpleNamespace(weight=param(vocab, dim, scale=0.5))
        self.fc1 = SimpleNamespace(weight=param(dim, hidden, scale=dim**-0.5), bias=Parameter(np.zeros(hidden, np.float32)))
        self.fc2 = SimpleNamespace(weight=param(hidden, dim, scale=hidden**-0.5), bias=Parameter(np.zeros(dim, np.float32)))
        self.lm_head = SimpleNamespace(weight=self.embed.weight if tie_weights else param(vocab, dim, scale=0.5))

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.embed.weight

    def __repr__(self) -> str:
        """The model's shape and size, not its arrays.

        >>> TinyLM(vocab=8, dim=4, hidden=16)
        TinyLM(vocab=8, dim=4, hidden=16, tied=True, dropout=0.1, 212 parameters)
        """
        count = sum(p.data.size for _, p in self.named_parameters())
        return (f"TinyLM(vocab={self.vocab}, dim={self.dim}, hidden={self.hidden}, tied={self.tied}, "
                f"dropout={self.dropout:g}, {plural(count, 'parameter')})")

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """Every (name, Parameter), tied ones under each of their names."""
        yield "embed.weight", self.embed.weight
        yield "fc1.weight", self.fc1.weight
        yield "fc1.bias", self.fc1.bias
        yield "fc2.weight", self.fc2.weight
        yield "fc2.bias", self.fc2.bias
        yield "lm_head.weight", self.lm_head.weight

    def parameters(self) -> list[Parameter]:
        """Unique parameters (a tied one once), in a fixed order."""
        out: list[Parameter] = []
        for _, p in self.named_parameters():
            if not any(p is q for q in out):
                out.append(p)
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """Name -> live array; tied names map to one array object."""
        return {name: p.data for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict[str, np.ndarray], strict: bool = True) -> None:
        """Copy arrays into the parameters; checks keys, dtypes, shapes and tying before changing anything."""
        params = dict(self.named_parameters())
        missing = [k for k in params if k not in state]
        unexpected = [k for k in state if k not in params]
        if strict and (missing or unexpected):
            raise KeyError(f"TinyLM.load_state_dict: missing keys {missing}, unexpected keys {unexpected} (strict=False ignores them)")
        for name, arr in state.items():
            if name not in params:
                continue
            arr = np.asarray(arr)
            want = params[name].data
            if arr.shape != want.shape or arr.dtype != want.dtype:
                raise ValueError(f"TinyLM.load_state_dict: {name!r} is {arr.dtype}{list(arr.shape)}, expected {want.dtype}{list(want.shape)}")
        if self.tied and "embed.weight" in state and "lm_head.weight" in state:
            a, b = state["embed.weight"], state["lm_head.weight"]
            if a is not b and not np.array_equal(a, b):
                raise ValueError("TinyLM.load_state_dict: the model ties lm_head.weight to embed.weight but the state holds different values")
        for name, arr in state.items():
            if name in params:
                np.copyto(params[name].data, arr)

    def forward_backward(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator,
                         loss_scale: float = 1.0) -> np.float32:
        """Mean next-token cross-entropy of ``x -> y``; sets every parameter's ``grad`` (times ``loss_scale``)."""
        with np.errstate(over="ignore", invalid="ignore"):
            return self._forward_backward(x, y, rng, loss_scale)

    def _forward_backward(self, x, y, rng, loss_scale):
        # Overflow is expected under loss scaling: GradScaler sees the inf and backs off.
        E, W1, b1 = self.embed.weight.data, self.fc1.weight.data, self.fc1.bias.data
        W2, b2, Wo = self.fc2.weight.data, self.fc2.bias.data, self.lm_head.weight.data
        ids = x.reshape(-1)
        tgt = y.reshape(-1)
        n = ids.size
        e = E[ids]
        h = np.tanh(e @ W1 + b1)
        if self.training and self.dropout > 0.0:
            keep = (rng.random(h.shape, dtype=np.float32) >= self.dropout).astype(np.float32)
            keep *= np.float32(1.0 / (1.0 - self.dropout))
        else:
            keep = np.ones_like(h)
        hd = h * keep
        o = hd @ W2 + b2 + e
        logits = o @ Wo.T
        logits -= logits.max(axis=1, keepdims=True)
        ex = np.exp(logits)
        denom = ex.sum(axis=1, keepdims=True)
        loss = np.mean(np.log(denom[:, 0]) - logits[np.arange(n), tgt])  # float32 for a float32 model
        dlogits = ex / denom
        dlogits[np.arange(n), tgt] -= 1.0
        dlogits *= E.dtype.type(loss_scale / n)
        dWo = dlogits.T @ o
        do = dlogits @ Wo
        db2 = do.sum(axis=0)
        dW2 = hd.T @ do
        dh = (do @ W2.T) * keep
        da = dh * (1.0 - h * h)
        db1 = da.sum(axis=0)
        dW1 = e.T @ da
        de = da @ W1.T + do
        dE = np.zeros_like(E)
        np.add.at(dE, ids, de)
        self.fc1.weight.grad, self.fc1.bias.grad = dW1, db1
        self.fc2.weight.grad, self.fc2.bias.grad = dW2, db2
        if self.tied:
            self.embed.weight.grad = dE + dWo
        else:
            self.embed.weight.grad, self.lm_head.weight.grad = dE, dWo
        return loss


def train_step(model: TinyLM, optimizer: Any, scheduler: Any, data_iter: Any, train_rng: np.random.Generator,
               scaler: Any = None) -> np.float32:
    """One iteration: next batch, forward/backward (dropout from ``train_rng``), scaled step, schedule.

    Returns the (unscaled) loss. A ``ReduceLROnPlateau`` scheduler gets the loss as its metric.

    >>> import numpy as np
    >>> from fastckpt.train.reference.optim import SGD
    >>> from fastckpt.train.reference.sched import StepLR
    >>> from fastckpt.train.reference.data import ShuffledTokenBatches
    >>> m = TinyLM(vocab=16, dim=8, hidden=16); opt = SGD(m.parameters(), lr=0.1)
    >>> data = ShuffledTokenBatches(np.arange(200) % 16, batch_size=4, seq_len=8, seed=0)
    >>> float(train_step(m, opt, StepLR(opt, 10), data, np.random.default_rng(0))) > 0
    True
    """
    x, y = next(data_iter)
    optimizer.zero_grad()
    scale = scaler.scale if scaler is not None else 1.0
    loss = model.forward_backward(x, y, train_rng, loss_scale=scale)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        if type(scheduler).__name__ == "ReduceLROnPlateau":
            scheduler.step(float(loss))
        else:
            scheduler.step()
    return loss
