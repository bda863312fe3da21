"""Shape checks for what a trace file holds: a record with a wrong-typed field is skipped (and
counted) at the reader, so nothing downstream meets a string where it expects a number.

The checks derive from the record dataclasses, so a new field is checked as soon as it exists.
Unknown fields and kinds pass (traces may come from newer writers).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

from kvtop.model.records import _BY_KIND
from kvtop.model.sanitize import printable

# One line of a trace may be at most this long; a longer one is skipped, never read whole.
MAX_LINE_BYTES = 1 << 20

Check = Callable[[object], bool]
_INT_MAX = 1 << 53
# Record times are seconds since the start of the run: a time outside this range is corruption,
# and one such value would make every gap and per-second bin downstream absurd (or huge).
T_MIN = -1.0
T_MAX = 1e9
_FLOAT_MAX = sys.float_info.max


def _num(v: object) -> bool:
    # an int is compared, not converted: math.isfinite(10**400) raises OverflowError
    return (type(v) is float and math.isfinite(v)) or (type(v) is int and -_FLOAT_MAX <= v <= _FLOAT_MAX)


def _time(v: object) -> bool:
    return (type(v) is float or type(v) is int) and T_MIN <= v <= T_MAX


def _num_or_nan(v: object) -> bool:
    # kvtop's writer turns NaN/Infinity into null: a non-finite number in a trace is corruption
    return _num(v)


def _int(v: object) -> bool:
    # every integer a record holds is a count, size, index or status: never negative
    return (type(v) is int or (type(v) is float and v.is_integer())) and 0 <= v <= _INT_MAX


def _str(v: object) -> bool:
    return type(v) is str


def _bool(v: object) -> bool:
    return type(v) is bool


def _list(v: object) -> bool:
    return type(v) is list


def _dict(v: object) -> bool:
    return type(v) is dict


def _hist(v: object) -> bool:
    # counts must be real numbers; the sum may be unknown (written as null)
    if type(v) is not dict or not _num(v.get("count")) or not (v.get("sum") is None or _num(v["sum"])):
        return False
    b = v.get("buckets")
    if type(b) is not list:
        return False
    for pair in b:
        if type(pair) is not list or len(pair) != 2 or not _num(pair[1]):
            return False
        le = pair[0]
        if not (_num(le) or le in ("+Inf", "Inf", "inf")):
            return False
    return True


_BY_TYPE: dict[str, Check] = {
    "float": _num_or_nan, "int": _int, "str": _str, "bool": _bool, "Histogram": _hist,
}


def _check_for(annotation: str) -> Check | None:
    parts = [p.strip() for p in annotation.split("|")]
    optional = "None" in parts
    parts = [p for p in parts if p != "None"]
    if len(parts) != 1:
        return None
    base = parts[0]
    if base.startswith("list["):
        check: Check = _list
    elif base.startswith("dict["):
        check = _dict
    elif base in _BY_TYPE:
        check = _BY_TYPE[base]
    else:
        return None
    if optional:
        return _optional(check)
    return check


def _optional(check: Check) -> Check:
    def ok(v: object) -> bool:
        return v is None or check(v)

    return ok


def _checks(cls: type) -> dict[str, Check]:
    out: dict[str, Check] = {}
    for f in dataclasses.fields(cls):
        if f.name == "t":
            continue
        c = _check_for(str(f.type))
        if c is not None:
            out["class" if f.name == "cls" else f.name] = c
    return out


_CHECKS: dict[str, dict[str, Check]] = {kind: _checks(cls) for kind, cls in _BY_KIND.items()}
# Request ids are strings; older simulated traces wrote integers, which the analysis reads as text.
_CHECKS["request"]["id"] = lambda v: type(v) is str or type(v) is int
_REQUEST_CHECKS = _CHECKS["request"]
_TOKEN_KEYS = frozenset(("kind", "t", "id", "event", "n"))  # what record_ok's token line check has checked
# msgspec's decoder gives the same values as ``json.loads`` for what it accepts (integers of any
# size stay integers, floats round the same); what it refuses goes to ``json`` (parse_line)
decode_line = msgspec.json.Decoder().decode
DecodeError = (msgspec.DecodeError, RecursionError)  # what decode_line raises on a line it refuses


class TokenLine(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A token line as most of a trace's lines are (``{"kind":"request","t":..,"id":..,"event":"token","n":..}``,
    a proxy's or capture's ``source`` beside them): decoded and checked in one step, no dict built,
    for the streaming reader (``TraceReader.items``). It takes only lines that ``record_ok`` passes
    and the analysis reads alike from the dict (each field checked as ``record_ok`` checks it, a
    repeated key at every occurrence, the last one kept as the dict keeps it); any other line fails
    here and takes the dict path, so what it accepts reads exactly as before."""

    kind: Literal["request"]
    t: Annotated[float, msgspec.Meta(ge=T_MIN, le=T_MAX)] | Annotated[int, msgspec.Meta(ge=int(T_MIN), le=int(T_MAX))]
    id: str
    event: Literal["token"]
    n: Annotated[int, msgspec.Meta(ge=0, le=_INT_MAX)]
    source: str | None = None


# raises a DecodeError on every line that is not such a token line (the common way out for other lines)
decode_token_line = msgspec.json.Decoder(TokenLine).decode
_REQUIRED: dict[str, tuple[str, ...]] = {
    kind: tuple("class" if f.name == "cls" else f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    for kind, cls in _BY_KIND.items()
}


def record_ok(d: object) -> bool:
    """True when ``d`` is a record dict whose known fields have the types the reader expects."""
    if type(d) is not dict:
        return False
    if d.get("event") == "token":
        # the common line, checked inline: {"kind":"request","t":..,"id":..,"event":"token","n":..}
        # and any further fields (a proxy's "source") through their usual checks
        try:
            t, n, rid = d["t"], d["n"], d["id"]
        except KeyError:
            t = n = rid = None  # the general checks below
        if (type(t) is float and T_MIN <= t <= T_MAX and type(n) is int and 0 <= n <= _INT_MAX
                and type(rid) is str and d.get("kind") == "request"):
            if len(d) == 5 or (len(d) == 6 and type(d.get("source")) is str):  # a proxy's or capture's line
                return True
            for k, v in d.items():
                if k not in _TOKEN_KEYS:
                    c = _REQUEST_CHECKS.get(k)
                    if c is not None and not c(v):
                        return False
            return True
    kind = d.get("kind")
    if type(kind) is not str:
        return False
    if not _time(d.get("t")):
        return False  # every record is a timestamped fact, within the run
    checks = _CHECKS.get(kind)
    if checks is None:
        return True  # a kind from a newer writer: the reader counts it as unknown, not bad
    for name in _REQUIRED[kind]:
        if name not in d:
            return False
    for k, v in d.items():
        c = checks.get(k)
        if c is not None and not c(v):
            return False
    return True


def parse_line(line: str | bytes | bytearray) -> dict[str, Any] | None:
    """One trace line as a checked record dict; None when it is malformed, too deep or wrong-typed."""
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        d = decode_line(line)
    except DecodeError:
        # What msgspec refuses, ``json`` may still read (1e400 as infinity, NaN, a UTF-8 byte-order
        # mark, a lone surrogate escape) and the record checks judge it as before: msgspec is the
        # speed (several times json's), ``json`` the meaning of a line.
        try:
            d = json.loads(line)
        except (ValueError, RecursionError):
            return None
    return d if record_ok(d) else None


def header_problems(h: dict[str, Any]) -> list[str]:
    """Fix wrong-typed header fields in place (dropping them) and say which ones were dropped."""
    bad: list[str] = []
    for key in ("engine", "kv", "sim"):
        if key in h and not isinstance(h[key], dict):
            bad.append(key)
            h[key] = {}
    eng = h.get("engine") or {}
    for key in ("adapter", "url", "model", "version"):
        if key in eng and eng[key] is not None and not isinstance(eng[key], str):
            bad.append(f"engine.{key}")
            eng[key] = None
        elif isinstance(eng.get(key), str):
            eng[key] = printable(eng[key], 200)  # shown by replay and the console
    for scope, d in (("kv", h.get("kv") or {}), ("sim", h.get("sim") or {}), ("", h)):
        for key in ("bytes_per_token", "block_size", "capacity_tokens", "itl_target_s", "interval_s"):
            if key in d and d[key] is not None and not (_num(d[key]) and d[key] > 0):
                bad.append(f"{scope}.{key}" if scope else key)
                d[key] = None
    return bad
