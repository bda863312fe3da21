"""The one gate every number and every displayed string passes through.

Numbers: an engine page can hold NaN, +/-Inf or a counter gone negative. Each such value becomes
``None`` ("n/a") on its own field with a warning on the record, so one bad series degrades one
field and never the scrape, the Core or the JSON output.

Strings: label values and engine-supplied text reach terminals. ``printable`` strips control
characters (ESC sequences could retitle or repaint the operator's terminal).

URLs: ``redact_url`` drops user-info (``user:pass@``) before a URL is printed or stored.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvtop.model.records import EngineRecord, Histogram

# Fields that are counts, totals or ratios: never negative.
_NON_NEGATIVE = (
    "running", "waiting", "preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "prefix_hits_total", "prefix_queries_total", "requests_finished_total", "requests_aborted_total",
    "offload_out_bytes_total", "offload_in_bytes_total", "offload_out_seconds_total",
    "offload_in_seconds_total",
)
_INTS = ("kv_capacity_tokens", "block_size", "offload_capacity_bytes")
_INT_MIN = {"block_size": 1}  # a KV block holds at least one token (the snapshot schema says so too)
# 2**53: beyond it floats stop being exact integers; no real capacity is that large.
_INT_MAX = float(1 << 53)


def finite_or_none(v: object) -> float | None:
    """``v`` as a finite float, else None (bools, strings, NaN and infinities are not numbers here)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def as_int(v: object) -> int | None:
    """``int(v)`` for a finite, non-negative number within 2**53; None otherwise (never raises)."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    f = finite_or_none(v)
    if f is None or f < 0 or f > _INT_MAX:
        return None
    return int(f)


def positive_whole(v: object) -> int | None:
    """``v`` where it is a whole number from 1 to 2**53 given as one (a limit an engine runs under:
    a count of sequences or tokens); None otherwise, floats, strings and bools included."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= _INT_MAX else None


def _histogram_ok(h: Histogram) -> bool:
    if not h.buckets or finite_or_none(h.count) is None or h.count < 0:
        return False
    prev = 0.0
    for le, c in h.buckets:
        if math.isnan(le) or finite_or_none(c) is None or c < prev:
            return False
        prev = c
    return math.isnan(h.sum) or math.isfinite(h.sum)


def sanitize_record(rec: EngineRecord) -> EngineRecord:
    """Clean ``rec`` in place: every numeric field finite and in range, or None with a warning."""
    bad: list[str] = []
    for name in _NON_NEGATIVE:
        v = getattr(rec, name)
        if v is None:
            continue
        f = finite_or_none(v)
        if f is None or f < 0:
            setattr(rec, name, None)
            bad.append(f"{name}={_show(v)}")
    v = rec.kv_usage
    if v is not None:
        f = finite_or_none(v)
        if f is None or f < 0 or f > 1.05:
            rec.kv_usage = None
            bad.append(f"kv_usage={_show(v)}")
        elif f > 1.0:
            rec.kv_usage = 1.0  # a usage ratio a hair over 1 is rounding, not more than full
    for name in _INTS:
        v = getattr(rec, name)
        if v is not None:
            iv = as_int(v)
            if iv is not None and iv < _INT_MIN.get(name, 0):
                iv = None
            if iv is None:
                bad.append(f"{name}={_show(v)}")
            setattr(rec, name, iv)
    for name, v in list(rec.limits.items()):
        if positive_whole(v) is None:
            del rec.limits[name]
            bad.append(f"limits.{name}={_show(v)}")
    if rec.restart_token is not None and finite_or_none(rec.restart_token) is None:
        rec.restart_token = None
    for name in ("itl", "ttft"):
        h = getattr(rec, name)
        if h is not None and not _histogram_ok(h):
            setattr(rec, name, None)
            bad.append(f"{name} histogram (non-finite, negative or decreasing buckets)")
    if rec.extra:
        rec.extra = _finite_tree(rec.extra)
    # Label values and engine text reach terminals: no control sequences past this point.
    for name in ("adapter", "url", "engine", "model", "version"):
        v = getattr(rec, name)
        if v is not None:
            setattr(rec, name, printable(v, 200) if isinstance(v, str) else None)
    if rec.warnings:
        rec.warnings = [printable(w, 400) for w in rec.warnings]
    if bad:
        rec.warnings.append("ignored invalid value(s): " + ", ".join(bad[:6]) + (" ..." if len(bad) > 6 else ""))
    return rec


def _show(v: object) -> str:
    return printable(repr(v), 24)


def _finite_tree(obj: Any, depth: int = 0) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, str):
        return printable(obj)
    if depth > 20:
        return None
    if isinstance(obj, dict):
        return {k: _finite_tree(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_tree(v, depth + 1) for v in obj]
    return obj


def finite_json(obj: Any) -> Any:
    """A copy of ``obj`` where every NaN/Infinity is ``None``: safe for ``allow_nan=False``."""
    return _finite_tree(obj)


def dumps(obj: Any, **kw: Any) -> str:
    """JSON that is valid by construction: non-finite numbers become null, never ``NaN``."""
    return json.dumps(finite_json(obj), allow_nan=False, **kw)


# C0 and C1 controls and DEL, except tab; newlines are replaced too (one field, one line).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def printable(s: object, limit: int | None = None) -> str:
    """``s`` as text safe to show on a terminal: control characters (ESC, BEL, CR, ...) become
    U+FFFD, and with ``limit`` the text is cut to that many characters."""
    text = s if isinstance(s, str) else str(s)
    text = _CONTROL.sub("\ufffd", text)
    if limit is not None and len(text) > limit:
        text = text[: max(0, limit - 1)] + "…"
    return text


# query parameters that carry a credential (``/metrics?api_key=...``, a signed URL's signature)
_SECRET_QUERY = re.compile(r"(?i)(key|token|secret|pass|auth|sig|credential|session)")


def redact_url(url: str) -> str:
    """``url`` without its credentials: the user-info (``http://user:pass@host`` ->
    ``http://***@host``) and the values of query parameters named like one (``?api_key=***``)."""
    if "@" not in url and "?" not in url:
        return url
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
    except ValueError:
        return re.sub(r"[^/@]*@", "***@", url, count=1).split("?", 1)[0]
    netloc, query = parts.netloc, parts.query
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    if query:
        query = "&".join(
            f"{k}=***" if _SECRET_QUERY.search(k) else f"{k}={v}" if sep else k
            for k, sep, v in (p.partition("=") for p in query.split("&")))
    if netloc == parts.netloc and query == parts.query:
        return url
    out = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    return out if "://" in url else out.split("://", 1)[1]


# What kvtop writes as JSON for people and scripts (analyze, replay, snapshot, the agent's /report):
# floats to 12 significant digits. That drops float arithmetic noise (0.009899999999999999 ->
# 0.0099) and keeps microseconds on a run clock up to 11 days; traces keep full precision.
JSON_DIGITS = 12


def output_json(obj: Any) -> Any:
    """A copy of ``obj`` for JSON output: NaN/Infinity as ``None``, floats rounded to JSON_DIGITS
    significant digits, tuples as lists."""
    if isinstance(obj, float):
        return float(f"{obj:.{JSON_DIGITS}g}") if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: output_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [output_json(v) for v in obj]
    return obj
