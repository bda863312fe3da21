"""A prompt's part of its engine step, by the witness's log, against the prefill rate kvtop measures.

kvtop prices a prompt at its *measured* prefill rate (prompt tokens / TTFT: a low rate, so a high
price). For a chat-sized prompt the price is far too high: its TTFT is mostly the decode work of the
step it rode in. This prints, per witnessed trace, what the engine itself spent on prompts: the steps
that prefilled prompt tokens beside decodes (no recompute), each priced as the witness prices it (its
time beyond the median of the decode-only steps just before it, ``StepIndex.decode_near``), pooled by
prompt size as a marginal rate (prompt tokens per second of that extra time), beside the rate kvtop's
analysis measured on the same trace without its step records. docs/real-engines.md 7.22.

    python -m eval.prompt_cost --rounds AN-AP
    python -m eval.prompt_cost TRACE [TRACE ...]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Iterable
from typing import Any

from eval.witness_matrix import step_records, without_witness
from kvtop.analysis.witness import StepIndex

SIZES = ((1, 64, "<= 64"), (65, 255, "65-255"), (256, math.inf, ">= 256"))  # prompt tokens in the step


def prompt_parts(steps: Iterable[dict[str, Any]]) -> list[tuple[int, float]]:
    """(prompt tokens, seconds beyond the decode-only steps just before it) for each step that
    prefilled prompts beside at least one decode and recomputed nothing, where a decode-only step
    came before it."""
    idx = StepIndex(horizon_s=math.inf)
    out = []
    for d in steps:
        n = idx.n
        idx.add(d)
        if idx.n == n:
            continue  # unreadable or out of order
        s = idx.steps[-1]
        if not s.prefill or s.recompute or not any(v[1] == 0 and v[2] == 0 for v in s.reqs.values()):
            continue
        before, _ = idx.decode_near(idx.base + len(idx.steps) - 1)
        if before:
            out.append((s.prefill, (s.t1 - s.t0) - statistics.median(before)))
    return out


def by_size(parts: list[tuple[int, float]]) -> list[tuple[str, int, float | None, float | None]]:
    """Per prompt size: (size, steps, median part in seconds, marginal rate in tokens/s)."""
    rows = []
    for lo, hi, name in SIZES:
        xs = [(p, x) for p, x in parts if lo <= p <= hi]
        spent = sum(max(0.0, x) for _, x in xs)
        rows.append((name, len(xs), statistics.median(x for _, x in xs) if xs else None,
                     sum(p for p, _ in xs) / spent if spent > 0 else None))
    return rows


def measured_rate(path: str) -> float | None:
    """The prefill rate kvtop's analysis measured over the trace without its step records."""
    from eval.calibrate import analyze

    with tempfile.TemporaryDirectory() as tmp:
        return analyze(without_witness(path, tmp), 0.1).prefill_rate()


def render(path: str) -> str:
    cells = []
    for name, n, med, rate in by_size(prompt_parts(step_records(path))):
        cells.append(f"{name}: {n} steps" + (f", {med * 1e3:.1f} ms, {rate:,.0f} tok/s" if med is not None and rate
                                              else ""))
    kv = measured_rate(path)
    return f"{os.path.basename(path):<28} " + " | ".join(cells) + f" | kvtop measured {f'{kv:,.0f} tok/s' if kv else '-'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", help="witnessed traces (kvtop record --witness)")
    ap.add_argument("--rounds", help="rounds shipped in eval/witness_rounds/ (e.g. AN-AP, all)")
    args = ap.parse_args(argv)
    if not args.traces and not args.rounds:
        ap.error("name traces or --rounds")
    print("prompt steps by prompt size: steps, median time beyond the decode-only steps before, marginal rate")
    for p in args.traces:
        print(render(p))
    if args.rounds:
        from eval import witnessed

        try:
            rounds = witnessed.select(args.rounds)
        except ValueError as e:
            print(f"prompt_cost: {e}", file=sys.stderr)
            return 2
        with witnessed.traces(rounds) as paths:
            for p in paths:
                print(render(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
