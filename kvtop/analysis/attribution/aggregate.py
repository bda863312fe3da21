"""Causes without request records: the engine's ITL histogram deltas per scrape vs its counters.

Lower confidence than per-spike attribution: a scrape interval holds many gaps of many streams,
so only the counts above the target per interval can be split, not who stalled or why.
Shares its thresholds with the per-spike rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtop.analysis.attribution.causes import ALL, Cause
from kvtop.analysis.attribution.thresholds import KV_HIGH, PROMPT_JUMP_MIN, PROMPT_JUMP_REL
from kvtop.model.records import EngineKey


@dataclass
class Scrape:
    """One engine scrape as the fallback needs it (kept only while no token timings exist)."""

    t: float
    key: EngineKey
    itl: dict[str, Any]  # {"buckets": [[le, cumulative count], ...], "count": n}
    preemptions: float | None
    prompt_tokens: float | None
    running: float | None
    kv: float | None


def _inc(prev: float | None, cur: float | None) -> float:
    return cur - prev if cur is not None and prev is not None and cur >= prev else 0.0


def aggregate_causes(scrapes: list[Scrape], target: float | None, k: float, preempts: bool,
                     target_source: str | None = None) -> tuple[dict[Cause, int], float | None, str | None]:
    """Spike counts per cause, the ITL target used and where it came from."""
    counts = dict.fromkeys(ALL, 0)
    if len(scrapes) < 2:
        return counts, None, None
    by_key: dict[EngineKey, list[Scrape]] = {}
    for s in scrapes:
        by_key.setdefault(s.key, []).append(s)
    src = target_source
    if target is None:
        # p50 of the whole run's histogram delta x k
        merged: dict[float, float] = {}
        total = 0.0
        for lst in by_key.values():
            f, last = lst[0].itl, lst[-1].itl
            for (le, c1), (_, c0) in zip(last["buckets"], f["buckets"], strict=False):
                merged[float(le)] = merged.get(float(le), 0.0) + (c1 - c0)
            total += last["count"] - f["count"]
        if total <= 0:
            return counts, None, None
        for le in sorted(merged):
            if merged[le] >= 0.5 * total:
                target = k * le
                src = f"derived: {k:g} x engine ITL histogram p50 (bucket bound)"
                break
    if target is None:
        return counts, None, None
    deltas = []
    for lst in by_key.values():
        for prev, cur in zip(lst, lst[1:], strict=False):
            if prev.prompt_tokens is not None and cur.prompt_tokens is not None:
                deltas.append(max(0.0, cur.prompt_tokens - prev.prompt_tokens))
    typ = sorted(deltas)[len(deltas) // 2] if deltas else 0.0
    for lst in by_key.values():
        for prev, cur in zip(lst, lst[1:], strict=False):
            h0, h1 = prev.itl, cur.itl
            dcount = h1["count"] - h0["count"]
            if not math.isfinite(dcount) or dcount <= 0:  # a NaN/Inf count is no observation
                continue
            below = 0.0
            p50_le = None
            for (le, c1), (_, c0) in zip(h1["buckets"], h0["buckets"], strict=False):
                if float(le) <= target:
                    below = c1 - c0
                if p50_le is None and c1 - c0 >= 0.5 * dcount:
                    p50_le = float(le)
            if not math.isfinite(below):
                continue
            above = int(round(dcount - below))
            if above <= 0:
                continue
            dpre = _inc(prev.preemptions, cur.preemptions)
            dprompt = _inc(prev.prompt_tokens, cur.prompt_tokens)
            if preempts and dpre >= 1 and (cur.kv is None or cur.kv >= KV_HIGH) and above <= 3 * dpre:
                counts[Cause.PREEMPTION] += above
            elif dprompt >= PROMPT_JUMP_MIN and dprompt > PROMPT_JUMP_REL * typ and \
                    (cur.running is None or above >= 0.5 * max(1, cur.running)):
                counts[Cause.PREFILL] += above
            elif p50_le is not None and p50_le > target:
                counts[Cause.SLOW_DECODE] += above
            else:
                counts[Cause.UNKNOWN] += above
    return counts, target, src
