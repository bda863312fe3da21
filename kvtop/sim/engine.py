"""A step-level discrete-event model of a paged-KV serving engine (vLLM V1-like).

Memory: a pool of ``num_gpu_blocks`` blocks of ``block_size`` tokens. Blocks of a shared prefix are
reference-counted; blocks that reach refcount 0 stay cached (LRU, evicted tail-first) so a later
request or a resumed victim can hit them. Scheduling per step: running sequences first (decode,
unfinished prefill chunks), then waiting ones (preempted first) while ``max_num_seqs`` and the token
budget allow; no admission in a step that preempted. A running sequence that needs a block when none
is free preempts the least important, most recently arrived running sequence (possibly itself):
``recompute`` frees its blocks (full ones keep their hashes) and re-prefills on resume, ``swap``
copies its private blocks to host over a link and back.

The engine never builds per-token objects: one step advances every scheduled sequence, and the
per-step work is a tight loop over the batch. Everything observable is reported to a ``Sink``.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from typing import Any, NamedTuple

from kvtop.model.records import TruthRecord
from kvtop.sim.workload import EngineConfig, RequestSpec

# vLLM V1 histogram buckets (reference/engines.md §2.1; fixture vllm-0.32.0-cpu-live-idle.prom).
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITER_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)

WAITING, RUNNING, SWAPPED, SWAPPING_IN, DONE = "waiting", "running", "swapped", "swapping_in", "done"


class Hist:
    """Prometheus-style histogram kept as plain per-bucket counts (cumulated when rendered)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, v)] += n
        self.sum += v * n
        self.count += n

    def cumulative(self) -> list[tuple[float, int]]:
        out, c = [], 0
        for le, k in zip((*self.bounds, float("inf")), self.counts, strict=True):
            c += k
            out.append((le, c))
        return out


class Stats:
    """Engine-side counters in vLLM V1 semantics (rendered by ``kvtop.sim.metrics``)."""

    def __init__(self) -> None:
        self.preemptions = 0  # counted when the victim produces its next output (vLLM V1)
        self.preempt_events = 0  # counted at preemption time (truth; not exported)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
        self.itl = Hist(ITL_BUCKETS)
        self.ttft = Hist(TTFT_BUCKETS)
        self.iteration_tokens = Hist(ITER_BUCKETS)
        self.e2e = Hist(E2E_BUCKETS)
        self.offload_bytes = {"GPU_to_CPU": 0.0, "CPU_to_GPU": 0.0}
        self.offload_time = {"GPU_to_CPU": 0.0, "CPU_to_GPU": 0.0}
        self.steps = 0


class Sink:
    """Receives what the engine does. Override what you need."""

    def on_tokens(self, t: float, seqs: list[Seq]) -> None:
        """Each seq produced one token at ``t`` (``seq.generated == 1``: the first token)."""

    def on_finish(self, t: float, seq: Seq, reason: str) -> None:
        pass

    def on_cancel(self, t: float, seq: Seq) -> None:
        pass

    def on_truth(self, rec: TruthRecord) -> None:
        pass


class Seq:
    __slots__ = (
        "id", "order", "arrival_t", "cls", "prompt", "out_len", "max_tokens", "priority", "prefix_id",
        "prefix_tokens", "patience", "key", "state", "num_tokens", "computed", "generated", "blocks",
        "shared", "n_sched", "last_t", "first_t", "preempted_at", "pending_preempts", "n_preempts",
        "materialising", "host_blocks", "out_done", "ready_t", "cancelled", "counted_prefix",
        "resume_info", "user",
    )

    def __init__(self, spec: RequestSpec, order: int, t: float):
        self.id = spec.id
        self.order = order
        self.arrival_t = t
        self.cls = spec.cls
        self.prompt = spec.prompt_tokens
        self.out_len = max(1, spec.output_tokens)
        self.max_tokens = spec.max_tokens
        self.priority = spec.priority
        self.prefix_id = spec.prefix_id
        self.prefix_tokens = spec.prefix_tokens if spec.prefix_id else 0
        self.patience = spec.patience_s
        self.key = (spec.priority, order)
        self.state = WAITING
        self.num_tokens = spec.prompt_tokens  # tokens known (prompt + generated)
        self.computed = 0  # tokens whose KV is on the GPU
        self.generated = 0
        self.blocks = 0  # blocks held (shared + private)
        self.shared = 0  # of which shared-prefix blocks (refcounted)
        self.n_sched = 0
        self.last_t = t  # last token time (arrival before the first token)
        self.first_t: float | None = None
        self.preempted_at: float | None = None
        self.pending_preempts = 0
        self.n_preempts = 0
        self.materialising = False
        self.host_blocks = 0
        self.out_done = 0.0
        self.ready_t = 0.0
        self.cancelled = False
        self.counted_prefix = False
        self.resume_info: dict[str, Any] | None = None
        self.user: Any = None  # owner's per-request data (the HTTP server's stream queue)


class _Prefix:
    __slots__ = ("resident", "holders", "held", "materialiser")

    def __init__(self) -> None:
        self.resident = 0  # computed blocks on the GPU (held or cached), a head of the prefix
        self.holders: dict[str, int] = {}  # seq id -> leading prefix blocks it references
        self.held = 0  # max(holders): blocks with refcount > 0 (refcounts never increase along the prefix)
        self.materialiser: str | None = None


class StepPlan(NamedTuple):
    t0: float
    t_end: float | None
    dec: list[Seq]
    sched: list[Seq]
    n_dec: int
    pf_tokens: int
    dec_cost: float
    pf_cost: float
    blocked_s: float
    prefills: list[Seq]


class Engine:
    def __init__(self, cfg: EngineConfig, sink: Sink | None = None, t0: float = 0.0):
        self.cfg = cfg
        self.sink = sink or Sink()
        self.t = t0
        self.bs = cfg.block_size
        self.n_blocks = cfg.num_gpu_blocks
        self.free_uncached = cfg.num_gpu_blocks
        self.cached = 0
        self.lru: OrderedDict[Any, int] = OrderedDict()
        self.prefixes: dict[str, _Prefix] = {}
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.swapping_in: list[Seq] = []
        self.seqs: dict[str, Seq] = {}
        self.stats = Stats()
        self._order = 0
        self._deadlines: list[tuple[float, int, Seq]] = []
        self.min_patience: float | None = None
        self.host_used = 0
        self.link_out_free = t0
        self.link_in_free = t0
        self._slow_run: dict[str, Any] | None = None
        self._inflight: StepPlan | None = None
        self.reserved: dict[int, int] = {}
        self.budget = cfg.max_num_batched_tokens if cfg.chunked_prefill else max(cfg.max_num_batched_tokens,
                                                                                 cfg.max_model_len)

    # --- requests in and out -------------------------------------------------------------------

    def set_reservations(self, by_priority: dict[int, float]) -> None:
        """KV share reserved for classes at least as important as each priority (0..1 of blocks).

        A request of priority p may not take a block that would leave fewer free blocks than the
        reservations of strictly more important priorities.
        """
        self.reserved = {p: int(frac * self.n_blocks) for p, frac in by_priority.items() if frac > 0}

    def add(self, spec: RequestSpec, t: float | None = None, user: Any = None) -> Seq:
        t = self.t if t is None else t
        s = Seq(spec, self._order, t)
        s.user = user
        self._order += 1
        # A request longer than the context or the whole pool could never run: cut its output
        # (finish "length"), as an engine does at max_model_len.
        limit = min(self.cfg.max_model_len, self.n_blocks * self.bs - 1)
        if s.num_tokens + s.out_len > limit:
            s.out_len = max(1, limit - s.num_tokens)
            s.max_tokens = min(s.max_tokens, s.out_len)
        if s.num_tokens >= limit:
            s.state = DONE
            self.stats.finished["error"] += 1
            self.sink.on_finish(t, s, "error")
            return s
        self.seqs[s.id] = s
        self.waiting.append(s)
        if s.patience is not None:
            heapq.heappush(self._deadlines, (t + s.patience, s.order, s))
            self.min_patience = s.patience if self.min_patience is None else min(self.min_patience, s.patience)
        return s

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapping_in)

    @property
    def kv_usage(self) -> float:
        return 1.0 - (self.free_uncached + self.cached) / self.n_blocks

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapping_in)

    def next_internal_event(self) -> float | None:
        """When an idle engine can next make progress by itself (an async swap-in completing)."""
        return min((s.ready_t for s in self.swapping_in), default=None)

    def next_deadline(self) -> float | None:
        """Earliest time a waiting client may give up (lazy: may be earlier than the real one)."""
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, until: float, inclusive: bool = False) -> list[tuple[float, Seq]]:
        """Cancel clients whose silence exceeded their patience before ``until``; returns (t, seq)."""
        out = []
        dl = self._deadlines
        while dl and (dl[0][0] < until or (inclusive and dl[0][0] <= until)):
            _, _, s = heapq.heappop(dl)
            if s.state == DONE or s.patience is None:
                continue
            real = s.last_t + s.patience
            if real < until or (inclusive and real <= until):
                out.append((real, s))
            else:
                heapq.heappush(dl, (real, s.order, s))
        out.sort(key=lambda x: x[0])
        for t, s in out:
            self.cancel(s, t)
        return out

    def cancel(self, s: Seq, t: float) -> None:
        """The client went away (disconnect or patience): abort inside the engine."""
        if s.state == DONE or s.cancelled:
            return
        state = s.state
        cause = "queue"
        if s.preempted_at is not None:
            cause = "preemption"
        elif state == RUNNING and t - s.last_t > self.cfg.itl_target_s:
            cause = "slow_step"
        self.sink.on_cancel(t, s)
        self.sink.on_truth(TruthRecord(t, "cancel", s.id, {
            "state": state, "cause": cause, "silent_s": round(t - s.last_t, 6), "generated": s.generated}))
        self.stats.finished["abort"] += 1
        p = self._inflight
        if p is not None and s.state == RUNNING:
            # in the step in flight: it produces nothing (its share of the step time stays spent)
            for lst in (p.dec, p.sched, p.prefills):
                if s in lst:
                    lst.remove(s)
        s.cancelled = True
        self._retire(s)

    def _retire(self, s: Seq) -> None:
        if s.state == RUNNING:
            self.running.remove(s)
        elif s.state in (WAITING, SWAPPED):
            try:
                self.waiting.remove(s)
            except ValueError:
                pass
        elif s.state == SWAPPING_IN:
            self.swapping_in.remove(s)
        if s.host_blocks:
            self.host_used -= s.host_blocks
            s.host_blocks = 0
        self._free_all(s, keep_private_cache=False)
        self._drop_private_cache(s)
        s.state = DONE
        self.seqs.pop(s.id, None)

    # --- block pool ------------------------------------------------------------------------------

    def available(self) -> int:
        return self.free_uncached + self.cached

    def _take(self, k: int) -> None:
        """Allocate k uncomputed blocks (evicting cached ones, least recently freed first)."""
        if k <= self.free_uncached:
            self.free_uncached -= k
            return
        k -= self.free_uncached
        self.free_uncached = 0
        lru = self.lru
        while k > 0:
            key, cnt = next(iter(lru.items()))
            take = min(cnt, k)
            k -= take
            self.cached -= take
            if take == cnt:
                del lru[key]
            else:
                lru[key] = cnt - take
            if key[0] == "p":
                self.prefixes[key[1]].resident -= take

    def _cache_add(self, key: tuple[str, str], k: int) -> None:
        if k <= 0:
            return
        self.lru[key] = self.lru.pop(key, 0) + k
        self.cached += k

    def _cache_remove(self, key: tuple[str, str], k: int) -> None:
        cnt = self.lru.get(key, 0)
        if k <= 0 or not cnt:
            return
        k = min(k, cnt)
        self.cached -= k
        if k == cnt:
            del self.lru[key]
        else:
            self.lru[key] = cnt - k

    def _drop_private_cache(self, s: Seq) -> None:
        cnt = self.lru.pop(("r", s.id), 0)
        if cnt:
            self.cached -= cnt
            self.free_uncached += cnt

    def _release_prefix(self, s: Seq) -> None:
        if not s.shared:
            return
        p = self.prefixes[s.prefix_id]  # type: ignore[index]
        p.holders.pop(s.id, None)
        new_held = max(p.holders.values(), default=0)
        self._cache_add(("p", s.prefix_id), p.held - new_held)  # type: ignore[arg-type]
        p.held = new_held
        if p.materialiser == s.id:
            p.materialiser = None
        s.shared = 0

    def _free_all(self, s: Seq, keep_private_cache: bool) -> dict[str, int]:
        """Free a sequence's blocks: private ones to the pool (full ones stay cached if asked),
        shared prefix blocks only lose a reference. Returns what happened for truth records."""
        private = s.blocks - s.shared
        shared = s.shared
        cached_private = 0
        if keep_private_cache and self.cfg.prefix_caching:
            cached_private = max(0, min(private, s.computed // self.bs - s.shared))
        # Tail blocks go into the LRU first, so they are evicted before the head (vLLM order).
        self.free_uncached += private - cached_private
        self._cache_add(("r", s.id), cached_private)
        self._release_prefix(s)
        if s.materialising:
            s.materialising = False
            p = self.prefixes.get(s.prefix_id)  # type: ignore[arg-type]
            if p is not None and p.materialiser == s.id:
                p.materialiser = None
        s.blocks = 0
        return {"private_blocks": private, "shared_blocks": shared, "cached_private_blocks": cached_private}

    def _lookup(self, s: Seq) -> tuple[int, int]:
        """Prefix-cache hit for a sequence about to be scheduled: (shared blocks, own cached blocks)."""
        if not self.cfg.prefix_caching:
            return 0, 0
        full = (s.num_tokens - 1) // self.bs  # the last token is always computed
        sh, pb = 0, 0
        if s.prefix_id is not None:
            pb = min(s.prefix_tokens // self.bs, full)
            p = self.prefixes.get(s.prefix_id)
            sh = min(p.resident, pb) if p else 0
        own = 0
        if sh == pb:
            own = min(self.lru.get(("r", s.id), 0), full - sh)
        return sh, own

    def _acquire(self, s: Seq, sh: int, own: int) -> None:
        """Take the hit blocks found by ``_lookup`` (they leave the cache / gain a reference)."""
        if sh:
            p = self.prefixes[s.prefix_id]  # type: ignore[index]
            if sh > p.held:
                self._cache_remove(("p", s.prefix_id), sh - p.held)  # type: ignore[arg-type]
                p.held = sh
            p.holders[s.id] = sh
        if own:
            self._cache_remove(("r", s.id), own)
        self._drop_private_cache(s)  # blocks past the hit can never be reused (hash chain broken)
        s.blocks = sh + own
        s.shared = sh
        s.computed = (sh + own) * self.bs
        if s.prefix_id is not None:
            p = self.prefixes.setdefault(s.prefix_id, _Prefix())
            pb = s.prefix_tokens // self.bs
            if sh < pb and p.materialiser is None and self.cfg.prefix_caching:
                p.materialiser = s.id
                s.materialising = True

    def _materialise(self, s: Seq) -> None:
        """Prefix blocks this sequence has computed become shared, hashed prefix blocks."""
        p = self.prefixes[s.prefix_id]  # type: ignore[index]
        pb = s.prefix_tokens // self.bs
        new = min(pb, s.computed // self.bs, s.blocks)
        if new > s.shared:
            if new > p.resident:
                p.resident = new
            p.holders[s.id] = new
            if new > p.held:
                p.held = new
            s.shared = new
        if new >= pb:
            s.materialising = False
            p.materialiser = None

    def _can_take(self, need: int, prio: int) -> bool:
        avail = self.free_uncached + self.cached
        if need > avail:
            return False
        if self.reserved:
            keep = sum(v for p, v in self.reserved.items() if p < prio)
            if keep:
                used = self.n_blocks - avail
                return used + need <= self.n_blocks - keep
        return True

    # --- link (swap) ---------------------------------------------------------------------------

    def _transfer_s(self, nbytes: float) -> float:
        sw = self.cfg.swap
        g = sw.copy_bytes or self.cfg.block_bytes
        copies = -(-int(nbytes) // g)
        return copies * sw.copy_overhead_s + nbytes / sw.link_bytes_per_s

    # --- preemption ----------------------------------------------------------------------------

    def _preempt(self, v: Seq, t: float) -> float | None:
        """Preempt ``v`` (already chosen). Returns the time a blocking swap-out ends, else None."""
        self.running.remove(v)
        self.stats.preempt_events += 1
        v.n_preempts += 1
        v.pending_preempts += 1
        v.preempted_at = v.last_t if v.preempted_at is None else v.preempted_at
        ctx = v.computed
        mode = self.cfg.preemption_mode
        done_t = None
        private = v.blocks - v.shared
        bb = self.cfg.block_bytes
        data: dict[str, Any] = {"mode": mode, "context_tokens": ctx, "generated": v.generated,
                                "kv_usage": round(self.kv_usage, 4), "cause": "kv_full"}
        if mode == "swap" and private * bb <= self.cfg.swap.host_capacity_bytes - self.host_used * bb:
            nbytes = private * bb
            dur = self._transfer_s(nbytes)
            start = max(t, self.link_out_free)
            done_t = start + dur
            self.link_out_free = done_t
            self.stats.offload_bytes["GPU_to_CPU"] += nbytes
            self.stats.offload_time["GPU_to_CPU"] += dur
            freed = self._free_all(v, keep_private_cache=False)
            v.host_blocks = private
            self.host_used += private
            v.out_done = done_t
            v.state = SWAPPED
            data.update(freed, swap_out_bytes=nbytes, swap_out_s=round(dur, 6))
            if self.cfg.swap.overlap:
                done_t = None
        else:
            if mode == "swap":
                data["mode"] = "recompute"
                data["fallback"] = "host_full"
            freed = self._free_all(v, keep_private_cache=True)
            v.computed = 0
            v.state = WAITING
            data.update(freed)
        v.resume_info = data
        self.waiting.appendleft(v)
        self.sink.on_truth(TruthRecord(t, "preempt", v.id, dict(data)))
        return done_t

    # --- one engine step -----------------------------------------------------------------------

    def step(self, hook: Any = None) -> bool:
        """Schedule and run one step starting at ``self.t``. ``hook(t_end)`` runs before outputs
        are committed (the caller delivers arrivals, cancels and scrapes that fall inside the step).
        Returns False when there was nothing to run (time does not move)."""
        plan = self.plan()
        if plan is None:
            return False
        if plan.t_end is None:
            return True
        if hook is not None:
            hook(plan.t_end)
        self.commit(plan)
        return True

    def plan(self) -> StepPlan | None:
        """Schedule one step at ``self.t`` (admissions, allocations, preemptions happen now).
        None: nothing to run. A plan with ``t_end`` None: only blocking swap-outs ran (time moved).
        Between ``plan`` and ``commit`` the caller may add requests and cancel them."""
        t0 = self.t
        cfg = self.cfg
        bs = self.bs
        if self.swapping_in:
            for s in [x for x in self.swapping_in if x.ready_t <= t0]:
                self.swapping_in.remove(s)
                s.state = RUNNING
                insort(self.running, s, key=_key)
        budget = self.budget
        sched: list[Seq] = []  # everything that is not a plain decode (prefill chunks, resumes)
        dec: list[Seq] = []
        block_until = t0
        preempted = False
        ctx_sum = 0
        pf_cost = 0.0
        pf_tokens = 0
        prefills: list[Seq] = []
        a = cfg.step.prefill_token_s
        ak = a * cfg.step.k_att
        running = self.running
        n_slow_dec = 0
        # Iterating while preempting is safe: victims are always taken from the end of the list.
        for s in running:
            if budget <= 0:
                break
            c = s.computed
            n = s.num_tokens - c
            if n == 1:
                if c >= s.blocks * bs:
                    ok = self._grow(s, 1, t0, running)
                    if self._last_swap_done > block_until:
                        block_until = self._last_swap_done
                    if self._preempted_flag:
                        preempted = True
                    if not ok:
                        break  # s itself was the victim (it was last)
                ctx_sum += c
                budget -= 1
                if s.generated and not s.pending_preempts:
                    dec.append(s)  # plain decode: the commit fast path
                else:
                    s.n_sched = 1
                    n_slow_dec += 1
                    sched.append(s)
                continue
            n = min(n, budget)
            need = -(-(c + n) // bs) - s.blocks
            if need > 0:
                ok = self._grow(s, need, t0, running)
                if self._last_swap_done > block_until:
                    block_until = self._last_swap_done
                if self._preempted_flag:
                    preempted = True
                if not ok:
                    break
            s.n_sched = n
            pf_cost += a * n + ak * ((c + n) * (c + n) - c * c)
            pf_tokens += n
            prefills.append(s)
            budget -= n
            sched.append(s)
        n_dec = len(dec) + n_slow_dec
        if not preempted:
            budget, w_cost, w_tokens, w_block, w_dec, w_ctx = self._admit(t0, budget, sched, prefills)
            pf_cost += w_cost
            pf_tokens += w_tokens
            n_dec += w_dec
            ctx_sum += w_ctx
            if w_block > block_until:
                block_until = w_block
        if not sched and not dec:
            if block_until > t0:
                self.t = block_until  # only swap-outs happened: the link kept the engine busy
                return StepPlan(t0, None, dec, sched, 0, 0, 0.0, 0.0, 0.0, prefills)
            return None
        st = cfg.step
        dec_cost = st.fixed_s + st.decode_seq_s * n_dec + st.decode_ctx_token_s * ctx_sum
        t_end = block_until + dec_cost + pf_cost
        plan = StepPlan(t0, t_end, dec, sched, n_dec, pf_tokens, dec_cost, pf_cost, block_until - t0, prefills)
        self._inflight = plan
        return plan

    def commit(self, p: StepPlan) -> None:
        """Finish a planned step at its ``t_end``: tokens, finishes, counters, truth labels."""
        assert p.t_end is not None
        self._inflight = None
        self._commit(p.dec, p.sched, p.t0, p.t_end, p.n_dec, p.pf_tokens, p.dec_cost, p.pf_cost, p.blocked_s,
                     p.prefills)
        self.t = p.t_end

    _last_swap_done = 0.0
    _preempted_flag = False

    def _grow(self, s: Seq, need: int, t: float, running: list[Seq]) -> bool:
        """Give s ``need`` more blocks, preempting from the back of the running list if needed.
        False when s itself was preempted. Sets ``_last_swap_done`` / ``_preempted_flag``."""
        self._last_swap_done = t
        self._preempted_flag = False
        while self.available() < need:
            victim = running[-1]
            self._preempted_flag = True
            done = self._preempt(victim, t)
            if done is not None and done > self._last_swap_done:
                self._last_swap_done = done
            if victim is s:
                return False
        self._take(need)
        s.blocks += need
        return True

    def _admit(self, t0: float, budget: int, sched: list[Seq],
               prefills: list[Seq]) -> tuple[int, float, int, float, int, int]:
        """Admit waiting sequences (preempted ones are at the front) while room remains."""
        cfg = self.cfg
        bs = self.bs
        a = cfg.step.prefill_token_s
        ak = a * cfg.step.k_att
        pf_cost = 0.0
        pf_tokens = 0
        block_until = t0
        n_dec_added = 0
        ctx_added = 0
        waiting = self.waiting
        max_seqs = cfg.max_num_seqs
        skipped: list[Seq] = []
        while waiting and budget > 0 and len(self.running) + len(self.swapping_in) < max_seqs:
            s = waiting[0]
            sh, own = self._lookup(s)
            if s.state == SWAPPED:
                total = -(-s.num_tokens // bs)
                need = total - sh
                hit_cached = self._cached_hits(s, sh, 0)
                if not self._can_take(need + hit_cached, s.priority):
                    if self.reserved and need + hit_cached <= self.available():
                        skipped.append(waiting.popleft())
                        continue
                    break
                waiting.popleft()
                self._take(need)
                p_sh = sh
                if p_sh:
                    self._acquire_shared_only(s, p_sh)
                s.blocks = total
                moved = (-(-s.computed // bs) - p_sh) * cfg.block_bytes
                moved = max(0, moved)
                dur = self._transfer_s(moved)
                start = max(t0, self.link_in_free, s.out_done)
                done = start + dur
                self.link_in_free = done
                self.stats.offload_bytes["CPU_to_GPU"] += moved
                self.stats.offload_time["CPU_to_GPU"] += dur
                self.host_used -= s.host_blocks
                s.host_blocks = 0
                if s.resume_info is not None:
                    s.resume_info["readmit_t"] = t0
                    s.resume_info["swap_in_bytes"] = moved
                    s.resume_info["swap_in_s"] = round(dur, 6)
                if cfg.swap.overlap:
                    s.state = SWAPPING_IN
                    s.ready_t = done
                    self.swapping_in.append(s)
                    continue
                if done > block_until:
                    block_until = done
                s.state = RUNNING
                insort(self.running, s, key=_key)
                s.n_sched = 1
                n_dec_added += 1
                ctx_added += s.computed
                budget -= 1
                sched.append(s)
                continue
            full_new = s.num_tokens - (sh + own) * bs
            if not cfg.chunked_prefill and full_new > budget:
                break
            n = min(full_new, budget)
            need = -(-((sh + own) * bs + n) // bs) - (sh + own)
            # Hit blocks that sit in the cache are not free for this request's new blocks.
            if not self._can_take(need + self._cached_hits(s, sh, own), s.priority):
                if self.reserved and need <= self.available() - self._cached_hits(s, sh, own):
                    skipped.append(waiting.popleft())
                    continue
                break
            waiting.popleft()
            if not s.counted_prefix:
                s.counted_prefix = True
                self.stats.prefix_queries += s.num_tokens
                self.stats.prefix_hits += (sh + own) * bs
            if s.resume_info is not None:
                s.resume_info["readmit_t"] = t0
                s.resume_info["hit_tokens"] = (sh + own) * bs
                s.resume_info["recompute_tokens"] = full_new
            self._acquire(s, sh, own)
            self._take(need)
            s.blocks += need
            s.state = RUNNING
            insort(self.running, s, key=_key)
            s.n_sched = n
            c = s.computed
            pf_cost += a * n + ak * ((c + n) * (c + n) - c * c)
            pf_tokens += n
            prefills.append(s)
            budget -= n
            sched.append(s)
        for s in reversed(skipped):
            waiting.appendleft(s)
        return budget, pf_cost, pf_tokens, block_until, n_dec_added, ctx_added

    def _cached_hits(self, s: Seq, sh: int, own: int) -> int:
        n = own
        if sh and s.prefix_id is not None:
            n += max(0, sh - self.prefixes[s.prefix_id].held)
        return n

    def _acquire_shared_only(self, s: Seq, sh: int) -> None:
        p = self.prefixes[s.prefix_id]  # type: ignore[index]
        if sh > p.held:
            self._cache_remove(("p", s.prefix_id), sh - p.held)  # type: ignore[arg-type]
            p.held = sh
        p.holders[s.id] = sh
        s.shared = sh

    def _commit(self, dec: list[Seq], sched: list[Seq], t0: float, t_end: float, n_dec: int, pf_tokens: int,
                dec_cost: float, pf_cost: float, blocked_s: float, prefills: list[Seq]) -> None:
        st = self.stats
        st.steps += 1
        dt = t_end - t0
        st.iteration_tokens.observe(float(n_dec + pf_tokens))
        stall = dt > self.cfg.itl_target_s
        affected: list[str] = []
        if stall:
            affected = [s.id for s in dec if s.last_t == t0]
            affected += [s.id for s in sched if s.n_sched == 1 and s.generated and s.last_t == t0]
        finished: list[Seq] = []
        itl = st.itl
        irregular = 0
        # plain decodes: one token each, no first tokens, no resumes (the hot loop)
        for s in dec:
            s.computed += 1
            s.num_tokens += 1
            s.generated = g = s.generated + 1
            lt = s.last_t
            if lt != t0:
                irregular += 1
                itl.observe(t_end - lt)
            s.last_t = t_end
            if g >= s.out_len:
                finished.append(s)
        same = len(dec) - irregular
        emitted = dec
        if sched:
            emitted = list(dec)
            for s in sched:
                s.computed += s.n_sched
                if s.materialising:
                    self._materialise(s)
                info = s.resume_info
                if info is not None and "recovered_t" not in info and s.computed >= info["context_tokens"]:
                    info["recovered_t"] = t_end
                if s.computed != s.num_tokens:
                    continue  # a prefill chunk that does not finish the prompt
                s.num_tokens += 1
                s.generated += 1
                if s.generated == 1:
                    s.first_t = t_end
                    st.ttft.observe(t_end - s.arrival_t)
                    st.prompt_tokens += s.prompt
                elif s.last_t == t0:
                    same += 1
                else:
                    itl.observe(t_end - s.last_t)
                if s.pending_preempts:
                    self._resumed(s, t_end)
                s.last_t = t_end
                emitted.append(s)
                if s.generated >= s.out_len:
                    finished.append(s)
        if same:
            itl.observe(dt, same)
        st.generation_tokens += len(emitted)
        if emitted:
            self.sink.on_tokens(t_end, emitted)
        for s in finished:
            reason = "length" if s.generated >= s.max_tokens else "stop"
            st.finished[reason] += 1
            st.e2e.observe(t_end - s.arrival_t)
            self.running.remove(s)
            self._free_all(s, keep_private_cache=False)
            s.state = DONE
            self.seqs.pop(s.id, None)
            self.sink.on_finish(t_end, s, reason)
        if stall:
            self._label_stall(t0, t_end, dec_cost, pf_cost, blocked_s, prefills, affected, n_dec)
        elif self._slow_run is not None:
            self._close_slow_run()

    def _resumed(self, s: Seq, t_end: float) -> None:
        """The victim's first output after a preemption: vLLM V1 counts the preemption now."""
        counted = s.pending_preempts
        self.stats.preemptions += counted
        s.pending_preempts = 0
        info = s.resume_info or {}
        self.sink.on_truth(TruthRecord(t_end, "resume", s.id, {
            **{k: v for k, v in info.items() if k in ("mode", "hit_tokens", "recompute_tokens",
                                                       "swap_out_s", "swap_in_s", "fallback")},
            "t_start": s.preempted_at, "t_end": t_end,
            "stall_s": round(t_end - (s.preempted_at or t_end), 6), "cause": "preemption",
            # wait: queued until memory was free again; resume: the mechanism's own cost, from
            # readmission until the KV the victim had when preempted is back on the GPU
            "wait_s": round(info.get("readmit_t", t_end) - (s.preempted_at or t_end), 6),
            "resume_s": round(info.get("recovered_t", t_end) - info.get("readmit_t", t_end), 6),
            "preemptions": s.n_preempts, "counted": counted}))
        s.preempted_at = None
        s.resume_info = None

    def _label_stall(self, t0: float, t_end: float, dec_cost: float, pf_cost: float, blocked_s: float,
                     prefills: list[Seq], affected: list[str], n_dec: int) -> None:
        target = self.cfg.itl_target_s
        if dec_cost > target:
            r = self._slow_run
            if r is None:
                self._slow_run = {"t_start": t0, "t_end": t_end, "steps": 1, "max_step_s": t_end - t0,
                                  "max_batch": n_dec, "cause": "slow_decode"}
            else:
                r["t_end"] = t_end
                r["steps"] += 1
                r["max_step_s"] = max(r["max_step_s"], t_end - t0)
                r["max_batch"] = max(r["max_batch"], n_dec)
            return
        if self._slow_run is not None:
            self._close_slow_run()
        if not affected:
            return
        if pf_cost >= blocked_s:
            main = max(prefills, key=lambda s: s.n_sched) if prefills else None
            self.sink.on_truth(TruthRecord(t0, "prefill_stall", main.id if main else None, {
                "t_start": t0, "t_end": t_end, "step_s": round(t_end - t0, 6), "cause": "prefill_interference",
                "affected": affected, "prefill_requests": [s.id for s in prefills],
                "prefill_tokens": sum(s.n_sched for s in prefills),
                "recompute": any(s.n_preempts > 0 for s in prefills),
                "decode_only_s": round(dec_cost, 6)}))
        else:
            self.sink.on_truth(TruthRecord(t0, "swap_stall", None, {
                "t_start": t0, "t_end": t_end, "step_s": round(t_end - t0, 6), "cause": "swap_blocking",
                "affected": affected, "blocked_s": round(blocked_s, 6)}))

    def _close_slow_run(self) -> None:
        r = self._slow_run
        self._slow_run = None
        if r is not None:
            r["max_step_s"] = round(r["max_step_s"], 6)
            self.sink.on_truth(TruthRecord(r["t_start"], "slow_step", None, r))

    def flush_truth(self) -> None:
        """Emit truth records still being accumulated (call at the end of a run)."""
        self._close_slow_run()

    # --- checks (tests) -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        held_private = 0
        for s in self.seqs.values():
            if s.state in (RUNNING, SWAPPING_IN) or (s.state == WAITING and s.blocks):
                held_private += s.blocks - s.shared
        prefix_resident = sum(p.resident for p in self.prefixes.values())
        private_cached = sum(c for k, c in self.lru.items() if k[0] == "r")
        total = self.free_uncached + held_private + prefix_resident + private_cached
        assert total == self.n_blocks, (total, self.n_blocks, self.free_uncached, held_private, prefix_resident,
                                        private_cached)
        assert self.cached == sum(self.lru.values())
        for pid, p in self.prefixes.items():
            assert p.held == max(p.holders.values(), default=0)
            assert self.lru.get(("p", pid), 0) == p.resident - p.held, (pid, p.resident, p.held)


def _key(s: Seq) -> tuple[int, int]:
    return s.key
