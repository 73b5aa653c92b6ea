"""Validating parser of ``.npy`` headers: a literal parser of its own, never ``eval``, never pickle.

An NPZ member is a ``.npy`` file; this module reads the header that starts it
and says where its payload begins (``fastckpt._native.npz`` finds the members, the
writer ``fastckpt.formats.npz.npy_header`` builds the headers). Every failure raises
:class:`fastckpt.errors.FormatError`, prefixed by ``where`` when one is given.

Byte layout
-----------
All integers are little-endian and unsigned.

| offset | size | field |
|---|---|---|
| 0 | 6 | magic ``\\x93NUMPY`` |
| 6 | 1 | major version: 1, 2 or 3 (anything else is refused) |
| 7 | 1 | minor version: 0 |
| 8 | 2 (1.0) or 4 (2.0, 3.0) | header length ``H`` |
| 10 or 12 | ``H`` | header text: latin-1 (1.0, 2.0) or UTF-8 (3.0) |

The payload follows at offset 10 + ``H`` (1.0) or 12 + ``H`` (2.0, 3.0): the
header's total length, which ``npy_header_length`` returns from the first 10
or 12 bytes alone.

``H`` is capped before any text is read: at ``max_header_size`` bytes (10000
by default, numpy's ``_MAX_HEADER_SIZE``), or 4 times that for 3.0, whose
characters take up to 4 bytes; the decoded text must then hold at most
``max_header_size`` characters.

Header text
-----------
What numpy writes (``numpy.lib.format._wrap_header``): the repr of the dict
``{'descr': <descr>, 'fortran_order': <bool>, 'shape': <tuple>, }`` (keys
sorted, each entry followed by ``", "``), spaces so that the first dimension
(the last, for Fortran order) could grow to 21 digits, then spaces and one
``\\n`` so that the header's total length is a multiple of 64. Format 1.0
unless ``H`` would exceed 65535 (then 2.0) or the text is not latin-1 (then
3.0). That text, for a plain dtype whose ``descr`` string has at most 26
characters, is matched by one linear regular expression and read without the
general parser below (with the same result).

Any other text is read by the literal parser, in linear time, as one Python
literal; whitespace (`` \\t\\r\\n\\f\\v``) may come before and after each of its
tokens, and nothing else may follow it:

- a dict of str keys (no key twice), a tuple or a list, nested at most 16
  levels; ``(x)`` without a comma is ``x``, trailing commas are allowed;
- a string in ``'`` or ``"`` quotes, without a raw line feed, with the escapes
  ``\\\\ \\' \\" \\n \\r \\t \\0 \\a \\b \\f \\v``, ``\\xHH``, ``\\uHHHH`` and
  ``\\UHHHHHHHH`` (at most U+10FFFF); no prefixes, no implicit concatenation;
- an int: an optional ``-`` then decimal digits, at most 20 characters in
  all, and an optional ``l``/``L`` suffix (old Python 2 headers);
- ``True``, ``False``, ``None``.

The value must be a dict with exactly the keys ``descr``, ``fortran_order``
and ``shape``:

- ``shape``: a tuple of at most 64 non-negative ints (numpy's ``NPY_MAXDIMS``);
- ``fortran_order``: ``True`` or ``False``;
- ``descr``: a string numpy accepts as a dtype, or the list numpy writes for a
  structured dtype, of ``(name, format)`` or ``(name, format, shape)`` fields:
  ``name`` a str or a ``(title, name)`` pair of strs, ``format`` a ``descr``
  again (nested at most 16 levels), ``shape`` an int or a tuple of at most 64
  non-negative ints. A field named ``''`` of a plain void type is padding: it
  takes its bytes and gives no field. Fields lie back to back in list order.

Refused besides: a dtype holding Python objects (reading one would need
pickle), and a shape whose nonzero dimensions times the item size (at least
1) exceed 2**63 - 1, numpy's own limit for any array, empty ones included.
"""

import re

import numpy as np

from fastckpt.errors import FormatError

__all__ = ["parse_npy_header", "npy_header_length", "MAX_HEADER_SIZE", "NPY_MAGIC"]

# numpy's cap (numpy.lib.format._MAX_HEADER_SIZE): longer headers are refused unless the caller
# raises it with ``max_header_size=``; the literal parser below is linear, the cap bounds its work.
MAX_HEADER_SIZE = 10000
NPY_MAGIC = b"\x93NUMPY"
# numpy's NPY_MAXDIMS (numpy >= 2.0).
MAX_NDIM = 64
# Nesting of tuples/lists/dicts in a header: a structured descr nests a few levels at most.
MAX_LITERAL_DEPTH = 16
# An int literal longer than this cannot be a dimension of an array that fits in a file.
MAX_INT_DIGITS = 20
MAX_INTP = 2**63 - 1


def _prefix(where):
    return f"{where}: " if where else ""


def npy_header_length(prefix, where="", max_header_size=MAX_HEADER_SIZE):
    """Total length in bytes (magic included) of the ``.npy`` header that ``prefix`` starts.

    ``prefix`` needs the first 10 bytes (format 1.0) or 12 (2.0, 3.0). Checks the
    magic, the version and the size cap.

    >>> npy_header_length(b"\\x93NUMPY\\x01\\x00\\x76\\x00")
    128
    """
    return npy_total_length(bytes(prefix), where, max_header_size)


cdef Py_ssize_t npy_total_length(bytes data, where, max_header_size) except -1:
    """npy_header_length of a bytes prefix, called from C by the NPZ parser (once per member)."""
    if len(data) < 8:
        raise FormatError(f"{_prefix(where)}expected an 8-byte npy magic and version at the start of the member, "
                          f"got {len(data)} bytes {data!r}")
    if data[:6] != NPY_MAGIC:
        raise FormatError(f"{_prefix(where)}bad npy magic: expected {NPY_MAGIC!r}, got {data[:6]!r}")
    version = (data[6], data[7])
    if version == (1, 0):
        fixed = 10
    elif version in ((2, 0), (3, 0)):
        fixed = 12
    else:
        raise FormatError(f"{_prefix(where)}unsupported npy format version {version[0]}.{version[1]} "
                          "(expected 1.0, 2.0 or 3.0)")
    if len(data) < fixed:
        raise FormatError(f"{_prefix(where)}npy {version[0]}.{version[1]} header needs {fixed} bytes before its text, "
                          f"got {len(data)}")
    hlen = int.from_bytes(data[8:fixed], "little")
    # A UTF-8 header (3.0) may take up to 4 bytes per character; the character cap is checked after decoding.
    limit = max_header_size * (4 if version == (3, 0) else 1)
    if hlen > limit:
        raise _header_too_long(where, hlen, max_header_size)
    return fixed + hlen


def _header_too_long(where, hlen, max_header_size):
    return FormatError(
        f"{_prefix(where)}npy header is {hlen} bytes, over the {max_header_size}-byte cap (numpy's "
        "_MAX_HEADER_SIZE): refused as unsafe to parse; if you trust this file pass a larger "
        "max_header_size= to fastckpt.open / read_npz_index / parse_npy_header")


def parse_npy_header(data, where="", max_header_size=MAX_HEADER_SIZE):
    """Parse the ``.npy`` header at the start of ``data``; return ``(dtype, shape, fortran_order, header_nbytes)``.

    Formats 1.0, 2.0 and 3.0 (UTF-8). The header text must be exactly the dict
    numpy writes (keys ``descr``, ``fortran_order``, ``shape``), read by a small
    literal parser: nothing is evaluated. Dtypes holding Python objects are
    refused (they would need pickle). ``where`` prefixes error messages.

    >>> import io, numpy as np
    >>> buf = io.BytesIO(); np.save(buf, np.zeros((2, 3), ">f4"))
    >>> parse_npy_header(buf.getvalue())
    (dtype('>f4'), (2, 3), False, 128)
    """
    data = bytes(data)
    return parse_npy(data, npy_total_length(data[:12], where, max_header_size), where, max_header_size)


cdef tuple parse_npy(bytes data, Py_ssize_t total, where, max_header_size):
    """parse_npy_header once the header's total length is known (and checked against the cap)."""
    if len(data) < total:
        raise FormatError(f"{_prefix(where)}expected a {total}-byte npy header, got {len(data)} bytes "
                          "(member seems truncated?)")
    fixed = 10 if data[6] == 1 else 12
    encoding = "utf-8" if data[6] == 3 else "latin-1"
    try:
        text = data[fixed:total].decode(encoding)
    except UnicodeDecodeError as e:
        raise FormatError(f"{_prefix(where)}npy {data[6]}.0 header is not valid {encoding} at byte "
                          f"{fixed + e.start}") from None
    if len(text) > max_header_size:
        raise _header_too_long(where, len(text), max_header_size)
    canonical = _CANONICAL_HEADER.fullmatch(text)
    if canonical is not None:
        # The exact text numpy writes for a plain dtype; the pattern itself guarantees the value types.
        dims = canonical.group(3).rstrip(",")
        descr = canonical.group(1)
        fortran_order = canonical.group(2) == "True"
        shape = tuple([int(d) for d in dims.split(", ")]) if dims else ()
    else:
        descr, fortran_order, shape = _checked_header_values(_LiteralParser(text, where).parse_header(), where)
    dtype = _descr_to_dtype(descr, where)
    # numpy's own limit (PyArray_NewFromDescr): nonzero dimensions times the item size must fit in intp,
    # even for an empty array.
    nbytes = max(dtype.itemsize, 1)
    for d in shape:
        nbytes *= d or 1
    if nbytes > MAX_INTP:
        raise FormatError(f"{_prefix(where)}npy shape {shape} of {dtype} spans {nbytes} bytes, more than numpy's "
                          f"limit of {MAX_INTP}")
    return dtype, shape, fortran_order, total


def _checked_header_values(dict header, where):
    if set(header) != {"descr", "fortran_order", "shape"}:
        raise FormatError(f"{_prefix(where)}npy header keys must be exactly 'descr', 'fortran_order' and 'shape', "
                          f"got {sorted(header)!r}")
    shape = header["shape"]
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        raise FormatError(f"{_prefix(where)}npy header 'shape' must be a tuple of non-negative ints, got {shape!r}")
    if len(shape) > MAX_NDIM:
        raise FormatError(f"{_prefix(where)}npy header 'shape' has {len(shape)} dimensions, more than numpy's "
                          f"{MAX_NDIM}")
    fortran_order = header["fortran_order"]
    if type(fortran_order) is not bool:
        raise FormatError(f"{_prefix(where)}npy header 'fortran_order' must be True or False, got {fortran_order!r}")
    return header["descr"], fortran_order, shape


def _ml_dtype(str descr):
    """The ml_dtypes type named ``descr`` (``"bfloat16"``, ``"float8_e4m3fn"`` ...: the descr fastckpt writes for
    them), else None. ml_dtypes registers its names with numpy only once imported, so it is imported here, when a
    file names one, not for every file."""
    import ml_dtypes

    dtype = getattr(ml_dtypes, descr, None)
    if dtype is None or not isinstance(dtype, type) or not descr.replace("_", "").isalnum():
        return None
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return None
    return dtype if dtype.type.__module__ == "ml_dtypes" and dtype.name == descr else None


def _descr_to_dtype(descr, where, int depth=0):
    """numpy.lib.format.descr_to_dtype over a validated literal, with every failure a FormatError."""
    if depth > MAX_LITERAL_DEPTH:
        raise FormatError(f"{_prefix(where)}npy 'descr' nests deeper than {MAX_LITERAL_DEPTH} levels")
    if type(descr) is str:
        try:
            dtype = np.dtype(descr)
        except Exception as e:  # numpy raises TypeError, ValueError or others for junk strings
            dtype = _ml_dtype(descr)
            if dtype is None:
                raise FormatError(f"{_prefix(where)}npy 'descr' {descr!r} is not a numpy dtype ({e})") from None
    elif type(descr) is tuple:
        # (format, shape): a sub-array format, as a field's format whose base is itself a sub-array is written
        # ([('a', ('<f4', (2,)), (3,))]); numpy's descr_to_dtype reads it as np.dtype((format, shape)).
        if len(descr) != 2:
            raise FormatError(f"{_prefix(where)}npy 'descr' sub-array must be (format, shape), got {descr!r}")
        shape = (descr[1],) if type(descr[1]) is int else descr[1]
        if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > MAX_NDIM:
            raise FormatError(f"{_prefix(where)}npy 'descr' sub-array has a bad shape {descr[1]!r}")
        try:
            dtype = np.dtype((_descr_to_dtype(descr[0], where, depth + 1), shape))
        except FormatError:
            raise
        except Exception as e:
            raise FormatError(f"{_prefix(where)}npy 'descr' sub-array {descr!r}: {e}") from None
    elif type(descr) is list:
        names, formats, titles, offsets = [], [], [], []
        offset = 0
        for field in descr:
            if type(field) is not tuple or len(field) not in (2, 3):
                raise FormatError(f"{_prefix(where)}npy 'descr' field must be (name, format) or "
                                  f"(name, format, shape), got {field!r}")
            name, fmt = field[0], field[1]
            title = None
            if type(name) is tuple and len(name) == 2 and all(type(x) is str for x in name):
                title, name = name
            elif type(name) is not str:
                raise FormatError(f"{_prefix(where)}npy 'descr' field name must be a str or a (title, name) "
                                  f"pair, got {name!r}")
            dt = _descr_to_dtype(fmt, where, depth + 1)
            if len(field) == 3:
                sub = field[2]
                if type(sub) is int:
                    sub = (sub,)
                if type(sub) is not tuple or not all(type(d) is int and d >= 0 for d in sub) or len(sub) > MAX_NDIM:
                    raise FormatError(f"{_prefix(where)}npy 'descr' field {name!r} has a bad subarray shape {field[2]!r}")
                try:
                    dt = np.dtype((dt, sub))
                except Exception as e:
                    raise FormatError(f"{_prefix(where)}npy 'descr' field {name!r}: {e}") from None
            if name == "" and dt.type is np.void and dt.names is None:
                pass  # padding bytes, as numpy writes them for offset/aligned fields
            else:
                names.append(name)
                formats.append(dt)
                titles.append(title)
                offsets.append(offset)
            offset += dt.itemsize
        try:
            dtype = np.dtype({"names": names, "formats": formats, "titles": titles, "offsets": offsets,
                              "itemsize": offset})
        except Exception as e:
            raise FormatError(f"{_prefix(where)}npy 'descr' {descr!r} is not a valid structured dtype ({e})") from None
    else:
        raise FormatError(f"{_prefix(where)}npy 'descr' must be a dtype string or a list of fields, got {descr!r}")
    if dtype.hasobject:
        raise FormatError(f"{_prefix(where)}npy 'descr' {descr!r} holds Python objects; reading it would need pickle, "
                          "which fastckpt never does (re-save the array with a numeric or string dtype)")
    return dtype


# What numpy writes for every non-structured dtype, e.g.
# "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" + spaces + "\n". Linear to match.
_CANONICAL_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[A-Za-z][A-Za-z0-9\[\]]{0,24})', 'fortran_order': (False|True), "
    r"'shape': \((|[0-9]{1,20},|[0-9]{1,20}(?:, [0-9]{1,20}){1,63})\), \} *\n?")
_WHITESPACE = " \t\r\n\f\v"
_SIMPLE_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "r": "\r", "t": "\t", "0": "\0",
                   "a": "\a", "b": "\b", "f": "\f", "v": "\v"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class _LiteralParser:
    """Reads the Python literal numpy writes as a ``.npy`` header: a dict of str keys whose values are
    strings, ints, True/False, tuples and lists (nested to ``MAX_LITERAL_DEPTH``). Linear time."""

    def __init__(self, str text, where):
        self.text = text
        self.pos = 0
        self.where = where

    def fail(self, what):
        near = self.text[max(0, self.pos - 20): self.pos + 20]
        return FormatError(f"{_prefix(self.where)}cannot parse npy header at character {self.pos}: {what} "
                           f"(near {near!r})")

    def skip_ws(self):
        cdef str text = self.text
        cdef Py_ssize_t n = len(text)
        cdef Py_ssize_t i = self.pos
        while i < n and text[i] in _WHITESPACE:
            i += 1
        self.pos = i

    def peek(self):
        self.skip_ws()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, ch):
        if self.peek() != ch:
            raise self.fail(f"expected {ch!r}")
        self.pos += 1

    def parse_header(self):
        value = self.value(0)
        if type(value) is not dict:
            raise FormatError(f"{_prefix(self.where)}npy header is not a dict: {self.text[:80]!r}")
        if self.peek() != "":
            raise self.fail("unexpected text after the header dict")
        return value

    def value(self, int depth):
        if depth > MAX_LITERAL_DEPTH:
            raise self.fail(f"nested deeper than {MAX_LITERAL_DEPTH} levels")
        ch = self.peek()
        if ch == "":
            raise self.fail("unexpected end of the header")
        if ch == "{":
            return self.mapping(depth)
        if ch in "([":
            return self.sequence(depth, ch)
        if ch in "'\"":
            return self.string()
        if ch.isdigit() or ch == "-":
            return self.integer()
        for word, val in (("True", True), ("False", False), ("None", None)):
            if self.text.startswith(word, self.pos):
                end = self.pos + len(word)
                if end < len(self.text) and (self.text[end].isalnum() or self.text[end] == "_"):
                    break
                self.pos = end
                return val
        raise self.fail("expected a string, int, True/False, tuple, list or dict")

    def mapping(self, int depth):
        self.expect("{")
        out = {}
        while self.peek() != "}":
            key = self.value(depth + 1)
            if type(key) is not str:
                raise self.fail(f"dict key must be a string, got {key!r}")
            if key in out:
                raise self.fail(f"duplicate key {key!r}")
            self.expect(":")
            out[key] = self.value(depth + 1)
            if self.peek() == ",":
                self.pos += 1
            elif self.peek() != "}":
                raise self.fail("expected ',' or '}'")
        self.pos += 1
        return out

    def sequence(self, int depth, str opener):
        closer = ")" if opener == "(" else "]"
        self.expect(opener)
        items = []
        trailing_comma = False
        while self.peek() != closer:
            items.append(self.value(depth + 1))
            trailing_comma = False
            if self.peek() == ",":
                self.pos += 1
                trailing_comma = True
            elif self.peek() != closer:
                raise self.fail(f"expected ',' or {closer!r}")
        self.pos += 1
        if opener == "[":
            return items
        if len(items) == 1 and not trailing_comma:
            return items[0]  # "(x)" is x, as in Python
        return tuple(items)

    def integer(self):
        cdef str text = self.text
        cdef Py_ssize_t start = self.pos
        cdef Py_ssize_t i = start
        cdef Py_ssize_t n = len(text)
        if i < n and text[i] == "-":
            i += 1
        while i < n and "0" <= text[i] <= "9":
            i += 1
        digits = text[start:i]
        if digits in ("", "-"):
            raise self.fail("expected digits")
        if len(digits) > MAX_INT_DIGITS:
            raise self.fail(f"integer literal longer than {MAX_INT_DIGITS} digits")
        if i < n and text[i] in "lL":
            i += 1  # Python 2's long suffix, still found in old .npy headers
        self.pos = i
        return int(digits)

    def string(self):
        cdef str text = self.text
        cdef Py_ssize_t n = len(text)
        cdef Py_ssize_t i = self.pos
        quote = text[i]
        i += 1
        parts = []
        while True:
            if i >= n:
                self.pos = i
                raise self.fail("unterminated string")
            ch = text[i]
            if ch == quote:
                i += 1
                break
            if ch == "\n":
                self.pos = i
                raise self.fail("newline inside a string")
            if ch == "\\":
                if i + 1 >= n:
                    self.pos = i
                    raise self.fail("unterminated escape")
                esc = text[i + 1:i + 2]
                if esc in _SIMPLE_ESCAPES:
                    parts.append(_SIMPLE_ESCAPES[esc])
                    i += 2
                elif esc in _HEX_ESCAPES:
                    width = _HEX_ESCAPES[esc]
                    digits = text[i + 2: i + 2 + width]
                    if len(digits) != width or any(c not in "0123456789abcdefABCDEF" for c in digits):
                        self.pos = i
                        raise self.fail(f"bad \\{esc} escape")
                    code = int(digits, 16)
                    if code > 0x10FFFF:
                        self.pos = i
                        raise self.fail(f"\\{esc} escape out of range")
                    parts.append(chr(code))
                    i += 2 + width
                else:
                    self.pos = i
                    raise self.fail(f"unsupported escape \\{esc}")
            else:
                parts.append(ch)
                i += 1
        self.pos = i
        return "".join(parts)

