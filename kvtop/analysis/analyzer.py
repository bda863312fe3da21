"""The analysis pipeline over a record stream: gaps -> spikes -> attribution -> inputs -> verdict.

One ``Analyzer`` serves both uses: ``kvtop analyze`` streams a trace through it and calls
``finish()``; the live console feeds it record by record and calls ``tick(now)`` (via
``LiveAnalyzer``). A spike is attributed once the evidence window after it has passed
(``settle`` seconds: the engine is scraped about once a second and vLLM counts a preemption only
when the victim resumes), and it reads what was known by its cut-offs (``asof``): the fast path,
which judges a whole block at once, and the live path give the same answers.
Memory is bounded: evidence older than ``horizon_s`` is dropped; per-request state is capped.

Per-stream gap state lives in ``GapTracker`` (``self.gaps``), what other streams did in its
``StallIndex`` (``self.gaps.stalls``); engine evidence in ``EngineTimeline``;
the evidence for one spike is gathered by ``attribution.gather`` and judged by ``attribution.classify``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvtop.analysis import gaps as G
from kvtop.analysis.asof import (
    MIN_SETTLE_S,
    PREFILL_HOLD_S,
    Cutoff,
    RunningMedian,
    cutoff,
    engine_prefill_of,
    known_by,
)
from kvtop.analysis.attribution import ALL, Cause, EngineTimeline, classify, gather
from kvtop.analysis.attribution.aggregate import Scrape
from kvtop.analysis.attribution.causes import WITNESS_KINDS
from kvtop.analysis.attribution.request_preemptions import RequestPreemptions
from kvtop.analysis.attribution.request_times import RequestTimes, rate_sample
from kvtop.analysis.attribution.spike import Spike
from kvtop.analysis.attribution.thresholds import RATE_MIN_PROMPT, RATE_MIN_PROMPTS
from kvtop.analysis.engines import EngineSemantics, engine_semantics
from kvtop.analysis.gaps import Gap, GapTracker, LogHistogram
from kvtop.analysis.state import AnalysisState
from kvtop.analysis.stepcurve import StepCurve
from kvtop.analysis.streams import ReqState, fold_arrive
from kvtop.analysis.tally import Tally
from kvtop.analysis.witness import Account, ResumeTally, StepIndex, prefill_compute
from kvtop.model.engine_id import engine_address

HOLD_REFRESH_S = 0.1  # the prefill hold line is recomputed at most this often (trace seconds)

CAUSES = tuple(c.value for c in ALL)


def header_itl_target(h: dict[str, Any]) -> float | None:
    """The ITL target a trace was recorded (or simulated) against, from its header; None if absent."""
    tgt = h.get("itl_target_s")
    if tgt is None and isinstance(h.get("sim"), dict):
        tgt = h["sim"].get("itl_target_s")
    if isinstance(tgt, (int, float)) and not isinstance(tgt, bool) and tgt > 0 and tgt == tgt and tgt != float("inf"):
        return float(tgt)
    return None


def header_interval(h: dict[str, Any]) -> float | None:
    """The scrape period a trace was recorded with (its header's ``interval_s``); None if absent."""
    iv = h.get("interval_s")
    if isinstance(iv, (int, float)) and not isinstance(iv, bool) and 0 < iv < 3600:
        return float(iv)
    return None


class Analyzer:
    def __init__(self, itl_target_s: float | None = None, k: float = G.K_TARGET, preempts: bool = True,
                 max_requests: int | None = None, keep_spikes: int = 10_000, horizon_s: float = 120.0,
                 use_request_preempts: bool = True):
        self.gaps = GapTracker(itl_target_s, k, max_requests)
        self.preempts = preempts
        self.keep_spikes = keep_spikes
        self.horizon_s = horizon_s
        self.use_request_preempts = use_request_preempts
        self.counted_at: str | None = None  # when the engine's preemption counter steps (its adapter says)
        self.in_order = False  # the engine admits prompts in arrival order (its adapter says)
        self.semantics: EngineSemantics | None = None  # its adapter's semantics, once named (``use_engine``)
        self.engine_name: str | None = None  # the adapter they are of (None: not named yet)
        self.header: dict[str, Any] = {}
        self.timeline = EngineTimeline(horizon_s=max(600.0, horizon_s))
        # the same engine records by engine address (``engine_address`` of their url): a spike on a
        # stream that names its engine is judged on that engine's records only
        self.timelines: dict[str, EngineTimeline] = {}
        self._no_engine = EngineTimeline(horizon_s=1.0)  # for streams of an engine kvtop does not scrape
        # the engines' own step logs (``step`` records from a witness), one per engine address
        self.witness: dict[str | None, StepIndex] = {}
        self.witnessed_spikes = 0
        self.held_spikes = 0  # of them, tokens made on pace that reached the client in one chunk
        self.resumes = ResumeTally()
        # requests whose prefill the engine timed (vLLM per-request metrics: first scheduled to first
        # token, their ``engine_prefill``), with their prompt tokens, by the prefill's end
        self.prefill_spans: deque[tuple[ReqState, int]] = deque()
        self.engine_times_from = math.inf  # the first finish record that carried them (``asof.cutoff``)
        self._hold_cache: tuple[float, float | None] = (float("-inf"), None)  # (asked at, hold line)
        self.spikes: deque[Spike] = deque(maxlen=keep_spikes)  # judged spikes, the latest keep_spikes
        self.cause_counts: dict[Cause, int] = dict.fromkeys(ALL, 0)
        self.cause_conf: dict[Cause, float] = dict.fromkeys(ALL, 0.0)
        # seconds above the target each cause cost (what a verdict should weigh, not spike counts)
        self.cause_over: dict[Cause, float] = dict.fromkeys(ALL, 0.0)
        self.cause_seconds: dict[Cause, float] = dict.fromkeys(ALL, 0.0)  # stall time per cause (kvtop agent's counters)
        self.n_spikes = 0
        self.n_spikes_dropped = 0
        self.t0: float | None = None
        self.now = 0.0
        self.records = 0
        self.losses: list[str] = []  # what the recorder said it could not write ("loss" records), first few
        self.token_records = 0
        self.scrapes: deque[Scrape] = deque(maxlen=50_000)
        self._hold = False  # the fast path holds attribution until a whole chunk is in
        self.acc = Tally()  # measured inputs (kvtop/analysis/inputs.py reads them)
        # prompt tokens / observed TTFT (prompts of RATE_MIN_PROMPT tokens or more): its median as of each refresh
        self._ttft_rate: RunningMedian[LogHistogram] = RunningMedian(self.acc.ttft_rate_hist, min_n=RATE_MIN_PROMPTS, step=4)
        self._eng_rate: dict[str, RunningMedian[LogHistogram]] = {}  # the same, per engine (streams that name theirs)
        self.request_preemptions = RequestPreemptions()  # vLLM's per-request histogram vs observed finishes
        self.request_times = RequestTimes()  # vLLM's per-request metrics (finish records) vs observation
        # hears every engine, GPU and host line as it goes in (the HTML report's history charts),
        # so a picture of a trace costs no second pass over it
        self.observe: Callable[[dict[str, Any]], None] | None = None

    # ---- the gap tracker's settings, as callers know them ------------------------------------
    @property
    def itl_target_s(self) -> float | None:
        return self.gaps.itl_target_s

    @itl_target_s.setter
    def itl_target_s(self, v: float | None) -> None:
        self.gaps.itl_target_s = v

    @property
    def target_source(self) -> str | None:
        return self.gaps.target_source

    @property
    def k(self) -> float:
        return self.gaps.k

    @property
    def reqs(self) -> dict[str, ReqState]:
        return self.gaps.reqs

    @property
    def n_gaps(self) -> int:
        return self.gaps.n_gaps

    # ---- setup ----------------------------------------------------------------------------
    def use_engine(self, sem: EngineSemantics, name: str | None = None) -> None:
        """Judge by the semantics of this engine's adapter (the header's, or one named later)."""
        self.semantics = sem
        self.engine_name = name
        self.preempts = sem.preempts
        self.counted_at = sem.counted_at
        self.in_order = sem.in_order

    def set_header(self, h: dict[str, Any]) -> None:
        self.header = h
        name = (h.get("engine") or {}).get("adapter")
        if name and self.semantics is None:
            # the header names the engine: its counting moment and admission order; whether it
            # preempts at all stays the caller's (``Analyzer(preempts=...)`` or ``use_engine``)
            sem = self.semantics = engine_semantics(name)
            self.engine_name = name
            self.counted_at, self.in_order = sem.counted_at, sem.in_order
        iv = header_interval(h)
        if iv is not None:
            self.timeline.interval_s = iv  # the recorder's scrape period, until scrapes show theirs
        if self.gaps.itl_target_s is None:
            tgt = header_itl_target(h)
            if tgt is not None:
                self.gaps.itl_target_s = tgt
                self.gaps.target_source = "trace header"

    @property
    def settle(self) -> float:
        return self.settle_at(math.inf)

    def settle_at(self, t: float) -> float:
        """How long after its end a spike is judged, by the scrape interval as known at trace time ``t``."""
        return max(MIN_SETTLE_S, 2.0 * self.timeline.interval_at(t) + 0.5)

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
                # ``token``, inline: one call fewer on the commonest record
                self.token_records += 1
                if t > self.now:
                    self.now = t
                gt = self.gaps
                rid = d.get("id")
                gt.token(rid if type(rid) is str else str(rid), t, d.get("n"))
                p = gt.pending
                if p and not self._hold and p[0].gap.t_end + MIN_SETTLE_S <= t and p[0].gap.t_end + self.settle <= t:
                    self.tick(t)
            else:
                self.request_event(t, str(d.get("id")), ev, d.get("n"), d.get("prompt_tokens"), d.get("class"),
                                   d.get("completion_tokens"), engine=d.get("engine"),
                                   finish_reason=d.get("finish_reason"), incomplete=d.get("incomplete"))
                if ev == "finish" and ("engine_ttft_s" in d or "engine_queue_s" in d or "engine_decode_s" in d):
                    self.engine_times(d)
        elif kind == "engine":
            if self.observe is not None:
                self.observe(d)
            self.engine(d)
        elif kind == "step":
            self.step(d)
        elif kind == "host":
            if self.observe is not None:
                self.observe(d)
            self.acc.host = d
            self._advance(t)
        elif kind == "gpu":
            if self.observe is not None:
                self.observe(d)
            tx = (d.get("pcie_tx_bytes_per_s") or 0) + (d.get("pcie_rx_bytes_per_s") or 0)
            self.acc.gpu_pcie_max = max(self.acc.gpu_pcie_max, tx)
            used, total = d.get("mem_used_bytes"), d.get("mem_total_bytes")
            if isinstance(used, int) and isinstance(total, int) and total > 0 and not d.get("lost"):
                idx = int(d.get("index") or 0)
                prev = self.acc.gpu_mem.get(idx)
                free = max(0, total - used)
                self.acc.gpu_mem[idx] = (free if prev is None else min(prev[0], free), total)
            self._advance(t)
        elif kind == "loss":
            self._loss(d, t)
        # "truth" records are ground truth for scoring only: never read here.

    def _loss(self, d: dict[str, Any], t: float) -> None:
        """The recorder could not write a run of records (its disk was full): the analysis of that
        stretch is missing them, and the report says so rather than let the gap read as a quiet one."""
        if len(self.losses) >= 5:
            return
        n = d.get("records")
        since = d.get("from_t")
        span = (f"from t={since:.1f}s to t={t:.1f}s" if isinstance(since, (int, float)) else f"before t={t:.1f}s")
        what = f"{n} record(s)" if isinstance(n, int) else "records"
        self.losses.append(f"the recorder could not write {what} {span} ({d.get('reason') or 'write failed'}): streams "
                           "across that stretch lack their tokens there")

    def _advance(self, t: float) -> None:
        if self.t0 is None:
            self.t0 = t
        if t > self.now:
            self.now = t
        p = self.gaps.pending
        if p and not self._hold and p[0].gap.t_end + MIN_SETTLE_S <= t and p[0].gap.t_end + self.settle <= t:
            self.tick(t)

    def token(self, rid: Any, t: float, n: Any = None) -> None:
        """Hot path: one token event."""
        self.token_records += 1
        if t > self.now:
            self.now = t
        self.gaps.token(str(rid), t, n)
        p = self.gaps.pending
        if p and not self._hold and p[0].gap.t_end + MIN_SETTLE_S <= t and p[0].gap.t_end + self.settle <= t:
            self.tick(t)

    def request_event(self, t: float, rid: str, ev: Any, n: Any = None, prompt: Any = None, cls: Any = None,
                      completion: Any = None, tokens_done: bool = False, engine: Any = None,
                      finish_reason: Any = None, incomplete: Any = None) -> None:
        gt = self.gaps
        r = gt.req(rid)
        acc = self.acc
        if engine is not None and r.engine is None:
            self.name_engine(rid, engine)
        if ev == "arrive":
            if r.arrive_t is None and r.end_t is None:
                acc.arrived += 1
                if acc.first_arrival is None or t < acc.first_arrival:
                    acc.first_arrival = t
                if acc.last_arrival is None or t > acc.last_arrival:
                    acc.last_arrival = t
                acc.inflight += 1
                acc.inflight_peak = max(acc.inflight_peak, acc.inflight)
                gt.stalls.arrived(r, t)
            fold_arrive(r, t, cls)
            if prompt is not None:
                self._prompt(r, prompt, t)
        elif ev == "first_token":
            if prompt is not None and r.prompt_tokens is None:
                r.prompt_tokens = int(prompt)
                r.prompt_t = t
            if gt.first_token(r, t):
                if r.arrive_t is not None and r.prompt_tokens and r.prompt_tokens >= RATE_MIN_PROMPT and t > r.arrive_t:
                    self._ttft_rate.add(r.prompt_tokens / (t - r.arrive_t), t)
                    if r.engine is not None:
                        eh = self._eng_rate.get(r.engine)
                        if eh is None:
                            eh = self._eng_rate[r.engine] = rate_sample()
                        eh.add(r.prompt_tokens / (t - r.arrive_t), t)
            if not tokens_done:  # the fast path has already counted it and its gap
                # a token event; a second "first_token" (resumed streams in some proxies) is still a gap
                gt.token(rid, t, n)
        elif ev == "resync":
            # Tokens seen after bytes of this stream were lost (passive capture): counted, but the
            # time since the previous token spans the hole and is never a gap (nor a stall).
            gt.resync(r, t, n)
        elif ev in ("finish", "cancel", "error"):
            if ev == "finish" and prompt is not None and r.prompt_tokens is None:
                # a text prompt's length is known only from the usage block at its finish
                self._prompt(r, prompt, t)
            if gt.end(r, t, ev):
                if r.arrive_t is not None:
                    acc.inflight = max(0, acc.inflight - 1)
                out = completion if completion is not None else r.tokens
                if ev == "finish":
                    acc.finished += 1
                    self.request_preemptions.finish(t, rid, r.engine)
                    if type(completion) is int and completion >= 0 and r.first_t is not None and not incomplete:
                        r.usage = completion
                        r.stopped = finish_reason == "stop"
                    if out:
                        acc.output_hist.add(max(1.0, float(out)))
                        acc.output_sum += out
                        acc.output_n += 1
                        if r.prompt_tokens is not None:
                            acc.request_hist.add(float(r.prompt_tokens + out))
                            acc.request_max = max(acc.request_max, int(r.prompt_tokens + out))
                elif ev == "cancel":
                    acc.cancelled += 1
                else:
                    acc.errors += 1
                if ev != "finish":
                    self._longest(r)
        elif ev == "preempt":
            if self.use_request_preempts:
                r.engine_preempts.append(t)
        self._advance(t)

    def _prompt(self, r: ReqState, prompt: Any, t: float) -> None:
        """A request's prompt length (told at ``t``), counted once into the measured prompt sizes."""
        try:
            p = int(prompt)
        except (TypeError, ValueError, OverflowError):
            return
        if p <= 0:
            return
        r.prompt_tokens = p
        r.prompt_t = t
        acc = self.acc
        acc.prompt_hist.add(max(1.0, float(p)))
        acc.prompt_sum += p
        acc.prompt_n += 1

    def engine_times(self, d: dict[str, Any]) -> None:
        """A finish record that carries the engine's own times for its request (``RequestTimes``)."""
        r = self.gaps.reqs.get(str(d.get("id")))
        if r is None:
            return
        p = d.get("prompt_tokens")
        prompt = p if isinstance(p, int) and not isinstance(p, bool) and p > 0 else r.prompt_tokens
        cached = d.get("cached_tokens")
        served = 0
        if prompt and isinstance(cached, int) and not isinstance(cached, bool) and cached > 0:
            # the engine's prefill worked on the tokens its prefix cache did not serve
            served = min(prompt, cached)
            prompt -= served
        self.request_times.finish(d, prompt, r.arrive_t, r.first_t, r.last_t, r.engine, served)
        ttft = d.get("engine_ttft_s")
        if isinstance(ttft, (int, float)) and ttft > 0 and r.first_t is not None and prompt:
            # the engine worked on this prompt from first scheduled to its first token (which the
            # client saw at first_t, a little after the engine made it)
            r.engine_prefill = (r.first_t - float(ttft), r.first_t)
            r.engine_prefill_t = float(d["t"])
            self.engine_times_from = min(self.engine_times_from, r.engine_prefill_t)
            self.prefill_spans.append((r, int(prompt)))

    def name_engine(self, rid: str, engine: Any) -> None:
        """The engine that serves stream ``rid`` (a request record's ``engine``), before its first token."""
        addr = engine_address(engine) if isinstance(engine, str) else None
        if addr is not None:
            self.gaps.set_engine(self.gaps.req(rid), addr)

    def engine(self, d: dict[str, Any]) -> None:
        t = d["t"]
        if d.get("up") is False:
            self._advance(t)
            return
        name = d.get("adapter")
        if self.engine_name is None and isinstance(name, str) and name:
            # a trace whose header names no adapter (an agent's segments did not): the records of an
            # engine that answered do (a failed scrape's says "unknown" until one did), and the live
            # path judges by them from the first; so does this one
            self.use_engine(engine_semantics(name), name)
        key = (d.get("url"), d.get("engine"))
        ttft = d.get("ttft")
        firsts = ttft.get("count") if isinstance(ttft, dict) else None
        ttft_sum = ttft.get("sum") if isinstance(ttft, dict) else None
        point = (t, key, d.get("running"), d.get("waiting"), d.get("kv_usage"), d.get("preemptions_total"),
                 d.get("prompt_tokens_total"), firsts if isinstance(firsts, (int, float)) else None,
                 ttft_sum if isinstance(ttft_sum, (int, float)) else None)
        self.timeline.add(*point)
        url = d.get("url")
        addr = engine_address(url) if isinstance(url, str) else None
        if addr is not None:
            tl = self.timelines.get(addr)
            if tl is None:
                tl = self.timelines[addr] = EngineTimeline(self.timeline.horizon_s, self.timeline.interval_s)
            tl.add(*point)
        acc = self.acc
        if key not in acc.engine_first:
            acc.engine_first[key] = d
        else:
            curve = acc.step_curves.get(key)
            if curve is None:
                curve = acc.step_curves[key] = StepCurve()
            curve.add(acc.engine_last[key], d)
        acc.engine_last[key] = d
        running = d.get("running")
        if running is not None:
            acc.running_sum += running
            acc.running_n += 1
            if running > acc.running_peak:
                acc.running_peak = running
        kv = d.get("kv_usage")
        if kv is not None:
            acc.kv_max = kv if acc.kv_max is None else max(acc.kv_max, kv)
        rp = (d.get("extra") or {}).get("request_preemptions")
        if isinstance(rp, dict):
            self.request_preemptions.scrape(key, t, rp.get("count"), rp.get("sum"), addr)
        itl = d.get("itl")
        if isinstance(itl, dict) and not self.token_records:
            # kept only while no per-request token timings exist: the aggregate fallback needs them
            self.scrapes.append(Scrape(t, key, itl, d.get("preemptions_total"), d.get("prompt_tokens_total"),
                                       d.get("running"), kv))
        self._advance(t)

    def step(self, d: dict[str, Any]) -> None:
        """One engine step from the engine's witness."""
        url = d.get("engine")
        addr = engine_address(url) if isinstance(url, str) else None
        idx = self.witness.get(addr)
        if idx is None:
            idx = self.witness[addr] = StepIndex()
        self.resumes.add(d, idx.add(d))
        lim = d.get("limits")
        if isinstance(lim, dict) and lim:
            self.acc.engine_limits = lim
        self._advance(d["t"])

    def witness_account(self, g: Gap) -> Account | None:
        """The engine's own account of spike ``g``, where a witness logged its request."""
        if not self.witness:
            return None
        first = self.witness.get(g.engine)
        for idx in ([first] if first is not None else []) + [i for i in self.witness.values() if i is not first]:
            if g.request_id in idx.by_req:
                return idx.account(g.request_id, g.t_start, g.t_end, self.gaps.itl_target_s)
        return None

    # ---- the fast path's batch API ----------------------------------------------------------
    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hold attribution while a block of records goes in (batch tokens and per-record events
        interleave in time), then restore time order and attribute what settled."""
        self._hold = True
        self.gaps.begin_batch()
        try:
            yield
            self.gaps.end_batch()
        finally:
            self._hold = False
        self.tick(self.now)

    def add_token_batch(self, ids: list[str], codes: Any, ts: Any, ns: Any, ft: Any) -> None:
        """A block of token events parsed by the fast path (see ``GapTracker.add_batch``)."""
        if len(ts):
            self.now = max(self.now, float(ts.max()))
        self.gaps.add_batch(ids, codes, ts, ns, ft)
        self.token_records += int(len(ft) - ft.sum())

    # ---- attribution ----------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """Attribute every pending spike whose evidence window has passed."""
        now = self.now if now is None else now
        for g in self.gaps.take_ready(now, self.settle, self._hold_line(now), PREFILL_HOLD_S):
            self._attribute(g)
        self._prune(now)

    def _hold_line(self, now: float) -> float | None:
        """Spikes that end after this wait (up to ``PREFILL_HOLD_S``) for evidence still to come: the
        engine's step log, where a witness runs, until it reaches them (its steps reach a trace a
        poll or two late); and once the run has engine-timed prefills, the report of a prefill they may
        lie in or whose prompt its window counted (a settle time before the earliest arrival of a
        stream with no first token yet, or of one within the hold and not finished). None: nothing
        to wait for."""
        if not self.prefill_spans and not self.witness:
            return None
        asked, line = self._hold_cache
        if 0.0 <= now - asked < HOLD_REFRESH_S:
            return line
        line = None
        if self.witness:
            line = min(idx.latest for idx in self.witness.values())
        if self.prefill_spans:
            # a stream that arrives up to a settle time after a spike may still have its prompt
            # counted in the spike's window (``Evidence.prompts_done_before``)
            margin = self.settle
            for r in self.gaps.reqs.values():
                if r.end_t is not None or r.arrive_t is None:
                    continue
                if r.first_t is None or now - r.first_t <= PREFILL_HOLD_S:
                    t = r.arrive_t - margin
                    line = t if line is None else min(line, t)
        self._hold_cache = (now, line)
        return line

    def prefill_span(self, g: Gap, cut: Cutoff) -> tuple[float, float, int, str] | None:
        """Another request's engine-timed prefill covering at least half of stall ``g`` (the longest prompt)."""
        best = None
        for r, prompt in self.prefill_spans:
            eng = r.engine
            if r.id == g.request_id or (g.engine is not None and eng is not None and eng != g.engine):
                continue
            sp = engine_prefill_of(r, cut)
            if sp is None:
                continue
            a, b = sp
            if min(b, g.t_end) - max(a, g.t_start) >= 0.5 * g.gap and (best is None or prompt > best[2]):
                best = (a, b, prompt, r.id)
        return best

    def _longest(self, r: ReqState) -> None:
        """A request that did not finish still needed its prompt and what it was served: a length bound
        below that rejects it (a client that gave up during a long prefill sent its prompt all the same)."""
        if r.prompt_tokens is not None:
            acc = self.acc
            acc.request_max = max(acc.request_max, int(r.prompt_tokens + r.tokens))

    def finish(self) -> None:
        gt = self.gaps
        for r in gt.reqs.values():
            if r.end_t is None:
                self._longest(r)  # still in flight when the trace ended
        if gt.itl_target_s is None and gt.warm:
            gt.derive_target()
        for g in gt.take_all():
            self._attribute(g)

    def _prune(self, now: float) -> None:
        gt = self.gaps
        keep_from = now - self.horizon_s
        if gt.pending:
            keep_from = min(keep_from, gt.pending[0].gap.t_start)
        drop_before = (gt.pending[0].gap.t_start if gt.pending else now) - self.settle - 5.0
        gt.stalls.prune(keep_from, drop_before)
        self.timeline.prune(keep_from - 60.0)
        for tl in self.timelines.values():
            tl.prune(keep_from - 60.0)
        for idx in self.witness.values():
            idx.prune(keep_from - 60.0)
        for m in (gt.median, self._ttft_rate, *self._eng_rate.values(), self.request_times.rate,
                  *self.request_times.by_engine.values()):
            m.history.prune(keep_from - 60.0)
        spans = self.prefill_spans
        while spans and (spans[0][0].engine_prefill or (0.0, keep_from))[1] < keep_from - 60.0:
            spans.popleft()

    def timeline_for(self, engine: str | None) -> EngineTimeline:
        """The engine records that speak for a stream of ``engine`` (its address, or None).

        A stream that names a scraped engine gets that engine's records. Otherwise all records
        together (as before streams named engines) while there is only one engine to speak of;
        with several, a stream whose engine kvtop does not scrape gets none (another engine's
        counter steps are not its evidence)."""
        if engine is None or not self.timelines:
            return self.timeline
        tl = self.timelines.get(engine)
        if tl is not None:
            return tl if len(self.timelines) > 1 else self.timeline
        if len(self.timelines) == 1 and sum(1 for k in self.gaps.stalls.eng_active if k is not None) <= 1:
            return self.timeline  # one engine named two ways (a DNS name and an IP, say)
        return self._no_engine

    def _attribute(self, g: Gap) -> None:
        r = self.gaps.reqs.get(g.request_id)
        gt = self.gaps
        # read as of the spike's cut-offs, not as of now: the same judgement on either path, whenever made
        settle = self.settle_at(known_by(g))
        cut = cutoff(g, settle, self.engine_times_from)
        ev = gather(g, gt.stalls, gt.median_gap(cut.facts), gt.itl_target_s, self.timeline_for(g.engine), self.preempts,
                    settle, cut, r.engine_preempts if r else None, self.counted_at, self.prefill_rate(g.engine, cut.facts),
                    r.last_spike if r else None, witness=self.witness_account(g), in_order=self.in_order,
                    prefill_span=self.prefill_span(g, cut) if self.prefill_spans else None)
        f = classify(ev)
        if f.kind in WITNESS_KINDS:
            self.witnessed_spikes += 1
            if ev.witness is not None and ev.witness.kind == "held":
                self.held_spikes += 1
        spike = Spike(g, f)
        self.n_spikes += 1
        self.cause_counts[f.cause] += 1
        self.cause_conf[f.cause] += f.confidence
        self.cause_over[f.cause] += max(0.0, g.gap - (self.gaps.itl_target_s or 0.0))
        self.cause_seconds[f.cause] += g.gap
        if len(self.spikes) == self.spikes.maxlen:
            self.n_spikes_dropped += 1
        self.spikes.append(spike)
        acc = self.acc
        if r is not None:
            r.spikes += 1
            if g.ended_by == "token" and g.chunk_n > max(1.0, g.tokens_per_event):
                # closed by a record of more tokens than the stream's usually carried: a merged one, maybe
                r.multi_spikes += 1
            r.last_cause = f.cause.value
            r.last_spike = spike
            if f.cause is Cause.PREEMPTION:
                r.preempt_spikes += 1
                if r.preempt_spikes == 1:  # the request's first preemption (a count: no id kept for ever)
                    acc.preempted_requests += 1
                    if g.ended_by == "cancel":  # never resumed: the client gave up during the stall
                        acc.preempted_cancelled += 1
                        r.cancelled_after_preempt = True
                if r.prompt_tokens is not None:
                    acc.seq_pre_sum += r.prompt_tokens + g.tokens_before
                    acc.seq_pre_n += 1
                if len(acc.preempt_stalls) < 100_000:
                    acc.preempt_stalls.append((g.t_start, g.t_end))
        ft = ev.first_token
        if f.cause is Cause.PREFILL and ft is not None and ft.prompt_tokens:
            base = ev.baseline or 0.0
            p = ft.prompt_tokens
            if p >= 512 and g.gap > base and len(acc.prefill_a) < 5000:
                acc.prefill_a.append((g.gap - base) / p)

    def prefill_rate(self, engine: str | None = None, t: float = math.inf) -> float | None:
        """A low estimate of the prefill rate: the median of prompt tokens / TTFT (TTFT
        includes queueing and the decode work of the same steps, so the true rate is higher). A
        prompt that this rate cannot make explain a stall certainly does not explain it.
        ``engine``: that engine's own rate (engines differ: another's faster prefill explains nothing).
        Where the engine reports its own per-request times, prompt tokens / the engine's TTFT is
        used instead: still a low estimate, without the queueing (``RequestTimes``). As known at
        trace time ``t`` (by default: now)."""
        named = engine if self.gaps.stalls.multi else None
        measured = self.request_times.prefill_rate(named, t)
        if measured is not None:
            return measured
        if named is not None:
            h = self._eng_rate.get(named)
            sampled = None if h is None else h.at(t)
        else:
            sampled = self._ttft_rate.at(t)
        if sampled is not None:
            return sampled
        tl = self.timeline if named is None else self.timelines.get(named)
        return None if tl is None else tl.prefill_rate_at(t)

    # ---- results --------------------------------------------------------------------------
    def state(self) -> AnalysisState:
        """What the analysis arrived at so far, for the report (see ``AnalysisState``)."""
        reqs = self.gaps.reqs
        return AnalysisState(
            header=self.header, preempts=self.preempts, records=self.records, token_records=self.token_records,
            t0=self.t0, now=self.now, gaps=self.gaps.n_gaps, median_gap=self.median_gap(),
            itl_target_s=self.gaps.itl_target_s, target_source=self.gaps.target_source, k=self.gaps.k,
            n_spikes=self.n_spikes, cause_counts=dict(self.cause_counts), cause_conf=dict(self.cause_conf),
            cause_over=dict(self.cause_over), spikes=tuple(self.spikes), streams=tuple(reqs.values()),
            tally=self.acc, scrapes=tuple(self.scrapes),
            request_preemptions=self.request_preemptions.report(
                {r.id: r.preempt_spikes for r in reqs.values() if r.ended_by == "finish"}),
            engine_request_times=self.request_times.report(),
            scrape_interval=self.timeline.scrape_interval if self.timeline.last_scrape is not None else None,
            witnessed_spikes=self.witnessed_spikes, held_spikes=self.held_spikes, resume_costs=self.resumes.report(),
            prefill_compute=prefill_compute(self.witness.values()))

    def median_gap(self) -> float | None:
        return self.gaps.median_gap()

    def request_info(self, rid: str) -> tuple[int, int, str | None]:
        r = self.gaps.streams.get(rid)
        if r is None:
            return (0, 0, None)
        return (r.spikes, r.preempt_spikes, r.last_cause)
