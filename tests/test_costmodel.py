"""Cost-model formulas (docs/kv-science.md §2.2, §3, §5, §6, §8, §9) and monotonicity properties."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtop.analysis.advice.capacity import capacity_plan, recommend_max_seqs
from kvtop.analysis.advice.chunking import plan_chunking, spike_share, spike_share_steps
from kvtop.analysis.advice.costmodel import EventInputs, break_even_tokens, evaluate_event, p_star, t_pf
from kvtop.analysis.advice.link import bw_eff

K8 = 1.8781e-5
A8 = 1 / 25_000


@pytest.mark.parametrize("g,expected", [
    (2 * 2**20, 43.7e9), (1.25 * 2**20, 40.7e9), (0.875 * 2**20, 37.7e9), (64 * 1024, 8.964e9), (32 * 1024, 4.92e9),
])
def test_bw_eff_table(g, expected):
    assert bw_eff(g) == pytest.approx(expected, rel=0.005)


def test_recompute_attention_share():
    # 8B: attention adds 15.4 % at 8K and 61.5 % at 32K over the linear estimate
    for n, extra in ((8192, 0.154), (32768, 0.615)):
        assert t_pf(n, 0, A8, K8) / (A8 * n) - 1 == pytest.approx(extra, abs=0.002)
    assert t_pf(600, 400, A8, K8) == pytest.approx(8.15e-3, rel=0.005)  # S2: only 200 tokens recomputed


@pytest.mark.parametrize("g,p,F,t_fix,expected", [
    (2 * 2**20, 0.0, 512, 1e-3, 624),
    (32 * 1024, 0.0, 0, 0, 17_629),
    (64 * 1024, 0.6, 0, 0, 14_876),
])
def test_break_even_table(g, p, F, t_fix, expected):
    s = break_even_tokens(131072, bw_eff(g), A8, K8, p=p, kappa=1.0, F=F, t_fix=t_fix)
    assert s == pytest.approx(expected, rel=0.02)


def test_break_even_swap_always():
    assert break_even_tokens(131072, bw_eff(2 * 2**20), A8, K8, kappa=1.0) == 1
    assert break_even_tokens(81920, bw_eff(1.25 * 2**20, contention=0.8), 1e-4, 9.5743e-6, kappa=1.0) == 1


def test_p_star_s3():
    assert p_star(0.1268, 0.0439, 1.0) == pytest.approx(0.471, abs=0.002)
    assert p_star(0.01, 0.05, 1.0) == 0.0  # recompute cheaper even if everyone resumes


def test_capacity_s6():
    c = capacity_plan(52e9 / 131072, 1500, 1000, 2500)
    assert int(c.n_floor) == 99 and int(c.n_ceiling) == 198
    assert c.recommended_max_seqs == 128
    assert recommend_max_seqs(10, 12) == 10  # no power of two in range: the floor
    assert recommend_max_seqs(40, 100) == 64


def test_chunk_plan_s5():
    plan = plan_chunking(12000, 0.1, 0.022, A8, K8, current_budget=16384, rate=0.5)
    assert plan.unchunked_step_s == pytest.approx(0.610, rel=0.005)
    assert plan.budget == 1024
    assert plan.spike_share == pytest.approx(0.0156, rel=0.01)
    assert spike_share(0.5, 0.610, 0.022) == pytest.approx(0.0156, rel=0.01)
    with_ttft = plan_chunking(12000, 0.1, 0.022, A8, K8, ttft_slo_s=0.8)
    assert with_ttft.disaggregate  # 852 ms of chunked prefill breaks a 0.8 s TTFT target


def test_gates():
    base: dict[str, Any] = dict(beta=131072, beta_rank=131072, S=3000, a=A8, k_att=K8, bw_eff=43.7e9)
    assert evaluate_event(EventInputs(**base, host_free=1e9)).gates["host"] is True
    c = evaluate_event(EventInputs(**base, host_free=1e8))
    assert c.gates["host"] is False and c.mechanism == "recompute"
    c = evaluate_event(EventInputs(**base, u_now=0.5, rate=200.0))  # 200 preemptions/s x 393 MB
    assert c.gates["link"] is False


def _decision(S, bw, p, kappa=1.0, F=0.0):
    c = evaluate_event(EventInputs(beta=131072, beta_rank=131072, S=S, a=A8, k_att=K8, bw_eff=bw, p=p,
                                   kappa=kappa, F=F))
    return c.mechanism


sizes = st.integers(min_value=16, max_value=131072)
bws = st.floats(min_value=1e8, max_value=4e11)
ps = st.floats(min_value=0.0, max_value=0.99)
kappas = st.sampled_from([1.0, 0.05])


@settings(max_examples=300, deadline=None)
@given(S=sizes, bw=bws, factor=st.floats(min_value=1.0, max_value=100.0), p=ps, kappa=kappas)
def test_more_bandwidth_never_favours_recompute(S, bw, factor, p, kappa):
    if _decision(S, bw, p, kappa) == "swap":
        assert _decision(S, bw * factor, p, kappa) == "swap"


@settings(max_examples=300, deadline=None)
@given(S=sizes, bw=bws, p1=ps, p2=ps, kappa=kappas)
def test_higher_cancel_probability_never_favours_swap(S, bw, p1, p2, kappa):
    lo, hi = sorted((p1, p2))
    if _decision(S, bw, lo, kappa) == "recompute":
        assert _decision(S, bw, hi, kappa) == "recompute"


@settings(max_examples=300, deadline=None)
@given(S=sizes, extra=st.integers(min_value=1, max_value=100000), bw=bws, p=ps, kappa=kappas)
def test_longer_sequences_never_favour_recompute_past_crossover(S, extra, bw, p, kappa):
    crossover = int(1 / K8)  # attention cost = linear cost (53K tokens for an 8B model)
    S1 = max(S, crossover)
    if _decision(S1, bw, p, kappa) == "swap":
        assert _decision(S1 + extra, bw, p, kappa) == "swap"


def test_directional_link_gates_each_direction_on_its_own_headroom():
    """V = 1 GB per victim at 10 preemptions/s, p = 0: 10 GB/s out and 10 GB/s back in.

    One shared figure of 20 GB/s: demand 20 GB/s > 0.8 · 20 = 16 GB/s -> the link gate fails.
    Measured per direction (20 GB/s each, full duplex): 10 <= 16 both ways -> it passes.
    GPU->host measured at 12 GB/s: 10 > 0.8 · 12 = 9.6 -> fails on the swap-out side alone.
    """
    base: dict[str, Any] = dict(beta=1e6, beta_rank=1e6, S=1000, a=A8, k_att=K8, bw_eff=20e9, rate=10.0)
    assert evaluate_event(EventInputs(**base)).gates["link"] is False
    c = evaluate_event(EventInputs(**base, bw_out=20e9, bw_in=20e9, directional=True))
    assert c.gates["link"] is True
    c = evaluate_event(EventInputs(**base, bw_out=12e9, bw_in=50e9, directional=True))
    assert c.gates["link"] is False and any("GPU->host" in n for n in c.gate_notes)
    assert c.t_out == pytest.approx(1e9 / 12e9) and c.t_in == pytest.approx(1e9 / 50e9)


def test_duplex_contention_slows_the_direction_that_overlaps():
    """Same storm, 20 GB/s each way, duplex 0.5: host->GPU is busy 10 · 1 GB / 20 GB/s = 50 % of the
    time, so GPU->host runs at 20 · (1 − 0.5 · 0.5) = 15 GB/s and a swap-out takes 66.7 ms, not 50."""
    c = evaluate_event(EventInputs(beta=1e6, beta_rank=1e6, S=1000, a=A8, k_att=K8, bw_eff=20e9, rate=10.0,
                                   bw_out=20e9, bw_in=20e9, directional=True, duplex=0.5))
    assert c.t_out == pytest.approx(1e9 / 15e9)
    assert c.t_in == pytest.approx(1e9 / 15e9)


def test_spike_share_counts_every_step_over_the_target():
    """Three steps of 0.4/0.5/0.56 s and one under the target: 3 spikes per prompt, not 1."""
    steps = [0.4, 0.5, 0.56, 0.05]
    per_s = (1 - 0.2 * sum(steps)) / 0.022 + 0.2 * 4
    assert spike_share_steps(0.2, steps, 0.1, 0.022) == pytest.approx(0.2 * 3 / per_s)
    assert spike_share_steps(0.2, [0.61], 0.1, 0.022) == pytest.approx(spike_share(0.2, 0.61, 0.022))
