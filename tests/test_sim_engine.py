"""Behaviour of the simulated paged-KV engine (issue 3, tests 1-5), with numbers."""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from collections import defaultdict

import pytest

from kvtop.model.records import EngineRecord, RequestRecord, TruthRecord
from kvtop.sim.engine import Engine
from kvtop.sim.simulate import Simulation
from kvtop.sim.stats import Sink
from kvtop.sim.workload import EngineConfig, RequestSpec, load_preset, parse_workload


def simulate(workload, seed=1, duration=60.0, scrape=1.0, tokens=True):
    recs: list = []
    res = Simulation(workload, seed, duration, recs.append, scrape_interval_s=scrape, tokens=tokens).run()
    res.engine.check_invariants()
    return recs, res


def token_times(recs) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        if isinstance(r, RequestRecord) and r.event in ("first_token", "token"):
            out[r.id].append(r.t)
    return out


def truths(recs, event):
    return [r for r in recs if isinstance(r, TruthRecord) and r.event == event]


def max_gap(ts: list[float]) -> float:
    return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0.0)


def test_healthy_has_no_preemption_and_no_gap_above_target():
    wl = load_preset("healthy")
    recs, res = simulate(wl, duration=60)
    engines = [r for r in recs if isinstance(r, EngineRecord)]
    assert res.requests > 400  # 8 req/s for 60 s
    assert res.stats.preempt_events == 0 and engines[-1].preemptions_total == 0
    assert not truths(recs, "preempt") and not truths(recs, "prefill_stall") and not truths(recs, "slow_step")
    tt = token_times(recs).values()
    assert max(max_gap(ts) for ts in tt) < wl.engine.itl_target_s
    gaps = [b - a for ts in tt for a, b in zip(ts, ts[1:], strict=False)]
    # a decode step with ~20 streams: 6 ms fixed + 2 ms per-seq + KV reads: ~10-15 ms per token
    assert 0.008 < statistics.median(gaps) < 0.02
    # the adapter reads the page like a real vLLM's: capacity from cache_config_info
    assert engines[-1].kv_capacity_tokens == int(20e9 // (16 * 131072)) * 16 == 152576
    assert engines[-1].block_size == 16 and engines[-1].model == "sim-llama-3.1-8b"


def test_preemption_storm_counter_matches_truth_and_only_the_victim_stalls():
    recs, res = simulate(load_preset("preemption-storm"), duration=120)
    pre, resume = truths(recs, "preempt"), truths(recs, "resume")
    assert len(pre) >= 30
    last = [r for r in recs if isinstance(r, EngineRecord)][-1]
    # vLLM V1 counts a preemption when the victim produces its next output: the counter equals
    # the preemptions whose victim has resumed (each resume record carries its count).
    resumed = sum(r.data["counted"] for r in resume)
    assert res.stats.preemptions == resumed
    # the last scrape (t=120) saw every resume that happened before it
    assert last.preemptions_total == sum(r.data["counted"] for r in resume if r.t < 120)
    assert len(pre) - resumed <= 15  # the rest are still waiting at the end
    toks = token_times(recs)
    stalls = [(r.request_id, r.data["t_start"], r.data["t_end"]) for r in resume]
    checked = 0
    for rid, a, b in stalls:
        if b - a < 0.5:
            continue
        victim = toks[rid]
        # the victim is silent for the whole stall
        assert not any(a < t < b for t in victim)
        flowing = []
        for other, ts in toks.items():
            if other == rid or any(o == other and s < b and e > a for o, s, e in stalls):
                continue
            i = bisect_left(ts, a)
            if i >= len(ts) or ts[i] != a:
                continue  # not running when the victim was preempted
            window = ts[i:bisect_right(ts, b) + 1]
            if len(window) > 1:
                flowing.append(max_gap(window))
        if not flowing:
            continue  # every other stream was itself preempted during this window
        # the others keep getting tokens at the normal pace (< 100 ms) while the victim waits >= 0.5 s
        assert max(flowing) < 0.1 < 0.5 <= b - a
        checked += 1
    assert checked >= 20


def test_prefill_interference_stalls_every_running_stream_at_once_without_preemption():
    wl = load_preset("prefill-interference")
    recs, res = simulate(wl, duration=60)
    assert res.stats.preempt_events == 0 and not truths(recs, "preempt")
    toks = token_times(recs)
    prompts = {r.id: r for r in recs if isinstance(r, RequestRecord) and r.event == "arrive"}
    st = wl.engine.step
    long_steps = [r for r in truths(recs, "prefill_stall") if prompts[r.request_id].cls == "rag"]
    assert len(long_steps) >= 10  # 0.3 RAG prompts/s for ~58 s
    for r in long_steps:
        d = r.data
        p = prompts[r.request_id].prompt_tokens
        # unchunked: the whole prompt in one step, a*P + a*k_att*P^2 (docs/kv-science.md §3.1) on top of decode
        pf = st.prefill_token_s * p + st.prefill_token_s * st.k_att * p * p
        assert p >= 8000 and d["prefill_tokens"] >= p
        if len(d["prefill_requests"]) == 1:
            assert d["step_s"] == pytest.approx(pf + d["decode_only_s"], abs=2e-6)
        else:
            assert d["step_s"] > pf + d["decode_only_s"]
        assert d["step_s"] > 0.35  # 8K tokens: 0.32 s + 0.05 s attention
        running = {rid for rid, ts in toks.items() if d["t_start"] in ts and ts[-1] > d["t_start"]}
        assert running and set(d["affected"]) == running
        for rid in running:  # every one of them waits the whole step for its next token
            ts = toks[rid]
            nxt = ts[bisect_right(ts, d["t_start"])]
            assert nxt == pytest.approx(d["t_end"])
            assert nxt - d["t_start"] > 5 * wl.engine.itl_target_s / 2


def _short_swap_workload() -> dict:
    return {"name": "short", "engine": {
        "bytes_per_token": 131072, "block_size": 16, "kv_cache_bytes": 1.2e9, "max_num_seqs": 64,
        "max_num_batched_tokens": 2048, "max_model_len": 4096,
        # busy/fragmented link: 2 GB/s with 32 KiB per-layer copies (docs/kv-science.md S2/S3 direction)
        "swap": {"link_bytes_per_s": 2e9, "copy_bytes": 32768, "copy_overhead_s": 2e-5}},
        "classes": [{"name": "c", "rate_per_s": 3, "prompt": {"median": 300, "sigma": 0.4, "max": 1000},
                     "output": {"median": 400, "sigma": 0.4, "max": 1500}}]}


def _resume_cost(wl, policy, duration):
    recs, _ = simulate(wl.with_policy(policy), duration=duration, scrape=None, tokens=False)
    res = truths(recs, "resume")
    assert len(res) >= 10
    assert {r.data["mode"] for r in res} == {policy}
    return statistics.mean(r.data["resume_s"] for r in res), res


def test_swap_vs_recompute_direction_follows_s1_and_s2():
    # S1-like: long contexts (70B TP4 per-rank KV, 8K-token prompts), fast contiguous link
    wl = load_preset("swap-vs-recompute")
    rec_cost, rec = _resume_cost(wl, "recompute", 600)
    swap_cost, sw = _resume_cost(wl, "swap", 600)
    assert swap_cost < 0.7 * rec_cost
    # a swap-in of S tokens moves S*81920 B at 40 GB/s (+6 us per 1.25 MiB block): ~2.05 us/token
    for r in sw:
        assert r.data["swap_in_s"] == pytest.approx(r.data["swap_out_s"])
    one = next(r for r in truths(simulate(wl.with_policy("swap"), duration=600, scrape=None, tokens=False)[0],
                                 "preempt"))
    s = one.data["context_tokens"]
    blocks = -(-s // 16)
    assert one.data["swap_out_s"] == pytest.approx(blocks * 6e-6 + blocks * 16 * 81920 / 40e9, rel=1e-4)
    # S2-like: short sequences on a slow fragmented link: recompute resumes faster
    short = parse_workload(_short_swap_workload())
    rec_short, _ = _resume_cost(short, "recompute", 240)
    swap_short, _ = _resume_cost(short, "swap", 240)
    assert rec_short < 0.5 * swap_short


def _spec(i, prompt, out, prefix=None, prefix_tokens=0):
    return RequestSpec(f"r{i}", 0.0, "c", prompt, out, out, None, 0, prefix, prefix_tokens)


def test_preempting_a_mostly_shared_prefix_request_frees_only_its_private_blocks():
    cfg = EngineConfig(num_gpu_blocks=560, block_size=16, max_num_batched_tokens=8192, max_num_seqs=32)
    truth = []

    class S(Sink):
        def on_truth(self, rec):
            truth.append(rec)

    eng = Engine(cfg, S())
    # one request materialises a 4000-token (250-block) shared prefix ...
    eng.add(_spec(0, 4100, 2000, "sys", 4000))
    assert eng.step()
    assert eng.prefixes["sys"].resident == 250
    # ... then 15 more share it: each computes only its private 100-token tail
    for i in range(1, 16):
        eng.add(_spec(i, 4100, 2000, "sys", 4000))
    eng.step()
    eng.check_invariants()
    assert eng.stats.prefix_hits == 15 * 4000
    assert all(s.shared == 250 for s in eng.running)
    # the shared 250 blocks are counted once, not 16 times
    assert eng.n_blocks - eng.available() == 250 + sum(s.blocks - s.shared for s in eng.running)
    avail = []
    while not truth:
        avail.append((eng.available(), sum(s.blocks - s.shared for s in eng.running)))
        eng.step()
        eng.check_invariants()
    pre = truth[0]
    assert pre.event == "preempt" and pre.request_id == "r15"  # the latest arrival
    d = pre.data
    ctx = d["context_tokens"]
    assert 4100 < ctx < 4100 + 400
    assert d["shared_blocks"] == 250
    # only the private blocks (context past the 4000-token prefix) were freed: < 10% of a naive
    # estimate that counts the whole context (docs/kv-science.md §7: count only private tokens)
    assert d["private_blocks"] == -(-(ctx - 4000) // 16) or d["private_blocks"] == -(-(ctx + 1 - 4000) // 16)
    assert d["private_blocks"] * 16 < 0.1 * ctx
    # ... and the prefix stays resident and referenced by the other 15 holders
    p = eng.prefixes["sys"]
    assert p.resident == 250 and p.held == 250 and len(p.holders) == 15


def test_recompute_resume_hits_the_prefix_and_its_own_surviving_blocks():
    cfg = EngineConfig(num_gpu_blocks=700, block_size=16, max_num_batched_tokens=8192, max_num_seqs=16)
    eng = Engine(cfg)
    for i in range(6):
        eng.add(_spec(i, 4200, 2000, "sys", 4000))
    while eng.stats.preempt_events == 0:
        eng.step()
    victim = eng.waiting[0]
    hits_before = eng.stats.prefix_hits
    while victim.state != "running":
        eng.step()
    eng.check_invariants()
    # re-queries after preemption are not counted in prefix_cache_* (vLLM #25787)
    assert eng.stats.prefix_hits == hits_before
    assert victim.shared == 250


def test_cancel_heavy_clients_abandon_during_preemption_stalls():
    recs, res = simulate(load_preset("cancel-heavy"), duration=120)
    cancels = [r for r in recs if isinstance(r, RequestRecord) and r.event == "cancel"]
    tc = truths(recs, "cancel")
    assert len(cancels) == len(tc) == res.stats.finished["abort"] >= 10
    # a client gives up exactly 2 s after its last token (or arrival)
    assert all(abs(r.data["silent_s"] - 2.0) < 1e-6 for r in tc)
    assert sum(1 for r in tc if r.data["cause"] == "preemption") >= 5
    last = [r for r in recs if isinstance(r, EngineRecord)][-1]
    assert last.requests_aborted_total == res.stats.finished["abort"]
    # preempted-then-cancelled requests never reach the counter (vLLM counts at resume)
    assert res.stats.preemptions < res.stats.preempt_events


def test_itl_histogram_has_one_sample_per_request_per_step_with_tokens():
    recs, res = simulate(load_preset("preemption-storm"), duration=40)
    firsts = sum(1 for r in recs if isinstance(r, RequestRecord) and r.event == "first_token")
    toks = sum(1 for r in recs if isinstance(r, RequestRecord) and r.event in ("first_token", "token"))
    assert res.stats.generation_tokens == toks
    assert res.stats.itl.count == toks - firsts
    assert res.stats.ttft.count == firsts
    # iteration_tokens counts generated tokens + whole prompts when their prefill finishes, never a
    # victim's recomputed tokens (docs/real-engines.md): its sum is exactly these two counters
    assert res.stats.preempt_events > 0
    assert res.stats.iteration_tokens.sum == res.stats.generation_tokens + res.stats.prompt_tokens
    assert res.stats.iteration_tokens.count == res.stats.steps


def test_bad_workloads_are_rejected_with_one_line():
    from kvtop.sim.workload import WorkloadError

    with pytest.raises(WorkloadError, match="classes"):
        parse_workload({"classes": []})
    with pytest.raises(WorkloadError, match="unknown field"):
        parse_workload({"engine": {"bogus": 1}, "classes": [{"prompt": 10, "output": 10}]})
    with pytest.raises(WorkloadError, match="preemption_mode"):
        parse_workload({"engine": {"preemption_mode": "magic"}, "classes": [{"prompt": 10, "output": 10}]})
    with pytest.raises(WorkloadError, match="max_model_len"):
        parse_workload({"engine": {"max_model_len": 100},
                        "classes": [{"prompt": {"median": 80, "max": 90}, "output": {"median": 20, "max": 20}}]})


def test_reserved_kv_and_priority_protect_interactive_requests():
    cfg = EngineConfig(num_gpu_blocks=200, block_size=16, max_num_batched_tokens=8192, max_num_seqs=32)
    eng = Engine(cfg)
    eng.set_reservations({0: 0.5})  # half the pool only for priority-0 (interactive) requests

    def spec(i, prio, prompt, out):
        return RequestSpec(f"{'b' if prio else 'i'}{i}", 0.0, "batch" if prio else "interactive", prompt, out, out,
                           None, prio, None, 0)

    for i in range(6):
        eng.add(spec(i, 1, 480, 2000))  # 30 blocks each: only 3 fit in the unreserved 100 blocks
    eng.step()
    assert [s.id for s in eng.running] == ["b0", "b1", "b2"]
    assert eng.n_blocks - eng.available() == 3 * 30  # a 4th would pass the 100 unreserved blocks
    eng.add(spec(0, 0, 1600, 400))  # 101 blocks: fits only thanks to the reservation
    eng.step()
    assert "i0" in {s.id for s in eng.running} and len(eng.waiting) == 3
    # when memory runs out, the batch requests (priority 1) are preempted before the interactive one,
    # although the interactive request arrived last
    while eng.stats.preempt_events == 0:
        eng.step()
        eng.check_invariants()
    assert all(s.id.startswith("b") for s in eng.waiting if s.n_preempts)
    assert eng.seqs["i0"].n_preempts == 0


def test_overlapped_swap_never_blocks_the_step_but_blocking_swap_does():
    wl = load_preset("swap-vs-recompute").with_policy("swap-slow-link")
    recs_block, _ = simulate(wl, duration=300, scrape=None, tokens=False)
    blocking = truths(recs_block, "swap_stall")
    assert blocking and all(r.data["blocked_s"] > 0 for r in blocking)
    over = parse_workload({**_swap_preset_dict(), "policies": {
        "async": {"preemption_mode": "swap", "swap": {"link_bytes_per_s": 2e9, "copy_bytes": 8192,
                                                      "copy_overhead_s": 2e-5, "overlap": True}}}})
    recs_over, res = simulate(over.with_policy("async"), duration=300, scrape=None, tokens=False)
    assert not truths(recs_over, "swap_stall") and truths(recs_over, "resume")
    assert res.stats.offload_bytes["CPU_to_GPU"] > 0


def _swap_preset_dict() -> dict:
    import json
    from importlib import resources

    return json.loads((resources.files("kvtop.sim") / "presets" / "swap-vs-recompute.json").read_text())


@pytest.mark.parametrize("seed", range(6))
def test_block_accounting_holds_at_every_step_and_every_request_completes(seed):
    """Random engines/traffic: prefixes, tight KV, both modes, cancels, reservations, priorities."""
    import random

    r = random.Random(seed)
    mode = ("recompute", "swap")[seed % 2]
    wl = parse_workload({"name": "fuzz", "engine": {
        "bytes_per_token": 131072, "block_size": r.choice([8, 16, 32]), "num_gpu_blocks": r.randint(60, 400),
        "max_num_seqs": r.randint(2, 40), "max_num_batched_tokens": r.choice([256, 512, 2048]),
        "chunked_prefill": r.random() < 0.7, "prefix_caching": r.random() < 0.8, "max_model_len": 4096,
        "preemption_mode": mode, "swap": {"overlap": seed % 4 >= 2, "host_capacity_bytes": r.choice([1e8, 1e10]),
                                          "link_bytes_per_s": r.choice([1e9, 4e10])}},
        "classes": [
            {"name": "a", "rate_per_s": r.uniform(0.5, 6), "prefix_id": "p", "prefix_tokens": r.choice([100, 700]),
             "prompt": {"median": 900, "sigma": 0.5, "min": 750, "max": 1500},
             "output": {"median": 150, "sigma": 0.8, "max": 1500}, "patience_s": r.choice([None, 0.5, 3.0]),
             "priority": r.choice([0, 1])},
            {"name": "b", "rate_per_s": r.uniform(0.2, 3), "reserved_kv_frac": r.choice([0.0, 0.2]),
             "prompt": {"median": 300, "sigma": 0.8, "max": 2000},
             "output": {"median": 200, "sigma": 0.8, "max": 1500}}]})
    sim = Simulation(wl, seed, 30, None, scrape_interval_s=5.0, tokens=False)
    eng = sim.engine
    commit = eng.commit

    def checked(p):
        commit(p)
        eng.check_invariants()

    eng.commit = checked  # type: ignore[method-assign]
    res = sim.run()
    assert res.steps > 100
    while eng.has_work():  # no more arrivals: every admitted request must run to the end
        if not eng.step():
            nxt = eng.next_internal_event()
            assert nxt is not None, "a request is stuck in the queue with nothing running"
            eng.t = max(eng.t, nxt)
    eng.check_invariants()
    assert eng.available() == eng.n_blocks and eng.host_used == 0
    st = res.stats
    assert sum(st.finished.values()) == res.requests


@pytest.mark.parametrize("name,policy", [("healthy", None), ("preemption-storm", None), ("prefill-interference", None),
                                         ("slow-decode", None), ("cancel-heavy", None), ("shared-prefix", None),
                                         ("swap-vs-recompute", "swap-slow-link")])
def test_every_preset_emits_records_in_time_order(name, policy):
    recs, res = simulate(load_preset(name).with_policy(policy), duration=150 if name in ("slow-decode", "swap-vs-recompute") else 40)
    ts = [r.t for r in recs]
    assert ts == sorted(ts)
    kinds = {r.event for r in recs if isinstance(r, TruthRecord)}
    expected = {"preemption-storm": {"preempt", "resume"}, "prefill-interference": {"prefill_stall"},
                "slow-decode": {"slow_step"}, "cancel-heavy": {"cancel"}, "swap-vs-recompute": {"swap_stall"}}
    assert expected.get(name, set()) <= kinds
    if name in ("healthy", "shared-prefix"):
        assert not kinds
