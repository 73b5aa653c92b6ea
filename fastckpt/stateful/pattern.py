"""Checkpoint file-name patterns: ``{seq}`` numbering, finding the files on disk, telling them apart.

>>> p = _Pattern("/tmp/ckpt_{seq:04d}.json")
>>> p.has_seq, p.path(7).name
(True, 'ckpt_0007.json')
"""

from __future__ import annotations

import os
import re
import string
from pathlib import Path

__all__ = ["_Pattern", "_identity"]


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _Pattern:
    """A ``save``/``load`` file name with at most one ``{seq}`` field in its last component."""

    def __init__(self, pattern: str | os.PathLike):
        text = os.fspath(pattern)
        if not isinstance(text, str):
            raise TypeError(f"the file pattern must be a str, got {type(text).__name__}")
        self.text = text
        directory, name = os.path.split(text)
        try:
            directory = directory.format()
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"{text!r}: {{seq}} may only appear in the file name, not in the directory") from None
        self.directory = Path(directory or ".")
        pieces, seq_fields = [], 0
        self.spec = ""
        try:
            parsed = list(string.Formatter().parse(name))
        except ValueError as exc:
            raise ValueError(f"{text!r} is not a valid format string ({exc}); write literal braces as {{{{ and }}}}") from None
        for literal, field, spec, conversion in parsed:
            pieces.append(re.escape(literal))
            if field is None:
                continue
            if field != "seq" or conversion:
                raise ValueError(f"{text!r}: the only placeholder allowed is {{seq}} (with an optional format spec such as {{seq:04d}}), found {{{field}}}")
            seq_fields += 1
            self.spec = spec
            pieces.append("([0-9]+)")
        if seq_fields > 1:
            raise ValueError(f"{text!r}: {{seq}} may appear only once")
        self.has_seq = seq_fields == 1
        self.name_template = name
        if self.has_seq:
            for probe in (0, 7, 12345):
                shown = format(probe, self.spec)
                if not (shown.isascii() and shown.isdigit() and int(shown) == probe):
                    raise ValueError(
                        f"{text!r}: the format spec {self.spec!r} does not write {probe} as plain decimal digits "
                        f"(it writes {shown!r}); use a spec such as '04d'"
                    )
        self._regex = re.compile("".join(pieces) + r"\Z")

    def path(self, seq: int | None = None) -> Path:
        name = self.name_template.format(seq=seq) if self.has_seq else self.name_template.format()
        return self.directory / name

    def existing(self) -> dict[int, Path]:
        """Sequence number -> path of the files on disk that this pattern writes."""
        if not self.has_seq:
            path = self.path()
            return {0: path} if path.is_file() else {}
        found = {}
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return found
        for entry in entries:
            match = self._regex.match(entry.name)
            if match is None:
                continue
            seq = int(match.group(1))
            # Only the canonical spelling counts: "ckpt_7.json" is not seq 7 of "ckpt_{seq:04d}.json".
            if self.name_template.format(seq=seq) == entry.name and entry.is_file():
                found[seq] = self.directory / entry.name
        return found
