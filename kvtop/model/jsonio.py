"""The one reader for files a user hands kvtop (scenarios, workloads, model configs, the TOML config,
trace headers): every way such a file can be wrong ends in one line naming the file, never a traceback.

``json.loads`` and ``tomllib`` alone let through: nesting deep enough to raise ``RecursionError``
(or to pass the parser and then exhaust the stack of whatever walks the document: jsonschema,
the cost model); integers of more than 4,300 digits (Python's int-from-text limit raises
``ValueError``) and integers past a double's range (``OverflowError`` in the first ``float()``);
``1e999`` read as infinity and the ``NaN``/``Infinity`` words JSON does not allow; and bytes that are
not UTF-8 (a latin-1 file, a UTF-16 file from a Windows editor, NUL bytes from a binary file).
This module refuses all of them with a ``ValueError`` of the caller's type and a one-line message.

Trace *records* do not come through here: their lines are parsed by ``kvtop.model.validate.parse_line``
(the hot path), which already turns every malformed line into a skipped, counted line.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Deeper than any file kvtop reads needs (a scenario or a Hugging Face config nests 4 levels), and
# shallow enough that every recursive walk over the document (jsonschema, finite checks) stays far
# from the interpreter's recursion limit.
MAX_DEPTH = 64
# Larger than any scenario, workload, model config or config file (they are kilobytes); a bigger file
# is a wrong path (a trace or a model's weights given where a config goes), not something to parse.
MAX_BYTES = 16 << 20
# A JSON integer with more digits than this is past a double's range (1.8e308): no count, size or
# rate kvtop reads is, and converting one to float raises OverflowError.
MAX_INT_DIGITS = 309
# TOML integers are 64-bit (the TOML spec: an integer that cannot be represented losslessly is an error)
TOML_INT_MIN, TOML_INT_MAX = -(1 << 63), (1 << 63) - 1

ErrorType = Callable[[str], Exception]


class InputError(ValueError):
    """A user file kvtop cannot read; the message is one line and names the file."""


def _one_line(s: str, limit: int = 200) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def read_bytes(path: str | Path, what: str, error: ErrorType = InputError, max_bytes: int = MAX_BYTES) -> bytes:
    """The file's bytes, at most ``max_bytes`` of them (more is refused without reading it all)."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise error(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    if len(data) > max_bytes:
        raise error(f"{what} {path} is larger than {max_bytes >> 20} MiB: not a {what}")
    return data


_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def decode(data: bytes, what: str, path: str | Path, error: ErrorType = InputError) -> str:
    """UTF-8 text (a leading UTF-8 byte-order mark is dropped, as RFC 8259 allows a parser to)."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise error(f"{what} {path} is {name} text: save it as UTF-8")
    if b"\x00" in data:
        raise error(f"{what} {path} holds NUL bytes: a binary file, not a {what}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    return text.removeprefix("\ufeff")


def depth_over(obj: Any, limit: int) -> bool:
    """True when ``obj`` nests lists/dicts more than ``limit`` deep (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            children: Any = o.values()
        elif isinstance(o, list):
            children = o
        else:
            continue
        if d > limit:
            return True
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _bounded_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(s.lstrip('-')):,} digits is out of range")
    return int(s)


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"{_one_line(s, 40)} is out of a double's range")
    return v


def loads(text: str | bytes, what: str, path: str | Path, error: ErrorType = InputError,
          allow_nan: bool = False, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON text; any problem is ``error("<what> <path> is not JSON: <one line>")``.

    ``allow_nan`` keeps the non-standard ``NaN``/``Infinity`` words (and numbers that overflow to
    infinity) for callers that check finiteness themselves; integers are bounded either way."""
    try:
        if allow_nan:
            doc = json.loads(text, parse_int=_bounded_int)
        else:
            doc = json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:
        raise error(f"{what} {path} is not JSON kvtop reads: nested more than {max_depth} levels deep") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (bytes) and the hooks above
        raise error(f"{what} {path} is not JSON: {_one_line(str(e))}") from None
    if depth_over(doc, max_depth):
        raise error(f"{what} {path} is not JSON kvtop reads: nested more than {max_depth} levels deep")
    return doc


def read_json(path: str | Path, what: str, error: ErrorType = InputError, allow_nan: bool = False,
              max_depth: int = MAX_DEPTH, max_bytes: int = MAX_BYTES) -> Any:
    """A user's JSON file, read and parsed under every bound above."""
    text = decode(read_bytes(path, what, error, max_bytes), what, path, error)
    return loads(text, what, path, error, allow_nan, max_depth)


def read_toml(path: str | Path, what: str, error: ErrorType = InputError, max_depth: int = MAX_DEPTH,
              max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """A user's TOML file: invalid TOML, nesting past ``max_depth`` and integers past 64 bits are refused.

    ``FileNotFoundError`` passes through (a missing default config file is not an error)."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise error(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    if len(data) > max_bytes:
        raise error(f"{what} {path} is larger than {max_bytes >> 20} MiB: not a {what}")
    text = decode(data, what, path, error)
    try:
        doc: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"invalid TOML in {path}: {_one_line(str(e).splitlines()[0] if str(e) else '')}") from None
    except RecursionError:
        raise error(f"invalid TOML in {path}: nested more than {max_depth} levels deep") from None
    except ValueError:  # an integer past Python's int-from-text limit (4,300 digits)
        raise error(f"invalid TOML in {path}: an integer too long to read") from None
    if depth_over(doc, max_depth):
        raise error(f"invalid TOML in {path}: nested more than {max_depth} levels deep")
    bad = _toml_int_out_of_range(doc)
    if bad is not None:
        raise error(f"invalid TOML in {path}: {bad} is past a 64-bit integer")
    return doc


def _toml_int_out_of_range(doc: dict[str, Any]) -> str | None:
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, o = stack.pop()
        if isinstance(o, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in o.items())
        elif isinstance(o, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(o))
        elif type(o) is int and not TOML_INT_MIN <= o <= TOML_INT_MAX:
            return _one_line(where, 80)
    return None
