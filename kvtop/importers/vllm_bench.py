"""``vllm bench serve --save-result --save-detailed`` results as a kvtop trace.

The result is one JSON object (vllm/benchmarks/serve.py): per request, in the same order,
``start_times`` (``time.perf_counter()`` when the request was sent), ``ttfts`` (seconds to the first
chunk), ``itls`` (seconds between successive chunks), ``input_lens``, ``output_lens`` (tokens),
``latencies`` (send to end) and ``errors`` (empty when it succeeded); plus ``model_id``, ``date``
(``YYYYMMDD-HHMMSS``, when the file was saved, the benchmark host's local time) and the run's
settings. ``generated_texts`` is never read.

What such a file cannot give is said in the trace header's ``missing`` list, and the analysis
repeats it as warnings: no engine scrapes (no KV usage, queue or preemption counter), and a chunk's
token count only as the request's output length spread evenly over its chunks.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from kvtop.model import jsonio
from kvtop.model.trace import make_header

# A detailed result of 100,000 requests of 1,000 tokens is about a gigabyte of JSON.
MAX_BYTES = 1 << 30
TOOL = "vllm bench serve"
MISSING_ENGINE = ("engine scrapes: no KV usage, queue or preemption counter was recorded, so no stall "
                  "can be tied to a preemption or a prefill from engine evidence")
MISSING_CHUNKS = ("per-chunk token counts: each request's output length is spread evenly over its "
                  "streamed chunks")
MISSING_CLOCK = ("wall-clock start: the result's date is when it was saved, in the benchmark host's "
                 "local time (read here as UTC)")


class BenchFileError(ValueError):
    """A file that is not a usable ``vllm bench serve`` detailed result (one line, names the file)."""


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read(path: str | Path) -> dict[str, Any]:
    """The result, checked: every per-request list there and of one length, every number finite."""
    # NaN/Infinity are kept (a summary figure of a run with a failed request can be one); every number
    # used below is checked finite on its own
    doc = jsonio.read_json(path, "vllm bench result", BenchFileError, allow_nan=True, max_bytes=MAX_BYTES)
    if not isinstance(doc, dict):
        raise BenchFileError(f"{path} is not a vllm bench serve result (expected one JSON object)")
    need = ("ttfts", "itls", "start_times")
    absent = [k for k in need if not isinstance(doc.get(k), list)]
    if "ttfts" in absent or "itls" in absent:
        raise BenchFileError(f"{path} has no per-request timings (ttfts, itls): save it with "
                             "`vllm bench serve --save-result --save-detailed`")
    if absent:
        raise BenchFileError(f"{path} has no start_times (saved by a vLLM before start times were kept): "
                             "without them the requests cannot be placed in time")
    n = len(doc["ttfts"])
    for k in ("itls", "start_times", "input_lens", "output_lens", "latencies", "errors"):
        v = doc.get(k)
        if v is not None and (not isinstance(v, list) or len(v) != n):
            raise BenchFileError(f"{path}: {k} has {len(v) if isinstance(v, list) else 'no'} entries for "
                                 f"{n} requests")
    if n == 0:
        raise BenchFileError(f"{path} holds no requests")
    for i in range(n):
        t, s, itl = doc["ttfts"][i], doc["start_times"][i], doc["itls"][i]
        if not (_num(t) and t >= 0 and _num(s)):
            raise BenchFileError(f"{path}: request {i} has a start time or TTFT that is not a finite number >= 0")
        if not isinstance(itl, list) or not all(_num(x) and x >= 0 for x in itl):
            raise BenchFileError(f"{path}: request {i}'s itls are not a list of finite numbers >= 0")
        for k in ("input_lens", "output_lens"):
            v = doc.get(k)
            if v is not None and v[i] is not None and not (isinstance(v[i], int) and not isinstance(v[i], bool)
                                                           and v[i] >= 0):
                raise BenchFileError(f"{path}: request {i}'s {k[:-1]} is not a token count")
        lat = doc.get("latencies")
        if lat is not None and lat[i] is not None and not (_num(lat[i]) and lat[i] >= 0):
            raise BenchFileError(f"{path}: request {i}'s latency is not a finite number >= 0")
    return doc


def _started_at(doc: dict[str, Any]) -> str | None:
    date = doc.get("date")
    if not isinstance(date, str):
        return None
    try:
        saved = datetime.strptime(date, "%Y%m%d-%H%M%S").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    dur = doc.get("duration")
    secs = float(dur) if isinstance(dur, (int, float)) and _num(dur) and 0 <= dur < 1e7 else 0.0
    start = saved - timedelta(seconds=secs)
    return str(start.isoformat(timespec="milliseconds")).replace("+00:00", "Z")


def header(doc: dict[str, Any], source: str) -> dict[str, Any]:
    model = doc.get("model_id")
    settings = {k: doc[k] for k in ("backend", "request_rate", "burstiness", "max_concurrency", "num_prompts")
                if isinstance(doc.get(k), str) or _num(doc.get(k))}
    started = _started_at(doc)
    clock = MISSING_CLOCK if started is not None else ("wall-clock start: the result has no date; started_at "
                                                       "is when it was imported")
    h = make_header(engine={"adapter": None, "url": None, "model": model if isinstance(model, str) else None,
                            "version": None},
                    kv={}, recorder="kvtop import vllm-bench",
                    imported_from={"tool": TOOL, "file": source, **settings},
                    missing=[MISSING_ENGINE, MISSING_CHUNKS, clock])
    h["host"] = ""  # not the importing machine's: the benchmark's host is not in the result
    if started is not None:
        h["started_at"] = started
    return h


def _request(doc: dict[str, Any], i: int, t0: float) -> Iterator[tuple[float, int, int, dict[str, Any]]]:
    """Request ``i``'s records in time order, as (t, i, k, record): k orders a request's own
    records that share a time (the merge never compares two records)."""
    for k, (t, rec) in enumerate(_events(doc, i, t0)):
        yield t, i, k, rec


def _events(doc: dict[str, Any], i: int, t0: float) -> Iterator[tuple[float, dict[str, Any]]]:
    rid = f"bench-{i}"
    s = doc["start_times"][i] - t0
    ttft = doc["ttfts"][i]
    itl: list[float] = doc["itls"][i]
    prompt = (doc.get("input_lens") or [None] * (i + 1))[i]
    out = (doc.get("output_lens") or [None] * (i + 1))[i]
    lat = (doc.get("latencies") or [None] * (i + 1))[i]
    err = (doc.get("errors") or [None] * (i + 1))[i]
    arrive: dict[str, Any] = {"kind": "request", "t": s, "id": rid, "event": "arrive", "source": "vllm-bench"}
    if prompt is not None:
        arrive["prompt_tokens"] = prompt
    yield s, arrive
    failed = bool(err) or (ttft == 0 and not itl and not out)
    if failed:
        # vLLM's client keeps what a request that failed mid-stream had received: its chunks stay,
        # and the error comes after them (it was put at the start, the streamed part dropped)
        t = s
        if ttft and ttft > 0:
            t = s + ttft
            yield t, {"kind": "request", "t": t, "id": rid, "event": "first_token", "n": 1}
            for g in itl:
                t += g
                yield t, {"kind": "request", "t": t, "id": rid, "event": "token", "n": 1}
        end = max(t, s + lat) if lat is not None else t
        # the error's text is never copied: it can quote the request
        yield end, {"kind": "request", "t": end, "id": rid, "event": "error", "error": "bench_error"}
        return
    chunks = 1 + len(itl)
    base, extra = divmod(out, chunks) if out and out >= chunks else (1, 0)
    t = s + ttft
    yield t, {"kind": "request", "t": t, "id": rid, "event": "first_token", "n": base + (1 if extra else 0)}
    for k, g in enumerate(itl, start=1):
        t += g
        yield t, {"kind": "request", "t": t, "id": rid, "event": "token", "n": base + (1 if k < extra else 0)}
    end = max(t, s + lat) if lat is not None else t
    fin: dict[str, Any] = {"kind": "request", "t": end, "id": rid, "event": "finish"}
    if out is not None:
        fin["completion_tokens"] = out
    if prompt is not None:
        fin["prompt_tokens"] = prompt
    yield end, fin


def records(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every request's records, merged in time order (memory: one pending record per request)."""
    t0 = min(doc["start_times"])
    for _, _, _, rec in heapq.merge(*(_request(doc, i, t0) for i in range(len(doc["ttfts"])))):
        yield rec
