"""What the analysis knew by a given trace time: running figures kept as a history, and the cut-offs
at which a spike's evidence is read.

A spike is judged from facts known by a fixed time after its end, whichever path judges it and
whenever it does: the live path judges it ``settle`` after its end, ``kvtop analyze``'s fast path at
the end of a whole block of records (seconds of later trace). Running figures (the run's median gap,
the measured prefill rate, the usual prompt tokens per scrape) change as records come in; read at the
end of a block they would carry later traffic (a run's idle tail pulls the usual prompt tokens per
scrape to zero) into an earlier spike's judgement. So each keeps its history, stamped with the trace
time of the record that moved it, and a spike reads the value as of its cut-off.

Cut-offs (``cutoff``): every fact, the end of the shortest settle time after the spike (both paths
have always passed it); what the engine reports when a request finishes (vLLM's per-request times
and the prompt length on the same record), ``PREFILL_HOLD_S`` after it: spikes wait that long for
such reports once the run has shown it carries them.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    from kvtop.analysis.gaps import Gap
    from kvtop.analysis.streams import ReqState

# a spike is judged at least this long after its end (``Analyzer.settle`` is never shorter)
MIN_SETTLE_S = 2.0
# a spike that may lie in another request's prefill waits this long past its end for the engine's
# report of that prefill (vLLM puts a request's times on its final chunk): with per-request metrics
# on, attribution lags by at most this
PREFILL_HOLD_S = 10.0


def known_by(g: Gap) -> float:
    """The trace time by which a fact must be known to count in spike ``g``'s judgement."""
    return g.t_end + MIN_SETTLE_S


class Cutoff(NamedTuple):
    """What one spike's judgement may know: facts told by ``facts``, and what the engine reports on
    a request's finish record (its own prefill times, the prompt length beside them) by ``engine``."""

    facts: float
    engine: float


def cutoff(g: Gap, settle: float, engine_times_from: float) -> Cutoff:
    """Spike ``g``'s cut-offs. It waits for the engine's reports only where, by the time the live path
    judges it (``settle`` after its end), the run has shown that its engine sends them (the first
    finish record that carried them, at ``engine_times_from``): before that nothing told it to wait."""
    wait = engine_times_from <= g.t_end + settle
    return Cutoff(known_by(g), g.t_end + PREFILL_HOLD_S if wait else -math.inf)


def prompt_of(r: ReqState, cut: Cutoff) -> int | None:
    """``r``'s prompt tokens as a judgement with cut-offs ``cut`` may know them (a text prompt's
    length comes with the usage count on its finish record, perhaps long after the spike)."""
    p = r.prompt_tokens
    if not p:
        return None
    t = r.prompt_t
    return p if t <= cut.facts or (r.engine_prefill is not None and t <= cut.engine) else None


def outside(span: tuple[float, float], a: float, b: float) -> bool:
    """An engine-timed prefill ``span`` that lies wholly outside [a, b] (queued or done all through it)."""
    return span[1] <= a or span[0] >= b


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``spans`` (an empty one, end before start, counts nothing)."""
    total, cur = 0.0, None
    for a, b in sorted(spans):
        if b <= a:
            continue
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = (a, b)
        else:
            cur = (cur[0], max(cur[1], b))
    return total + (cur[1] - cur[0] if cur is not None else 0.0)


def engine_prefill_of(r: ReqState, cut: Cutoff) -> tuple[float, float] | None:
    """``r``'s engine-timed prefill, if its finish record reported it by ``cut.engine``."""
    return r.engine_prefill if r.engine_prefill is not None and r.engine_prefill_t <= cut.engine else None


class History:
    """A running figure's values, each stamped with the latest trace time of the records that had
    moved it so far (stamps never go back, so a trace a little out of time order still bisects)."""

    __slots__ = ("stamps", "values")

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.values: list[float] = []

    def record(self, t: float, value: float) -> None:
        st = self.stamps
        if st and t < st[-1]:
            t = st[-1]
        if st and t == st[-1]:
            self.values[-1] = value
            return
        st.append(t)
        self.values.append(value)

    def at(self, t: float) -> float | None:
        """The value as of trace time ``t`` (None: none yet)."""
        i = bisect_right(self.stamps, t)
        return self.values[i - 1] if i else None

    def latest(self) -> float | None:
        return self.values[-1] if self.values else None

    def prune(self, before: float) -> None:
        """Drop values superseded before ``before`` (the one in force then stays)."""
        i = bisect_right(self.stamps, before) - 1
        if i > 0:
            del self.stamps[:i]
            del self.values[:i]


class Median(Protocol):
    """A sample's histogram (``gaps.LogHistogram``): its size and its quantiles."""

    n: int

    def add(self, v: float, k: int = 1) -> None: ...

    def quantile(self, q: float) -> float | None: ...


H = TypeVar("H", bound=Median)


class RunningMedian(Generic[H]):
    """The median of a growing sample (a histogram), refreshed as the sample grows by ``step`` or by
    1 %, whichever is more (it moves slowly), from ``min_n`` on, with its history; while the sample is
    smaller than ``step``, as often as it doubles (a run's first gaps, its first prompts' prefills among
    them, would otherwise stand as its median for ``step`` samples). The caller says after each
    addition at which trace time it was made (``added``)."""

    __slots__ = ("hist", "history", "step", "next_n")

    def __init__(self, hist: H, min_n: int = 1, step: int = 64):
        self.hist = hist
        self.history = History()
        self.step = step
        self.next_n = min_n  # the sample size at which the median is refreshed next

    def add(self, v: float, t: float) -> None:
        """One sample ``v``, taken at trace time ``t``."""
        self.hist.add(v)
        self.added(t)

    def added(self, t: float) -> None:
        n = self.hist.n
        if n >= self.next_n:
            q = self.hist.quantile(0.5)
            if q is not None:
                self.history.record(t, q)
            self.next_n = n + max(min(self.step, n), n // 100) + 1

    def at(self, t: float) -> float | None:
        return self.history.at(t)

    def latest(self) -> float | None:
        return self.history.latest()
