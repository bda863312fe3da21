"""Cost of one preemption event: swap/offload vs recompute (docs/kv-science.md §3, §5, §6, §7).

All times are seconds of GPU time unless named ``t_*`` (wall time). Every function is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvtop.analysis.advice.kvbytes import KVSize

# docs/kv-science.md §12 common defaults
EPSILON_ASYNC = 0.05  # GPU cost fraction of an asynchronous (DMA, overlapped) copy
U_MAX = 0.8  # link utilisation ceiling for the swap gate
MARGINAL = 0.30  # within ±30 % of a break-even the verdict is "marginal"


def t_pf(S: float, h: float, a: float, k_att: float, F: float = 0.0) -> float:
    """Prefill (recompute) time of positions [h, S): linear part beyond F free tokens + attention."""
    S = max(S, 0.0)
    h = min(max(h, 0.0), S)
    return a * max(0.0, S - h - F) + a * k_att * (S * S - h * h)


def t_pf_attention(S: float, h: float, a: float, k_att: float) -> float:
    h = min(max(h, 0.0), S)
    return a * k_att * (S * S - h * h)


@dataclass
class EventInputs:
    """One preemption class (docs/kv-science.md §5.1). Bytes in B, rates in B/s, times in s."""

    beta: float  # KV bytes per token, all ranks (freed GPU memory)
    beta_rank: float  # KV bytes per token on one rank (bytes moved per rank)
    S: float  # tokens with KV at preemption
    a: float  # s/token at saturated prefill (1/ρ)
    k_att: float
    bw_eff: float
    h_sh: float = 0.0  # tokens in blocks shared with live requests (never freed, never moved)
    h_res: float | None = None  # tokens hitting the prefix cache on resume (default h_sh)
    h_host: float = 0.0  # tokens already in the host tier
    p: float = 0.0  # P(preempted request never resumes)
    kappa: float = EPSILON_ASYNC
    F: float = 0.0
    q_out: float = 0.0  # bytes queued ahead on the link, out / in
    q_in: float = 0.0
    u_now: float | None = None
    u_max: float = U_MAX
    host_free: float | None = None  # free pinned host bytes
    ranks: int = 1
    rate: float | None = None  # preemptions per second
    t_fix: float = 0.0
    t_iter: float | None = None  # one engine step (for the per-iteration move budget)
    size: KVSize | None = None  # when given, every byte count comes from it (beta/beta_rank: labels only)
    bw_out: float | None = None  # GPU->host usable B/s (default bw_eff)
    bw_in: float | None = None  # host->GPU usable B/s (default bw_eff)
    directional: bool = False  # directions measured separately: gate each on its own headroom
    duplex: float = 1.0  # share of one-way rate left while the other direction copies too
    swap_unavailable: str | None = None  # why no host tier exists (swap infeasible)


@dataclass
class EventCost:
    freed_bytes: float
    naive_freed_bytes: float
    bytes_per_rank: float
    t_out: float
    t_in: float
    t_pf: float
    t_pf_attention: float
    c_swap: float
    c_swap_blocking: float
    c_rec: float
    p_star: float | None
    break_even_tokens: float | None
    link_demand: float | None  # B/s per rank at the observed preemption rate
    gates: dict[str, bool | None] = field(default_factory=dict)
    gate_notes: list[str] = field(default_factory=list)
    tokens_per_iteration: float | None = None
    bytes_total: float | None = None  # moved bytes over all ranks (host pool demand)

    @property
    def swap_feasible(self) -> bool:
        return all(v is not False for v in self.gates.values())

    @property
    def cheaper(self) -> str:
        """Reference decision on cost alone: swap only if cheaper AND it resumes no later than recompute."""
        return "swap" if (self.c_swap < self.c_rec and self.t_in <= self.t_pf) else "recompute"

    @property
    def mechanism(self) -> str:
        return self.cheaper if self.swap_feasible else "recompute"

    def marginal(self, p: float, S: float) -> bool:
        lo, hi = sorted((self.c_swap, self.c_rec))
        if lo > 0 and hi / lo <= 1 + MARGINAL:
            return True
        if self.p_star is not None and 0 < self.p_star < 1 and abs(p - self.p_star) <= MARGINAL * self.p_star:
            return True
        s_star = self.break_even_tokens
        return bool(s_star is not None and s_star > 1 and abs(S - s_star) <= MARGINAL * s_star)


def p_star(r: float, s: float, kappa: float) -> float | None:
    """Cancel probability above which recompute is cheaper (docs/kv-science.md §6): (r − 2κs)/(r − κs)."""
    den = r - kappa * s
    if den <= 0:
        return 0.0  # recompute is cheaper even if every victim resumes
    return min(1.0, max(0.0, (r - 2 * kappa * s) / den))


def break_even_tokens(beta_rank: float, bw_eff: float, a: float, k_att: float, p: float = 0.0,
                      kappa: float = 1.0, F: float = 0.0, t_fix: float = 0.0) -> float | None:
    """Smallest S at which recomputing S tokens costs more than swapping them (docs/kv-science.md §6).

    Below S* recompute is cheaper; 1 means swap is cheaper for any length. None when recompute
    never costs more (every victim cancels).
    """
    if p >= 1:
        return None
    u = kappa * (2 - p) * beta_rank / bw_eff
    q = 1 - p
    # region S <= F: only attention is paid for recompute
    A1, B1, C1 = q * a * k_att, -u, -t_fix
    r1 = _first_positive(A1, B1, C1)
    if r1 is not None and r1 <= F:
        return max(1.0, r1)
    A2, B2, C2 = q * a * k_att, q * a - u, -(q * a * F + t_fix)
    r2 = _first_positive(A2, B2, C2)
    if r2 is None:
        return None
    return max(1.0, F, r2)


def _first_positive(A: float, B: float, C: float) -> float | None:
    """Smallest x > 0 from which A·x² + B·x + C stays positive (A >= 0)."""
    if A <= 0:
        if B > 0:
            return max(0.0, -C / B)
        return None
    disc = B * B - 4 * A * C
    if disc < 0:
        return 0.0  # always positive
    root = (-B + math.sqrt(disc)) / (2 * A)
    return max(0.0, root)


def evaluate_event(x: EventInputs) -> EventCost:
    h_res = x.h_sh if x.h_res is None else x.h_res
    if x.size is not None:
        # windows, MLA replication and fixed state: bytes come from the one size function
        V = x.size.private_rank_bytes(x.S, x.h_sh + x.h_host)
        V_total = x.size.private_total_bytes(x.S, x.h_sh + x.h_host)
        freed = x.size.private_total_bytes(x.S, x.h_sh)
        naive = x.S * x.size.token_bytes_total
    else:
        V = max(0.0, x.S - x.h_sh - x.h_host) * x.beta_rank
        V_total = V * x.ranks
        freed = max(0.0, x.S - x.h_sh) * x.beta
        naive = x.S * x.beta
    bw_out = x.bw_out or x.bw_eff
    bw_in = x.bw_in or x.bw_eff
    if x.rate is not None and x.duplex < 1.0:
        # a storm overlaps swap-outs of new victims with swap-ins of resumed ones; while both
        # directions run, each gets only ``duplex`` of its one-way rate (GPU->host suffers most)
        busy_in = min(1.0, x.rate * (1 - x.p) * (x.q_in + V) / bw_in)
        busy_out = min(1.0, x.rate * (x.q_out + V) / bw_out)
        bw_out *= 1 - busy_in * (1 - x.duplex)
        bw_in *= 1 - busy_out * (1 - x.duplex)
    t_out = (x.q_out + V) / bw_out
    t_in = (x.q_in + V) / bw_in
    tpf = t_pf(x.S, h_res, x.a, x.k_att, x.F)
    c_swap = x.kappa * (t_out + (1 - x.p) * t_in)
    c_swap_blocking = t_out + (1 - x.p) * t_in
    c_rec = (1 - x.p) * tpf
    gates: dict[str, bool | None] = {}
    notes: list[str] = []
    if x.swap_unavailable:
        gates["implementation"] = False
        notes.append(f"implementation: {x.swap_unavailable}")
    if x.host_free is not None:
        gates["host"] = V_total <= x.host_free
        if not gates["host"]:
            notes.append(f"host: {V_total / 1e9:.2f} GB needed > {x.host_free / 1e9:.2f} GB free pinned")
    else:
        gates["host"] = None
        notes.append("host: free pinned memory unknown")
    demand = None
    u_now = x.u_now if x.u_now is not None else 0.0
    link_ok = u_now <= x.u_max
    if not link_ok:
        notes.append(f"link: utilisation {u_now:.2f} > ceiling {x.u_max:.2f}")
    if x.rate is not None:
        demand = x.rate * V * (2 - x.p)
        head = x.u_max - u_now
        if x.directional:
            # a full-duplex link: each direction has its own headroom
            d_out, d_in = x.rate * V, x.rate * V * (1 - x.p)
            if d_out > head * bw_out:
                link_ok = False
                notes.append(f"link: GPU->host demand {d_out / 1e9:.2f} GB/s exceeds headroom "
                             f"{max(0.0, head) * bw_out / 1e9:.2f} GB/s")
            if d_in > head * bw_in:
                link_ok = False
                notes.append(f"link: host->GPU demand {d_in / 1e9:.2f} GB/s exceeds headroom "
                             f"{max(0.0, head) * bw_in / 1e9:.2f} GB/s")
        elif demand > head * x.bw_eff:
            link_ok = False
            notes.append(f"link: demand {demand / 1e9:.2f} GB/s exceeds headroom "
                         f"{max(0.0, head) * x.bw_eff / 1e9:.2f} GB/s")
    gates["link"] = link_ok
    n_free = min(bw_out, bw_in) * x.t_iter / x.beta_rank if x.t_iter else None
    return EventCost(
        freed_bytes=freed,
        naive_freed_bytes=naive,
        bytes_per_rank=V,
        t_out=t_out,
        t_in=t_in,
        t_pf=tpf,
        t_pf_attention=t_pf_attention(x.S, h_res, x.a, x.k_att),
        c_swap=c_swap,
        c_swap_blocking=c_swap_blocking,
        c_rec=c_rec,
        p_star=p_star(tpf, t_out, x.kappa),
        break_even_tokens=break_even_tokens(x.beta_rank, x.bw_eff, x.a, x.k_att, x.p, x.kappa, x.F,
                                            x.t_fix + x.kappa * (x.q_out + (1 - x.p) * x.q_in) / x.bw_eff),
        link_demand=demand,
        gates=gates,
        gate_notes=notes,
        tokens_per_iteration=n_free,
        bytes_total=V_total,
    )


# ---- victims and shared prefixes (docs/kv-science.md §7) -------------------------------------------

@dataclass
class Victim:
    name: str
    S: float
    h_sh: float = 0.0


def choose_victim(cands: list[Victim], deficit_bytes: float, beta: float, cost_per_token: float = 1.0
                  ) -> tuple[str, list[dict[str, Any]]]:
    """Rank victims: one that covers the deficit alone first, then freed bytes per unit cost."""
    rows: list[dict[str, Any]] = []
    for v in cands:
        freed = max(0.0, v.S - v.h_sh) * beta
        needed = math.ceil(deficit_bytes / freed) if freed > 0 else None
        rows.append({"name": v.name, "freed_bytes": freed, "naive_bytes": v.S * beta,
                     "victims_needed": needed, "covers_deficit": freed >= deficit_bytes,
                     "freed_per_cost": freed / max(1.0, v.S * cost_per_token)})
    best = sorted(rows, key=lambda r: (not r["covers_deficit"], -r["freed_per_cost"]))[0]
    return best["name"], rows


def prefix_policy(P: float, reuse_rate: float, beta_rank: float, bw_eff: float, a: float, k_att: float
                  ) -> dict[str, float | str]:
    """Keep/offload/discard for an idle shared prefix: saving rate λ·T_pf vs a one-time reload."""
    recompute = t_pf(P, 0, a, k_att)
    reload = P * beta_rank / bw_eff
    return {
        "prefix_recompute_s": recompute,
        "prefix_reload_s": reload,
        "discard_cost_gpu_s_per_s": reuse_rate * recompute,
        "policy": "keep_or_offload" if recompute > reload else "discard_ok",
    }
