"""Engine evidence over time: per-instance gauges and counters from the scrapes, bounded.

Engine records arrive about once a scrape interval, so every query works on a tolerance window.
The preemption counter is kept as a pool of steps (a scrape where it rose): a spike claims one
unit, so two spikes never explain themselves with the same preemption.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from kvtop.analysis.asof import union_length
from kvtop.analysis.attribution.thresholds import RATE_MIN_PROMPT, RATE_MIN_PROMPTS, STEP_EARLY_S
from kvtop.model.records import EngineKey

INTERVALS = 64  # scrape intervals the usual interval is the median of
PROMPT_DELTAS = 256  # scrape intervals the usual prompt rise is the median of


@dataclass
class EngineWindow:
    """What the engine's scrapes show around one spike (all instances together)."""

    kv_max: float | None = None
    running_drop: float = 0.0
    waiting_rise: bool = False
    prompt_delta: float = 0.0  # prompt-token counter increase
    points: int = 0  # scrapes read
    intervals: int = 0  # scrape intervals the prompt increase spans
    t_base: float | None = None  # the scrape the gauges are compared with (at or before the start)
    t_state: float | None = None  # the last scrape read for gauges
    t_prompt_end: float | None = None  # the last scrape the prompt increase reaches
    # first tokens the engine counted over the prompt window (its TTFT histogram's count); None
    # where an instance does not report one
    first_delta: float | None = None


@dataclass
class _Key:
    """Per engine instance: last raw counters (for resets) and time-ordered points."""

    last_pre: float | None = None
    last_prompt: float | None = None
    last_first: float | None = None
    last_ttft: float | None = None
    last_t: float | None = None
    pre_cum: float = 0.0
    prompt_cum: float = 0.0
    first_cum: float = 0.0
    ttft_cum: float = 0.0
    # the prompt, first-token and TTFT-sum counters as first read: with the cumulative lists, what the
    # engine counted since it started (its prefills before kvtop began included)
    base: list[float | None] = field(default_factory=lambda: [None, None, None])
    t: list[float] = field(default_factory=list)
    running: list[float | None] = field(default_factory=list)
    waiting: list[float | None] = field(default_factory=list)
    kv: list[float | None] = field(default_factory=list)
    prompt: list[float] = field(default_factory=list)
    first: list[float | None] = field(default_factory=list)  # cumulative engine first-token count
    ttft: list[float | None] = field(default_factory=list)  # cumulative sum of the engine's TTFT histogram
    head: int = 0


def _inc(prev: float | None, cur: float | None) -> float:
    if prev is None or cur is None:
        return 0.0
    return cur - prev if cur >= prev else cur  # a drop is a restart: count from zero


class EngineTimeline:
    """Bounded engine evidence: per-instance points and a pool of preemption-counter steps."""

    def __init__(self, horizon_s: float = 600.0, interval_s: float = 1.0):
        self.horizon_s = horizon_s
        # the interval before two scrapes were read: the recorder's own (a trace header's
        # ``interval_s``), else 1 s; a first stall judged with the wrong one misses its counter step
        self.interval_s = interval_s
        self.keys: dict[EngineKey, _Key] = {}
        # (t_prev, t, units left, units) per scrape where the counter rose, time-ordered
        self.steps: deque[list[float]] = deque()
        # (scrape time, figure): the usual interval and prompt rise are medians of the last
        # INTERVALS / PROMPT_DELTAS of them, read as of a spike's cut-off (``asof``); the deques keep
        # more, for a spike judged a block of records later
        self.intervals = TimedFigures(4 * INTERVALS)
        self.prompt_deltas = TimedFigures(4 * PROMPT_DELTAS)
        self.has_counter = False
        # stall spans already explained by the prompt tokens of one scrape interval (keyed by the
        # scrape that closes it): those tokens are a finite amount of prefill time, not a licence
        self.prefill_claims: dict[float, list[tuple[float, float]]] = {}

    def add(self, t: float, key: EngineKey, running: float | None, waiting: float | None,
            kv: float | None, pre: float | None, prompt: float | None, first: float | None = None,
            ttft: float | None = None) -> None:
        k = self.keys.get(key)
        if k is None:
            k = self.keys[key] = _Key()
        if k.last_t is not None and t > k.last_t:
            self.intervals.append((t, t - k.last_t))
        if pre is not None:
            self.has_counter = True
            d = _inc(k.last_pre, pre)
            if d > 0 and k.last_t is not None:
                self.steps.append([k.last_t, t, d, d])  # (t_prev, t, units left, units)
            k.pre_cum += d
            k.last_pre = pre
        if prompt is not None:
            d = _inc(k.last_prompt, prompt)
            if k.last_prompt is not None:
                self.prompt_deltas.append((t, d))
            k.prompt_cum += d
            k.last_prompt = prompt
        if first is not None:
            k.first_cum += _inc(k.last_first, first)
            k.last_first = first
        if ttft is not None:
            k.ttft_cum += _inc(k.last_ttft, ttft)
            k.last_ttft = ttft
        for i, v in enumerate((prompt, first, ttft)):
            if k.base[i] is None and v is not None:
                k.base[i] = v
        k.last_t = t
        k.t.append(t)
        k.running.append(running)
        k.waiting.append(waiting)
        k.kv.append(kv)
        k.prompt.append(k.prompt_cum)
        k.first.append(None if first is None else k.first_cum)
        k.ttft.append(None if ttft is None else k.ttft_cum)
        if len(k.t) - k.head > 4096 or (k.head > 2048):
            self._compact(k, t)

    def _compact(self, k: _Key, now: float) -> None:
        cut = bisect_left(k.t, now - self.horizon_s, k.head)
        if cut > k.head:
            k.head = cut
        if k.head > 2048:
            for name in ("t", "running", "waiting", "kv", "prompt", "first", "ttft"):
                lst = getattr(k, name)
                del lst[: k.head]
            k.head = 0

    def prune(self, before: float) -> None:
        while self.steps and self.steps[0][1] < before:
            self.steps.popleft()
        for key in [k for k in self.prefill_claims if k < before]:
            del self.prefill_claims[key]

    def _closing_scrape(self, t: float) -> float | None:
        """The first scrape at or after ``t`` (any instance): the one that closes t's interval."""
        best = None
        for k in self.keys.values():
            i = bisect_left(k.t, t, k.head)
            if i < len(k.t) and (best is None or k.t[i] < best):
                best = k.t[i]
        return best

    def prefill_room(self, t: float, span: tuple[float, float], budget_s: float, share: float,
                     same_step_s: float = 0.0) -> bool:
        """Whether the prompt tokens of the scrape interval around ``t`` (``budget_s`` of prefill at
        the measured rate) have enough left to cover ``share`` of ``span``: each stall they explained
        spent its whole span of them (a prefill that covers a stall is used up by it, however little of
        the stall it had to cover to explain it), and spans of streams stalled in the same step overlap
        and count once, so a part of ``span`` already claimed costs nothing (nor does one within
        ``same_step_s`` of it: the streams of one step get their tokens that far apart), and a span
        ending where a claimed one ends is that step's (the streams' paces, and so their spans' starts,
        differ) and costs nothing."""
        key = self._closing_scrape(t)
        if key is None:
            return True
        claims = self.prefill_claims.get(key, [])
        if any(abs(c[1] - span[1]) <= same_step_s for c in claims):
            return True
        used = union_length(claims)
        new = union_length([*claims, span]) - used
        return new <= same_step_s + 1e-9 or share * new <= budget_s - used + 1e-9

    def claim_prefill(self, t: float, span: tuple[float, float]) -> None:
        key = self._closing_scrape(t)
        if key is not None:
            self.prefill_claims.setdefault(key, []).append(span)

    @property
    def last_scrape(self) -> float | None:
        """The latest scrape read (any instance)."""
        ts = [k.last_t for k in self.keys.values() if k.last_t is not None]
        return max(ts) if ts else None

    @property
    def scrape_interval(self) -> float:
        """The usual interval between scrapes, of the latest ones (``interval_s`` before two were read)."""
        return self.interval_at(math.inf)

    def interval_at(self, t: float) -> float:
        """The usual scrape interval as known at trace time ``t``."""
        return self.intervals.median_upto(t, INTERVALS, self.interval_s)

    # -- queries ----------------------------------------------------------------------------
    def claim_counter(self, a: float, b: float, tol: float) -> float | None:
        """Claim one preemption-counter unit that stepped in [a, b + tol]; returns its scrape time.

        For engines whose counting moment is unknown; ``claim_in`` is the bounded form."""
        best = None
        for st in self.steps:
            if st[1] < a - STEP_EARLY_S:
                continue
            if st[1] > b + tol:
                break
            if st[2] >= 1 and (best is None or abs(st[1] - b) < abs(best[1] - b)):
                best = st
        if best is None:
            return None
        best[2] -= 1
        return best[1]

    def claim_in(self, lo: float, hi: float, at: float) -> tuple[float, float] | None:
        """Claim one counter unit from a scrape interval (t_prev, t] that overlaps [lo, hi], the one
        nearest to ``at`` first; returns (t, interval length). The interval bounds when the counter
        really moved: a step read 5 s after a stall, from an interval that began after it, is
        somebody else's."""
        best = self.unit_in(lo, hi, at)
        if best is None:
            return None
        best[2] -= 1
        return best[1], best[1] - best[0]

    def unit_in(self, lo: float, hi: float, at: float) -> list[float] | None:
        """The scrape interval ``claim_in`` would take a unit from: [t_prev, t, units left, units]."""
        best = None
        best_d = 0.0
        for st in self.steps:
            if st[1] < lo:
                continue
            if st[0] >= hi:
                if st[0] > hi + 60.0:
                    break
                continue
            if st[2] < 1:
                continue
            d = 0.0 if st[0] <= at <= st[1] else min(abs(st[0] - at), abs(st[1] - at))
            if best is None or d < best_d:
                best, best_d = st, d
        return best

    def steps_in(self, lo: float, hi: float) -> float:
        """Counter units (claimed or not) read in scrape intervals that overlap [lo, hi]."""
        n = 0.0
        for st in self.steps:
            if st[1] >= lo and st[0] < hi:
                n += st[3]
        return n

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

    def covering_interval(self, a: float, b: float) -> float:
        """The longest wait between two of kvtop's own scrapes that covers at least half of [a, b]
        (its whole length, not clipped to [a, b]): a scrape late by about the stall waited with it."""
        worst = 0.0
        half = 0.5 * (b - a)
        for k in self.keys.values():
            i = max(k.head, bisect_right(k.t, a, k.head) - 1)
            while i + 1 < len(k.t) and k.t[i] < b:
                if min(k.t[i + 1], b) - max(k.t[i], a) >= half:
                    worst = max(worst, k.t[i + 1] - k.t[i])
                i += 1
        return worst

    def hang_span(self, a: float, b: float, late: float) -> tuple[float, float] | None:
        """The widest a hang of kvtop's scrapes overlapping [a, b] can have been: from the last reply
        before the first interval (overlapping it) that ran ``late`` seconds or more past its beat, to
        the late reply that ended the last such interval."""
        span: tuple[float, float] | None = None
        for k in self.keys.values():
            i = max(k.head, bisect_right(k.t, a, k.head) - 1)
            while i + 1 < len(k.t) and k.t[i] < b:
                if k.t[i + 1] - k.t[i] >= late:
                    lo, hi = k.t[i], k.t[i + 1]
                    span = (lo, hi) if span is None else (min(span[0], lo), max(span[1], hi))
                i += 1
        return span

    def held_reply(self, a: float, b: float, si: float) -> tuple[float, float] | None:
        """A scrape due inside [a, b] that was answered late: (how late, when answered), the latest
        answered one. A reply held until about when the stalled streams resumed waited with them."""
        best = None
        for k in self.keys.values():
            i = max(k.head, bisect_right(k.t, a - si, k.head) - 1)
            while i + 1 < len(k.t) and k.t[i] < b:
                due = k.t[i] + si
                if a <= due <= b and (best is None or k.t[i + 1] > best[1]):
                    best = (k.t[i + 1] - due, k.t[i + 1])
                i += 1
        return best

    def gauges_in(self, a: float, b: float) -> list[tuple[float, float, float]]:
        """(scrape time, running, waiting) of each scrape in (a, b). Only for an engine of one
        instance: with several, one instance's gauges cannot be set against streams kvtop cannot
        place on an instance, so there are none."""
        if len(self.keys) != 1:
            return []
        (k,) = self.keys.values()
        out = []
        i = bisect_right(k.t, a, k.head)
        while i < len(k.t) and k.t[i] < b:
            r, w = k.running[i], k.waiting[i]
            if r is not None and w is not None:
                out.append((k.t[i], r, w))
            i += 1
        return out

    def running_at(self, t: float) -> float | None:
        """The running gauge summed over instances, from each one's last scrape at or before ``t``."""
        tot = None
        for k in self.keys.values():
            i = bisect_right(k.t, t, k.head) - 1
            if i >= k.head and k.running[i] is not None:
                tot = (tot or 0.0) + (k.running[i] or 0.0)
        return tot

    def waiting_through(self, a: float, b: float) -> float | None:
        """Requests the engine held queued all through [a, b], as far as its gauges tell: the lower
        of the waiting gauge at the last scrape by ``a`` and the first at or after ``b`` (summed over
        instances; None where none frames the span)."""
        tot = None
        for k in self.keys.values():
            i = bisect_right(k.t, a, k.head) - 1
            j = bisect_left(k.t, b, k.head)
            if i < k.head or j >= len(k.t) or k.waiting[i] is None or k.waiting[j] is None:
                continue
            tot = (tot or 0.0) + min(k.waiting[i] or 0.0, k.waiting[j] or 0.0)
        return tot

    def counter_delta(self, a: float, b: float) -> float:
        return sum(st[2] for st in self.steps if a <= st[1] <= b)

    def window(self, a: float, b: float, state_end: float | None = None) -> EngineWindow:
        """KV max, running drop and waiting rise over [a, state_end]; prompt-token increase over [a, b].

        The prompt counter steps when a prefill completes, so it is read past the stall's end; the
        gauges after the end show the engine after the stream resumed (or the next stall), not why
        it stopped."""
        out = EngineWindow()
        firsts: float | None = 0.0
        for k in self.keys.values():
            if not k.t:
                continue
            i0 = bisect_right(k.t, a, k.head) - 1  # last point at or before a
            i1 = bisect_right(k.t, b, k.head)
            if i0 < k.head:
                i0 = k.head if k.t[k.head] <= b else -1
            if i0 < 0:
                continue
            out.points += max(0, i1 - i0)
            i1s = i1 if state_end is None else min(i1, bisect_right(k.t, state_end, k.head))
            kvs = [v for v in k.kv[i0:i1s] if v is not None]
            if kvs:
                m = max(kvs)
                out.kv_max = m if out.kv_max is None else max(out.kv_max, m)
            r0, w0 = k.running[i0], k.waiting[i0]
            tb, ts = k.t[i0], k.t[max(i0, i1s - 1)]
            out.t_base = tb if out.t_base is None else min(out.t_base, tb)
            out.t_state = ts if out.t_state is None else max(out.t_state, ts)
            later_r = [v for v in k.running[i0 + 1:i1s] if v is not None]
            later_w = [v for v in k.waiting[i0 + 1:i1s] if v is not None]
            if r0 is not None and later_r and min(later_r) < r0:
                out.running_drop = max(out.running_drop, r0 - min(later_r))
            if w0 is not None and later_w and max(later_w) > w0:
                out.waiting_rise = True
            if i1 - 1 > i0:
                out.prompt_delta += k.prompt[i1 - 1] - k.prompt[i0]
                out.intervals += i1 - 1 - i0
                f0, f1 = k.first[i0], k.first[i1 - 1]
                if firsts is not None:
                    firsts = None if f0 is None or f1 is None else firsts + f1 - f0
                te = k.t[i1 - 1]
                out.t_prompt_end = te if out.t_prompt_end is None else max(out.t_prompt_end, te)
        out.first_delta = firsts if out.intervals else None
        return out

    def prompt_at(self, t: float) -> float | None:
        """The prompt-token increase over the scrape interval in which ``t`` falls (all instances;
        None before two scrapes frame it)."""
        tot = None
        for k in self.keys.values():
            i = bisect_left(k.t, t, k.head)
            if k.head < i < len(k.t):
                tot = (tot or 0.0) + k.prompt[i] - k.prompt[i - 1]
        return tot

    def prefill_rate_at(self, t: float) -> float | None:
        """The engine's own prefill rate as of ``t``: the prompt tokens it counted since it started
        over the sum of its TTFT histogram (all instances), whoever sent the prompts. TTFT holds
        queueing and the decode work of the steps that prefilled, so it is a low estimate, like
        kvtop's own sample; None before ``RATE_MIN_PROMPTS`` first tokens, or where the prompts
        average under ``RATE_MIN_PROMPT`` tokens (on real vLLM, prompts of 50-75 tokens read a rate so
        low that it explained nearly any stall: docs/real-engines.md 7.11)."""
        p = n = s = 0.0
        for k in self.keys.values():
            i = bisect_right(k.t, t, k.head) - 1
            if i < k.head or k.first[i] is None or k.ttft[i] is None or None in k.base:
                continue
            b0, b1, b2 = k.base
            p += (b0 or 0.0) + k.prompt[i]
            n += (b1 or 0.0) + (k.first[i] or 0.0)
            s += (b2 or 0.0) + (k.ttft[i] or 0.0)
        return p / s if n >= RATE_MIN_PROMPTS and s > 0 and p >= RATE_MIN_PROMPT * n else None

    def firsts_at(self, t: float) -> tuple[float, float, float] | None:
        """The engine's first-token count over the scrape interval in which ``t`` falls, and that
        interval (all instances; None before two scrapes frame it, or where one reports no count)."""
        tot, a, b = 0.0, math.inf, -math.inf
        for k in self.keys.values():
            i = bisect_left(k.t, t, k.head)
            if not k.head < i < len(k.t):
                continue
            f0, f1 = k.first[i - 1], k.first[i]
            if f0 is None or f1 is None:
                return None
            tot += f1 - f0
            a, b = min(a, k.t[i - 1]), max(b, k.t[i])
        return None if b < a else (tot, a, b)

    def typical_prompt_delta(self, t: float = math.inf) -> float:
        """The prompt tokens a scrape interval usually adds, as known at trace time ``t``."""
        return self.prompt_deltas.median_upto(t, PROMPT_DELTAS, 0.0)


class TimedFigures:
    """(scrape time, figure) pairs in time order, bounded."""

    def __init__(self, maxlen: int):
        self.items: deque[tuple[float, float]] = deque(maxlen=maxlen)
        # the last answer: every stall asks, and the figures a stall reads change once a scrape
        self._memo: tuple[tuple[int, int, tuple[float, float], tuple[float, float]], float] | None = None

    def append(self, item: tuple[float, float]) -> None:
        self.items.append(item)

    def median_upto(self, t: float, n: int, empty: float) -> float:
        """The median of the last ``n`` figures read by ``t``."""
        xs = self.items
        j = len(xs)
        while j and xs[j - 1][0] > t:
            j -= 1
        if not j:
            return empty
        key = (j, n, xs[0], xs[j - 1])
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        s = sorted(v for _, v in islice(xs, max(0, j - n), j))
        self._memo = (key, s[len(s) // 2])
        return s[len(s) // 2]
