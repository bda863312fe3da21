"""The simulated engine's parts on their own: block pool, preemption + swap link, stall labels."""

from __future__ import annotations

import pytest

from kvtop.model.records import TruthRecord
from kvtop.sim.blocks import BlockPool
from kvtop.sim.preemption import Preemptor
from kvtop.sim.seq import RUNNING, SWAPPED, WAITING, Seq
from kvtop.sim.stats import Sink, Stats
from kvtop.sim.truth import StallLabeller
from kvtop.sim.workload import EngineConfig, RequestSpec, SwapConfig


class Truths(Sink):
    def __init__(self) -> None:
        self.recs: list[TruthRecord] = []

    def on_truth(self, rec: TruthRecord) -> None:
        self.recs.append(rec)


def seq(i: int, prompt: int, prefix: str | None = None, prefix_tokens: int = 0, priority: int = 0) -> Seq:
    return Seq(RequestSpec(f"r{i}", 0.0, "c", prompt, 100, 100, None, priority, prefix, prefix_tokens), i, 0.0)


def run_prefill(pool: BlockPool, s: Seq) -> None:
    """Admit ``s`` and compute its whole prompt, as the scheduler does."""
    sh, own = pool.lookup(s)
    pool.acquire(s, sh, own)
    need = -(-s.num_tokens // pool.bs) - s.blocks
    pool.take(need)
    s.blocks += need
    s.computed = s.num_tokens
    if s.materialising:
        pool.materialise(s)
    s.state = RUNNING


def test_pool_evicts_a_victims_own_cached_blocks_before_the_shared_prefix_it_used():
    pool = BlockPool(20, 16)
    a = seq(0, 160, "sys", 64)  # 10 blocks: a 4-block shared prefix + 6 private
    run_prefill(pool, a)
    assert pool.prefixes["sys"].resident == 4 and a.shared == 4 and pool.available() == 10
    pool.check_invariants([a])
    # preempted for recompute: its 6 full private blocks and the unreferenced prefix stay cached
    freed = pool.free_all(a, keep_private_cache=True)
    a.state = WAITING
    assert freed == {"private_blocks": 6, "shared_blocks": 4, "cached_private_blocks": 6}
    assert pool.available() == 20 and pool.cached == 10 and pool.free_uncached == 10
    pool.check_invariants([])
    # a newcomer with the same prefix would hit all 4 prefix blocks; they sit in the cache
    b = seq(1, 100, "sys", 64)
    assert pool.lookup(b) == (4, 0) and pool.cached_hits(b, 4, 0) == 4
    # allocating 13 blocks takes the 10 free ones, then evicts 3 of the victim's tail blocks ...
    pool.take(13)
    assert pool.lookup(a) == (4, 3) and pool.prefixes["sys"].resident == 4
    # ... 5 more evict its last 3 and then 2 prefix blocks (the prefix's tail)
    pool.take(5)
    assert pool.lookup(a) == (2, 0) and pool.lookup(b) == (2, 0)
    assert pool.available() == 2


def test_pool_prefix_is_freed_only_when_its_last_holder_leaves():
    pool = BlockPool(40, 16)
    holders = [seq(i, 130, "sys", 96) for i in range(3)]  # 6 prefix blocks + 3 private each
    for s in holders:
        run_prefill(pool, s)
    assert [s.shared for s in holders] == [6, 6, 6]
    assert pool.available() == 40 - 6 - 3 * 3  # the prefix is held once
    pool.free_all(holders[0], keep_private_cache=False)
    pool.free_all(holders[1], keep_private_cache=False)
    assert pool.cached == 0 and pool.prefixes["sys"].held == 6
    pool.free_all(holders[2], keep_private_cache=False)
    assert pool.cached == 6 and pool.prefixes["sys"].held == 0 and pool.available() == 40
    pool.check_invariants([])


def test_pool_reservation_keeps_blocks_for_more_important_priorities():
    pool = BlockPool(100, 16)
    pool.set_reservations({0: 0.3})  # 30 blocks only priority 0 may use
    assert pool.can_take(70, 1) and not pool.can_take(71, 1)
    assert pool.can_take(100, 0) and not pool.can_take(101, 0)
    pool.take(60)
    assert pool.can_take(10, 1) and not pool.can_take(11, 1) and pool.can_take(40, 0)


def swap_cfg(host_capacity_bytes: float = 64e9) -> EngineConfig:
    return EngineConfig(num_gpu_blocks=100, block_size=16, bytes_per_token=131072, preemption_mode="swap",
                        swap=SwapConfig(link_bytes_per_s=10e9, copy_overhead_s=1e-4,
                                        host_capacity_bytes=host_capacity_bytes))


def running(pool: BlockPool, i: int, prompt: int, generated: int, t: float) -> Seq:
    s = seq(i, prompt)
    run_prefill(pool, s)
    s.generated = generated
    s.last_t = t
    return s


def test_swap_out_is_timed_on_the_link_and_serialised_and_the_preemption_counted_at_resume():
    cfg = swap_cfg()
    pool, stats, sink = BlockPool(100, 16), Stats(), Truths()
    pre = Preemptor(cfg, pool, stats, sink)
    v1, v2 = running(pool, 0, 320, 5, 1.0), running(pool, 1, 160, 9, 1.0)  # 20 and 10 blocks
    block = 16 * 131072
    done1 = pre.preempt(v1, 2.0)
    done2 = pre.preempt(v2, 2.0)
    one = 20 * 1e-4 + 20 * block / 10e9  # 20 block copies
    two = 10 * 1e-4 + 10 * block / 10e9
    assert done1 == pytest.approx(2.0 + one)
    assert done2 == pytest.approx(2.0 + one + two)  # waits for the first copy on the same link
    assert v1.state == SWAPPED and pre.host_used == 30 and pool.available() == 100
    assert stats.offload_bytes["GPU_to_CPU"] == 30 * block
    assert stats.preempt_events == 2 and stats.preemptions == 0  # not yet counted (vLLM V1)
    rec = sink.recs[0]
    assert rec.event == "preempt" and rec.data["mode"] == "swap" and rec.data["swap_out_s"] == round(one, 6)
    # readmitted at t=3: copied back after its swap-out ended, on the other direction of the link
    pool.take(20)
    back = pre.swap_in(v1, 3.0, 0)
    assert back == pytest.approx(3.0 + one) and pre.host_used == 10
    v1.computed += 1
    pre.note_progress(v1, back + 0.02)
    pre.resumed(v1, back + 0.02)
    assert stats.preemptions == 1 and v1.pending_preempts == 0
    res = sink.recs[-1]
    assert res.event == "resume" and res.data["counted"] == 1 and res.data["t_start"] == 1.0
    assert res.data["wait_s"] == pytest.approx(2.0)  # preempted (last token at 1.0) until readmitted at 3.0
    assert res.data["resume_s"] == pytest.approx(one + 0.02, abs=1e-6)


def test_swap_falls_back_to_recompute_when_host_memory_is_full():
    cfg = swap_cfg(host_capacity_bytes=15 * 16 * 131072)  # room for 15 blocks
    pool, stats, sink = BlockPool(100, 16), Stats(), Truths()
    pre = Preemptor(cfg, pool, stats, sink)
    v = running(pool, 0, 320, 5, 1.0)  # 20 blocks
    assert pre.preempt(v, 2.0) is None
    assert v.state == WAITING and v.computed == 0 and pre.host_used == 0
    d = sink.recs[0].data
    assert d["mode"] == "recompute" and d["fallback"] == "host_full" and d["cached_private_blocks"] == 20
    assert stats.offload_bytes["GPU_to_CPU"] == 0


def test_consecutive_slow_decode_steps_make_one_slow_step_run():
    sink = Truths()
    lab = StallLabeller(0.1, sink)
    for k, (dur, batch) in enumerate([(0.15, 40), (0.22, 60), (0.18, 50)]):
        t0 = 1.0 + k
        lab.stall(t0, t0 + dur, dur - 0.01, 0.0, 0.0, [], ["r1"], batch)
    assert not sink.recs  # still accumulating
    lab.smooth(4.05)
    (r,) = sink.recs
    assert r.event == "slow_step" and r.t == 4.05
    assert r.data["steps"] == 3 and r.data["t_start"] == 1.0 and r.data["t_end"] == pytest.approx(3.18)
    assert r.data["max_step_s"] == 0.22 and r.data["max_batch"] == 60


def test_a_long_step_is_labelled_by_what_made_it_long():
    sink = Truths()
    lab = StallLabeller(0.1, sink)
    big, small = seq(1, 4000), seq(2, 300)
    big.n_sched, small.n_sched = 1800, 200
    lab.stall(5.0, 5.3, 0.02, 0.28, 0.0, [small, big], ["r7", "r8"], 2)
    lab.stall(6.0, 6.4, 0.02, 0.05, 0.33, [], ["r7"], 1)
    lab.stall(7.0, 7.4, 0.02, 0.38, 0.0, [big], [], 1)  # nobody was decoding through it: no label
    pf, sw = sink.recs
    assert pf.event == "prefill_stall" and pf.request_id == "r1" and pf.data["prefill_tokens"] == 2000
    assert pf.data["affected"] == ["r7", "r8"]
    assert sw.event == "swap_stall" and sw.data["blocked_s"] == 0.33
    assert len(sink.recs) == 2
