"""Everything the rules may look at for one spike, gathered in one place.

``gather`` is the only code that reads the gap tracker and the engine timeline for attribution;
the streaming and the fast path both reach it through ``Analyzer``. The rules
(``preemption``, ``prefill``, ``slow_decode``, ``host``) read an ``Evidence`` and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtop.analysis.attribution.thresholds import PROMPT_JUMP_MIN, PROMPT_JUMP_REL, REL_SLOW, STEP_EARLY_S
from kvtop.analysis.attribution.timeline import EngineTimeline, EngineWindow
from kvtop.analysis.gaps import Gap, GapTracker


@dataclass
class FirstToken:
    """Another request's first token at the end of the stall."""

    request_id: str
    prompt_tokens: int | None


@dataclass
class Evidence:
    gap: Gap
    preempts: bool  # the engine can preempt at all (from its adapter)
    baseline: float | None  # the stream's recent gaps, else the run's median gap
    baseline_is_stream: bool
    engine_reported_preempt: bool  # a per-request preempt event inside the gap (engine/simulator)
    active_others: int | None  # other streams between first token and end at the stall's middle
    co_stalled: int  # of those, silent over at least half of this stall
    co_fresh: int  # ... and of those, the ones that fell silent with it (not long before)
    co_gap_median: float | None  # median length of their silences
    first_token: FirstToken | None
    window: EngineWindow  # engine gauges/counters around the stall
    departures: int  # streams that ended between the window's two gauge readings
    typical_prompt_delta: float  # prompt tokens the engine adds per scrape, usually
    scrape_interval: float
    scrape_lag: float  # the longest pause between kvtop's own scrapes across the stall
    tol: float  # how far after the stall a counter step still belongs to it
    timeline: EngineTimeline  # for claiming counter units (a spike consumes what it claims)

    @property
    def rel(self) -> float | None:
        return self.gap.gap / self.baseline if self.baseline else None

    @property
    def flowing(self) -> int | None:
        """Other active streams that kept receiving tokens through the stall (None: no others)."""
        if not self.active_others:
            return None
        return max(0, self.active_others - self.co_stalled)

    @property
    def kv_high(self) -> bool:
        from kvtop.analysis.attribution.thresholds import KV_HIGH

        return self.window.kv_max is not None and self.window.kv_max >= KV_HIGH

    @property
    def running_drop(self) -> bool:
        # running falls by one whenever a stream finishes (this one too, if its last token ends the
        # gap): only a drop beyond the streams that ended between its readings is evidence
        return self.window.running_drop > self.departures

    @property
    def prompt_jump(self) -> bool:
        """The prompt counter rose well above what the scrapes in the window add at the usual rate."""
        w = self.window
        return w.prompt_delta >= PROMPT_JUMP_MIN and \
            w.prompt_delta > PROMPT_JUMP_REL * self.typical_prompt_delta * max(1, w.intervals)

    def claim_counter(self) -> float | None:
        """Claim one preemption-counter unit that stepped near the stall's end; its scrape time."""
        return self.timeline.claim_counter(self.gap.t_start, self.gap.t_end, self.tol)

    def counter_delta(self) -> float:
        return self.timeline.counter_delta(self.gap.t_start - STEP_EARLY_S, self.gap.t_end + self.tol)

    def context_lines(self) -> list[str]:
        """How the stall compares with its stream and with the other streams (leads every answer)."""
        out = []
        rel = self.rel
        if rel is not None:
            out.append(f"gap is {rel:.0f}x this stream's recent gaps")
        if self.active_others:
            older = self.co_stalled - self.co_fresh
            out.append(f"{self.co_stalled}/{self.active_others} other active streams stalled over the same interval"
                       + (f" ({older} of them silent since before it)" if older else ""))
        return out


def gather(g: Gap, gaps: GapTracker, timeline: EngineTimeline, preempts: bool, settle: float,
           engine_preempts: list[float] | None = None) -> Evidence:
    """Build the evidence for spike ``g`` (called once it has settled: ``settle`` after its end)."""
    a, b = g.t_start, g.t_end
    reported = bool(engine_preempts and any(a - 1e-6 <= t <= b + 1e-6 for t in engine_preempts))
    act = gaps.active_at(0.5 * (a + b))
    median = gaps.median_gap()
    base = g.stream_baseline or median
    if base and g.gap < REL_SLOW * base:
        co, co_med, fresh = 0, None, 0  # not an outlier for its stream: no need to look for company
    else:
        co, co_med, fresh = gaps.co_stalled(g, settle, None if act is None else max(1, act - 1))
    si = timeline.scrape_interval
    tol = 1.5 * si + 0.25
    w = timeline.window(a - si, b + tol, b + 0.1)
    ft = gaps.first_token_near(g)
    return Evidence(
        gap=g, preempts=preempts, baseline=base, baseline_is_stream=bool(g.stream_baseline),
        engine_reported_preempt=reported, active_others=None if act is None else max(0, act - 1),
        co_stalled=co, co_fresh=fresh, co_gap_median=co_med,
        first_token=FirstToken(ft[0], ft[1]) if ft else None, window=w,
        departures=gaps.departures(w.t_base, w.t_state) if w.t_base is not None and w.t_state is not None else 0,
        typical_prompt_delta=timeline.typical_prompt_delta(), scrape_interval=si,
        scrape_lag=timeline.scrape_lag(a, b), tol=tol, timeline=timeline)
