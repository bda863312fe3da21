"""The stall index: what other streams did around a spike (the cross-stream questions).

Long gaps by end time, first tokens by time, the count of active streams over time (per engine
once streams name theirs) and the streams that are live or ended lately. ``co_stalled`` (who else
fell silent with it), ``first_token_near`` (prompts admitted as it ended), ``active_at`` and
``departures`` are what the evidence builder asks about them. The gap tracker fills it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple

from kvtop.analysis.asof import Cutoff, engine_prefill_of, outside, prompt_of, union_length
from kvtop.analysis.streams import ReqState

if TYPE_CHECKING:  # types only: the gap tracker (gaps.py) owns an index and fills it
    from kvtop.analysis.gaps import Gap


def _t_end(g: Gap) -> float:
    return g.t_end


def _step(ts: list[float], vs: list[int], t: float, v: int) -> None:
    """Append a step of a count over time (a second change at the same instant replaces the first)."""
    if ts and ts[-1] == t:
        vs[-1] = v
    else:
        ts.append(t)
        vs.append(v)


class Company(NamedTuple):
    """The other streams stalled with a spike (``StallIndex.co_stalled``)."""

    stalled: int  # silent over at least half of it
    gap_median: float | None  # the median length of their silences (those that fell silent with it, where any did)
    fresh: int  # ... that fell silent with it rather than long before
    together: int  # ... and came back with it
    start: float | None  # the median moment the compared silences began
    end: float | None  # ... and ended (cut where the spike is judged)


class StallIndex:
    def __init__(self) -> None:
        self.long: list[Gap] = []  # long gaps by t_end (co-stall search)
        self.long_max = 0.0  # the longest of them: no gap ending later than a + it can reach back to a
        self.long_head = 0
        # (time, request id, request, engine): the request itself, so a prompt length learned after
        # its first token (the server's usage count on its finish) sizes it when a spike is judged
        self.first_tokens: list[tuple[float, str, ReqState, str | None]] = []
        self.ft_head = 0
        # arrivals by time, within the evidence horizon: who was being prefilled during a spike
        self.arrivals: deque[tuple[float, ReqState]] = deque()
        self.active = 0
        # streams between first token and end, and those that ended lately: the co-stall search
        # needs streams whose silence had not ended when a spike is judged
        self.live: dict[str, ReqState] = {}
        self.ended: deque[ReqState] = deque()
        self.active_t: list[float] = []
        self.active_v: list[int] = []
        # Set once a stream names its engine: from then on the queries about other streams look
        # only at streams of the same engine (a stream on another engine flowing through a stall
        # says nothing about it). Per-engine active counts: engine -> (count, times, values).
        self.multi = False
        self.eng_active: dict[str | None, tuple[list[int], list[float], list[int]]] = {}

    # ---- filling it --------------------------------------------------------------------------
    def add_long(self, gp: Gap, in_order: bool = True) -> None:
        """A long gap (at least LONG_FRACTION of the target), in t_end order: ``in_order`` places one
        that ends before the last kept (a trace's lines a little out of time order, one stream's gaps
        closing after another's that ended later) where it belongs, since the co-stall search finds
        its candidates by bisection; a fast-path batch appends and sorts once (``sort_long_from``)."""
        lg = self.long
        if in_order and lg and gp.t_end < lg[-1].t_end:
            insort(lg, gp, lo=self.long_head, key=_t_end)
        else:
            lg.append(gp)
        if gp.gap > self.long_max:
            self.long_max = gp.gap

    def sort_long_from(self, i: int) -> None:
        """Restore t_end order of the long gaps added since there were ``i`` of them (a fast-path batch)."""
        if len(self.long) - i > 1:
            self.long[i:] = sorted(self.long[i:], key=_t_end)

    def engines_named(self) -> None:
        """The first stream named its engine: the streams so far named none, their active counts
        carry on under None."""
        if not self.multi:
            self.eng_active[None] = ([self.active], list(self.active_t), list(self.active_v))
            self.multi = True

    def arrived(self, r: ReqState, t: float) -> None:
        """Request ``r`` arrived at ``t`` (its prompt is prefilled until its first token)."""
        self.arrivals.append((t, r))

    def first_token(self, r: ReqState, t: float) -> None:
        """Stream ``r`` got its first token at ``t``: active from now (live unless it already ended)."""
        self.first_tokens.append((t, r.id, r, r.engine))
        self._set_active(t, +1, r.engine)
        if r.end_t is None:
            self.live[r.id] = r

    def stream_ended(self, r: ReqState, t: float) -> None:
        """An active stream ended at ``t``."""
        self._set_active(t, -1, r.engine)
        if self.live.pop(r.id, None) is not None:
            self.ended.append(r)

    def forget(self, rid: str) -> None:
        """A stream dropped from the per-stream store (capped): no longer live."""
        self.live.pop(rid, None)

    def _set_active(self, t: float, d: int, engine: str | None = None) -> None:
        self.active += d
        _step(self.active_t, self.active_v, t, self.active)
        if self.multi:
            e = self.eng_active.get(engine)
            if e is None:
                e = self.eng_active[engine] = ([0], [], [])
            e[0][0] += d
            _step(e[1], e[2], t, e[0][0])

    def _active_lists(self, engine: str | None) -> tuple[list[float], list[int]]:
        """The active-count steps of ``engine``'s streams (all streams while none names its engine)."""
        if not self.multi:
            return self.active_t, self.active_v
        e = self.eng_active.get(engine)
        return (e[1], e[2]) if e is not None else ([], [])

    # ---- the questions ---------------------------------------------------------------------------
    def active_at(self, t: float, engine: str | None = None) -> int | None:
        """Streams between first token and end at ``t`` (of ``engine`` once streams name theirs)."""
        ts, vs = self._active_lists(engine)
        i = bisect_right(ts, t) - 1
        return vs[i] if i >= 0 else None

    def departures(self, a: float, b: float, engine: str | None = None) -> int:
        """Streams that ended in [a, b] (a step down of the active count; several at one instant merge)."""
        ts, vs = self._active_lists(engine)
        i = bisect_left(ts, a)
        prev = vs[i - 1] if i > 0 else 0
        n = 0
        while i < len(ts) and ts[i] <= b:
            if vs[i] < prev:
                n += prev - vs[i]
            prev = vs[i]
            i += 1
        return n

    def _long_ending_from(self, t: float) -> int:
        """Index of the first long gap (they are in t_end order) that ends at or after ``t``."""
        lg = self.long
        lo, hi = self.long_head, len(lg)
        while lo < hi:
            mid = (lo + hi) // 2
            if lg[mid].t_end < t:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _over_half(self, g: Gap) -> Iterator[Gap]:
        """Other streams' long gaps (of the spike's engine) silent over at least half of spike ``g``,
        the first of each stream's."""
        half = 0.5 * (g.t_end - g.t_start)
        a_end = g.t_start + half
        reach = a_end + self.long_max  # a gap ending later began after a + L/2: it cannot cover half
        lg = self.long
        seen = set()
        multi, eng = self.multi, g.engine
        for i in range(self._long_ending_from(a_end), len(lg)):  # candidates end at or after a + L/2
            q = lg[i]
            if q.t_end > reach:
                break
            if q.request_id == g.request_id or q.request_id in seen or (multi and q.engine != eng):
                continue
            if min(q.t_end, g.t_end) - max(q.t_start, g.t_start) >= half:
                seen.add(q.request_id)
                yield q

    def company_pace(self, g: Gap, seasoned: int) -> float | None:
        """The decode-only pace of the batch as the other streams silent over at least half of spike
        ``g`` had seen it: the median of their fastest recent gaps, of those with ``seasoned`` gaps or
        more behind them (every running request takes each step). None: no such stream."""
        v = sorted(q.fast_baseline for q in self._over_half(g) if q.fast_baseline and q.gaps_before >= seasoned)
        return v[len(v) // 2] if v else None

    def co_stalled(self, g: Gap, settle: float, enough: int | None = None) -> Company:
        """Other streams silent over at least half of the spike, the median of their silences (of those
        that fell silent with it, where any did), and
        how many of them fell silent with it (up to a second, or half its length, before it began)
        rather than long before (streams preempted earlier and still waiting), and how many of those
        also came back with it (their silence ended within a quarter of its length, >= 50 ms, of its
        end: one engine-wide or delivery event, not victims resuming one by one), and the median
        moments the compared silences began and ended (a victim fell silent steps before them).

        A silence counts as seen when the spike is judged (``settle`` after its end): closed gaps up
        to then, and streams still silent then (preempted streams often resume much later). Lengths
        are cut at that moment, so the batch path, which judges later, gets the same answer."""
        L = g.t_end - g.t_start
        half = 0.5 * L
        cap = g.t_end + settle
        a_end = g.t_start + half
        seen = set()
        spans: list[tuple[float, float]] = []
        fresh_spans: list[tuple[float, float]] = []
        fresh_from = g.t_start - min(half, 1.0)
        fresh = together = 0
        tol = max(0.05, 0.25 * L)
        multi, eng = self.multi, g.engine
        for q in self._over_half(g):
            seen.add(q.request_id)
            spans.append((q.t_start, min(q.t_end, cap)))
            if q.t_start >= fresh_from:
                fresh += 1
                fresh_spans.append(spans[-1])
                together += abs(q.t_end - g.t_end) <= tol
            if enough is not None and len(seen) >= enough:
                break  # every other active stream already found stalled
        if enough is None or len(seen) < enough:
            groups: tuple[Iterable[ReqState], ...] = (self.live.values(), self.ended)
            for group in groups:
                for r in group:
                    lt = r.last_t
                    if lt is None or lt > a_end or r.id == g.request_id or r.id in seen or \
                            (multi and r.engine != eng):
                        continue
                    # silent from its last token until now, or until it ended (a stream that
                    # errors out mid-stall without a token streamed nothing through it either)
                    end = cap if r.end_t is None else min(r.end_t, cap)
                    if min(end, g.t_end) - max(lt, g.t_start) < half:
                        continue
                    seen.add(r.id)
                    spans.append((lt, end))
                    if lt >= fresh_from:
                        fresh += 1
                        fresh_spans.append(spans[-1])
        if not spans:
            return Company(0, None, 0, 0, None, None)
        # the company a silence is compared with is the streams that fell silent with it: those
        # silent since long before are victims still waiting, whose silences say nothing of this one's
        comp = fresh_spans or spans
        m = len(comp) // 2
        lens = sorted(b - a for a, b in comp)
        return Company(len(seen), lens[m], fresh, together, sorted(a for a, _ in comp)[m], sorted(b for _, b in comp)[m])

    def silent_at(self, g: Gap, t: float, min_gap: float, now: float) -> int:
        """Streams (of the spike's engine) between first token and end at ``t`` that were silent
        across it, in a gap of at least ``min_gap`` (closed by ``now``, or still open then)."""
        seen: set[str] = set()
        lg = self.long
        i = self._long_ending_from(t)
        reach = t + self.long_max
        multi, eng = self.multi, g.engine
        while i < len(lg) and lg[i].t_end <= reach:
            q = lg[i]
            if q.t_start < t < q.t_end and q.gap >= min_gap and not (multi and q.engine != eng):
                seen.add(q.request_id)
            i += 1
        # and streams with no token since before t: still silent now, or silent until they ended
        for group in (self.live.values(), self.ended):
            for r in group:
                lt = r.last_t
                if lt is None or lt >= t or r.id in seen or (multi and r.engine != eng):
                    continue
                end = now if r.end_t is None else r.end_t
                if end > t and end - lt >= min_gap:
                    seen.add(r.id)
        return len(seen)

    def victim_resumed(self, g: Gap) -> str | None:
        """Another stream, silent since before the spike began, whose silence ended with it (both
        within a quarter of its length, >= 50 ms, the tolerance of ``co_stalled``'s "together", and
        its end inside the spike, or after it by no more than the spike was long: a resume later than
        that came out of a later step, as a late first token does in ``first_token_near``): a
        waiting victim that the engine resumed as the spike ended. Its id, or None."""
        L = g.t_end - g.t_start
        tol = max(0.05, 0.25 * L)
        for q in self._others_ending_in(g, g.t_end - tol, g.t_end + min(tol, L)):
            # its silence ended inside the spike (a short spike's tolerance reaches back past its
            # start: a silence that ended before the spike began was resumed by an earlier step)
            if q.t_start <= g.t_start - tol and q.t_end > g.t_start:
                return q.request_id
        return None

    def _others_ending_in(self, g: Gap, a: float, b: float) -> Iterator[Gap]:
        """Other streams' long gaps (of the spike's engine) that ended in [a, b], by end."""
        lg = self.long
        i = self._long_ending_from(a)
        multi, eng = self.multi, g.engine
        while i < len(lg) and lg[i].t_end <= b:
            q = lg[i]
            if q.request_id != g.request_id and not (multi and q.engine != eng):
                yield q
            i += 1

    def _resumed_in(self, g: Gap, a: float, b: float) -> Iterator[Gap]:
        """Other streams' long gaps (of the spike's engine) that ended in (a, b] and after the spike."""
        return (q for q in self._others_ending_in(g, max(a, g.t_end), b) if q.t_end > g.t_end and q.t_end > a)

    def last_silent_from(self, g: Gap, t: float, tol: float, cut: Cutoff) -> float | None:
        """The latest moment another stream (of the spike's engine) fell silent among those whose
        silence, begun before ``t`` - ``tol``, ended within ``tol`` of ``t``: a hang of the host or the
        API server that released them then began no earlier (that stream was still receiving
        tokens). None: no such silence known by the cut-off."""
        return max((q.t_start for q in self._others_ending_in(g, t - tol, t + tol)
                    if q.t_start < t - tol and q.t_end <= cut.facts), default=None)

    def resuming_after(self, g: Gap, a: float, b: float, wait_rel: float, turn_rel: float | None = None) -> int:
        """Other streams whose silence ended in (a, b] and after the spike's end, silent since before
        the spike began for at least ``wait_rel`` times their stream's recent gaps: waiting victims
        that an engine counting at resume counts later (a shorter silence was a step they shared,
        no victim's wait). With ``turn_rel``, also those whose silence was longer than the spike and
        at least ``turn_rel`` times their stream's recent gaps (a victim's turn: a wait and a re-prefill)."""
        def turn(q: Gap, rel: float) -> bool:
            return not q.stream_baseline or q.gap >= rel * q.stream_baseline

        return len({q.request_id for q in self._resumed_in(g, a, b)
                    if (q.t_start < g.t_start and turn(q, wait_rel))
                    or (turn_rel is not None and q.gap > g.gap and q.stream_baseline and turn(q, turn_rel))})

    def clean_gaps(self, g: Gap, cut: Cutoff, rel: float, want: int = 4, reach_s: float = 10.0,
                   walk: int = 64) -> list[float] | None:
        """The stream's own gaps before spike ``g`` during which no other request was between arrival
        and first token (as ``prefilling`` asks) and that were no spike of their own (under ``rel``
        times the stream's gaps before them): its decode-only steps, the last ``want`` of them within
        ``reach_s`` (and ``walk`` gaps). Only the stream's unbroken run of long gaps back from the spike
        is read (the index keeps long gaps only): a shorter gap before them ends the run, and so does
        the stream's first token. None when that run holds no such gap (the pace was never seen clean)."""
        # every other request's prompt window before the spike, once, by start, with the latest end
        # so far: each gap of the run then asks in O(log n) whether one overlapped it
        wins = sorted(self._prompt_windows(g, g.t_start, cut))
        starts = [w[0] for w in wins]
        reach = list(accumulate((w[1] for w in wins), max))
        rid = g.request_id
        lg = self.long
        t = g.t_start
        out: list[float] = []
        for _ in range(walk):
            if len(out) >= want or g.t_start - t > reach_s:
                break
            i = self._long_ending_from(t)
            prev = None
            while i < len(lg) and lg[i].t_end <= t:
                if lg[i].request_id == rid:
                    prev = lg[i]
                    break
                i += 1
            if prev is None:
                break  # a gap too short to be kept (the pace met half the target), or its first token
            if prev.stream_baseline and prev.gap < rel * prev.stream_baseline:
                k = bisect_left(starts, prev.t_end)  # windows that start before it ends (``outside``)
                if not (k and reach[k - 1] > prev.t_start):
                    out.append(prev.gap)
            t = prev.t_start
        return out or None

    def _prompt_windows(self, g: Gap, until: float, cut: Cutoff) -> Iterator[tuple[float, float]]:
        """Other requests (of the spike's engine) that arrived by ``until``: when each was in prefill or
        waiting for it. The engine's own times where it gave them (queued, or done, outside them),
        else from arrival to first token (to its end without one; still open: infinity)."""
        for t, r in self.arrivals:
            if t > until:
                break
            if r.id == g.request_id or (self.multi and r.engine != g.engine):
                continue
            sp = engine_prefill_of(r, cut)
            if sp is not None:
                yield sp
            else:
                end = r.first_t if r.first_t is not None else r.end_t
                yield t, end if end is not None else float("inf")

    def prefilling(self, g: Gap, a: float, b: float, cut: Cutoff) -> bool:
        """Another request (of the spike's engine) arrived by ``b`` and had no first token by ``a``:
        its prompt was still being prefilled (or waited for it) during [a, b]. (A chunked prefill
        of a long prompt between slow decode steps can take longer than its length at the measured
        rate, so a late first token does not tell a queued request from one in prefill.)"""
        return any(not outside(w, a, b) for w in self._prompt_windows(g, b, cut))

    def pending_through(self, g: Gap, a: float, b: float, cut: Cutoff | None = None) -> int:
        """Other requests (of the spike's engine) that arrived by ``a`` and had no first token by
        ``b``: in prefill, or queued, all through [a, b]. With ``cut``, not one the engine's own times
        (as known by then) place in prefill wholly outside [a, b]."""
        n = 0
        for t, r in self.arrivals:
            if t > a:
                break
            if r.id == g.request_id or (self.multi and r.engine != g.engine):
                continue
            if cut is not None:
                sp = engine_prefill_of(r, cut)
                if sp is not None and outside(sp, a, b):
                    continue
            if r.first_t is None:
                n += r.end_t is None or r.end_t > b
                continue
            n += r.first_t > b
        return n

    def prefilled_elsewhere(self, g: Gap, a: float, b: float, cut: Cutoff) -> tuple[int, int]:
        """First tokens (of the spike's engine) in (a, b] of prompts whose engine-timed prefill lies
        outside the spike (vLLM's per-request metrics): how many, and their prompt tokens."""
        ft = self.first_tokens
        i = bisect_right(ft, (a, "\uffff"), self.ft_head)
        n = tokens = 0
        while i < len(ft) and ft[i][0] <= b:
            r = ft[i][2]
            sp = engine_prefill_of(r, cut)
            p = prompt_of(r, cut)
            if (sp is not None and p and outside(sp, g.t_start, g.t_end)
                    and not (self.multi and ft[i][3] != g.engine)):
                n += 1
                tokens += p
            i += 1
        return n, tokens

    def first_tokens_in(self, g: Gap, a: float, b: float, cut: Cutoff) -> tuple[int, int, int]:
        """First tokens (of the spike's engine, its own stream's included) in [a, b]: how many, their
        prompt tokens, and how many of them came without a prompt length."""
        ft = self.first_tokens
        i = bisect_left(ft, (a,), self.ft_head)
        n = tokens = unsized = 0
        while i < len(ft) and ft[i][0] <= b:
            if not (self.multi and ft[i][3] != g.engine):
                n += 1
                p = prompt_of(ft[i][2], cut)
                if p:
                    tokens += p
                else:
                    unsized += 1
            i += 1
        return n, tokens, unsized

    def first_token_near(self, g: Gap, median_gap: float | None, opening_s: float, cut: Cutoff,
                         in_order: bool = False) -> tuple[str, int | None, int, int, float | None] | None:
        """Other requests' first tokens close to the spike's end: (the one with the longest prompt,
        its prompt tokens, the prompt tokens of all of them, how many). Prompts admitted in one
        engine step get their first tokens together, and the step's length is their sum. Close: within
        two of the stream's gaps (``median_gap``, the run's, for a stream without a baseline), and not
        delivered with the token that opened the stall (within ``opening_s`` of its start): those came
        out of the step before the stall, whose prefill was over when it began (a short stall right
        after a batch of prompts was admitted had their first tokens at its start); nor one delivered
        later after the stall's end than the stall was long: it came out of a later step (scored
        against real vLLM's own step log at targets of a few decode steps, such first tokens, 10-40 ms
        after a 10 ms stall, were almost all a prompt admitted just after it). Nor a prompt whose
        prefill the engine itself timed outside the stall (vLLM's per-request metrics): scored against
        real vLLM's own step log, such first tokens were almost never the stall's cause. Nor, on an
        engine that admits prompts in arrival order (``in_order``), one that a later request
        overtook (``overtaker``): its prefill was over before the stall began, and its first token
        was only delivered late (scored against real vLLM's own step log, the stragglers of a burst
        of arrivals whose first tokens came a step after the others' were all decode steps). Last: how
        much of the stall the engine spent on their prefills by its own times (the union of their
        engine-timed prefills within the stall), None where one of them is not engine-timed."""
        best: tuple[str, int | None] | None = None
        total = n = 0
        timed: list[tuple[float, float]] | None = []
        for rid, r in self._first_tokens_at_end(g, median_gap, opening_s):
            p = prompt_of(r, cut)
            sp = engine_prefill_of(r, cut)
            if ((sp is None or not outside(sp, g.t_start, g.t_end))
                    and not (in_order and self.overtaker(r, g, g.t_start + opening_s, cut))):
                total += p or 0
                n += 1
                if best is None or (p or 0) > (best[1] or 0):
                    best = (rid, p)
                if sp is None:
                    timed = None
                elif timed is not None:
                    timed.append((max(sp[0], g.t_start), min(sp[1], g.t_end)))
        return None if best is None else (best[0], best[1], total, n, None if timed is None else union_length(timed))

    def _first_tokens_at_end(self, g: Gap, median_gap: float | None, opening_s: float) -> Iterator[tuple[str, ReqState]]:
        """Other requests (of the spike's engine) whose first tokens came close to its end, as
        ``first_token_near`` reads close, before it asks where their prefills were."""
        base = g.stream_baseline or median_gap or 0.02
        delta = max(0.05, 2.0 * base)
        ft = self.first_tokens
        i = bisect_left(ft, (g.t_end - delta,), self.ft_head)
        while i < len(ft) and ft[i][0] <= g.t_end + delta:
            t, rid, r, e = ft[i]
            if (rid != g.request_id and t > g.t_start + opening_s and t <= g.t_end + g.gap
                    and not (self.multi and e != g.engine)):
                yield rid, r
            i += 1

    def late_first_token(self, g: Gap, median_gap: float | None, opening_s: float,
                         cut: Cutoff) -> tuple[str, str] | None:
        """A first token at the spike's end that a later request beat (``overtaker``), and that
        request: (its request, the overtaker's). What ``first_token_near`` leaves out on an engine
        that admits prompts in arrival order, for the answer to say why."""
        for rid, r in self._first_tokens_at_end(g, median_gap, opening_s):
            q = self.overtaker(r, g, g.t_start + opening_s, cut)
            if q is not None:
                return rid, q
        return None

    def overtaker(self, r: ReqState, g: Gap, by: float, cut: Cutoff) -> str | None:
        """A request (of the spike's engine) that arrived after ``r``, of the same class and with a
        prompt no shorter (either length unknown: ``r``'s only), had its first token by ``by``. On an
        engine that admits prompts in arrival order, ``r``'s prefill was then over by ``by`` too: a
        later prompt cannot finish first unless it is shorter (a long prompt's chunks leave room for
        a short one in the same step) or of a class a priority policy puts first."""
        ra = r.arrive_t
        if ra is None:
            return None
        pr = prompt_of(r, cut)
        for t, q in reversed(self.arrivals):
            if t <= ra:
                break
            if (q.first_t is not None and q.first_t <= by and q.cls == r.cls
                    and not (self.multi and q.engine != g.engine)
                    and (pr is None or (prompt_of(q, cut) or 0) >= pr)):
                return q.id
        return None

    def prune(self, keep_from: float, ended_before: float) -> None:
        """Drop evidence older than ``keep_from``; ended streams that ended before ``ended_before``."""
        lg = self.long
        h = self.long_head
        while h < len(lg) and lg[h].t_end < keep_from:
            h += 1
        if h > 4096 and h > len(lg) // 2:
            del lg[:h]
            h = 0
        self.long_head = h
        ft = self.first_tokens
        h = self.ft_head
        while h < len(ft) and ft[h][0] < keep_from:
            h += 1
        if h > 4096 and h > len(ft) // 2:
            del ft[:h]
            h = 0
        self.ft_head = h
        # by arrival: one request that never got a first token nor an end (its end lost, or dropped
        # from the per-stream store) must not hold every later arrival past the horizon
        arr = self.arrivals
        while arr and arr[0][0] < keep_from:
            arr.popleft()
        for ts, vs in [(self.active_t, self.active_v), *((e[1], e[2]) for e in self.eng_active.values())]:
            if len(ts) > 8192:
                i = bisect_left(ts, keep_from)
                if i > 4096:
                    del ts[: i - 1]
                    del vs[: i - 1]
        # a stream silent for the whole horizon without an end (a lost finish) is gone
        if self.live:
            stale = [k for k, r in self.live.items() if r.last_t is not None and r.last_t < keep_from]
            for k in stale:
                del self.live[k]
        # an ended stream matters only to spikes ending before it did; later spikes end after now
        ended = self.ended
        while ended and (ended[0].end_t or 0.0) < ended_before:
            ended.popleft()
