"""A step-level serving-engine model: one loop iteration = one batch iteration with a cost model.

Deliberately not a paged-KV event simulator: KV is a token pool counted in blocks, a request's
state is a handful of integers, and everything the outside world sees comes out of two logs that
the step loop appends to: per-request *emissions* (engine time, tokens) and a per-step *state log*
(the gauges and counters a /metrics page would show right after that step). Delivery to clients
and scraping are applied afterwards (``delivery.py``, ``observe.py``), so one engine run serves
every scrape interval.

Counter semantics per engine family (what kvtop has to cope with):

* ``vllm`` (V1): a preemption is counted when the victim *resumes* (the step that gives it its
  next token after re-prefill); a victim cancelled while waiting is never counted; recomputed
  prompt tokens appear in no token counter.
* ``sglang``: a retraction is counted when it happens, cancelled or not.
* ``never`` (TGI-like): admission reserves prompt + output tokens, so nothing is ever preempted;
  KV pressure shows up as queueing.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineSpec:
    semantics: str = "vllm"  # vllm | sglang | never
    scheduler: str = "fcfs"  # fcfs | priority
    kv_tokens: int = 24_000
    block: int = 16
    max_seqs: int = 64
    token_budget: int = 2048  # tokens per step (prefill chunks + decodes)
    chunked: bool = True  # False: a prompt is prefilled whole in one step
    fixed_s: float = 0.010
    per_seq_s: float = 0.00025
    prefill_tok_s: float = 0.00005  # ~20K prompt tokens/s
    attn_tok2_s: float = 2e-9  # quadratic attention term per prefill chunk
    ctx_tok_s: float = 1e-8  # per context token of each decoding sequence
    spec_k: int = 0  # speculative decoding: up to k extra tokens per step and sequence
    spec_accept: float = 0.7
    spec_cost: float = 1.35  # a verify step costs this much more than a plain decode step
    slowdowns: tuple[tuple[float, float], ...] = ()  # (from engine time, cost factor), sorted
    model: str = "tracegen/llama-3.1-8b"


@dataclass(eq=False)
class Req:
    id: str
    cls: str
    arrive: float
    prompt: int
    output: int
    priority: int = 0
    patience: float | None = None  # client gives up after this long without a token
    observed: bool = True
    state: str = "new"  # new | waiting | running | done
    computed: int = 0  # tokens whose KV is held
    need: int = 0  # tokens to (re)compute before the next emission
    recompute: int = 0  # of ``need``, tokens that were computed before (a victim's re-prefill)
    generated: int = 0
    blocks: int = 0
    reserved: int = 0  # blocks reserved at admission (``never`` semantics)
    emits: list[tuple[float, int]] = field(default_factory=list)
    victim_of: int | None = None  # index into Run.victims while preempted
    count_on_resume: int = 0
    deadline: float | None = None
    end_t: float | None = None
    end_kind: str | None = None  # finish | cancel
    finish_reason: str | None = None
    counted: int = 0  # preemptions of this request the engine's counter added


@dataclass
class Span:
    """A stall of one request in engine terms: from emission ``i_from`` to ``i_to`` (or ``t_to``)."""

    rid: str
    cause: str
    i_from: int
    i_to: int | None
    t_to: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Victim:
    rid: str
    t: float  # preempted at (engine time)
    i_from: int  # its last emission before
    outcome: str = "waiting"  # resumed | cancelled | waiting (run ended first)
    t_end: float | None = None
    counted_at: float | None = None
    recompute_tokens: int = 0
    observed: bool = True
    times: int = 0  # preempted again while waiting to resume (re-prefill interrupted)
    counted: int = 0  # what the engine's counter added for this silence


@dataclass
class Run:
    spec: EngineSpec
    reqs: list[Req]
    # (t_end, running, waiting, used_blocks, preemptions, prompt, generation, stop, length, abort)
    log: list[tuple[float, int, int, int, int, int, int, int, int, int]] = field(default_factory=list)
    itl: list[tuple[float, float, int]] = field(default_factory=list)  # (t, seconds, tokens) per request per step
    ttft: list[tuple[float, float]] = field(default_factory=list)
    # (t, preemptions counted for the request) when a request ends: vLLM's request_num_preemptions
    ended: list[tuple[float, int]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    victims: list[Victim] = field(default_factory=list)
    steps: int = 0
    total_blocks: int = 0


class Stepper:
    def __init__(self, spec: EngineSpec, reqs: list[Req], rng_spec: random.Random,
                 pauses: list[tuple[float, float]] | None = None, itl_target_s: float = 0.1):
        self.s = spec
        self.rng = rng_spec
        self.pending = sorted(reqs, key=lambda r: (r.arrive, r.id))
        self.run = Run(spec, list(self.pending))
        self.total_blocks = spec.kv_tokens // spec.block
        self.run.total_blocks = self.total_blocks
        self.free = self.total_blocks
        self.reserved_free = self.total_blocks
        self.running: list[Req] = []
        self.waiting: list[Req] = []
        self.pauses = sorted(pauses or [])
        self.target = itl_target_s
        self.stall_floor = 0.5 * itl_target_s
        self.pre = self.prompt = self.gen = 0
        self.fin = {"stop": 0, "length": 0, "abort": 0}

    # -- helpers ---------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.s.block)

    def _key(self, r: Req) -> tuple[Any, ...]:
        return (r.priority, r.arrive, r.id) if self.s.scheduler == "priority" else (r.arrive, r.id)

    def _factor(self, t: float) -> float:
        f = 1.0
        for t0, x in self.s.slowdowns:
            if t >= t0:
                f = x
        return f

    def _release(self, r: Req) -> None:
        self.free += r.blocks
        r.blocks = 0
        r.computed = 0
        self.reserved_free += r.reserved
        r.reserved = 0

    def _end(self, r: Req, t: float, kind: str, reason: str | None = None) -> None:
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self._release(r)
        r.state = "done"
        r.end_t, r.end_kind, r.finish_reason = t, kind, reason
        self.run.ended.append((t, r.counted))
        if kind == "cancel":
            self.fin["abort"] += 1
            if r.victim_of is not None:
                v = self.run.victims[r.victim_of]
                v.outcome, v.t_end = "cancelled", t
                if v.i_from >= 0:
                    self.run.spans.append(Span(r.id, "preemption", v.i_from, None, t,
                                               {"outcome": "cancelled", "counted": v.counted, "times": v.times}))
                r.count_on_resume = 0
                r.victim_of = None
        else:
            self.fin[reason or "stop"] += 1

    def _enqueue(self, r: Req, front: bool = False) -> None:
        r.state = "waiting"
        if self.s.scheduler == "priority":
            self.waiting.append(r)
            self.waiting.sort(key=self._key)
        elif front:
            self.waiting.insert(0, r)
        else:
            self.waiting.append(r)

    def _preempt(self, v: Req, t: float) -> None:
        self.running.remove(v)
        tokens = v.computed
        self._release(v)
        v.need = v.prompt + v.generated  # recompute: prompt and everything generated so far
        # tokens of the coming re-prefill that were computed before (all of them once it streamed)
        v.recompute = v.need if v.generated else tokens
        if v.victim_of is None:
            # a victim preempted before its first token stalls no inter-token gap (i_from = -1)
            v.victim_of = len(self.run.victims)
            self.run.victims.append(Victim(v.id, t, len(v.emits) - 1, observed=v.observed))
        vi = self.run.victims[v.victim_of]
        vi.times += 1
        vi.recompute_tokens = v.need
        if self.s.semantics == "sglang":
            self.pre += 1
            v.counted += 1
            vi.counted += 1
            vi.counted_at = t
        else:
            # vLLM V1 reports a request's preemption events with its next output: all at once at
            # the resume, never if the client cancels first
            v.count_on_resume += 1
        self._enqueue(v, front=True)

    def _victim(self) -> Req:
        if self.s.scheduler == "priority":
            return max(self.running, key=self._key)
        return self.running[-1]  # the most recently scheduled

    def _paused_until(self, t: float) -> float:
        for a, d in self.pauses:
            if a <= t < a + d:
                return a + d
        return t

    # -- the loop --------------------------------------------------------------------------
    def simulate(self, duration: float) -> Run:
        t = 0.0
        s = self.s
        rng = self.rng
        run = self.run
        pend = self.pending
        pi = 0
        while t < duration:
            t = self._paused_until(t)
            while pi < len(pend) and pend[pi].arrive <= t:
                self._enqueue(pend[pi])
                pi += 1
            # clients that gave up while their stream was silent
            for r in [r for r in self.running + self.waiting if r.deadline is not None and r.deadline <= t]:
                self._end(r, r.deadline, "cancel")  # type: ignore[arg-type]
            if not self.running and not self.waiting:
                nxt = [pend[pi].arrive] if pi < len(pend) else []
                if not nxt:
                    break
                t = max(t, nxt[0])
                continue
            budget = s.token_budget
            decode: list[tuple[Req, int]] = []
            chunks: list[tuple[Req, int]] = []
            preempted = False
            order = sorted(self.running, key=self._key) if s.scheduler == "priority" else list(self.running)
            for r in order:
                if r.state != "running":
                    continue
                if r.need == 0:
                    k = 1
                    if s.spec_k:
                        while k <= s.spec_k and rng.random() < s.spec_accept:
                            k += 1
                    k = min(k, r.output - r.generated)
                    want, is_dec = k, True
                else:
                    want = min(r.need, budget) if s.chunked else r.need
                    if want <= 0:
                        continue
                    is_dec = False
                nb = self._blocks_for(r.computed + want) - r.blocks
                while nb > self.free and s.semantics != "never":
                    v = self._victim()
                    self._preempt(v, t)
                    preempted = True
                    if v is r:
                        break
                if r.state != "running":
                    continue
                self.free -= nb
                r.blocks += nb
                if is_dec:
                    decode.append((r, want))
                    budget -= 1
                else:
                    chunks.append((r, want))
                    budget -= want
            if not preempted:
                while self.waiting and len(self.running) < s.max_seqs and budget > 0:
                    r = self.waiting[0]
                    want = min(r.need, budget) if s.chunked else r.need
                    if not s.chunked and chunks and want > budget:
                        break
                    nb = self._blocks_for(r.computed + want) - r.blocks
                    if s.semantics == "never":
                        res = self._blocks_for(r.prompt + r.output)
                        if res > self.reserved_free:
                            break
                    if nb > self.free:
                        break
                    self.waiting.pop(0)
                    if s.semantics == "never":
                        r.reserved = res
                        self.reserved_free -= res
                    r.state = "running"
                    self.running.append(r)
                    self.free -= nb
                    r.blocks += nb
                    chunks.append((r, want))
                    budget -= want
            if not decode and not chunks:
                # nothing fits (memory held by requests mid-prefill cannot happen here): wait for time
                t += s.fixed_s
                continue
            # step cost
            dec_cost = len(decode) * s.per_seq_s + s.ctx_tok_s * sum(r.computed for r, _ in decode)
            if s.spec_k and decode:
                dec_cost = (dec_cost + s.fixed_s) * s.spec_cost - s.fixed_s
            pf_cost = 0.0
            recompute_tok = fresh_tok = 0
            for r, n in chunks:
                start = r.computed  # progress of this (re)prefill before the chunk
                pf_cost += s.prefill_tok_s * n + s.attn_tok2_s * ((start + n) ** 2 - start ** 2)
                if r.recompute > 0:
                    recompute_tok += n
                else:
                    fresh_tok += n
            f = self._factor(t)
            dur = (s.fixed_s + dec_cost + pf_cost) * f
            t_end = t + dur
            for a, d in self.pauses:
                if t < a < t_end:
                    t_end += d
            # outputs
            run.steps += 1
            emitted: list[Req] = []
            for r, k in decode:
                r.computed += k
                self._emit(r, t_end, k)
                emitted.append(r)
            for r, n in chunks:
                r.computed += n
                r.need -= n
                if r.need <= 0:
                    r.need = 0
                    fresh = r.generated == 0
                    if fresh:
                        self.prompt += r.prompt
                    r.recompute = 0
                    self._emit(r, t_end, 1)
                    emitted.append(r)
            # stall truth for streams that waited through a long step
            if dur >= self.stall_floor:
                # the cause is what made the step long: if the decode part alone would already
                # miss the target, the prefill riding along is not why (an onset of slow decode)
                base = (s.fixed_s + dec_cost) * f
                if base < self.target and pf_cost * f >= 0.5 * dur:
                    cause = "prefill_interference"
                    detail = {"prefill_tokens": fresh_tok + recompute_tok, "recompute": recompute_tok > fresh_tok,
                              "step_s": round(dur, 6)}
                else:
                    cause, detail = "slow_decode", {"step_s": round(dur, 6), "batch": len(decode)}
                for r, _ in decode:
                    if r.state == "running" and len(r.emits) >= 2 and r.emits[-1][0] == t_end:
                        run.spans.append(Span(r.id, cause, len(r.emits) - 2, len(r.emits) - 1, None, detail))
            for r in emitted:
                if r.generated >= r.output and r.state == "running":
                    self._end(r, t_end, "finish", r.finish_reason or "stop")
            run.log.append((t_end, len(self.running), len(self.waiting), self.total_blocks - self.free, self.pre,
                            self.prompt, self.gen, self.fin["stop"], self.fin["length"], self.fin["abort"]))
            t = t_end
        for r in self.running + self.waiting:
            if r.victim_of is not None and run.victims[r.victim_of].i_from >= 0:
                vo = run.victims[r.victim_of]
                run.spans.append(Span(r.id, "preemption", vo.i_from, None, None, {"outcome": "open"}))
        return run

    def _emit(self, r: Req, t: float, k: int) -> None:
        if r.deadline is not None and t > r.deadline:
            self._end(r, r.deadline, "cancel")
            return
        prev = r.emits[-1][0] if r.emits else None
        r.emits.append((t, k))
        r.generated += k
        self.gen += k
        if prev is None:
            self.run.ttft.append((t, t - r.arrive))
        else:
            self.run.itl.append((t, t - prev, k))
        if r.patience is not None:
            r.deadline = t + r.patience
        if r.victim_of is not None:
            v = self.run.victims[r.victim_of]
            v.outcome, v.t_end = "resumed", t
            if r.count_on_resume:
                self.pre += r.count_on_resume
                v.counted += r.count_on_resume
                r.counted += r.count_on_resume
                v.counted_at = t
                r.count_on_resume = 0
            if v.i_from >= 0:
                self.run.spans.append(Span(r.id, "preemption", v.i_from, len(r.emits) - 1, None,
                                           {"outcome": "resumed", "counted": v.counted, "times": v.times,
                                            "recompute_tokens": v.recompute_tokens}))
            r.victim_of = None


def lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(sigma * rng.gauss(0.0, 1.0))))
