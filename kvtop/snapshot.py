"""The Snapshot: the one immutable value every view renders (docs/design.md §1).

The core derives it from its state; the TUI, the headless report, the exporter and tests only
read it. JSON output follows ``kvtop/schemas/snapshot.schema.json``: numbers stay numbers,
unknown is ``null``.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtop.model.analysis import AnalysisReport
from kvtop.model.records import GpuRecord, HostRecord
from kvtop.model.sanitize import output_json

# The shape `snapshot`/`replay --format json` print (kvtop/schemas/snapshot.schema.json); the number
# changes when a field changes meaning or goes away, not when one is added.
SNAPSHOT_SCHEMA = "kvtop-snapshot/1"

# Severity thresholds (docs/host-and-gpu.md §6; vLLM kv-cache dashboard).
KV_WARN = 0.90
KV_CRIT = 0.98
PREEMPT_WARN_PER_S = 0.0  # any preemption is worth a look
PREEMPT_CRIT_PER_S = 1.0


def _json_after(name: str) -> dict[str, str]:
    """Field metadata: where a derived field sits among the record's fields in the snapshot JSON."""
    return {"json_after": name}


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU as the views show it: its latest reading as the trace holds it (the fields are
    defined once, on ``GpuRecord``) and what the core derives from its readings. The derived
    fields live here only, so a trace never carries them."""

    record: GpuRecord
    # Theoretical per-direction capacity at the *current* gen/width (docs/host-and-gpu.md §2).
    pcie_capacity_bytes_per_s: float | None = field(default=None, metadata=_json_after("pcie_link_width_max"))
    # Current link below the max while traffic flows (idle links down-train on purpose).
    link_downtrained: bool = field(default=False, metadata=_json_after("pcie_link_width_max"))
    pcie_tx_history: tuple[float, ...] = field(default=(), metadata=_json_after("engine_proc_mem_bytes"))
    pcie_rx_history: tuple[float, ...] = field(default=(), metadata=_json_after("engine_proc_mem_bytes"))


@dataclass(frozen=True, slots=True)
class EngineView:
    url: str
    adapter: str | None
    up: bool
    engine: str | None = None
    model: str | None = None
    error: str | None = None  # why it is down / unreadable, one line
    stale_s: float | None = None  # seconds since the last good scrape
    preempts: bool = True  # False: this engine never preempts (TGI, llama.cpp)
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions_total: float | None = None
    preemptions_per_s: float | None = None
    # the seconds the rates and quantiles cover: the window, or less where the engine was read for less
    rates_over_s: float | None = None
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    kv_capacity_tokens: int | None = None
    block_size: int | None = None
    restarts: int = 0
    kv_usage_history: tuple[float, ...] = ()
    preemptions_history: tuple[float, ...] = ()  # preemptions/s per tick
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestView:
    id: str
    state: str  # waiting, running, finished, cancelled, error
    cls: str | None = None
    source: str | None = None
    tokens: int = 0
    age_s: float = 0.0
    current_gap_s: float | None = None
    max_gap_s: float | None = None
    spikes: int = 0
    preempt_spikes: int = 0
    last_cause: str | None = None
    # ended more than finished_keep_s ago and still listed: one of the worst stalls of the last hour
    kept: bool = False


@dataclass(frozen=True, slots=True)
class EventView:
    t: float
    severity: str  # info, warning, error
    kind: str  # preemption_burst, engine_restart, engine_down, engine_up, source_error, link_downtrained, verdict_change
    message: str


@dataclass(frozen=True, slots=True)
class RequestTimeline:
    """One request's token arrivals and the engine events around it (request detail view)."""

    id: str
    arrive_t: float
    end_t: float | None
    state: str
    tokens: tuple[tuple[float, int], ...]  # (t, tokens in chunk); only the newest chunks are kept
    marks: tuple[tuple[float, str], ...]  # request-level preempt / resume events
    engine_marks: tuple[tuple[float, str, float], ...]  # (t, "preemption" | "prompt_burst", amount)
    # the engine's own steps for this request where a witness runs (newest kept): (start, end, kind),
    # kind "p" prompt (prefill), "r" recompute after a preemption, "d" decode
    steps: tuple[tuple[float, float, str], ...] = ()


class Samples:
    """A chart series' (t, value) samples in time order, read side; a missing value is NaN.

    The core's bounded store (kvtop/history.py ``Ring``) appends to these arrays; a Snapshot holds
    copies of the window it covers. ``origin`` names the series the samples came from, so a chart
    can tell "the same series, newer samples" (repaint the newest column) from another series."""

    __slots__ = ("t", "v", "origin")

    def __init__(self, t: array[float] | None = None, v: array[float] | None = None, origin: int = 0):
        self.t = array("d") if t is None else t
        self.v = array("d") if v is None else v
        self.origin = origin

    def __len__(self) -> int:
        return len(self.t)

    def last(self) -> float | None:
        for i in range(len(self.v) - 1, max(-1, len(self.v) - 4), -1):
            if not math.isnan(self.v[i]):
                return self.v[i]
        return None

    def span(self, t0: float, t1: float) -> tuple[int, int]:
        """Index range of the samples with t0 <= t <= t1."""
        return bisect_left(self.t, t0), bisect_right(self.t, t1)

    def columns(self, t0: float, t1: float, n: int, how: str = "max") -> list[float | None]:
        """``n`` equal time columns over [t0, t1]: each column's max (spikes stay visible when
        an hour is squeezed into 60 columns) or mean; None where a column has no sample."""
        out: list[float | None] = [None] * n
        if n <= 0 or t1 <= t0:
            return out
        i, j = self.span(t0, t1)
        ts, vs = self.t, self.v
        scale = n / (t1 - t0)
        if how == "max":
            for k in range(i, j):
                v = vs[k]
                if v != v:  # NaN
                    continue
                c = min(n - 1, int((ts[k] - t0) * scale))
                cur = out[c]
                if cur is None or v > cur:
                    out[c] = v
            return out
        sums = [0.0] * n
        cnt = [0] * n
        for k in range(i, j):
            v = vs[k]
            if v != v:
                continue
            c = min(n - 1, int((ts[k] - t0) * scale))
            sums[c] += v
            cnt[c] += 1
        return [sums[c] / cnt[c] if cnt[c] else None for c in range(n)]

    def at(self, t: float) -> tuple[float, float] | None:
        """The sample nearest to ``t`` (hover readout)."""
        if not self.t:
            return None
        k = bisect_left(self.t, t)
        best = min((x for x in (k - 1, k) if 0 <= x < len(self.t)), key=lambda x: abs(self.t[x] - t))
        return self.t[best], self.v[best]


@dataclass(frozen=True, slots=True)
class HistoryWindow:
    """The console's chart series over the window a snapshot was asked for: per engine (url,
    engine label), per GPU index and for the host, series name -> samples."""

    engines: dict[tuple[str, str | None], dict[str, Samples]] = field(default_factory=dict)
    gpus: dict[int, dict[str, Samples]] = field(default_factory=dict)
    host: dict[str, Samples] = field(default_factory=dict)

    def engine_series(self, url: str, engine: str | None) -> dict[str, Samples] | None:
        return self.engines.get((url, engine))


@dataclass(frozen=True, slots=True)
class Snapshot:
    kvtop_version: str
    taken_at: str  # ISO-8601 UTC
    t: float  # run clock
    window_s: float
    gpu_status: str  # "ok" or the one-line reason there is no GPU data
    gpus: tuple[GpuView, ...] = ()
    host: HostRecord | None = None  # the latest host reading: nothing is derived from it
    engines: tuple[EngineView, ...] = ()
    requests: tuple[RequestView, ...] = ()
    events: tuple[EventView, ...] = ()
    itl_target_s: float | None = None
    analysis: AnalysisReport | None = None  # spikes, causes, verdict
    paused: bool = False
    source_label: str = "live"  # live, replay FILE, demo
    host_status: str = "ok"  # "ok" or why there is no host data ("off (--no-host)")
    # passive capture (--capture): port, status ("ok" or why not) and its loss counters; None when off
    capture: dict[str, Any] | None = None
    # Requests that ended and left the screens (only their summary kept), and their gaps over target.
    finished_total: int = 0
    gaps_over_target_total: int = 0
    # What the console asks for on top (never in the JSON): the history charts' series over the
    # asked window, and the timeline of the selected request (else of the listed one with the
    # worst gap).
    history: HistoryWindow | None = None
    detail: RequestTimeline | None = None

    def to_json(self, include_history: bool = False) -> dict[str, Any]:
        """The documented JSON contract (schemas/snapshot.schema.json)."""

        def clean(obj: Any) -> Any:
            if isinstance(obj, GpuView):
                d = _record_json(obj.record, obj)
            elif isinstance(obj, HostRecord):
                d = _record_json(obj)
            else:
                d = dataclasses.asdict(obj)
            if not include_history:
                d = {k: v for k, v in d.items() if not k.endswith("_history")}
            for k, v in d.items():
                if isinstance(v, tuple):
                    d[k] = list(v)
            return d

        out: dict[str, Any] = {
            "kvtop_version": self.kvtop_version,
            "schema": SNAPSHOT_SCHEMA,
            "taken_at": self.taken_at,
            "window_s": self.window_s,
            "gpu_status": self.gpu_status,
            "host_status": self.host_status,
            "gpus": [clean(g) for g in self.gpus],
            "host": clean(self.host) if self.host else {},
            "engines": [clean(e) for e in self.engines],
        }
        if self.requests:
            out["requests"] = [
                {("class" if k == "cls" else k): v for k, v in clean(r).items()} for r in self.requests
            ]
        if self.events:
            out["events"] = [clean(e) for e in self.events]
        if self.analysis is not None:
            out["analysis"] = self.analysis.to_dict()
        if self.capture is not None:
            out["capture"] = dict(self.capture)
        cleaned: dict[str, Any] = output_json(out)
        return cleaned


class SnapshotSource(Protocol):
    """What a view may ask of the core: snapshots, and an entry in its event log (a feed that
    failed). Pausing is shown in the snapshot the core derives."""

    now: float
    paused: bool

    def snapshot(self, now: float | None = None, *, history_s: float | None = None, timeline: bool = False,
                 request_id: str | None = None) -> Snapshot: ...

    def event(self, t: float, severity: str, kind: str, message: str) -> None: ...


def _record_json(rec: GpuRecord | HostRecord, view: GpuView | None = None) -> dict[str, Any]:
    """A record's fields for the snapshot JSON: its time is the snapshot's business, and a view's
    derived fields go after the record field their ``json_after`` metadata names."""
    after: dict[str, list[str]] = {}
    if view is not None:
        for f in dataclasses.fields(view):
            if "json_after" in f.metadata:
                after.setdefault(f.metadata["json_after"], []).append(f.name)
    out: dict[str, Any] = {}
    for k, v in dataclasses.asdict(rec).items():
        if k == "t":
            continue
        out[k] = v
        for name in after.get(k, ()):
            out[name] = getattr(view, name)
    return out


def finite(obj: Any) -> Any:
    """JSON has no NaN/Infinity (a histogram without _sum, a 0/0 rate): unknown is null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
