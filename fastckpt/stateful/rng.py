"""A seeded random number generator whose state can be saved and resumed bit-exactly.

:class:`RNG` wraps a numpy :class:`numpy.random.Generator`. Its state is the
bit generator's own state (``bit_generator.state``) made JSON-safe, so
restoring it continues the very same stream: it never reseeds.

>>> rng = RNG(seed=42)
>>> saved = str(rng.get_state())          # safe to write to disk
>>> first = rng.integers(0, 1000, size=4)
>>> rng.set_state(saved)
>>> bool((rng.integers(0, 1000, size=4) == first).all())
True

Not thread-safe: one RNG must not be drawn from and checkpointed concurrently.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastckpt.state import StateObject

__all__ = ["RNG", "RNGState", "GlobalRNG", "BIT_GENERATORS"]

#: Bit generators an RNG can be built on (all of numpy's).
BIT_GENERATORS = {
    "PCG64": np.random.PCG64,
    "PCG64DXSM": np.random.PCG64DXSM,
    "Philox": np.random.Philox,
    "SFC64": np.random.SFC64,
    "MT19937": np.random.MT19937,
}


class RNGState(StateObject):
    """The state of an :class:`RNG`: numpy's ``bit_generator.state``, JSON-safe.

    ``str(state)`` is compact JSON (arrays of Philox/SFC64/MT19937 as base64
    with dtype and shape); ``to_dict()`` gives numpy's own dict back.

    >>> s = RNG(seed=0).get_state()
    >>> s.bit_generator
    'PCG64'
    >>> RNGState.from_string(str(s)) == s
    True
    """

    __slots__ = ()

    def __init__(self, data: dict):
        name = data.get("bit_generator") if isinstance(data, dict) else None
        if name not in BIT_GENERATORS:
            raise ValueError(
                f"not an RNG state: 'bit_generator' is {name!r}, expected one of {sorted(BIT_GENERATORS)}"
            )
        super().__init__(data)

    @property
    def bit_generator(self) -> str:
        """Name of the bit generator the state belongs to.

        >>> RNG(seed=0, bit_generator="SFC64").get_state().bit_generator
        'SFC64'
        """
        return self._json_tree()["bit_generator"]


def _bit_generator_class(bit_generator) -> tuple[str, type]:
    if isinstance(bit_generator, str):
        cls = BIT_GENERATORS.get(bit_generator)
        if cls is None:
            raise ValueError(f"unknown bit_generator {bit_generator!r}; choose one of {sorted(BIT_GENERATORS)}")
        return bit_generator, cls
    for name, cls in BIT_GENERATORS.items():
        if bit_generator is cls:
            return name, cls
    raise TypeError(
        f"bit_generator must be a name or one of numpy's classes {sorted(BIT_GENERATORS)}, got {bit_generator!r}"
    )


class RNG:
    """A random number generator with ``get_state`` / ``set_state`` for checkpoints.

    ``seed`` is anything :class:`numpy.random.SeedSequence` accepts (an int,
    a sequence of ints, or ``None`` for fresh OS entropy); ``RNG(seed=s)``
    draws the same numbers as ``numpy.random.default_rng(s)``.
    ``bit_generator`` names the algorithm (default ``"PCG64"``).

    >>> rng = RNG(seed=7, bit_generator="Philox")
    >>> rng.random() == RNG(seed=7, bit_generator="Philox").random()
    True
    """

    __slots__ = ("_generator", "_name")

    def __init__(self, seed: Any = None, *, bit_generator: str | type = "PCG64"):
        name, cls = _bit_generator_class(bit_generator)
        self._name = name
        self._generator = np.random.Generator(cls(np.random.SeedSequence(seed)))

    @classmethod
    def from_state(cls, state: RNGState | str | dict) -> "RNG":
        """Build an RNG that continues the stream ``state`` was taken from.

        The bit generator is the one named in the state.

        >>> a = RNG(seed=3, bit_generator="SFC64")
        >>> b = RNG.from_state(a.get_state())
        >>> bool(a.integers(1 << 62) == b.integers(1 << 62))
        True
        """
        state = RNGState.coerce(state)
        rng = cls(0, bit_generator=state.bit_generator)
        rng.set_state(state)
        return rng

    @property
    def generator(self) -> np.random.Generator:
        """The underlying numpy Generator; draws from it advance this RNG's state.

        >>> RNG(seed=1).generator.bit_generator.__class__.__name__
        'PCG64'
        """
        return self._generator

    @property
    def bit_generator(self) -> str:
        """Name of the bit generator.

        >>> RNG().bit_generator
        'PCG64'
        """
        return self._name

    def get_state(self) -> RNGState:
        """Snapshot of the generator's state (an :class:`RNGState`; ``str()`` it to store it).

        >>> rng = RNG(seed=5)
        >>> s = rng.get_state(); x = rng.random()
        >>> rng.set_state(s); rng.random() == x
        True
        """
        return RNGState(self._generator.bit_generator.state)

    def set_state(self, value: RNGState | str | dict) -> None:
        """Continue from ``value``: an :class:`RNGState`, its ``str()``, or numpy's state dict.

        The state must belong to the same bit generator; ``RNG.from_state``
        builds an RNG of the right kind.

        >>> rng = RNG(seed=5)
        >>> rng.set_state(str(RNG(seed=6).get_state()))
        >>> rng.random() == RNG(seed=6).random()
        True
        """
        state = RNGState.coerce(value)
        if state.bit_generator != self._name:
            raise ValueError(
                f"the state is for the {state.bit_generator} bit generator but this RNG uses {self._name}; "
                f"build it with RNG(bit_generator={state.bit_generator!r}) or RNG.from_state(state)"
            )
        try:
            self._generator.bit_generator.state = state.to_dict()
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise ValueError(f"invalid {self._name} state: {exc}") from None

    @property
    def state(self) -> RNGState:
        """Same as :meth:`get_state`; assigning to it is :meth:`set_state`.

        >>> rng = RNG(seed=1); s = rng.state; x = rng.random()
        >>> rng.state = s; rng.random() == x
        True
        """
        return self.get_state()

    @state.setter
    def state(self, value: RNGState | str | dict) -> None:
        self.set_state(value)

    def random(self, size: int | tuple[int, ...] | None = None, dtype: Any = np.float64) -> Any:
        """Uniform floats in [0, 1), as ``Generator.random``.

        >>> 0.0 <= RNG(seed=1).random() < 1.0
        True
        """
        return self._generator.random(size, dtype=dtype)

    def integers(self, low: Any, high: Any = None, size: int | tuple[int, ...] | None = None, dtype: Any = np.int64,
                 endpoint: bool = False) -> Any:
        """Random integers in [low, high), as ``Generator.integers``.

        >>> RNG(seed=1).integers(10, size=3).shape
        (3,)
        """
        return self._generator.integers(low, high, size, dtype=dtype, endpoint=endpoint)

    def normal(self, loc: Any = 0.0, scale: Any = 1.0, size: int | tuple[int, ...] | None = None) -> Any:
        """Normally distributed floats, as ``Generator.normal``.

        >>> RNG(seed=1).normal(size=2).dtype
        dtype('float64')
        """
        return self._generator.normal(loc, scale, size)

    def permutation(self, x: Any) -> Any:
        """A shuffled copy of ``x`` (or of ``arange(x)`` for an int), as ``Generator.permutation``.

        >>> sorted(RNG(seed=1).permutation(4).tolist())
        [0, 1, 2, 3]
        """
        return self._generator.permutation(x)

    def __repr__(self) -> str:
        return f"RNG(bit_generator={self._name!r})"


class GlobalRNG:
    """The process-wide generators as one checkpointable object: Python's ``random``, numpy's ``np.random``
    and, when torch is imported, torch's default CPU generator (``torch.manual_seed``'s).

    ``get_state()`` takes all three (``{"python": ..., "numpy": ..., "torch": ...}``,
    ``"torch"`` only when torch is imported); ``set_state(state)`` tries each
    part on a fresh generator first and changes nothing when one does not fit,
    then restores them all. Pass it as ``train_rng`` (or next to other
    generators in a dict) to resume code that draws from the global generators.

    >>> import random
    >>> g = GlobalRNG(); saved = g.get_state()
    >>> a, b = random.random(), np.random.random()
    >>> g.set_state(saved)
    >>> (random.random(), np.random.random()) == (a, b)
    True
    """

    __slots__ = ()

    def get_state(self) -> dict[str, Any]:
        """The state of every global generator (a copy).

        >>> sorted(GlobalRNG().get_state())[:2]
        ['numpy', 'python']
        """
        import random
        import sys

        state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(legacy=False)}
        torch = sys.modules.get("torch")
        if torch is not None:
            state["torch"] = torch.random.get_rng_state().numpy().copy()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore every generator ``state`` names; all are checked before any is changed.

        >>> GlobalRNG().set_state({"python": (3, (), None)})
        Traceback (most recent call last):
        ...
        ValueError: GlobalRNG.set_state: the 'python' state does not fit: ...
        """
        import importlib
        import random

        from fastckpt.state.protocol import check_state, random_state

        if not isinstance(state, dict) or not set(state) <= {"python", "numpy", "torch"} or not state:
            raise ValueError(f"GlobalRNG.set_state: expected a dict with 'python', 'numpy' and/or 'torch', got "
                             f"{type(state).__name__} {sorted(state) if isinstance(state, dict) else ''}")
        torch: Any = None
        if "torch" in state:
            torch = importlib.import_module("torch")
        checks = {"python": (random.Random(), state.get("python")),
                  "numpy": (np.random.Generator(np.random.MT19937()), state.get("numpy")),
                  "torch": (torch.Generator() if torch is not None else None, state.get("torch"))}
        for name, (probe, part) in checks.items():
            if name in state:
                try:
                    check_state(probe, part)
                except ValueError as exc:
                    raise ValueError(f"GlobalRNG.set_state: the {name!r} state does not fit: {exc}") from None
        if "python" in state:
            random.setstate(random_state(state["python"]))
        if "numpy" in state:
            np.random.set_state(state["numpy"])
        if torch is not None:
            torch.random.set_rng_state(torch.from_numpy(np.array(state["torch"], dtype=np.uint8, copy=True)))

    def __repr__(self) -> str:
        return "GlobalRNG()"
