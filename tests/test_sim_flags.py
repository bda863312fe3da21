"""vLLM flags on the simulated engine (`kvtop sim-server --engine-flags`), and the prescription loop on it."""

from __future__ import annotations

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


def test_token_budget_turns_chunking_on_and_memory_share_scales_kv():
    wl = load_preset("prefill-interference")
    assert wl.engine.chunked_prefill is False
    e = apply_engine_flags(wl, "--max-num-batched-tokens=1024 --gpu-memory-utilization 0.45").engine
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
