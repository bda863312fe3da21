"""Engine tracker: one state per (URL, engine label) from the scraped EngineRecords: counters as
series, up/down, restarts; derives the engine events (down, up, restart, preemption burst), the
EngineViews and the request detail's engine marks (preemption rises, prompt bursts)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvtop.core.events import EventLog
from kvtop.model.records import EngineRecord
from kvtop.model.sanitize import sanitize_record
from kvtop.model.series import HistogramSeries, Series, counter_increase_over, counter_rate, covered_span
from kvtop.snapshot import EngineView

# A preemption burst is an error when the engine preempted at least BURST_ERROR_COUNT times in the
# trailing BURST_WINDOW_S seconds (a sustained 1/s), else a warning. A count over a fixed window,
# not the rate over one scrape step: a step of 0.99 s or 1.01 s must not flip one preemption
# between a warning and an error.
BURST_WINDOW_S = 10.0
BURST_ERROR_COUNT = 10


@dataclass
class _EngineState:
    url: str
    adapter: str | None
    engine: str | None
    last: EngineRecord | None = None
    last_ok_t: float | None = None
    up: bool = True
    error: str | None = None
    restarts: int = 0
    kv_usage: Series = field(default_factory=lambda: Series(3600))
    preemptions: Series = field(default_factory=lambda: Series(3600))
    prompt: Series = field(default_factory=lambda: Series(3600))
    generation: Series = field(default_factory=lambda: Series(3600))
    itl: HistogramSeries = field(default_factory=lambda: HistogramSeries(600))
    ttft: HistogramSeries = field(default_factory=lambda: HistogramSeries(600))
    preempt_rate_hist: deque[float] = field(default_factory=lambda: deque(maxlen=120))
    preempts: bool = True


def _restarted(prev: EngineRecord, cur: EngineRecord) -> bool:
    if prev.restart_token is not None and cur.restart_token is not None and cur.restart_token != prev.restart_token:
        return True
    for f in ("generation_tokens_total", "prompt_tokens_total", "preemptions_total", "requests_finished_total"):
        a, b = getattr(prev, f), getattr(cur, f)
        if a is not None and b is not None and b < a:
            return True
    return False


class EngineTracker:
    def __init__(self, log: EventLog) -> None:
        self._log = log
        self._engines: OrderedDict[tuple[str, str | None], _EngineState] = OrderedDict()

    def _state(self, url: str, engine: str | None, adapter: str | None) -> _EngineState:
        key = (url, engine)
        st = self._engines.get(key)
        if st is None:
            st = _EngineState(url=url, adapter=adapter, engine=engine)
            self._engines[key] = st
        return st

    def down(self, url: str, t: float, error: str, adapter: str | None = None) -> None:
        """A scrape failed: mark every engine behind ``url`` down, keep its history."""
        states = [s for (u, _), s in self._engines.items() if u == url] or [self._state(url, None, adapter)]
        for st in states:
            if st.up:
                self._log.add(t, "error", "engine_down", f"{url}: down ({error})")
            st.up = False
            st.error = error

    def set_capabilities(self, url: str, preempts: bool) -> None:
        for (u, _), st in self._engines.items():
            if u == url:
                st.preempts = preempts

    def ingest(self, rec: EngineRecord) -> None:
        # Live records are clean already; replayed traces may come from older or foreign writers.
        sanitize_record(rec)
        url = rec.url or "?"
        if not rec.up:
            # A failed scrape has no engine label: it marks every engine behind the URL down
            # (creating a placeholder only if the URL never answered).
            self.down(url, rec.t, rec.warnings[0] if rec.warnings else "down", rec.adapter)
            return
        # A URL that was down before its first good scrape has a label-less placeholder: drop it
        # once the real engine labels are known.
        placeholder = self._engines.get((url, None))
        if rec.engine is not None and placeholder is not None and placeholder.last is None:
            del self._engines[(url, None)]
        st = self._state(url, rec.engine, rec.adapter)
        st.adapter = rec.adapter
        if not st.up:
            self._log.add(rec.t, "info", "engine_up", f"{url}: reachable again")
        st.up, st.error = True, None
        prev = st.last
        restarted = prev is not None and _restarted(prev, rec)
        if restarted:
            st.restarts += 1
            self._log.add(rec.t, "warning", "engine_restart", f"{url}: engine restarted (counters reset)")
            # Counters began again from zero: rates must not use the pre-restart value as a baseline.
            for s in (st.preemptions, st.prompt, st.generation):
                s.mark_counter_reset(rec.t)
            st.itl.mark_reset(rec.t)
            st.ttft.mark_reset(rec.t)
        st.last = rec
        st.last_ok_t = rec.t
        st.kv_usage.append(rec.t, rec.kv_usage)
        st.preemptions.append(rec.t, rec.preemptions_total)
        st.prompt.append(rec.t, rec.prompt_tokens_total)
        st.generation.append(rec.t, rec.generation_tokens_total)
        st.itl.append(rec.t, rec.itl)
        st.ttft.append(rec.t, rec.ttft)
        if prev is not None and prev.preemptions_total is not None and rec.preemptions_total is not None:
            d = rec.preemptions_total - prev.preemptions_total
            dt = rec.t - prev.t
            if d < 0 or restarted:
                d = rec.preemptions_total
            rate = d / dt if dt > 0 else 0.0
            st.preempt_rate_hist.append(rate)
            if d >= 1:
                recent = counter_increase_over(st.preemptions, BURST_WINDOW_S, rec.t)
                severity = "error" if max(d, recent) >= BURST_ERROR_COUNT else "warning"
                self._log.add(rec.t, severity, "preemption_burst",
                              f"{url}: {int(d)} preemption(s) in {dt:.1f}s")

    def views(self, now: float, w: float) -> tuple[EngineView, ...]:
        """Every engine as the views show it; rates and quantiles over the last ``w`` seconds."""
        out = []
        for st in self._engines.values():
            rec = st.last
            ev = EngineView(
                url=st.url, adapter=st.adapter, up=st.up and rec is not None, engine=st.engine, error=st.error,
                stale_s=None if st.last_ok_t is None else round(now - st.last_ok_t, 3),
                preempts=st.preempts, restarts=st.restarts,
            )
            if rec is not None:
                ev = dataclasses.replace(
                    ev,
                    model=rec.model,
                    kv_usage=rec.kv_usage,
                    running=rec.running,
                    waiting=rec.waiting,
                    preemptions_total=rec.preemptions_total,
                    preemptions_per_s=counter_rate(st.preemptions, w, now),
                    rates_over_s=covered_span(st.kv_usage, w, now),
                    prompt_tokens_per_s=counter_rate(st.prompt, w, now),
                    generation_tokens_per_s=counter_rate(st.generation, w, now),
                    itl_p50_s=st.itl.quantile(0.5, w, now),
                    itl_p99_s=st.itl.quantile(0.99, w, now),
                    ttft_p50_s=st.ttft.quantile(0.5, w, now),
                    ttft_p99_s=st.ttft.quantile(0.99, w, now),
                    kv_capacity_tokens=rec.kv_capacity_tokens,
                    block_size=rec.block_size,
                    kv_usage_history=tuple(st.kv_usage.values(120)),
                    preemptions_history=tuple(st.preempt_rate_hist),
                    warnings=tuple(rec.warnings),
                )
            out.append(ev)
        return tuple(out)

    def marks(self, t0: float, t1: float) -> tuple[tuple[float, str, float], ...]:
        """Scrape instants in [t0, t1] where any engine's preemption counter rose, or its prompt
        token rate jumped to more than 3x its median over the span (a prefill burst)."""
        out: list[tuple[float, str, float]] = []
        for st in self._engines.values():
            prev: tuple[float, float] | None = None
            for t, v in st.preemptions.items():
                if prev is not None and t0 <= t <= t1 and v > prev[1]:
                    out.append((t, "preemption", v - prev[1]))
                prev = (t, v)
            out.extend(_prompt_bursts(st.prompt, t0, t1))
        out.sort()
        return tuple(out)


def _prompt_bursts(prompt: Series, t0: float, t1: float) -> list[tuple[float, str, float]]:
    """Scrapes in [t0, t1] whose prompt token rate is over 3x the span's median (at least 3 rates)."""
    rates: list[tuple[float, float]] = []
    prev: tuple[float, float] | None = None
    for t, v in prompt.items():
        if prev is not None and t0 <= t <= t1 and t > prev[0] and v >= prev[1]:
            rates.append((t, (v - prev[1]) / (t - prev[0])))
        prev = (t, v)
    if len(rates) < 3:
        return []
    med = sorted(r for _, r in rates)[len(rates) // 2]
    return [(t, "prompt_burst", r) for t, r in rates if r > 3 * med and r > 0]
