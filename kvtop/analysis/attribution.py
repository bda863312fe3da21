"""Cause attribution for token-gap spikes (reference/kv-science.md §4, real-engines.md).

Signatures:
* preemption — one stream stalls while the others keep flowing; KV near full; running drops /
  waiting rises; the preemption counter steps at the end of the stall or shortly after (vLLM V1
  counts a preemption when the victim *resumes*; SGLang when it is retracted). A victim cancelled
  while preempted may never be counted. A lone stall with none of this evidence is not a preemption.
* prefill interference — no other stream streams through the stall (every one is silent over most
  of it), with a new request's first token at its end or a prompt-token jump. Streams preempted
  earlier and still waiting are silent too: whether anybody kept receiving tokens, not the share of
  silent streams, tells a stall of one stream from a stall of the engine.
* slow decode — the spike is no outlier for its stream: its gaps were already about as long.
Engine records arrive about once a second, so every engine test uses a tolerance window.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtop.analysis.gaps import Gap

REL_SLOW = 2.0  # a spike less than 2x its stream's recent gaps is "all gaps lifted", not an outlier
KV_HIGH = 0.8  # KV usage counted as near full (vLLM frees a victim's blocks at once: it rarely reads 1.0)
KV_FULL = 0.95
LONGER = 1.2  # a co-stalled victim stalled this much longer than the others: it was preempted too


@dataclass
class _Key:
    """Per engine instance: last raw counters (for resets) and time-ordered points."""

    last_pre: float | None = None
    last_prompt: float | None = None
    last_t: float | None = None
    pre_cum: float = 0.0
    prompt_cum: float = 0.0
    t: list[float] = field(default_factory=list)
    running: list[float | None] = field(default_factory=list)
    waiting: list[float | None] = field(default_factory=list)
    kv: list[float | None] = field(default_factory=list)
    prompt: list[float] = field(default_factory=list)
    head: int = 0


def _inc(prev: float | None, cur: float | None) -> float:
    if prev is None or cur is None:
        return 0.0
    return cur - prev if cur >= prev else cur  # a drop is a restart: count from zero


class EngineTimeline:
    """Bounded engine evidence: per-instance points and a pool of preemption-counter steps."""

    def __init__(self, horizon_s: float = 600.0):
        self.horizon_s = horizon_s
        self.keys: dict[tuple[Any, Any], _Key] = {}
        # (t_prev, t, units left) per scrape where the counter rose, time-ordered
        self.steps: deque[list[float]] = deque()
        self.intervals: deque[float] = deque(maxlen=64)
        self.prompt_deltas: deque[float] = deque(maxlen=256)
        self.has_counter = False

    def add(self, t: float, key: tuple[Any, Any], running: float | None, waiting: float | None,
            kv: float | None, pre: float | None, prompt: float | None) -> None:
        k = self.keys.get(key)
        if k is None:
            k = self.keys[key] = _Key()
        if k.last_t is not None and t > k.last_t:
            self.intervals.append(t - k.last_t)
        if pre is not None:
            self.has_counter = True
            d = _inc(k.last_pre, pre)
            if d > 0 and k.last_t is not None:
                self.steps.append([k.last_t, t, d])
            k.pre_cum += d
            k.last_pre = pre
        if prompt is not None:
            d = _inc(k.last_prompt, prompt)
            if k.last_prompt is not None:
                self.prompt_deltas.append(d)
            k.prompt_cum += d
            k.last_prompt = prompt
        k.last_t = t
        k.t.append(t)
        k.running.append(running)
        k.waiting.append(waiting)
        k.kv.append(kv)
        k.prompt.append(k.prompt_cum)
        if len(k.t) - k.head > 4096 or (k.head > 2048):
            self._compact(k, t)

    def _compact(self, k: _Key, now: float) -> None:
        cut = bisect_left(k.t, now - self.horizon_s, k.head)
        if cut > k.head:
            k.head = cut
        if k.head > 2048:
            for name in ("t", "running", "waiting", "kv", "prompt"):
                lst = getattr(k, name)
                del lst[: k.head]
            k.head = 0

    def prune(self, before: float) -> None:
        while self.steps and self.steps[0][1] < before:
            self.steps.popleft()

    @property
    def scrape_interval(self) -> float:
        if not self.intervals:
            return 1.0
        s = sorted(self.intervals)
        return s[len(s) // 2]

    # -- queries ----------------------------------------------------------------------------
    def claim_counter(self, a: float, b: float, tol: float) -> float | None:
        """Claim one preemption-counter unit that stepped in [a, b + tol]; returns its scrape time."""
        best = None
        for st in self.steps:
            if st[1] < a - 0.25:
                continue
            if st[1] > b + tol:
                break
            if st[2] >= 1 and (best is None or abs(st[1] - b) < abs(best[1] - b)):
                best = st
        if best is None:
            return None
        best[2] -= 1
        return best[1]

    def scrape_lag(self, a: float, b: float) -> float:
        """The longest wait between two of kvtop's own scrapes that overlaps [a, b].

        The recorder scrapes on a fixed beat; a beat missed for a second means the host (or the
        engine's API server, which answers /metrics and streams tokens alike) stalled.
        """
        worst = 0.0
        for k in self.keys.values():
            i = max(k.head, bisect_right(k.t, a, k.head) - 1)
            while i + 1 < len(k.t) and k.t[i] < b:
                worst = max(worst, min(k.t[i + 1], b) - max(k.t[i], a))
                i += 1
        return worst

    def counter_delta(self, a: float, b: float) -> float:
        return sum(st[2] for st in self.steps if a <= st[1] <= b)

    def window(self, a: float, b: float, state_end: float | None = None) -> dict[str, Any]:
        """KV max, running drop and waiting rise over [a, state_end]; prompt-token increase over [a, b].

        The prompt counter steps when a prefill completes, so it is read past the stall's end; the
        gauges after the end show the engine after the stream resumed (or the next stall), not why
        it stopped."""
        out: dict[str, Any] = {"kv_max": None, "running_drop": 0.0, "waiting_rise": False, "prompt_delta": 0.0,
                               "points": 0, "intervals": 0, "t_base": None, "t_state": None}
        for k in self.keys.values():
            if not k.t:
                continue
            i0 = bisect_right(k.t, a, k.head) - 1  # last point at or before a
            i1 = bisect_right(k.t, b, k.head)
            if i0 < k.head:
                i0 = k.head if k.t[k.head] <= b else -1
            if i0 < 0:
                continue
            out["points"] += max(0, i1 - i0)
            i1s = i1 if state_end is None else min(i1, bisect_right(k.t, state_end, k.head))
            kvs = [v for v in k.kv[i0:i1s] if v is not None]
            if kvs:
                m = max(kvs)
                out["kv_max"] = m if out["kv_max"] is None else max(out["kv_max"], m)
            r0, w0 = k.running[i0], k.waiting[i0]
            tb, ts = k.t[i0], k.t[max(i0, i1s - 1)]
            out["t_base"] = tb if out["t_base"] is None else min(out["t_base"], tb)
            out["t_state"] = ts if out["t_state"] is None else max(out["t_state"], ts)
            later_r = [v for v in k.running[i0 + 1:i1s] if v is not None]
            later_w = [v for v in k.waiting[i0 + 1:i1s] if v is not None]
            if r0 is not None and later_r and min(later_r) < r0:
                out["running_drop"] = max(out["running_drop"], r0 - min(later_r))
            if w0 is not None and later_w and max(later_w) > w0:
                out["waiting_rise"] = True
            if i1 - 1 > i0:
                out["prompt_delta"] += k.prompt[i1 - 1] - k.prompt[i0]
                out["intervals"] += i1 - 1 - i0
        return out

    def typical_prompt_delta(self) -> float:
        if not self.prompt_deltas:
            return 0.0
        s = sorted(self.prompt_deltas)
        return s[len(s) // 2]


@dataclass
class Context:
    """What the classifier may look at besides the spike itself."""

    timeline: EngineTimeline
    preempts: bool
    global_median: float | None
    co_stalled: int  # other streams silent over >= half of this spike
    co_fresh: int  # of those, the ones that fell silent with this stream (not long before)
    active_others: int | None
    first_token_near_end: tuple[str, int | None] | None  # (request id, prompt tokens) of a first token at the end
    engine_preempt: bool  # the engine/simulator reported a per-request preempt inside the gap
    tol: float
    departures: Callable[[float, float], int]  # streams that ended in [t0, t1]
    co_gap_median: float | None = None  # median length of the other streams' overlapping gaps


def classify(g: Gap, ctx: Context) -> None:
    """Set ``g.cause``, ``g.confidence`` and ``g.evidence``."""
    ev: list[str] = []
    a, b = g.t_start, g.t_end
    if ctx.engine_preempt and ctx.preempts:
        g.cause, g.confidence = "preemption", 0.98
        g.evidence = ["engine reported a preempt event for this request inside the gap"]
        return
    base = g.stream_baseline or ctx.global_median
    rel = g.gap / base if base else None
    if rel is not None and rel < REL_SLOW:
        g.cause = "slow_decode"
        g.confidence = 0.7 if g.stream_baseline else 0.5
        g.evidence = [f"gap {g.gap * 1e3:.0f} ms is only {rel:.1f}x this stream's recent gaps: all gaps lifted"]
        return
    if rel is not None:
        ev.append(f"gap is {rel:.0f}x this stream's recent gaps")
    flowing = None  # other active streams that kept receiving tokens through the stall
    if ctx.active_others:
        flowing = max(0, ctx.active_others - ctx.co_stalled)
        older = ctx.co_stalled - ctx.co_fresh
        ev.append(f"{ctx.co_stalled}/{ctx.active_others} other active streams stalled over the same interval"
                  + (f" ({older} of them silent since before it)" if older else ""))
    w = ctx.timeline.window(a - ctx.timeline.scrape_interval, b + ctx.tol, b + 0.1)
    kv_high = w["kv_max"] is not None and w["kv_max"] >= KV_HIGH
    # running falls by one whenever a stream finishes (this one too, if its last token ends the gap):
    # only a drop beyond the streams that ended between the scrapes it was read from is evidence
    ended = ctx.departures(w["t_base"], w["t_state"]) if w["t_base"] is not None else 0
    running_drop = w["running_drop"] > ended
    prompt_jump = False
    typ = ctx.timeline.typical_prompt_delta()
    # a jump is well above what the scrapes in the window add at the usual rate
    if w["prompt_delta"] >= 512 and w["prompt_delta"] > 1.5 * typ * max(1, w["intervals"]):
        prompt_jump = True
    ft = ctx.first_token_near_end
    prefill_ev = []
    if ft is not None:
        prefill_ev.append(f"request {ft[0]} got its first token at the end of the stall"
                          + (f" ({ft[1]} prompt tokens)" if ft[1] else ""))
    if prompt_jump:
        prefill_ev.append(f"prompt tokens rose by {w['prompt_delta']:.0f} around the stall")

    # While any other stream still received tokens the engine kept stepping: this stream alone was
    # left out. In a preemption storm most streams sit silent (preempted earlier, still waiting), so
    # a share of silent streams says nothing; an engine-wide stall (a prefill step, a host hiccup)
    # is one that nobody streamed through.
    isolated = flowing is None or flowing > 0
    if isolated:
        if ctx.preempts:
            pev = []
            score = 0.0
            t_c = ctx.timeline.claim_counter(a, b, ctx.tol)
            if t_c is not None:
                score += 0.45
                pev.append(f"preemption counter stepped at t={t_c:.2f}s ({t_c - b:+.2f}s from the stall's end)")
            if kv_high:
                score += 0.2
                pev.append(f"KV usage {w['kv_max']:.2f}")
            if running_drop or w["waiting_rise"]:
                score += 0.2
                pev.append("running dropped / waiting rose" if running_drop and w["waiting_rise"] else
                           ("running dropped" if running_drop else "waiting rose"))
            if g.ended_by == "cancel":
                pev.append("the client cancelled while the stream was silent (an uncounted victim?)")
            # KV pinned at full while every other stream keeps flowing is itself the signature
            # (kv-science §4), e.g. for victims the counter never counts (cancelled while preempted)
            kv_full_flowing = flowing is not None and w["kv_max"] is not None and w["kv_max"] >= KV_FULL
            strong = t_c is not None or (kv_high and (running_drop or w["waiting_rise"])) or kv_full_flowing
            if strong:
                if flowing is not None:
                    score += 0.15
                    ev.append("the other streams kept flowing")
                g.cause, g.confidence = "preemption", min(0.97, 0.3 + score)
                g.evidence = ev + pev
                return
            ev.extend(pev)
        if prefill_ev and flowing is None:
            # a single running stream stalled by another request's prefill
            g.cause, g.confidence = "prefill_interference", 0.5
            g.evidence = ev + prefill_ev
            return
        g.cause, g.confidence = "unknown", 0.3
        lag = ctx.timeline.scrape_lag(a, b)
        if lag >= 0.5 * g.gap and lag >= 2.0 * ctx.timeline.scrape_interval:
            ev.append(f"kvtop's own scrapes stalled {lag:.1f}s across it: the host or the engine's API server hung")
        if flowing is None:
            ev.append("the only active stream stalled, so nothing tells the engine apart from the host"
                      + ("" if ctx.preempts else " (this engine never preempts)"))
        else:
            ev.append("a lone stall without preemption evidence (no counter step, KV not near full, "
                      "no running/waiting change)" if ctx.preempts else "a lone stall (this engine never preempts)")
        g.evidence = ev
        return
    # (nearly) every stream stalled together
    if ctx.preempts and ctx.co_gap_median and g.gap > LONGER * ctx.co_gap_median:
        # a prefill step stalled everyone, but this stream stayed silent longer: a victim — only
        # with a counter step to claim. KV sits near full through a whole storm, so "longer and KV
        # high" alone turned host hiccups that stall every stream into preemptions on a real vLLM.
        t_c = ctx.timeline.claim_counter(a, b, ctx.tol)
        if t_c is not None:
            g.cause, g.confidence = "preemption", 0.8
            g.evidence = ev + [f"silent {g.gap / ctx.co_gap_median:.1f}x longer than the other stalled streams",
                               f"preemption counter stepped at t={t_c:.2f}s"] + (
                [f"KV usage {w['kv_max']:.2f}"] if kv_high else [])
            return
    if ctx.preempts:
        d = ctx.timeline.counter_delta(a - 0.25, b + ctx.tol)
        if d >= max(2.0, 0.5 * (ctx.co_fresh + 1)) and not prefill_ev:
            g.cause, g.confidence = "preemption", 0.6
            g.evidence = ev + [f"the preemption counter rose by {d:.0f}: a mass preemption"]
            return
    if prefill_ev:
        g.cause = "prefill_interference"
        g.confidence = min(0.95, 0.55 + 0.25 * (ft is not None) + 0.15 * prompt_jump)
        g.evidence = ev + prefill_ev
        return
    g.cause, g.confidence = "unknown", 0.35
    g.evidence = ev + ["all streams stalled together without a prefill or preemption signal"]
