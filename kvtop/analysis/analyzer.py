"""The analysis pipeline over a record stream: gaps -> spikes -> attribution -> inputs -> verdict.

One ``Analyzer`` serves both uses: ``kvtop analyze`` streams a trace through it and calls
``finish()``; the live console feeds it record by record and calls ``tick(now)`` (via
``LiveAnalyzer``). A spike is attributed once the evidence window after it has passed
(``settle`` seconds: the engine is scraped about once a second and vLLM counts a preemption only
when the victim resumes), so both paths see the same evidence and give the same answers.
Memory is bounded: evidence older than ``horizon_s`` is dropped; per-request state is capped.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from typing import Any

from kvtop.analysis import gaps as G
from kvtop.analysis.attribution import REL_SLOW, Context, EngineTimeline, classify
from kvtop.analysis.gaps import Gap, LogHistogram, ReqState

CAUSES = ("preemption", "prefill_interference", "slow_decode", "unknown")


def header_itl_target(h: dict[str, Any]) -> float | None:
    """The ITL target a trace was recorded (or simulated) against, from its header; None if absent."""
    tgt = h.get("itl_target_s")
    if tgt is None and isinstance(h.get("sim"), dict):
        tgt = h["sim"].get("itl_target_s")
    if isinstance(tgt, (int, float)) and not isinstance(tgt, bool) and tgt > 0 and tgt == tgt and tgt != float("inf"):
        return float(tgt)
    return None


class Analyzer:
    def __init__(self, itl_target_s: float | None = None, k: float = G.K_TARGET, preempts: bool = True,
                 max_requests: int | None = None, keep_spikes: int = 10_000, horizon_s: float = 120.0,
                 use_request_preempts: bool = True):
        self.itl_target_s = itl_target_s
        self.target_source = "given" if itl_target_s else None
        self.k = k
        self.preempts = preempts
        self.max_requests = max_requests
        self.keep_spikes = keep_spikes
        self.horizon_s = horizon_s
        self.use_request_preempts = use_request_preempts
        self.header: dict[str, Any] = {}
        self.reqs: OrderedDict[str, ReqState] = OrderedDict()
        self.timeline = EngineTimeline(horizon_s=max(600.0, horizon_s))
        self.hist = LogHistogram()  # every 8th gap after warm-up (a sample for the median)
        self.n_gaps = 0
        self._warm: list[Gap] = []  # every gap until the target is known
        self._long: list[Gap] = []  # long gaps by t_end (co-stall search)
        self._long_max = 0.0  # the longest of them: no gap ending later than a + it can reach back to a
        self._long_head = 0
        self._pending: deque[Gap] = deque()
        self.spikes: deque[Gap] = deque(maxlen=keep_spikes)
        self.cause_counts = dict.fromkeys(CAUSES, 0)
        self.cause_conf = dict.fromkeys(CAUSES, 0.0)
        self.cause_seconds = dict.fromkeys(CAUSES, 0.0)  # stall time per cause (kvtop agent's counters)
        self.n_spikes = 0
        self.n_spikes_dropped = 0
        self._first_tokens: list[tuple[float, str, int | None]] = []
        self._ft_head = 0
        self._active = 0
        # streams between first token and end, and those that ended lately: the co-stall search
        # needs streams whose silence had not ended when a spike is judged
        self._live: dict[str, ReqState] = {}
        self._ended: deque[ReqState] = deque()
        self._active_t: list[float] = []
        self._active_v: list[int] = []
        self.t0: float | None = None
        self.now = 0.0
        self.records = 0
        self.token_records = 0
        self._scrapes: deque[tuple] = deque(maxlen=50_000)
        self._median_cache: tuple[int, float | None] | None = None
        self._hold = False  # the fast path holds attribution until a whole chunk is in
        # accumulators for measured inputs (kvtop/analysis/inputs.py reads them)
        self.acc: dict[str, Any] = {
            "finished": 0, "cancelled": 0, "errors": 0, "prompt_hist": LogHistogram(lo=1.0, bins=800),
            "prompt_sum": 0.0, "prompt_n": 0, "output_hist": LogHistogram(lo=1.0, bins=800), "output_sum": 0.0,
            "output_n": 0, "ttft_rate_hist": LogHistogram(lo=1.0, bins=1000), "preempted_ids": set(),
            "preempted_cancelled": 0, "preempted_ended": 0, "S_pre_sum": 0.0, "S_pre_n": 0, "prefill_a": [],
            "engine_first": {}, "engine_last": {}, "running_sum": 0.0, "running_n": 0, "kv_max": None,
            "host": None, "gpu_pcie_max": 0.0,
        }

    # ---- setup ----------------------------------------------------------------------------
    def set_header(self, h: dict[str, Any]) -> None:
        self.header = h
        if self.itl_target_s is None:
            tgt = header_itl_target(h)
            if tgt is not None:
                self.itl_target_s = tgt
                self.target_source = "trace header"

    @property
    def settle(self) -> float:
        return max(2.0, 2.0 * self.timeline.scrape_interval + 0.5)

    # ---- ingest ---------------------------------------------------------------------------
    def feed_dict(self, d: dict[str, Any]) -> None:
        kind = d.get("kind")
        t = d.get("t")
        if not isinstance(t, (int, float)):
            return
        self.records += 1
        if kind == "request":
            ev = d.get("event")
            if ev == "token":
                self.token(d.get("id"), t, d.get("n"))
            else:
                self.request_event(t, str(d.get("id")), ev, d.get("n"), d.get("prompt_tokens"), d.get("class"),
                                   d.get("completion_tokens"))
        elif kind == "engine":
            self.engine(d)
        elif kind == "host":
            self.acc["host"] = d
            self._advance(t)
        elif kind == "gpu":
            tx = (d.get("pcie_tx_bytes_per_s") or 0) + (d.get("pcie_rx_bytes_per_s") or 0)
            self.acc["gpu_pcie_max"] = max(self.acc["gpu_pcie_max"], tx)
            self._advance(t)
        # "truth" records are ground truth for scoring only: never read here.

    def _advance(self, t: float) -> None:
        if self.t0 is None:
            self.t0 = t
        if t > self.now:
            self.now = t
        if self._pending and not self._hold and self._pending[0].t_end + self.settle <= t:
            self.tick(t)

    def _req(self, rid: str) -> ReqState:
        r = self.reqs.get(rid)
        if r is None:
            r = self.reqs[rid] = ReqState(rid)
            if self.max_requests is not None and len(self.reqs) > self.max_requests:
                self._evict()
        return r

    def _evict(self) -> None:
        for k, v in self.reqs.items():
            if v.end_t is not None:
                del self.reqs[k]
                return
        k, _ = self.reqs.popitem(last=False)
        self._live.pop(k, None)

    def token(self, rid: Any, t: float, n: Any = None) -> None:
        """Hot path: one token event."""
        self.token_records += 1
        rid = str(rid)
        r = self.reqs.get(rid) or self._req(rid)
        lt = r.last_t
        r.last_t = t
        r.tokens += n if n else 1
        if t > self.now:
            self.now = t
        if lt is None:
            return
        g = t - lt
        self._gap(r, lt, t, g, "token")
        if self._pending and not self._hold and self._pending[0].t_end + self.settle <= t:
            self.tick(t)

    def _gap(self, r: ReqState, lt: float, t: float, g: float, ended_by: str) -> None:
        self.n_gaps += 1
        if g > r.max_gap:
            r.max_gap = g
        tgt = self.itl_target_s
        if tgt is None:
            self._warm.append(Gap(r.id, lt, t, g, r.baseline_gap(), r.tokens, ended_by))
            if len(self._warm) >= G.WARMUP_GAPS:
                self._derive_target()
        else:
            if not self.n_gaps & 7:
                self.hist.add(g)
            if g >= G.LONG_FRACTION * tgt:
                gp = Gap(r.id, lt, t, g, r.baseline_gap(), r.tokens, ended_by)
                self._long.append(gp)
                if g > self._long_max:
                    self._long_max = g
                if g > tgt:
                    self._pending.append(gp)
        if ended_by == "token":
            r.recent.append(g)

    def _derive_target(self) -> None:
        vals = sorted(x.gap for x in self._warm)
        med = vals[len(vals) // 2] if vals else None
        for x in self._warm:
            self.hist.add(x.gap)
        if med:
            self.itl_target_s = self.k * med
            self.target_source = f"derived: {self.k:g} x median gap of the first {len(vals)} gaps"
        warm, self._warm = self._warm, []
        tgt = self.itl_target_s
        if tgt is None:
            return
        for gp in warm:
            if gp.gap >= G.LONG_FRACTION * tgt:
                self._long.append(gp)
                self._long_max = max(self._long_max, gp.gap)
                if gp.gap > tgt:
                    self._pending.append(gp)

    def request_event(self, t: float, rid: str, ev: Any, n: Any = None, prompt: Any = None, cls: Any = None,
                      completion: Any = None, tokens_done: bool = False) -> None:
        r = self._req(rid)
        acc = self.acc
        if ev == "arrive":
            r.arrive_t = t
            if prompt is not None:
                r.prompt_tokens = int(prompt)
                acc["prompt_hist"].add(max(1.0, float(prompt)))
                acc["prompt_sum"] += prompt
                acc["prompt_n"] += 1
            r.cls = cls
        elif ev == "first_token":
            if prompt is not None and r.prompt_tokens is None:
                r.prompt_tokens = int(prompt)
            if r.first_t is None:
                r.first_t = t
                self._first_tokens.append((t, rid, r.prompt_tokens))
                self._set_active(t, +1)
                if r.end_t is None:
                    self._live[rid] = r
                if r.arrive_t is not None and r.prompt_tokens and r.prompt_tokens >= 256 and t > r.arrive_t:
                    acc["ttft_rate_hist"].add(r.prompt_tokens / (t - r.arrive_t))
            if not tokens_done:  # the fast path has already counted it and its gap
                lt = r.last_t
                r.last_t = t
                r.tokens += n if n else 1
                if lt is not None:  # a second "first_token" (resumed streams in some proxies): still a gap
                    self._gap(r, lt, t, t - lt, "token")
        elif ev == "resync":
            # Tokens seen after bytes of this stream were lost: counted, but the time since the
            # previous token spans the hole and is never a gap (nor a stall).
            r.last_t = t
            r.tokens += n if n else 1
            if t > self.now:
                self.now = t
        elif ev in ("finish", "cancel", "error"):
            if r.end_t is None:
                r.end_t = t
                r.ended_by = ev
                if r.first_t is not None:
                    self._set_active(t, -1)
                    if self._live.pop(rid, None) is not None:
                        self._ended.append(r)
                out = completion if completion is not None else r.tokens
                if ev == "finish":
                    acc["finished"] += 1
                    if out:
                        acc["output_hist"].add(max(1.0, float(out)))
                        acc["output_sum"] += out
                        acc["output_n"] += 1
                elif ev == "cancel":
                    acc["cancelled"] += 1
                    if r.last_t is not None and t - r.last_t > 0:
                        self._gap(r, r.last_t, t, t - r.last_t, "cancel")
                else:
                    acc["errors"] += 1
        elif ev == "preempt":
            if self.use_request_preempts:
                r.engine_preempts.append(t)
        self._advance(t)

    def _set_active(self, t: float, d: int) -> None:
        self._active += d
        if self._active_t and self._active_t[-1] == t:
            self._active_v[-1] = self._active
        else:
            self._active_t.append(t)
            self._active_v.append(self._active)

    def engine(self, d: dict[str, Any]) -> None:
        t = d["t"]
        if d.get("up") is False:
            self._advance(t)
            return
        key = (d.get("url"), d.get("engine"))
        self.timeline.add(t, key, d.get("running"), d.get("waiting"), d.get("kv_usage"), d.get("preemptions_total"),
                          d.get("prompt_tokens_total"))
        acc = self.acc
        if key not in acc["engine_first"]:
            acc["engine_first"][key] = d
        acc["engine_last"][key] = d
        if d.get("running") is not None:
            acc["running_sum"] += d["running"]
            acc["running_n"] += 1
        kv = d.get("kv_usage")
        if kv is not None:
            acc["kv_max"] = kv if acc["kv_max"] is None else max(acc["kv_max"], kv)
        itl = d.get("itl")
        if isinstance(itl, dict) and not self.token_records:
            # kept only while no per-request token timings exist: the aggregate fallback needs them
            self._scrapes.append((t, key, itl, d.get("preemptions_total"), d.get("prompt_tokens_total"),
                                  d.get("running"), kv))
        self._advance(t)

    # ---- attribution ----------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """Attribute every pending spike whose evidence window has passed."""
        now = self.now if now is None else now
        settle = self.settle
        ready = []
        while self._pending and self._pending[0].t_end + settle <= now:
            ready.append(self._pending.popleft())
        # spikes ending in the same engine step: a fixed order, so counter units go the same way
        # whichever path (streaming or fast) produced them
        ready.sort(key=lambda g: (g.t_end, g.request_id))
        for g in ready:
            self._attribute(g)
        self._prune(now)

    def finish(self) -> None:
        if self.itl_target_s is None and self._warm:
            self._derive_target()
        ready = sorted(self._pending, key=lambda g: (g.t_end, g.request_id))
        self._pending.clear()
        for g in ready:
            self._attribute(g)

    def _prune(self, now: float) -> None:
        keep_from = now - self.horizon_s
        if self._pending:
            keep_from = min(keep_from, self._pending[0].t_start)
        lg = self._long
        h = self._long_head
        while h < len(lg) and lg[h].t_end < keep_from:
            h += 1
        if h > 4096 and h > len(lg) // 2:
            del lg[:h]
            h = 0
        self._long_head = h
        ft = self._first_tokens
        h = self._ft_head
        while h < len(ft) and ft[h][0] < keep_from:
            h += 1
        if h > 4096 and h > len(ft) // 2:
            del ft[:h]
            h = 0
        self._ft_head = h
        if len(self._active_t) > 8192:
            i = bisect_left(self._active_t, keep_from)
            if i > 4096:
                del self._active_t[: i - 1]
                del self._active_v[: i - 1]
        self.timeline.prune(keep_from - 60.0)
        # a stream silent for the whole horizon without an end (a lost finish) is gone
        if self._live:
            stale = [k for k, r in self._live.items() if r.last_t is not None and r.last_t < keep_from]
            for k in stale:
                del self._live[k]
        # an ended stream matters only to spikes ending before it did; later spikes end after now
        ended = self._ended
        drop_before = (self._pending[0].t_start if self._pending else now) - self.settle - 5.0
        while ended and (ended[0].end_t or 0.0) < drop_before:
            ended.popleft()

    def _active_at(self, t: float) -> int | None:
        i = bisect_right(self._active_t, t) - 1
        return self._active_v[i] if i >= 0 else None

    def _departures(self, a: float, b: float) -> int:
        """Streams that ended in [a, b] (a step down of the active count; several at one instant merge)."""
        ts, vs = self._active_t, self._active_v
        i = bisect_left(ts, a)
        prev = vs[i - 1] if i > 0 else 0
        n = 0
        while i < len(ts) and ts[i] <= b:
            if vs[i] < prev:
                n += prev - vs[i]
            prev = vs[i]
            i += 1
        return n

    def _co_stalled(self, g: Gap, enough: int | None = None) -> tuple[int, float | None, int]:
        """Other streams silent over at least half of the spike, the median of their silences, and
        how many of them fell silent with it (up to a second, or half its length, before it began)
        rather than long before (streams preempted earlier and still waiting).

        A silence counts as seen when the spike is judged (``settle`` after its end): closed gaps up
        to then, and streams still silent then (preempted streams often resume much later). Lengths
        are cut at that moment, so the batch path, which judges later, gets the same answer."""
        L = g.t_end - g.t_start
        half = 0.5 * L
        cap = g.t_end + self.settle
        lg = self._long
        lo = self._long_head
        hi = len(lg)
        a_end = g.t_start + half
        while lo < hi:  # bisect on t_end: candidates end at or after a + L/2
            mid = (lo + hi) // 2
            if lg[mid].t_end < a_end:
                lo = mid + 1
            else:
                hi = mid
        seen = set()
        lens = []
        fresh_from = g.t_start - min(half, 1.0)
        fresh = 0
        reach = a_end + self._long_max  # a gap ending later began after a + L/2: it cannot cover half
        for i in range(lo, len(lg)):
            q = lg[i]
            if q.t_end > reach:
                break
            if q.request_id == g.request_id or q.request_id in seen:
                continue
            ov = min(q.t_end, g.t_end) - max(q.t_start, g.t_start)
            if ov >= half:
                seen.add(q.request_id)
                lens.append(min(q.t_end, cap) - q.t_start)
                fresh += q.t_start >= fresh_from
                if enough is not None and len(seen) >= enough:
                    break  # every other active stream already found stalled
        if enough is None or len(seen) < enough:
            for group in (self._live.values(), self._ended):
                for r in group:
                    lt = r.last_t
                    if lt is None or lt > a_end or r.id == g.request_id or r.id in seen:
                        continue
                    # silent from its last token until now, or until it ended (a stream that
                    # errors out mid-stall without a token streamed nothing through it either)
                    end = cap if r.end_t is None else min(r.end_t, cap)
                    if min(end, g.t_end) - max(lt, g.t_start) < half:
                        continue
                    seen.add(r.id)
                    lens.append(end - lt)
                    fresh += lt >= fresh_from
        if not lens:
            return 0, None, 0
        lens.sort()
        return len(seen), lens[len(lens) // 2], fresh

    def _first_token_near(self, g: Gap) -> tuple[str, int | None] | None:
        base = g.stream_baseline or self.median_gap() or 0.02
        delta = max(0.05, 2.0 * base)
        ft = self._first_tokens
        i = bisect_left(ft, (g.t_end - delta,), self._ft_head)
        best = None
        while i < len(ft) and ft[i][0] <= g.t_end + delta:
            t, rid, p = ft[i]
            if rid != g.request_id and t > g.t_start and (best is None or (p or 0) > (best[1] or 0)):
                best = (rid, p)
            i += 1
        return best

    def _attribute(self, g: Gap) -> None:
        r = self.reqs.get(g.request_id)
        engine_pre = bool(r and any(g.t_start - 1e-6 <= t <= g.t_end + 1e-6 for t in r.engine_preempts))
        mid = 0.5 * (g.t_start + g.t_end)
        act = self._active_at(mid)
        base = g.stream_baseline or self.median_gap()
        if base and g.gap < REL_SLOW * base:
            co, co_med, fresh = 0, None, 0  # not an outlier for its stream: no need to look for company
        else:
            co, co_med, fresh = self._co_stalled(g, None if act is None else max(1, act - 1))
        ctx = Context(
            timeline=self.timeline, preempts=self.preempts, global_median=self.median_gap(),
            co_stalled=co, co_gap_median=co_med, co_fresh=fresh, active_others=None if act is None else max(0, act - 1),
            first_token_near_end=self._first_token_near(g), engine_preempt=engine_pre,
            tol=1.5 * self.timeline.scrape_interval + 0.25,
            departures=self._departures,
        )
        classify(g, ctx)
        self.n_spikes += 1
        self.cause_counts[g.cause] += 1
        self.cause_conf[g.cause] += g.confidence
        self.cause_seconds[g.cause] += g.gap
        if len(self.spikes) == self.spikes.maxlen:
            self.n_spikes_dropped += 1
        self.spikes.append(g)
        acc = self.acc
        if r is not None:
            r.spikes += 1
            r.last_cause = g.cause
            if g.cause == "preemption":
                r.preempt_spikes += 1
                if r.id not in acc["preempted_ids"]:
                    acc["preempted_ids"].add(r.id)
                    if g.ended_by == "cancel":  # never resumed: the client gave up during the stall
                        acc["preempted_cancelled"] += 1
                        r.cancelled_after_preempt = True
                if r.prompt_tokens is not None:
                    acc["S_pre_sum"] += r.prompt_tokens + g.tokens_before
                    acc["S_pre_n"] += 1
        if g.cause == "prefill_interference" and ctx.first_token_near_end and ctx.first_token_near_end[1]:
            base = g.stream_baseline or self.median_gap() or 0.0
            p = ctx.first_token_near_end[1]
            if p >= 512 and g.gap > base:
                a_list = acc["prefill_a"]
                if len(a_list) < 5000:
                    a_list.append((g.gap - base) / p)

    # ---- results --------------------------------------------------------------------------
    def median_gap(self) -> float | None:
        n = self.hist.n
        if n:
            c = self._median_cache
            # the median moves slowly: refresh it when the sample grew by 1 %
            if c is None or n - c[0] > max(64, c[0] // 100):
                c = self._median_cache = (n, self.hist.quantile(0.5))
            return c[1]
        if self._warm:
            vals = sorted(x.gap for x in self._warm)
            return vals[len(vals) // 2]
        return None

    def request_info(self, rid: str) -> tuple[int, int, str | None]:
        r = self.reqs.get(rid)
        if r is None:
            return (0, 0, None)
        return (r.spikes, r.preempt_spikes, r.last_cause)

