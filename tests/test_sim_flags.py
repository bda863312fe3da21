"""vLLM flags on the simulated engine (`kvtop sim-server --engine-flags`), and the prescription loop on it."""

from __future__ import annotations

import json

import pytest
from conftest import run_kvtop

from kvtop.sim.flags import apply_engine_flags
from kvtop.sim.workload import WorkloadError, load_preset

GIB = 1 << 30


def test_the_storm_prescription_sets_the_simulated_engine():
    wl = load_preset("preemption-storm")
    out = apply_engine_flags(wl, "--max-num-seqs 8 --max-model-len 4864 --kv-offloading-size 1 "
                                 "--kv-offloading-backend native")
    e = out.engine
    assert (e.max_num_seqs, e.max_model_len, e.preemption_mode) == (8, 4864, "swap")
    assert e.swap.host_capacity_bytes == GIB and e.swap.overlap is True
    # the preset itself is untouched
    assert (wl.engine.max_num_seqs, wl.engine.preemption_mode, wl.engine.swap.overlap) == (64, "recompute", False)


def test_a_budget_below_the_context_needs_chunking_as_vllm_says_and_memory_share_scales_kv():
    wl = load_preset("prefill-interference")
    assert wl.engine.chunked_prefill is False
    # vLLM refuses a budget below max_model_len with chunked prefill off (verify_max_model_len): the
    # simulator turned chunking on by itself, so a prescription without the switch passed here
    with pytest.raises(WorkloadError, match=r"max_num_batched_tokens \(1024\) is smaller than max_model_len"):
        apply_engine_flags(wl, "--max-num-batched-tokens=1024")
    e = apply_engine_flags(wl, "--max-num-batched-tokens=1024 --enable-chunked-prefill "
                               "--gpu-memory-utilization 0.45").engine
    assert e.max_num_batched_tokens == 1024 and e.chunked_prefill is True
    assert e.num_gpu_blocks == wl.engine.num_gpu_blocks // 2
    assert apply_engine_flags(wl, "--enable-chunked-prefill").engine.chunked_prefill is True


@pytest.mark.parametrize("flags, msg", [
    ("--swap-space 4", "no simulated counterpart"),
    ("--max-num-seqs", "needs a value"),
    ("--max-num-seqs eight", "whole number"),
    ("--kv-offloading-backend native", "needs --kv-offloading-size"),
    ("--kv-offloading-size 1 --kv-offloading-backend lmcache", "only the native backend"),
    ("--max-num-seqs '8", "--engine-flags"),
])
def test_bad_flags_are_one_line(flags, msg):
    with pytest.raises(WorkloadError, match=msg):
        apply_engine_flags(load_preset("healthy"), flags)


def test_sim_server_refuses_an_unknown_flag():
    r = run_kvtop("sim-server", "--preset", "healthy", "--engine-flags", "--swap-space 4", "--duration", "1")
    assert r.returncode == 2 and "no simulated counterpart" in r.stderr and "Traceback" not in r.stderr


def test_a_smaller_max_model_len_refuses_the_longer_prompts_the_traffic_still_sends(tmp_path):
    # the traffic is the preset's: a prescription that lowers max_model_len below its prompts gets
    # errors, as vLLM answers them ("Input length exceeds model's maximum context length"), where the
    # simulator had shrunk every prompt to fit and shown no harm
    from kvtop.sim.simulate import simulate_to_trace

    wl = apply_engine_flags(load_preset("prefill-interference"), "--max-model-len 4096 --enable-chunked-prefill")
    p = tmp_path / "t.jsonl"
    simulate_to_trace(wl, 1, 60.0, str(p))
    recs = [json.loads(x) for x in p.read_text().splitlines()]
    prompts = {d["id"]: d["prompt_tokens"] for d in recs if d.get("event") == "arrive" and "prompt_tokens" in d}
    errors = {d["id"] for d in recs if d.get("kind") == "request" and d.get("event") == "error"}
    long = {i for i, n in prompts.items() if n >= 4096}
    assert long and long <= errors
    assert not errors - long


def test_a_kv_cache_too_small_for_one_request_of_max_model_len_is_refused_as_vllm_refuses_it():
    # a 32-token cache under max_model_len 8192 started; vLLM exits ("To serve at least one request
    # with the model's max seq len ... KV cache is needed, which is larger than the available")
    wl = load_preset("healthy")
    with pytest.raises(WorkloadError, match=r"holds 32 tokens, fewer than max_model_len"):
        apply_engine_flags(wl, f"--kv-cache-memory-bytes {2 * wl.engine.block_bytes}")
    assert apply_engine_flags(wl, f"--kv-cache-memory-bytes {2 * wl.engine.block_bytes} --max-model-len 32")
    with pytest.raises(WorkloadError, match="positive number"):
        apply_engine_flags(wl, "--kv-offloading-size inf")
