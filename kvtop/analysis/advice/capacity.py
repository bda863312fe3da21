"""Capacity-based concurrency and churn (docs/kv-science.md §8)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtop.analysis.advice.costmodel import t_pf

# Heuristic churn thresholds (docs/kv-science.md §8): sustained preemptions per completed request and
# mean preemptions per preempted request; p above ABANDON means stalls drive users away.
CHURN_R_PRE = 0.05
CHURN_KBAR = 1.5
ABANDON_P = 0.3


@dataclass
class Capacity:
    c_kv_tokens: float
    n_floor: float
    n_ceiling: float
    recommended_max_seqs: int
    seq_tokens: float = 0.0  # the sequence size behind N_floor
    seq_what: str = ""  # where that size comes from
    mean_tokens: float = 0.0  # mean occupancy per sequence (N_ceiling)


def capacity_plan(c_kv_tokens: float, prompt_mean: float, output_mean: float, output_p90: float,
                  request_p90: float | None = None) -> Capacity:
    """N_floor = C/S_p90 (almost no preemption); N_ceiling = C/(P̄ + Ō/2) (mean occupancy).

    S_p90 is the p90 of prompt + output of the same requests where the trace measured it, else
    P̄ + O_p90 (a long prompt and a long output need not come together, so that sum overstates).
    """
    if request_p90 is not None and request_p90 > 0:
        seq, what = request_p90, "p90 of prompt + output per request"
    else:
        seq, what = prompt_mean + output_p90, "mean prompt + output p90"
    mean = prompt_mean + output_mean / 2
    n_floor = c_kv_tokens / max(1.0, seq)
    n_ceiling = c_kv_tokens / max(1.0, mean)
    return Capacity(c_kv_tokens, n_floor, n_ceiling, recommend_max_seqs(n_floor, n_ceiling), seq, what, mean)


def recommend_max_seqs(n_floor: float, n_ceiling: float) -> int:
    """A round starting point between floor and ceiling, on the floor side of the midpoint.

    The largest power of two not above the midpoint if it is still >= the floor (99..198 -> 128),
    else the floor rounded down (rounding up admits a sequence the KV cannot hold at the p90
    size: 22,880 tokens / 2,400 per sequence = 9.5 -> 9). Then steer by measurement
    (kv usage p99 <= 0.9, preemptions/completed <= 0.01).
    """
    lo = max(1.0, n_floor)
    mid = (lo + max(lo, n_ceiling)) / 2
    p2 = 1
    while p2 * 2 <= mid:
        p2 *= 2
    if p2 >= lo:
        return p2
    return max(1, math.floor(lo))


@dataclass
class Churn:
    r_pre: float | None
    k_bar: float | None
    p: float | None
    churn: bool
    abandonment: bool
    recompute_per_event_s: float | None = None
    wasted_per_completed_s: float | None = None
    useful_prefill_s: float | None = None
    overhead: float | None = None
    swap_bytes_per_event: float | None = None
    lost_share: float | None = None


def churn_assessment(r_pre: float | None, k_bar: float | None, p: float | None,
                     S_pre: float | None = None, prompt_mean: float | None = None,
                     a: float | None = None, k_att: float | None = None, beta: float | None = None,
                     h_res: float = 0.0) -> Churn:
    churn = bool((r_pre is not None and r_pre > CHURN_R_PRE) or (k_bar is not None and k_bar > CHURN_KBAR))
    abandon = bool(p is not None and p >= ABANDON_P)
    c = Churn(r_pre, k_bar, p, churn, abandon)
    if r_pre is not None and p is not None:
        c.lost_share = r_pre * p
    if S_pre is not None and a is not None and k_att is not None:
        c.recompute_per_event_s = t_pf(S_pre, h_res, a, k_att)
        if r_pre is not None:
            c.wasted_per_completed_s = r_pre * (1 - (p or 0.0)) * c.recompute_per_event_s
        if prompt_mean:
            c.useful_prefill_s = t_pf(prompt_mean, 0, a, k_att)
            if c.wasted_per_completed_s is not None and c.useful_prefill_s > 0:
                c.overhead = c.wasted_per_completed_s / c.useful_prefill_s
        if beta is not None:
            c.swap_bytes_per_event = 2 * S_pre * beta
    return c
