"""The state protocol: how every checkpoint in fastckpt reads state out of an object and puts it back.

An object is *stateful* when it satisfies :class:`Stateful` (PyTorch's
``state_dict()`` / ``load_state_dict(state)`` pair) or one of the shapes
adapted to it. The training checkpoints (:mod:`fastckpt.train`), the
aggregator (:mod:`fastckpt.stateful`) and anything built on them find an
object's state in ONE order, the first that applies:

1. a ``numpy.random.Generator``: its ``bit_generator.state`` (read and
   assigned; the generator is never reseeded);
2. a ``torch.Generator``: ``get_state()`` as a numpy ``uint8`` array (a
   copy), given back to ``set_state`` as the ``torch.ByteTensor`` it wants;
3. a ``random.Random`` (Python's generator): ``getstate()`` / ``setstate()``;
4. ``state_dict()`` and ``load_state_dict(state)``, both callable;
5. ``get_state()`` and ``set_state(state)``, both callable (DALI's and
   TensorFlow's shape; the readers and :class:`~fastckpt.stateful.RNG` of
   :mod:`fastckpt.stateful`).

:func:`check_state` tries a state on a fresh generator of the same kind
(steps 1 to 3) without touching the object, so a restore can refuse a bad
RNG state before it changes anything.

A pair counts only when both of its methods are there: an object with
``state_dict()`` but no ``load_state_dict()`` falls through to step 3. An
object that matches none is refused with a ``TypeError`` that names its type
and the methods it needs.

Loading into an object of a ``torch`` module converts numpy arrays in the
state to ``torch`` tensors first (``torch.from_numpy``, no copy), since
PyTorch's ``load_state_dict`` wants its own tensors.

>>> import numpy as np
>>> g = np.random.default_rng(3)
>>> saved = state_of(g)
>>> first = g.random()
>>> load_state(g, saved)
>>> g.random() == first
True
>>> class Counter:
...     def __init__(self): self.n = 0
...     def get_state(self): return {"n": self.n}
...     def set_state(self, state): self.n = state["n"]
>>> isinstance(as_stateful(Counter()), Stateful)
True
"""

from __future__ import annotations

import random
import sys
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

__all__ = ["Stateful", "LOOKUP_ORDER", "accessors", "as_stateful", "is_stateful", "state_of", "load_state",
           "check_state", "random_state"]

LOOKUP_ORDER = ("numpy.random.Generator.bit_generator.state", "torch.Generator.get_state()/set_state(ByteTensor)",
                "random.Random.getstate()/setstate(state)", "state_dict()/load_state_dict(state)",
                "get_state()/set_state(state)")


@runtime_checkable
class Stateful(Protocol):
    """An object whose state can be taken and given back: PyTorch's pair of methods.

    >>> class Step:
    ...     def state_dict(self): return {"step": 1}
    ...     def load_state_dict(self, state): pass
    >>> isinstance(Step(), Stateful)
    True
    """

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _pair(obj: Any, getter: str, setter: str) -> tuple[Callable, Callable] | None:
    get, put = getattr(obj, getter, None), getattr(obj, setter, None)
    return (get, put) if callable(get) and callable(put) else None


def accessors(obj: Any) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """``(get, put)``: the two callables that read and restore ``obj``'s state, in the documented order.

    >>> get, put = accessors(np.random.default_rng(0))
    >>> get()["bit_generator"]
    'PCG64'
    """
    if isinstance(obj, np.random.Generator):
        bit_generator = obj.bit_generator

        def put(state: Any) -> None:
            bit_generator.state = state

        return (lambda: bit_generator.state), put
    if _is_torch_generator(obj):
        return (lambda: obj.get_state().numpy().copy()), lambda state: obj.set_state(_byte_tensor(state))
    if isinstance(obj, random.Random):
        return obj.getstate, lambda state: obj.setstate(random_state(state))
    pair = _pair(obj, "state_dict", "load_state_dict")
    if pair is not None:
        get, put = pair
        if _is_torch(obj):
            return get, lambda state: put(_to_torch(state))
        return pair
    pair = _pair(obj, "get_state", "set_state")
    if pair is not None:
        return pair
    raise TypeError(
        f"a {_qualname(type(obj))} cannot be checkpointed: it needs state_dict()/load_state_dict(state) "
        "or get_state()/set_state(state) (or to be a numpy.random.Generator, a torch.Generator or a random.Random)"
    )


def is_stateful(obj: Any) -> bool:
    """Whether :func:`accessors` finds a way to take ``obj``'s state.

    >>> is_stateful(np.random.default_rng()), is_stateful(object())
    (True, False)
    """
    try:
        accessors(obj)
    except TypeError:
        return False
    return True


class _Adapted:
    """A :class:`Stateful` view of an object found by another step of the lookup order."""

    __slots__ = ("target", "_get", "_put")

    def __init__(self, target: Any) -> None:
        self.target = target
        self._get, self._put = accessors(target)

    def state_dict(self) -> Any:
        return self._get()

    def load_state_dict(self, state: Any) -> None:
        self._put(state)

    def __repr__(self) -> str:
        return f"as_stateful({self.target!r})"


def as_stateful(obj: Any) -> Stateful:
    """``obj`` itself when it has the :class:`Stateful` pair, else an adapter with that pair.

    >>> g = np.random.default_rng(0)
    >>> as_stateful(g).state_dict()["bit_generator"]
    'PCG64'
    """
    if not isinstance(obj, np.random.Generator) and _pair(obj, "state_dict", "load_state_dict") is not None:
        return obj
    return _Adapted(obj)


def state_of(obj: Any) -> Any:
    """``obj``'s state, taken by the first step of the lookup order that applies.

    >>> state_of(np.random.default_rng(1))["state"]["state"] > 2**64
    True
    """
    return accessors(obj)[0]()


def load_state(obj: Any, state: Any) -> None:
    """Give ``state`` back to ``obj`` through the same step :func:`state_of` used.

    >>> g = np.random.default_rng(1); s = state_of(g); a = g.integers(99)
    >>> load_state(g, s); int(g.integers(99)) == int(a)
    True
    """
    accessors(obj)[1](state)


def check_state(obj: Any, state: Any) -> None:
    """Try ``state`` on a fresh generator of ``obj``'s kind (numpy, torch, Python); raise what it raises.

    ``obj`` itself never changes. For other objects this checks nothing (their own
    ``load_state_dict`` / ``set_state`` is the only judge of their state).

    >>> check_state(np.random.default_rng(0), {"bit_generator": "PCG64"})
    Traceback (most recent call last):
    ...
    ValueError: state for numpy.random.Generator (PCG64) does not fit: ...
    """
    try:
        if isinstance(obj, np.random.Generator):
            type(obj.bit_generator)().state = state
        elif _is_torch_generator(obj):
            type(obj)(device=obj.device).set_state(_byte_tensor(state))
        elif isinstance(obj, random.Random):
            random.Random().setstate(random_state(state))
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as exc:
        kind = f"numpy.random.Generator ({type(obj.bit_generator).__name__})" if isinstance(obj, np.random.Generator) \
            else _qualname(type(obj))
        raise ValueError(f"state for {kind} does not fit: {exc!r}") from None


def random_state(state: Any) -> Any:
    """A ``random.Random`` state as ``setstate`` takes it: JSON formats give its tuples back as lists.

    >>> random_state([3, [1, 2], None])
    (3, (1, 2), None)
    """
    if isinstance(state, list) and len(state) == 3 and isinstance(state[1], (list, tuple)):
        return (state[0], tuple(state[1]), state[2])
    return state


def _is_torch_generator(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: if it is not loaded, obj is no torch object
    return torch is not None and isinstance(obj, torch.Generator)


def _byte_tensor(state: Any) -> Any:
    """A torch Generator's state (a uint8 array as saved, or already a ByteTensor) as the ByteTensor it takes."""
    torch = sys.modules["torch"]
    if isinstance(state, torch.Tensor):
        return state
    array = np.asarray(state)
    if array.dtype != np.uint8 or array.ndim != 1:
        raise TypeError(f"a torch.Generator state is a 1-d uint8 array, got {array.dtype}{list(array.shape)}")
    return torch.from_numpy(np.array(array, copy=True))


def _is_torch(obj: Any) -> bool:
    """A PyTorch module or optimizer (subclasses defined anywhere included), whose state wants torch tensors."""
    if type(obj).__module__.split(".")[0] == "torch":
        return True
    torch = sys.modules.get("torch")  # never imported here: if it is not loaded, obj is no torch object
    return torch is not None and isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def _to_torch(state: Any) -> Any:
    from fastckpt.arrays import to_torch  # ml_dtypes arrays (bfloat16, float8) too, where from_numpy refuses them

    def convert(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return to_torch(value)
        if isinstance(value, dict):
            return type(value)((k, convert(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v) for v in value)
        return value

    return convert(state)
