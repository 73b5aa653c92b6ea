"""The one name rule: which tensor, table, slot, file and step names a format can store and read back.

A format does not write its own name check. It describes what its reader cannot take back as a
:class:`NameRule` (data: the substrings and prefixes it reserves, whether a name becomes a file name or a
relative path, whether control characters break it) and calls :meth:`NameRule.check` on every name before
anything is written. A save with a name its reader cannot load back is refused at once, the previous commit
untouched, with a message that names the tensor, the offending character (its ``repr`` and its position) and
the way out. Readers call the same rule where a name read from a file becomes a path (a manifest's file
names, an index's shard files) and raise :class:`~fastckpt.errors.FormatError` instead.

What each rule refuses:

- ``controls``: the control characters (U+0000-U+001F, U+007F-U+009F) and the line and paragraph separators
  (U+2028, U+2029). Formats whose keys are parsed with separators, kept in line-based tools or turned into
  file names refuse them; single-file formats that store names as JSON or binary keys (safetensors, NPZ, HF
  shards, TensorFlow bundles) read every such name back exactly and keep accepting it.
- ``reserved``: substrings the format uses as separators, each with the reason (RecIS's ``'^'`` and ``'@'``,
  the ``'/part_'`` suffix of stored parts).
- ``whole``: names the format keeps for itself (safetensors' ``__metadata__``, TensorFlow's empty key).
- ``prefixes``: starts the format keeps for itself (TensorFlow's keys beginning with NUL hold slices).
- ``file_name``: the name is one file name in a directory: not empty, ``'.'`` or ``'..'``; no ``'/'``,
  ``'\\\\'`` or NUL.
- ``path``: the name is a relative path of ``'/'``-separated file names: not absolute, no empty, ``'.'`` or
  ``'..'`` component, no NUL.

NPZ is the one exception: its member rule (no NUL, backslash, absolute name or ``'..'`` component, the
message naming the character and its position as here) sits in the native ZIP parser
(``fastckpt._native.npz.member_name_problem``), below this floor, where its reader and its writer share it.

Step directories of :class:`~fastckpt.train.CheckpointManager` are ``step-<N>`` with ``N`` in ASCII digits;
:func:`step_name` makes one and :func:`parse_step` is the only reader of one (a name with anything after the
digits, a newline included, is not a step).

>>> rule = NameRule("fastckpt's sharded layout", reserved=(("/part_", "the suffix of every stored part"),))
>>> rule.check("tower/dense/kernel")
'tower/dense/kernel'
>>> rule.check("layer\\nweight")
Traceback (most recent call last):
ValueError: tensor name 'layer\\nweight' holds '\\n' at position 5, a control character: fastckpt's sharded layout cannot read such a name back; rename the tensor (for example replace it with '_')
>>> parse_step("step-00000005"), parse_step("step-5\\n")
(5, None)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["NameRule", "FILE_NAME", "RELATIVE_PATH", "step_name", "parse_step", "STEP_PATTERN"]

# Control characters (C0, DEL, C1) and the separators that str.splitlines and most line-based tools split on.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_DRIVE = re.compile(r"[A-Za-z]:")


@dataclass(frozen=True)
class NameRule:
    """What a format's reader cannot take back in a name; :meth:`check` refuses it before anything is written.

    ``format`` names the format in messages; ``reserved`` holds ``(substring, why)`` pairs, ``whole``
    ``(name, why)`` pairs of names the format keeps for itself and ``prefixes`` ``(start, why)`` pairs;
    ``controls`` refuses control characters; ``file_name`` and ``path`` say that the name becomes one file
    name or a relative path; ``empty`` allows the empty name; ``refusal`` says why a save cannot take the name
    (``{format}`` is replaced) and ``way_out`` ends every message.

    >>> NameRule("RecIS's layout", reserved=(("^", "RecIS's separator"),)).problem("a^b")
    "holds '^' at position 1 (RecIS's separator)"
    """

    format: str
    reserved: tuple[tuple[str, str], ...] = ()
    whole: tuple[tuple[str, str], ...] = ()
    prefixes: tuple[tuple[str, str], ...] = ()
    controls: bool = True
    file_name: bool = False
    path: bool = False
    empty: bool = False
    way_out: str = "rename the {what} (for example replace it with '_')"
    refusal: str = "{format} cannot read such a name back"

    def __post_init__(self):
        # What check() looks for before it asks problem() what is wrong: substring, set and prefix tests and
        # str.isprintable (a few hundred ns a name); a relative path (read side only) always takes the full rule.
        inside = [c for c, _ in self.reserved]
        if self.file_name or self.path:
            inside.append("\x00")
        if self.file_name:
            inside += ["/", "\\"]
        names = [c for c, _ in self.whole] + ([] if self.empty else [""]) + ([".", ".."] if self.file_name else [])
        object.__setattr__(self, "_inside", tuple(dict.fromkeys(inside)))
        object.__setattr__(self, "_starts", tuple(c for c, _ in self.prefixes))
        object.__setattr__(self, "_names", frozenset(names))

    def _suspect(self, name: str) -> bool:
        if self.path or name in self._names or (self._starts and name.startswith(self._starts)):
            return True
        # isprintable() is False for every control character (and for more: those take the full rule)
        if self.controls and not name.isprintable() and _CONTROL.search(name) is not None:
            return True
        for s in self._inside:
            if s in name:
                return True
        return False

    def problem(self, name: str) -> str | None:
        """What makes ``name`` unreadable in this format (the character, its position and why), or None.

        >>> FILE_NAME.problem("../x"), FILE_NAME.problem("w.safetensors") is None
        ("holds '/' at position 2 (a file name has no directory separator)", True)
        """
        for reserved, why in self.whole:
            if name == reserved:
                return f"is reserved ({why})"
        if not name:
            return None if self.empty else "is empty"
        if self.controls:
            m = _CONTROL.search(name)
            if m:
                return f"holds {m.group()!r} at position {m.start()}, a control character"
        for start, why in self.prefixes:
            if name.startswith(start):
                return f"starts with {start!r}, which is reserved ({why})"
        found = [(name.find(s), s, why) for s, why in self.reserved if s in name]
        if found:
            at, s, why = min(found)
            return f"holds {s!r} at position {at} ({why})"
        if self.file_name or self.path:
            at = name.find("\x00")
            if at >= 0:
                return f"holds '\\x00' at position {at} (no file name holds NUL)"
        if self.file_name:
            at = name.find("\\")
            if at >= 0:
                return f"holds '\\\\' at position {at} (a path separator on Windows)"
            if name in (".", ".."):
                return f"is {name!r}, a directory, not a file name"
            at = name.find("/")
            if at >= 0:
                return f"holds '/' at position {at} (a file name has no directory separator)"
        if self.path:
            if name.startswith("/") or _DRIVE.match(name):
                return "is an absolute path; expected a relative one"
            at = 0
            for part in name.split("/"):
                if part in ("", ".", ".."):
                    what = "an empty" if not part else f"a {part!r}"
                    return f"has {what} path component at position {at}"
                at += len(part) + 1
        return None

    def check(self, name, what: str = "tensor", *, where: str | None = None, error: type = ValueError) -> str:
        """``name`` when this format reads it back exactly; otherwise raises ``error`` naming ``what``, the
        character and its position, and the way out. A reader passes ``where`` (the file the name was read
        from) and ``error=FormatError``: the message then says the name is refused, not how to rename it.

        >>> FILE_NAME.check("a/b", "shard file", where="i.json", error=KeyError)
        Traceback (most recent call last):
        KeyError: "i.json: shard file name 'a/b' holds '/' at position 1 (a file name has no directory separator): not a plain file name; refusing to use it"
        """
        if type(name) is not str:
            raise TypeError(f"{where + ': ' if where else ''}{what} names must be str, got {name!r} "
                            f"({type(name).__name__})")
        if not self._suspect(name):
            return name
        problem = self.problem(name)
        if problem is None:
            return name
        if where is not None:
            raise error(f"{where}: {what} name {name!r} {problem}: not {self.format}; refusing to use it")
        raise error(f"{what} name {name!r} {problem}: {self.refusal.format(format=self.format)}; "
                    f"{self.way_out.format(what=what)}")


FILE_NAME = NameRule("a plain file name", controls=False, file_name=True, refusal="not {format}",
                     way_out="use a plain file name")
"""One file name inside a directory (a prefix, a shard file an index names, a manifest's files)."""

RELATIVE_PATH = NameRule("a plain relative name", controls=False, path=True, refusal="not {format}",
                         way_out="use a plain relative path")
"""A relative path below a directory (object keys fetched into a local copy)."""

STEP_PATTERN = re.compile(r"step-([0-9]+)")
"""A step directory's name; matched with ``fullmatch`` only (``$`` would accept ``'step-5\\n'``)."""


def step_name(step) -> str:
    """The directory name of ``step``'s checkpoint: ``step-`` and eight or more digits.

    >>> step_name(30)
    'step-00000030'
    """
    if isinstance(step, bool) or not hasattr(step, "__index__") or step.__index__() < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step.__index__():08d}"


def parse_step(name: str) -> int | None:
    """The step of a ``step-<N>`` directory name (ASCII digits, nothing after them), or None.

    >>> parse_step("step-10"), parse_step("step-5\\n"), parse_step("step-\\u0665"), parse_step("latest")
    (10, None, None, None)
    """
    m = STEP_PATTERN.fullmatch(name)
    return int(m.group(1)) if m else None
