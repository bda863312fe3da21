"""Inter-token gaps: the gap distribution and spike candidates (per-stream state is in ``streams``,
what other streams did in ``stalls``).

A gap is the time between two consecutive token events of one request (the first gap starts at
the first token: time to first token is not an inter-token gap). A gap that ends in a cancel (the
client gave up while the stream was silent) is a gap too: a victim cancelled while preempted never
produces another token, and the engine may never count its preemption.

A long gap becomes a frozen ``Gap`` in one place, ``candidate``, from what the stream's recent
events say (its last gaps, the tokens of its last events, its stall-free gaps): the per-event path
(``GapTracker.token``) and the fast path's numpy batches (``GapTracker.add_batch``) both call it,
so a gap feature is written once. A spike's look-ahead (the events after it) is collected beside
it by a ``Pending`` and fixed into the ``Gap`` attribution reads once it settles.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvtop.analysis.asof import RunningMedian
from kvtop.analysis.stalls import StallIndex
from kvtop.analysis.streams import RECENT, ReqState, StreamStore, fold_end, fold_resync, fold_token

# Default ITL target = K_TARGET × the median of the first WARMUP gaps (documented in the README).
K_TARGET = 4.0
WARMUP_GAPS = 2000
# Gaps at least this fraction of the target are kept (for a while) to find streams that stalled together.
LONG_FRACTION = 0.5
# Look-ahead after a spike (both paths see the same): token events within BURST_S of its end are
# the chunk that ended it (a delivery stall ends with everything buffered at once, as one event or
# many within a millisecond); then up to LOOKAHEAD following gaps that end within LOOKAHEAD_S.
# LOOKAHEAD_S stays below the shortest settle time (2 s), so the live path, which judges a spike
# ``settle`` after its end, has seen all of it: that is the live path's bounded deferral.
BURST_S = 0.002
LOOKAHEAD = 3
LOOKAHEAD_S = 1.5


class LogHistogram:
    """Fixed-memory histogram of positive values on a log scale (1 µs .. ~3 h, 2 % bins)."""

    __slots__ = ("counts", "n", "_lo", "_scale")

    def __init__(self, lo: float = 1e-6, bins: int = 1200, ratio: float = 1.02):
        self.counts = [0] * bins
        self.n = 0
        self._lo = lo
        self._scale = 1.0 / math.log(ratio)

    def index(self, v: float) -> int:
        if v <= self._lo:
            return 0
        return min(len(self.counts) - 1, int(math.log(v / self._lo) * self._scale))

    def add(self, v: float, k: int = 1) -> None:
        # ``index``, inline: five of these a request on the analysis's serial path
        if v <= self._lo:
            i = 0
        else:
            i = int(math.log(v / self._lo) * self._scale)
            if i >= len(self.counts):
                i = len(self.counts) - 1
        self.counts[i] += k
        self.n += k

    def add_array(self, values: Any) -> None:
        """Add a numpy array of values at once (the fast path's sample of gaps); the bins of ``add``."""
        import numpy as np

        if not len(values):
            return
        lo = self._lo
        idx = np.clip((np.log(np.maximum(values, lo) / lo) * self._scale).astype(np.int64), 0, len(self.counts) - 1)
        idx[values <= lo] = 0
        # a count per bin (no sort of the values), added where there is one
        per = np.bincount(idx, minlength=len(self.counts))
        counts = self.counts
        for i in np.flatnonzero(per).tolist():
            counts[i] += int(per[i])
        self.n += len(values)

    def value_at(self, i: int) -> float:
        return self._lo * math.exp((i + 0.5) / self._scale)

    def quantile(self, q: float) -> float | None:
        if self.n == 0:
            return None
        target = q * self.n
        counts = self.counts
        acc = 0
        i = 0
        if target > 0:
            # whole blocks of bins that stay short of the target, summed in C (the running median
            # asks for this about once per hundred samples: half the time of a bin-by-bin walk)
            while i + 64 <= len(counts):
                s = sum(counts[i:i + 64])
                if acc + s >= target:
                    break
                acc += s
                i += 64
        for j in range(i, len(counts)):
            c = counts[j]
            acc += c
            if acc >= target and c:
                return self.value_at(j)
        return None


@dataclass(frozen=True, slots=True)
class Gap:
    """A long gap of one stream (a candidate spike), its features fixed when ``candidate`` builds it.

    ``burst_n`` and ``after`` are its look-ahead: as built they hold only the closing event; a spike
    collects the rest in its ``Pending`` and the Gap handed to attribution carries them."""

    request_id: str
    t_start: float
    t_end: float
    gap: float
    stream_baseline: float | None  # median of the stream's previous gaps
    tokens_before: int  # the stream's tokens up to the end of the gap (the closing event's included)
    ended_by: str  # "token" or "cancel"
    chunk_n: int  # tokens delivered by the event that ended the gap
    tokens_per_event: float  # the stream's usual chunk size before the gap
    calm_baseline: float | None  # median of the stream's previous stall-free gaps (within the target)
    engine: str | None  # the stream's engine (ReqState.engine): other streams are compared on it only
    fast_baseline: float | None  # the shortest of the stream's recent gaps (its decode-only pace, at most)
    gaps_before: int  # how many of the stream's recent gaps (at most RECENT) its baselines rest on
    # the most tokens one of the stream's recent events carried: one engine step's worth at most
    # (k + 1 with speculative decoding), unless the API server already merged steps before the gap
    step_n_max: int
    burst_n: int  # tokens delivered within BURST_S of the end (the closing event included)
    after: tuple[float, ...] = ()  # the stream's following gaps (look-ahead)
    finished: bool = False  # the stream finished with the burst that ended the gap (look-ahead)


def _median(v: Sequence[float]) -> float | None:
    return sorted(v)[len(v) // 2] if v else None


def candidate(rid: str, engine: str | None, t_start: float, t_end: float, gap: float, ended_by: str, chunk_n: int,
              tokens: int, events: int, recent: Sequence[float], recent_n: Iterable[int],
              calm: Sequence[float]) -> Gap:
    """The long gap ``t_start``..``t_end`` (``gap`` long) of stream ``rid``, with what the stream's
    recent events say about it. The one place a gap feature is computed (both ingestion paths).

    ``tokens`` and ``events``: the stream's tokens and token events so far, the closing event
    included when it is a token (``chunk_n`` tokens); ``recent``: its last RECENT gaps before this
    one, ``recent_n`` the tokens of the events that closed them, ``calm`` its last RECENT gaps
    within the target."""
    if ended_by == "token":
        tpe = (tokens - chunk_n) / (events - 1) if events > 1 else 1.0
    else:
        tpe = tokens / events if events else 1.0
    return Gap(rid, t_start, t_end, gap, _median(recent), tokens, ended_by, chunk_n, tpe, _median(calm), engine,
               min(recent) if recent else None, len(recent), max(recent_n, default=0), chunk_n)


def _stream_gap(r: ReqState, lt: float, t: float, g: float, ended_by: str, chunk_n: int) -> Gap:
    """A long gap of stream ``r`` from its state before the closing event (the per-event path)."""
    return candidate(r.id, r.engine, lt, t, g, ended_by, chunk_n, r.tokens, r.events, r.recent, r.recent_n, r.calm)


@dataclass(slots=True)
class Pending:
    """A spike waiting for attribution, and its look-ahead as the stream's next events arrive."""

    gap: Gap
    burst_n: int = 0
    after: list[float] = field(default_factory=list)
    finished: bool = False

    def __post_init__(self) -> None:
        self.burst_n = self.gap.chunk_n

    def look(self, t: float, k: int, g: float) -> bool:
        """One token event after the spike (``k`` tokens, ``g`` its gap); True when the look-ahead is complete."""
        end = self.gap.t_end
        if t - end <= BURST_S:
            self.burst_n += k
            return False
        if t - end > LOOKAHEAD_S:
            return True
        self.after.append(g)
        return len(self.after) >= LOOKAHEAD

    def finish(self, t: float) -> None:
        """The stream finished at ``t``: with the burst that ended the spike, if within ``BURST_S``."""
        if not self.after and t - self.gap.t_end <= BURST_S:
            self.finished = True

    def settled(self) -> Gap:
        """The spike with its look-ahead, as attribution reads it."""
        return replace(self.gap, burst_n=self.burst_n, after=tuple(self.after), finished=self.finished)


def _batch_look(watch: list[Pending], spikes: list[tuple[int, Pending]], t_s: Any, n_s: Any, gaps: Any, g0: int,
                g1: int) -> list[Pending]:
    """The look-ahead of a stream's spikes over one batch of its events (sorted positions g0..g1-1),
    as ``token`` collects it event by event; returns the spikes still watching at the batch's end."""
    j = g0
    k = 0
    while True:
        nxt = spikes[k][0] if k < len(spikes) else g1 - 1
        while watch and j <= nxt:
            t, n, g = float(t_s[j]), int(n_s[j]), float(gaps[j])
            watch = [w for w in watch if not w.look(t, n, g)]
            j += 1
        if k >= len(spikes):
            return watch
        i, sp = spikes[k]
        watch.append(sp)
        j = i + 1
        k += 1


def _windows(lo: Any, hi: Any) -> tuple[Any, Any]:
    """The positions lo[i]..hi[i]-1 of every window, back to back, and where each window starts
    among them (one more entry: the end)."""
    import numpy as np

    lens = np.maximum(hi - lo, 0)
    at = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=at[1:])
    return np.repeat(lo - at[:-1], lens) + np.arange(int(at[-1])), at


class GapTracker:
    """Owns the per-stream gap state: request states, the gap distribution and spikes waiting for
    attribution; fills the stall index (``stalls``: long gaps, first tokens, active streams) that the
    evidence builder asks about other streams around a spike.

    Both ingestion paths go through it: ``token`` one event at a time, ``add_batch`` a block of
    token events parsed by the fast path (same results).
    """

    def __init__(self, itl_target_s: float | None = None, k: float = K_TARGET, max_requests: int | None = None):
        self.itl_target_s = itl_target_s
        self.target_source: str | None = "given" if itl_target_s else None
        self.k = k
        self.max_requests = max_requests
        self.hist = LogHistogram()  # every 8th gap after warm-up (a sample for the median)
        self.n_gaps = 0
        self.warm: list[Gap] = []  # every gap until the target is known
        self.pending: deque[Pending] = deque()  # spikes by t_end, collecting their look-ahead
        self.stalls = StallIndex()
        # a stream dropped from the store (capped) is no longer live for the co-stall search
        self.streams = StreamStore(max_requests, on_drop=self.stalls.forget)
        self.reqs = self.streams.by_id  # the hot paths look streams up here directly
        # the run's median gap as of each refresh: a spike reads it as of its cut-off (``asof``)
        self.median: RunningMedian[LogHistogram] = RunningMedian(self.hist)
        self._batch_marks: tuple[int, int] | None = None

    # ---- per-stream state --------------------------------------------------------------------
    def req(self, rid: str) -> ReqState:
        return self.streams.req(rid)

    def token(self, rid: str, t: float, n: int | None = None) -> None:
        """Hot path: one token event (``n`` tokens delivered at once)."""
        r = self.reqs.get(rid) or self.req(rid)
        k = n if n else 1
        lt = fold_token(r, t, k)
        if lt is not None:
            g = t - lt
            if r.watch:
                r.watch = [w for w in r.watch if not w.look(t, k, g)]
            tgt = self.itl_target_s
            if tgt is None or g >= LONG_FRACTION * tgt:
                self.gap(r, lt, t, g, "token", k)
            else:
                # ``gap`` for the common case (target known, a short gap), inline: the live path's
                # cost per token is mostly Python calls
                ng = self.n_gaps = self.n_gaps + 1
                if not ng & 7:
                    self.hist.add(g)
                    if self.hist.n >= self.median.next_n:
                        self.median.added(t)
                r.recent.append(g)
                r.calm.append(g)
            r.recent_n.append(k)

    def resync(self, r: ReqState, t: float, n: int | None = None) -> None:
        """Tokens after a hole in the observed bytes: counted, and the stream's clock moves on
        without a gap (the silence spans lost data, not a stall)."""
        fold_resync(r, t, n if n else 1)

    def gap(self, r: ReqState, lt: float, t: float, g: float, ended_by: str, chunk_n: int = 1) -> None:
        self.n_gaps += 1
        tgt = self.itl_target_s
        if tgt is None:
            gp = _stream_gap(r, lt, t, g, ended_by, chunk_n)
            self.warm.append(gp)
            if len(self.warm) >= WARMUP_GAPS:
                self.derive_target()
        else:
            if not self.n_gaps & 7:
                self.hist.add(g)
                if self.hist.n >= self.median.next_n:
                    self.median.added(t)
            if g >= LONG_FRACTION * tgt:
                p = self._keep(_stream_gap(r, lt, t, g, ended_by, chunk_n), tgt)
                if p is not None and ended_by == "token":
                    r.watch.append(p)
        if ended_by == "token":
            r.recent.append(g)
            if tgt is None or g <= tgt:
                r.calm.append(g)

    def derive_target(self) -> None:
        vals = sorted(x.gap for x in self.warm)
        med = vals[len(vals) // 2] if vals else None
        for x in self.warm:
            self.hist.add(x.gap)
        if self.warm:
            self.median.added(self.warm[-1].t_end)
        if med:
            self.itl_target_s = self.k * med
            self.target_source = f"derived: {self.k:g} x {med * 1e3:.1f} ms, the median gap of the first {len(vals)} gaps"
        warm, self.warm = self.warm, []
        tgt = self.itl_target_s
        if tgt is None:
            return
        for gp in warm:
            if gp.gap >= LONG_FRACTION * tgt:
                self._keep(gp, tgt)

    def _keep(self, gp: Gap, tgt: float) -> Pending | None:
        """A long gap (at least LONG_FRACTION of the target): kept for the co-stall search, and a
        spike (over the target) waits for attribution; returns its ``Pending``."""
        self.stalls.add_long(gp, in_order=self._batch_marks is None)
        if gp.gap > tgt:
            p = Pending(gp)
            self.pending.append(p)
            return p
        return None

    def set_engine(self, r: ReqState, engine: str) -> None:
        """Name the engine that serves ``r`` (before its first token: the active counts are per engine)."""
        if r.engine is None and r.first_t is None:
            r.engine = engine
            self.stalls.engines_named()

    def first_token(self, r: ReqState, t: float) -> bool:
        """Record a stream's first token; False when it already had one."""
        if r.first_t is not None:
            return False
        r.first_t = t
        self.stalls.first_token(r, t)
        return True

    def end(self, r: ReqState, t: float, how: str) -> bool:
        """A stream ended (finish / cancel / error); False when it had ended already."""
        if not fold_end(r, t, how):
            return False
        if r.first_t is not None:
            self.stalls.stream_ended(r, t)
        if how == "finish":
            for w in r.watch:
                w.finish(t)
        if how == "cancel" and r.last_t is not None and t - r.last_t > 0:
            self.gap(r, r.last_t, t, t - r.last_t, "cancel")
        return True

    # ---- the fast path's batch API -----------------------------------------------------------
    def begin_batch(self) -> None:
        self._batch_marks = (len(self.stalls.long), len(self.pending))

    def end_batch(self) -> None:
        """Gaps from a batch and from the per-record events around it interleave in time: restore
        t_end order of the long gaps and the pending spikes added since ``begin_batch``."""
        if self._batch_marks is None:
            return
        l0, p0 = self._batch_marks
        self._batch_marks = None
        self.stalls.sort_long_from(l0)
        if len(self.pending) - p0 > 1:
            tail = [self.pending.pop() for _ in range(len(self.pending) - p0)]
            tail.sort(key=lambda p: p.gap.t_end)
            self.pending.extend(tail)

    def add_batch(self, ids: list[str], codes: Any, ts: Any, ns: Any, ft: Any) -> None:
        """Gaps for a block of token events in file order, as ``token`` would compute them one by one.

        ``ids`` are the distinct request ids of the block, ``codes`` each event's index into them,
        ``ts`` times, ``ns`` tokens per event and ``ft`` whether it is a first_token event (its
        bookkeeping follows through the per-record path). Needs a target (``itl_target_s``)."""
        import numpy as np

        tgt = self.itl_target_s
        assert tgt is not None, "add_batch needs the ITL target (derived from the first gaps)"
        # few streams per block: a 16-bit key gets numpy's radix sort instead of a merge sort
        order = np.argsort(codes.astype(np.uint16) if len(ids) <= 1 << 16 else codes, kind="stable")
        # the sorted codes are each code repeated its count of times (no gather of every code)
        per = np.bincount(codes, minlength=len(ids))
        c_s = np.repeat(np.arange(len(ids)), per)
        t_s = ts[order]
        n_s = ns[order]
        m = len(c_s)
        gend = np.cumsum(per)[per > 0]
        gstart = np.empty_like(gend)
        gstart[:1] = 0
        gstart[1:] = gend[:-1]
        by_id = self.reqs
        reqs = [by_id.get(rid) or self.req(rid) for rid in ids]
        last = np.array([math.nan if r.last_t is None else r.last_t for r in reqs], dtype=np.float64)
        tok0 = np.array([r.tokens for r in reqs], dtype=np.int64)
        ev0 = [r.events for r in reqs]
        prev = np.empty(m)
        prev[1:] = t_s[:-1]
        prev[gstart] = last[c_s[gstart]]
        gaps = t_s - prev
        valid = ~np.isnan(gaps)
        # tokens counted up to and including each event (what ``token`` records on a long gap)
        cum = np.cumsum(n_s)
        base = np.repeat(cum[gstart] - n_s[gstart], gend - gstart)
        tokens_at = tok0[c_s] + (cum - base)
        nvalid = int(np.count_nonzero(valid))
        # the median sample: every 8th gap in file order, as the per-event path takes it
        if nvalid:
            gfile = np.empty(m)
            gfile[order] = gaps  # back in file order
            # the valid gaps numbered on from n_gaps + 1: those numbered a multiple of 8
            at = np.flatnonzero(~np.isnan(gfile))[-(self.n_gaps + 1) % 8::8]
            self._sample(gfile[at], ts[at])
        self.n_gaps += nvalid
        long_thr = LONG_FRACTION * tgt
        gz = np.where(valid, gaps, -np.inf)  # a stream's first event has no gap
        sf_pos = np.flatnonzero(valid & (gz <= tgt))  # stall-free gaps: the baseline's sample
        longs = np.flatnonzero(gz >= long_thr).tolist()
        gmax = np.maximum.reduceat(gz, gstart)
        tsum = np.add.reduceat(n_s, gstart)
        spikes: dict[int, list[tuple[int, Pending]]] = {}  # group -> (sorted index, spike)
        if longs:
            grp = np.searchsorted(gstart, longs, side="right") - 1
            # stall-free gaps of the same stream before each long gap: positions lo_ks[k]..hi_ks[k] of sf_pos
            lo_ks = np.searchsorted(sf_pos, gstart[grp]).tolist()
            hi_ks = np.searchsorted(sf_pos, longs).tolist()
            for li, (i, gi) in enumerate(zip(longs, grp.tolist(), strict=True)):
                r = reqs[int(c_s[i])]
                g0 = int(gstart[gi])
                lo_k, hi_k = lo_ks[li], hi_ks[li]
                # the stream's windows as ``token`` would hold them before event i: this batch's
                # part of them, topped up from the stream's state before the batch
                cw = gaps[sf_pos[max(lo_k, hi_k - RECENT):hi_k]].tolist()
                if len(cw) < RECENT:
                    cw = list(r.calm)[-(RECENT - len(cw)):] + cw if r.calm else cw
                lo = max(g0, i - RECENT)
                w = [x for x in gaps[lo:i].tolist() if not math.isnan(x)]
                if len(w) < RECENT:
                    w = list(r.recent)[-(RECENT - len(w)):] + w if r.recent else w
                wn = [int(x) for x, v in zip(n_s[lo:i].tolist(), valid[lo:i].tolist(), strict=True) if v]
                if len(wn) < RECENT and r.recent_n:
                    wn = list(r.recent_n)[-(RECENT - len(wn)):] + wn
                gv = float(gaps[i])
                te = float(t_s[i])
                events = ev0[int(c_s[i])] + i - g0 + 1  # the stream's token events up to this one
                p = self._keep(candidate(r.id, r.engine, te - gv, te, gv, "token", int(n_s[i]), int(tokens_at[i]),
                                         events, w[-RECENT:], wn[-RECENT:], cw[-RECENT:]), tgt)
                if p is not None:
                    spikes.setdefault(gi, []).append((i, p))
        # each stream's state after the batch: its last RECENT gaps (the only one that can be
        # missing, NaN, is a stream's first), their tokens and its last RECENT stall-free gaps,
        # gathered for all streams at once and converted to Python numbers once per batch
        lo = np.maximum(gstart, gend - RECENT)
        lo += ~valid[lo]
        tail, tail_at = _windows(lo, gend)
        tail_g, tail_n = gaps[tail].tolist(), n_s[tail].tolist()
        sf_hi = np.searchsorted(sf_pos, gend)
        calm, calm_at = _windows(np.maximum(np.searchsorted(sf_pos, gstart), sf_hi - RECENT), sf_hi)
        calm_g = gaps[sf_pos[calm]].tolist()
        for gi, (g0, g1, u, lt, ts_, mg, a, b, ca, cb) in enumerate(zip(
                gstart.tolist(), gend.tolist(), c_s[gstart].tolist(), t_s[gend - 1].tolist(), tsum.tolist(),
                gmax.tolist(), tail_at[:-1].tolist(), tail_at[1:].tolist(), calm_at[:-1].tolist(),
                calm_at[1:].tolist(), strict=True)):
            r = reqs[u]
            if r.watch or gi in spikes:
                r.watch = _batch_look(r.watch, spikes.get(gi, []), t_s, n_s, gaps, g0, g1)
            r.last_t = lt
            r.events += g1 - g0
            r.tokens += ts_
            if mg > r.max_gap:
                r.max_gap = mg
            r.recent.extend(tail_g[a:b])
            r.recent_n.extend(tail_n[a:b])
            r.calm.extend(calm_g[ca:cb])

    def _sample(self, g: Any, t: Any) -> None:
        """Gaps of the median's sample (file order) closed at times ``t``: added as ``token`` adds
        them one by one, the median refreshed at the same sample sizes."""
        i = 0
        m = self.median
        while i < len(g):
            j = i + max(1, m.next_n - self.hist.n)
            if j > len(g):
                self.hist.add_array(g[i:])
                return
            self.hist.add_array(g[i:j])
            m.added(float(t[j - 1]))
            i = j

    # ---- queries -----------------------------------------------------------------------------
    def median_gap(self, t: float = math.inf) -> float | None:
        """The run's median gap as known at trace time ``t`` (by default: now)."""
        if self.hist.n:
            return self.median.at(t)
        if self.warm:
            vals = sorted(x.gap for x in self.warm)
            return vals[len(vals) // 2]
        return None

    def take_ready(self, now: float, settle: float, hold_after: float | None = None, hold_s: float = 0.0) -> list[Gap]:
        """Pending spikes whose evidence window (``settle`` after their end) has passed, in a fixed
        order (t_end, request id) so counter units are claimed the same way whichever path
        produced them. ``hold_after``: spikes ending after it wait up to ``hold_s`` past their end
        for evidence still to come (a prefill the engine reports when its request finishes)."""
        ready = []
        while self.pending and self.pending[0].gap.t_end + settle <= now:
            t_end = self.pending[0].gap.t_end
            if hold_after is not None and t_end > hold_after and now < t_end + hold_s:
                break
            ready.append(self.pending.popleft().settled())
        ready.sort(key=lambda g: (g.t_end, g.request_id))
        return ready

    def take_all(self) -> list[Gap]:
        ready = sorted((p.settled() for p in self.pending), key=lambda g: (g.t_end, g.request_id))
        self.pending.clear()
        return ready
