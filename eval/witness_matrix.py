"""Score kvtop's inference against the engine's own account (the witness), stall by stall.

A witnessed trace (``kvtop record --witness``) is analysed twice at the same ITL target: with its
``step`` records, where every spike the witness covers is read from the engine's log (rule
``witness``), and without them, which is kvtop's inference from the outside (scrapes, streams, first
tokens). The two analyses find the same spikes (finding a gap over the target needs no engine log);
each inferred call is scored against the engine's account of the same spike. Spikes the witness does
not cover (a stream the engine did not log under its id) are left out and counted.

Targets: a loose 100 ms and a tight one, ``TIGHT_K`` x the median decode-only step the witness
measured (operators set 2-3x the decode step).

After the pooled matrix, a table of merged chunks: the spikes the witness read as tokens held outside
the engine's steps, the bound the report without the witness gives on spikes that can be merged
chunks (``merged_tokens``), the traces it warned on, and the tokens the engine counted beyond the
chunks (docs/real-engines.md 7.25).

    python -m eval.witness_matrix TRACE [TRACE ...] [--json out.json]
    python -m eval.witness_matrix --rounds O          # rounds shipped in eval/witness_rounds/ (A-O, "all")
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from eval import witnessed
from eval.scoring import precision_recall
from kvtop.analysis.attribution.causes import WITNESS_KINDS
from kvtop.analysis.report import MERGED_WARNING
from kvtop.analysis.scan import analyze_trace
from kvtop.model.analysis import AnalysisReport

TIGHT_K = 2.5
LOOSE_S = 0.100
ENGINE_CAUSES = ("preemption", "prefill_interference")


def _is_step(line: bytes) -> bool:
    return b'"kind":"step"' in line or b'"kind": "step"' in line


def step_records(path: str) -> Iterator[dict[str, Any]]:
    """The witness's ``step`` records of a trace, in file order."""
    with open(path, "rb") as f:
        for line in f:
            if _is_step(line):
                yield json.loads(line)


def decode_step_s(path: str) -> float | None:
    """Median duration of the witnessed steps that ran decode tokens only."""
    durs = []
    for d in step_records(path):
        reqs = d.get("reqs") or []
        if reqs and not any(r[2] or r[3] for r in reqs):
            durs.append(d["end"] - d["t"])
    return statistics.median(durs) if durs else None


def without_witness(path: str, out_dir: str) -> str:
    """A copy of the trace without its step records: what kvtop sees without a witness."""
    out = os.path.join(out_dir, os.path.basename(path) + ".nowitness.jsonl")
    with open(path, "rb") as src, open(out, "wb") as dst:
        for line in src:
            if not _is_step(line):
                dst.write(line)
    return out


def spike_key(s: Any) -> tuple[str, float]:
    """How a spike of the inference is matched with the witness's: its stream and its end."""
    return (s.request_id, round(s.t_end, 6))


def truth(path: str, target_s: float) -> tuple[dict[tuple[str, float], str], int, set[tuple[str, float]]]:
    """The cause the engine's log gives each spike of the witnessed trace at this target, how many
    spikes it did not cover, and those whose cause it could not tell (the engine's pace changed
    around a prompt step and the cause depends on which pace: ``witness-ambiguous``; scored by no one)."""
    return _read(analyze_trace(path, itl_target_s=target_s, fast=False))


def _read(rep: AnalysisReport) -> tuple[dict[tuple[str, float], str], int, set[tuple[str, float]]]:
    told, untold = WITNESS_KINDS
    return ({spike_key(s): str(s.cause) for s in rep.spikes if s.rule == told},
            sum(1 for s in rep.spikes if s.rule not in WITNESS_KINDS),
            {spike_key(s) for s in rep.spikes if s.rule == untold})


def targets(path: str) -> list[tuple[str, float]]:
    """The targets a trace is scored at: 100 ms, and ``TIGHT_K`` x its median decode-only step."""
    dec = decode_step_s(path)
    out = [("100 ms", LOOSE_S)]
    if dec:
        out.append((f"{TIGHT_K * dec * 1e3:.1f} ms ({TIGHT_K:g}x a {dec * 1e3:.1f} ms step)", TIGHT_K * dec))
    return out


def score(path: str, target_s: float, blind: str | None = None) -> dict[str, Any]:
    """Inference vs the witness on one trace at one target (``blind``: the trace without its step
    records, when already written)."""
    with tempfile.TemporaryDirectory() as tmp:
        blind = blind or without_witness(path, tmp)
        wit_rep = analyze_trace(path, itl_target_s=target_s, fast=False)
        causes, not_covered, untold = _read(wit_rep)
        inf_rep = analyze_trace(blind, itl_target_s=target_s, fast=False)
    pairs: list[tuple[str, str | None]] = []
    unmatched = ambiguous = 0
    for s in inf_rep.spikes:
        t = causes.get(spike_key(s))
        if t is None:
            if spike_key(s) in untold:
                ambiguous += 1
            else:
                unmatched += 1
            continue
        pairs.append((str(s.cause), t))
    res: dict[str, Any] = dict(precision_recall(pairs, ENGINE_CAUSES))
    neither = [(p, t) for p, t in pairs if t not in ENGINE_CAUSES]  # t is never None here
    res["neither"] = len(neither)
    res["neither_called_engine"] = sum(1 for p, _ in neither if p in ENGINE_CAUSES)
    res["neither_called_prefill"] = sum(1 for p, _ in neither if p == "prefill_interference")
    res["spikes"] = len(pairs)
    res["not_witnessed"] = unmatched + not_covered
    res["ambiguous"] = ambiguous
    res["target_s"] = target_s
    res["truth_causes"] = {c: sum(1 for _, t in pairs if t == c) for c in sorted({str(t) for _, t in pairs})}
    # merged chunks: what the witness read as held, what the report without it counts and bounds
    m = inf_rep.merged_tokens
    res["merged"] = {"spikes": inf_rep.spikes_total, "held": wit_rep.held_spikes or 0,
                     "spikes_max": m.spikes_max if m else 0,
                     "tokens": m.tokens if m else 0, "usage_tokens": m.usage_tokens if m else 0,
                     "warned": int(any(MERGED_WARNING in w for w in inf_rep.warnings))}
    return res


def matrix(paths: list[str]) -> list[dict[str, Any]]:
    rows = []
    for p in paths:
        with tempfile.TemporaryDirectory() as tmp:
            blind = without_witness(p, tmp)  # once per trace, for both targets
            for name, tgt in targets(p):
                rows.append({"trace": os.path.basename(p), "target": name, **score(p, tgt, blind)})
    return rows


def workload(trace: str) -> str:
    """A trace's workload: its file name without the round's seed ("storm8x900-161.jsonl" -> "storm8x900")."""
    return re.sub(r"(-\d+)?\.jsonl$", "", trace)


def pool(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows summed per workload and over all of them, at 100 ms and at the tight target (each
    trace's own 2.5x step): precision and recall of the pooled counts, not a mean of ratios."""
    sums: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        tgt = "100 ms" if r["target_s"] == LOOSE_S else f"{TIGHT_K:g}x decode step"
        for name in (workload(r["trace"]), "all"):
            acc = sums.setdefault((name, tgt), {"trace": name, "target": tgt, "traces": 0, "neither": 0,
                                                "neither_called_engine": 0, "neither_called_prefill": 0,
                                                "spikes": 0, "not_witnessed": 0, "ambiguous": 0,
                                                **{c: {"tp": 0, "predicted": 0, "actual": 0} for c in ENGINE_CAUSES}})
            acc["traces"] += 1
            for k in ("neither", "neither_called_engine", "neither_called_prefill", "spikes", "not_witnessed",
                      "ambiguous"):
                acc[k] += r[k]
            merged = acc.setdefault("merged", dict.fromkeys(r["merged"], 0))
            for k, v in r["merged"].items():
                merged[k] += v
            for c in ENGINE_CAUSES:
                for k in ("tp", "predicted", "actual"):
                    acc[c][k] += r[c][k]
    for acc in sums.values():
        for c in ENGINE_CAUSES:
            d = acc[c]
            d["precision"] = d["tp"] / d["predicted"] if d["predicted"] else None
            d["recall"] = d["tp"] / d["actual"] if d["actual"] else None
    return [sums[k] for k in sorted(sums, key=lambda k: (k[0] == "all", k))]


def _num(x: float | None) -> str:
    return "  —  " if x is None else f"{x:5.2f}"


def _pr(d: dict[str, Any]) -> str:
    return f"{_num(d['precision'])} / {_num(d['recall'])} ({d['tp']}/{d['predicted']}p {d['actual']}a)"


def render(rows: list[dict[str, Any]]) -> str:
    out = [f"{'trace':<28} {'target':<34} {'preemption P / R':<28} {'prefill P / R':<28} "
           f"{'neither called engine':<22} spikes"]
    for r in rows:
        nn = f"{r['neither_called_engine']} of {r['neither']}" + (
            f" ({r['neither_called_engine'] / r['neither']:.0%})" if r["neither"] else "")
        out.append(f"{r['trace'][:28]:<28} {r['target']:<34} {_pr(r['preemption']):<28} "
                   f"{_pr(r['prefill_interference']):<28} {nn:<22} {r['spikes']}"
                   + (f" (+{r['not_witnessed']} not witnessed)" if r["not_witnessed"] else "")
                   + (f" (+{r['ambiguous']} the log cannot tell)" if r["ambiguous"] else ""))
    return "\n".join(out)


def render_merged(rows: list[dict[str, Any]]) -> str:
    """Merged chunks per row: the spikes the witness read as tokens held outside the engine's steps,
    the bound the report without it gives (``merged_tokens.spikes_max``), the traces it warned on, and
    the engine's tokens that reached the client merged (of all it counted); ``spikes``: all the
    report's spikes, the witness's covered or not."""
    out = [f"{'trace':<28} {'target':<34} {'spikes':>7} {'held (witness)':>15} {'bound (report)':>15} "
           f"{'warned':>7}  merged tokens"]
    for r in rows:
        m = r["merged"]
        share = f" ({m['tokens'] / m['usage_tokens']:.1%})" if m["usage_tokens"] else ""
        out.append(f"{r['trace'][:28]:<28} {r['target']:<34} {m['spikes']:>7} {m['held']:>15} {m['spikes_max']:>15} "
                   f"{m['warned']:>7}  {m['tokens']} of {m['usage_tokens']}{share}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.witness_matrix", description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--rounds", default=None, metavar="SPEC",
                    help="also score the witnessed rounds shipped in eval/witness_rounds/: A-G, H,K, all")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if not args.traces and not args.rounds:
        ap.error("give traces or --rounds")
    try:
        rounds = witnessed.select(args.rounds) if args.rounds else []
    except ValueError as e:
        ap.error(str(e))
    with witnessed.traces(rounds) as shipped:
        rows = matrix(args.traces + shipped)
    print(render(rows))
    if len(rows) > 2:
        print(f"\npooled ({len({r['trace'] for r in rows})} traces)")
        print(render(pool(rows)))
        print("\nmerged chunks, pooled (the report's warning and bound without the witness, its held count with it)")
        print(render_merged(pool(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
