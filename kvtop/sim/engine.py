"""A step-level discrete-event model of a paged-KV serving engine (vLLM V1-like): the scheduler.

The ``Engine`` takes requests in, runs steps, and reports tokens, finishes, cancels and truth
labels to a ``Sink`` (``kvtop.sim.stats``). It composes:

- ``kvtop.sim.blocks.BlockPool``: free / cached / held blocks and shared-prefix refcounts;
- ``kvtop.sim.preemption.Preemptor``: evicting a victim (recompute or swap), the swap link,
  resume accounting;
- ``kvtop.sim.truth.StallLabeller``: why a long step stalled its streams.

Scheduling per step: running sequences first (decode, unfinished prefill chunks), then waiting ones
(preempted first) while ``max_num_seqs`` and the token budget allow; no admission in a step that
preempted. A running sequence that needs a block when none is free preempts the least important,
most recently arrived running sequence (possibly itself).

The engine never builds per-token objects: one step advances every scheduled sequence, and the
per-step work is a tight loop over the batch.
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections import deque
from collections.abc import Callable

from kvtop.sim.blocks import BlockPool, Prefix
from kvtop.sim.preemption import Preemptor
from kvtop.sim.seq import DONE, RUNNING, SWAPPED, SWAPPING_IN, WAITING, Seq, StepPlan, order_key
from kvtop.sim.stats import Sink, Stats
from kvtop.sim.truth import StallLabeller, cancel_record, stalled_streams
from kvtop.sim.workload import EngineConfig, RequestSpec

# Names other modules imported from here before the split.
__all__ = ["Engine", "Seq", "Sink", "StepPlan"]


class Engine:
    def __init__(self, cfg: EngineConfig, sink: Sink | None = None, t0: float = 0.0):
        self.cfg = cfg
        self.sink = sink or Sink()
        self.t = t0
        self.bs = cfg.block_size
        self.n_blocks = cfg.num_gpu_blocks
        self.pool = BlockPool(cfg.num_gpu_blocks, cfg.block_size, cfg.prefix_caching)
        self.stats = Stats()
        self.preemptor = Preemptor(cfg, self.pool, self.stats, self.sink, t0)
        self.truth = StallLabeller(cfg.itl_target_s, self.sink)
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.swapping_in: list[Seq] = []
        self.seqs: dict[str, Seq] = {}
        self._order = 0
        self._deadlines: list[tuple[float, int, Seq]] = []
        self.min_patience: float | None = None
        self._inflight: StepPlan | None = None
        self.budget = cfg.max_num_batched_tokens if cfg.chunked_prefill else max(cfg.max_num_batched_tokens,
                                                                                 cfg.max_model_len)

    # --- requests in and out -------------------------------------------------------------------

    def set_reservations(self, by_priority: dict[int, float]) -> None:
        """KV share reserved for classes at least as important as each priority (0..1 of blocks).

        A request of priority p may not take a block that would leave fewer free blocks than the
        reservations of strictly more important priorities.
        """
        self.pool.set_reservations(by_priority)

    def add(self, spec: RequestSpec, t: float | None = None, user: object = None) -> Seq:
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
        return self.pool.usage

    def available(self) -> int:
        return self.pool.available()

    @property
    def prefixes(self) -> dict[str, Prefix]:
        return self.pool.prefixes

    @property
    def host_used(self) -> int:
        """Blocks held in host memory by swapped-out sequences."""
        return self.preemptor.host_used

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
        rec = cancel_record(t, s, self.cfg.itl_target_s)
        self.sink.on_cancel(t, s)
        self.sink.on_truth(rec)
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
        self.preemptor.release_host(s)
        self.pool.free_all(s, keep_private_cache=False)
        self.pool.drop_private_cache(s)
        s.state = DONE
        self.seqs.pop(s.id, None)

    # --- one engine step -----------------------------------------------------------------------

    def step(self, hook: Callable[[float], None] | None = None) -> bool:
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
                insort(self.running, s, key=order_key)
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
        pool = self.pool
        self._last_swap_done = t
        self._preempted_flag = False
        while pool.available() < need:
            victim = running[-1]
            self._preempted_flag = True
            done = self._preempt(victim, t)
            if done is not None and done > self._last_swap_done:
                self._last_swap_done = done
            if victim is s:
                return False
        pool.take(need)
        s.blocks += need
        return True

    def _preempt(self, v: Seq, t: float) -> float | None:
        """Preempt ``v`` (already chosen); it goes to the front of the queue. Returns the time a
        blocking swap-out ends, else None."""
        self.running.remove(v)
        done = self.preemptor.preempt(v, t)
        self.waiting.appendleft(v)
        return done

    def _admit(self, t0: float, budget: int, sched: list[Seq],
               prefills: list[Seq]) -> tuple[int, float, int, float, int, int]:
        """Admit waiting sequences (preempted ones are at the front) while room remains."""
        cfg = self.cfg
        bs = self.bs
        pool = self.pool
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
            sh, own = pool.lookup(s)
            if s.state == SWAPPED:
                total = -(-s.num_tokens // bs)
                need = total - sh
                hit_cached = pool.cached_hits(s, sh, 0)
                if not pool.can_take(need + hit_cached, s.priority):
                    if pool.reserved and need + hit_cached <= pool.available():
                        skipped.append(waiting.popleft())
                        continue
                    break
                waiting.popleft()
                pool.take(need)
                p_sh = sh
                if p_sh:
                    pool.acquire_shared_only(s, p_sh)
                s.blocks = total
                done = self.preemptor.swap_in(s, t0, p_sh)
                if cfg.swap.overlap:
                    s.state = SWAPPING_IN
                    s.ready_t = done
                    self.swapping_in.append(s)
                    continue
                if done > block_until:
                    block_until = done
                s.state = RUNNING
                insort(self.running, s, key=order_key)
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
            if not pool.can_take(need + pool.cached_hits(s, sh, own), s.priority):
                if pool.reserved and need <= pool.available() - pool.cached_hits(s, sh, own):
                    skipped.append(waiting.popleft())
                    continue
                break
            waiting.popleft()
            if not s.counted_prefix:
                s.counted_prefix = True
                self.stats.prefix_queries += s.num_tokens
                self.stats.prefix_hits += (sh + own) * bs
            if s.resume_info is not None:
                Preemptor.note_readmit(s, t0, (sh + own) * bs, full_new)
            pool.acquire(s, sh, own)
            pool.take(need)
            s.blocks += need
            s.state = RUNNING
            insort(self.running, s, key=order_key)
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

    def _commit(self, dec: list[Seq], sched: list[Seq], t0: float, t_end: float, n_dec: int, pf_tokens: int,
                dec_cost: float, pf_cost: float, blocked_s: float, prefills: list[Seq]) -> None:
        st = self.stats
        st.steps += 1
        dt = t_end - t0
        stall = dt > self.cfg.itl_target_s
        affected = stalled_streams(dec, sched, t0) if stall else []
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
        first_prompts = 0
        emitted = dec
        if sched:
            emitted = list(dec)
            for s in sched:
                s.computed += s.n_sched
                if s.materialising:
                    self.pool.materialise(s)
                if s.resume_info is not None:
                    Preemptor.note_progress(s, t_end)
                if s.computed != s.num_tokens:
                    continue  # a prefill chunk that does not finish the prompt
                s.num_tokens += 1
                s.generated += 1
                if s.generated == 1:
                    s.first_t = t_end
                    st.ttft.observe(t_end - s.arrival_t)
                    st.prompt_tokens += s.prompt
                    first_prompts += s.prompt
                elif s.last_t == t0:
                    same += 1
                else:
                    itl.observe(t_end - s.last_t)
                if s.pending_preempts:
                    self.preemptor.resumed(s, t_end)
                s.last_t = t_end
                emitted.append(s)
                if s.generated >= s.out_len:
                    finished.append(s)
        if same:
            itl.observe(dt, same)
        st.generation_tokens += len(emitted)
        # vLLM V1 semantics: generated tokens + whole prompts of requests whose prefill finished in this
        # step; prefill chunks before that and a victim's recomputed tokens are in no token counter
        st.iteration_tokens.observe(float(len(emitted) + first_prompts))
        if emitted:
            self.sink.on_tokens(t_end, emitted)
        for s in finished:
            reason = "length" if s.generated >= s.max_tokens else "stop"
            st.finished[reason] += 1
            st.e2e.observe(t_end - s.arrival_t)
            self.running.remove(s)
            self.pool.free_all(s, keep_private_cache=False)
            s.state = DONE
            self.seqs.pop(s.id, None)
            self.sink.on_finish(t_end, s, reason)
        if stall:
            self.truth.stall(t0, t_end, dec_cost, pf_cost, blocked_s, prefills, affected, n_dec)
        else:
            self.truth.smooth(t_end)

    def flush_truth(self) -> None:
        """Emit truth records still being accumulated (call at the end of a run)."""
        self.truth.close_slow_run(self.t)

    # --- checks (tests) -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.pool.check_invariants(
            s for s in self.seqs.values()
            if s.state in (RUNNING, SWAPPING_IN) or (s.state == WAITING and s.blocks))

