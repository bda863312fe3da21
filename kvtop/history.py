"""Bounded time series for the console's history charts.

The core hands every engine, GPU and host record to ``History.ingest``; each record adds one sample
per chart series, derived at ingest (rates from counter deltas, ITL/TTFT quantiles over the last
``QUANTILE_WINDOW_S`` of histogram deltas) so a chart only reads numbers. Every series is a pair of
flat arrays capped at ``MAX_POINTS`` samples (an hour at the default 1 s poll; ~30 KB a series):
memory stays flat however long the console runs. A Snapshot carries copies of the window the
console asks for (``History.window``), so the charts never read this store. Pure: no I/O, no Textual.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

from kvtop.model.records import EngineRecord, GpuRecord, Histogram, HostRecord, Record
from kvtop.model.series import histogram_delta, histogram_quantile
from kvtop.snapshot import HistoryWindow, Samples

MAX_POINTS = 3600
QUANTILE_WINDOW_S = 10.0
NAN = float("nan")
# Samples.last() looks back over the last 3 samples and Samples.at() to the one before its time.
_LOOK_BACK = 3
_ORIGINS = itertools.count(1)


class Ring(Samples):
    """(t, value) samples in time order, the last ``maxlen`` kept; a missing value is NaN. The read
    side (columns, nearest sample, last value) is ``Samples``, which a Snapshot carries copies of."""

    __slots__ = ("maxlen",)

    def __init__(self, maxlen: int = MAX_POINTS):
        super().__init__(origin=next(_ORIGINS))
        self.maxlen = maxlen

    def append(self, t: float, v: float | None) -> None:
        if self.t and t < self.t[-1]:
            return  # out of order (a late poll): the chart's x axis is time
        self.t.append(t)
        self.v.append(NAN if v is None else float(v))
        if len(self.t) >= self.maxlen + self.maxlen // 4:  # trim in batches: amortised O(1)
            del self.t[: len(self.t) - self.maxlen]
            del self.v[: len(self.v) - self.maxlen]

    def since(self, t0: float) -> Samples:
        """A copy of the samples from ``t0`` on, plus the few before it that a chart's latest
        value and hover readout may look back to, so they read the same as on the whole ring."""
        k = max(0, bisect_left(self.t, t0) - _LOOK_BACK)
        return Samples(self.t[k:], self.v[k:], self.origin)


ENGINE_SERIES = ("kv_usage", "running", "waiting", "preemptions_per_s", "itl_p50_s", "itl_p99_s",
                 "ttft_p99_s", "prompt_tokens_per_s", "generation_tokens_per_s")
GPU_SERIES = ("mem_used_bytes", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s")
HOST_SERIES = ("pinned_bytes", "mem_used_bytes")


@dataclass
class _EngineHist:
    series: dict[str, Ring]
    prev: EngineRecord | None = None
    itl: deque[tuple[float, Histogram]] = field(default_factory=deque)
    ttft: deque[tuple[float, Histogram]] = field(default_factory=deque)


def _rate(prev: float | None, cur: float | None, dt: float) -> float | None:
    if prev is None or cur is None or dt <= 0:
        return None
    d = cur - prev
    return (cur if d < 0 else d) / dt  # a counter that went down restarted from zero


def _windowed_quantiles(hist: deque[tuple[float, Histogram]], t: float, h: Histogram | None,
                        qs: tuple[float, ...]) -> list[float | None]:
    if h is None:
        return [None] * len(qs)
    if hist and h.count < hist[-1][1].count:
        hist.clear()  # counters reset (engine restart)
    hist.append((t, h))
    while len(hist) > 2 and hist[1][0] <= t - QUANTILE_WINDOW_S:
        hist.popleft()
    if len(hist) < 2:
        return [None] * len(qs)
    d = histogram_delta(hist[0][1], h)
    if d.count <= 0:
        return [None] * len(qs)
    return [histogram_quantile(q, d) for q in qs]


class History:
    """Per engine / GPU / host chart series, fed record by record; each keeps its last
    ``max_points`` samples (the console's hour; the HTML report asks for a whole trace)."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max_points
        self.engines: dict[tuple[str, str | None], _EngineHist] = {}
        self.gpus: dict[int, dict[str, Ring]] = {}
        self.host: dict[str, Ring] = self._rings(HOST_SERIES)

    def _rings(self, names: tuple[str, ...]) -> dict[str, Ring]:
        return {k: Ring(self.max_points) for k in names}

    def ingest(self, rec: Record) -> None:
        if isinstance(rec, EngineRecord):
            if rec.up:
                self._engine(rec)
        elif isinstance(rec, GpuRecord):
            g = self.gpus.get(rec.index)
            if g is None:
                g = self.gpus[rec.index] = self._rings(GPU_SERIES)
            for k in GPU_SERIES:
                g[k].append(rec.t, None if rec.lost else getattr(rec, k))
        elif isinstance(rec, HostRecord):
            used = None
            if rec.mem_total_bytes is not None and rec.mem_available_bytes is not None:
                used = rec.mem_total_bytes - rec.mem_available_bytes
            self.host["pinned_bytes"].append(rec.t, rec.pinned_bytes)
            self.host["mem_used_bytes"].append(rec.t, used)

    def _engine(self, rec: EngineRecord) -> None:
        key = (rec.url or "?", rec.engine)
        e = self.engines.get(key)
        if e is None:
            e = self.engines[key] = _EngineHist(self._rings(ENGINE_SERIES))
        s, prev, t = e.series, e.prev, rec.t
        dt = t - prev.t if prev is not None else 0.0
        s["kv_usage"].append(t, rec.kv_usage)
        s["running"].append(t, rec.running)
        s["waiting"].append(t, rec.waiting)
        s["preemptions_per_s"].append(t, _rate(None if prev is None else prev.preemptions_total, rec.preemptions_total, dt))
        s["prompt_tokens_per_s"].append(t, _rate(None if prev is None else prev.prompt_tokens_total, rec.prompt_tokens_total, dt))
        s["generation_tokens_per_s"].append(
            t, _rate(None if prev is None else prev.generation_tokens_total, rec.generation_tokens_total, dt))
        p50, p99 = _windowed_quantiles(e.itl, t, rec.itl, (0.5, 0.99))
        s["itl_p50_s"].append(t, p50)
        s["itl_p99_s"].append(t, p99)
        (ttft99,) = _windowed_quantiles(e.ttft, t, rec.ttft, (0.99,))
        s["ttft_p99_s"].append(t, ttft99)
        e.prev = rec

    def engine_series(self, url: str, engine: str | None) -> dict[str, Ring] | None:
        e = self.engines.get((url, engine))
        return e.series if e is not None else None

    def window(self, t0: float) -> HistoryWindow:
        """Copies of every series from ``t0`` on, for a Snapshot."""

        def cut(series: dict[str, Ring]) -> dict[str, Samples]:
            return {k: r.since(t0) for k, r in series.items()}

        return HistoryWindow(engines={k: cut(e.series) for k, e in self.engines.items()},
                             gpus={i: cut(g) for i, g in self.gpus.items()}, host=cut(self.host))
