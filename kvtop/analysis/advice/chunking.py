"""Chunked-prefill token budget under an ITL SLO (docs/kv-science.md §9)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Round budgets an operator would set (the engine's own suggestions are powers of two and their
# 1.5x neighbours); the largest that passes is recommended.
LADDER = (16384, 12288, 8192, 6144, 4096, 3072, 2048, 1536, 1024, 768, 512, 384, 256, 128, 64)
DEFAULT_MARGIN = 0.1


def ladder(multiple: int | None = None) -> tuple[int, ...]:
    """The round budgets an engine accepts: those ``multiple`` divides, where it needs whole blocks."""
    if not multiple or multiple <= 1:
        return LADDER
    return tuple(b for b in LADDER if b % multiple == 0)


def t_step(start: float, length: float, t_dec: float, a: float, k_att: float) -> float:
    """One engine step carrying a prefill chunk [start, start+length) next to the decodes."""
    return t_dec + a * length + a * k_att * ((start + length) ** 2 - start ** 2)


def chunk_steps(P: int, B: int, t_dec: float, a: float, k_att: float) -> list[float]:
    out = []
    start = 0
    while start < P:
        n = min(B, P - start)
        out.append(t_step(start, n, t_dec, a, k_att))
        start += n
    return out


@dataclass
class BudgetRow:
    budget: int
    worst_step_s: float
    steps: int
    prefill_s: float
    fits_step: bool  # the worst step stays the margin under the target
    holds_batch: bool = True  # False: an engine whose budget counts decodes could not run the observed batch

    @property
    def passes(self) -> bool:
        return self.fits_step and self.holds_batch


@dataclass
class ChunkPlan:
    itl_slo_s: float
    prompt_tokens: int
    unchunked_step_s: float
    current_budget: int | None
    current_worst_step_s: float
    budget: int | None  # recommended (largest passing on the ladder)
    prefill_s: float | None  # TTFT prefill phase at the recommended budget
    rows: list[BudgetRow] = field(default_factory=list)
    spike_share: float | None = None  # share of each stream's ITL samples that are spikes
    current_steps_over: int | None = None  # steps per prompt above the target at the current budget
    ttft_slo_s: float | None = None
    disaggregate: bool = False


def spike_share(rate: float, t_spike: float, t_dec: float) -> float:
    """Share of a stream's ITL samples that land on a long prefill step (docs/kv-science.md §12 S5)."""
    per_s = (1 - rate * t_spike) / t_dec + rate
    return rate / per_s if per_s > 0 else 1.0


def spike_share_steps(rate: float, steps: list[float], target: float, t_dec: float) -> float:
    """Share of a stream's ITL samples above ``target`` when each prompt runs as ``steps``.

    Every step of a prompt emits one token per stream; those longer than the target are spikes.
    The rest of each second is ordinary ``t_dec`` steps. With one step this is ``spike_share``.
    """
    over = sum(1 for t in steps if t > target)
    per_s = (1 - rate * sum(steps)) / t_dec + rate * len(steps)
    if per_s <= 0:
        return 1.0 if over else 0.0
    return rate * over / per_s


def plan_chunking(P: int, itl_slo_s: float, t_dec: float, a: float, k_att: float,
                  current_budget: int | None = None, rate: float | None = None,
                  ttft_slo_s: float | None = None, margin: float = DEFAULT_MARGIN,
                  decodes: float | None = None, batch_peak: float | None = None,
                  multiple: int | None = None) -> ChunkPlan:
    """``decodes`` and ``batch_peak``: for an engine whose budget counts every scheduled token (vLLM
    V1), the sequences decoding beside a chunk (the mean running batch) and the most it ran at once.
    A chunk then gets the budget less the decodes, so a prompt takes more steps (its TTFT), and a
    budget below the peak would cap the batch below the traffic (the engine holds at most that many
    sequences): such a budget does not pass. The worst step is still priced with a whole-budget
    chunk, as when few sequences decode. ``multiple``: the engine takes only budgets of whole KV
    blocks of this many tokens (SGLang's page size); the others are not on its ladder."""
    limit = itl_slo_s * (1 - margin)
    rows = []
    beside = math.ceil(decodes) if decodes else 0
    for B in ladder(multiple):
        worst = max(chunk_steps(P, B, t_dec, a, k_att))
        holds = (batch_peak is None or B >= batch_peak) and B - beside >= 1
        steps = chunk_steps(P, B - beside if holds else B, t_dec, a, k_att)
        rows.append(BudgetRow(B, worst, len(steps), sum(steps), worst <= limit, holds))
    unchunked = t_step(0, P, t_dec, a, k_att)
    cur_steps = chunk_steps(P, current_budget, t_dec, a, k_att) if current_budget else [unchunked]
    best = next((r for r in rows if r.passes), None)
    plan = ChunkPlan(
        itl_slo_s=itl_slo_s, prompt_tokens=P, unchunked_step_s=unchunked, current_budget=current_budget,
        current_worst_step_s=max(cur_steps), budget=best.budget if best else None,
        prefill_s=best.prefill_s if best else None, rows=rows, ttft_slo_s=ttft_slo_s,
    )
    if rate is not None:
        # every step above the target is a spike, not only the longest one
        plan.spike_share = spike_share_steps(rate, cur_steps, itl_slo_s, t_dec)
        plan.current_steps_over = sum(1 for t in cur_steps if t > itl_slo_s)
    if best is None or (ttft_slo_s is not None and best.prefill_s > ttft_slo_s):
        plan.disaggregate = True
    return plan
