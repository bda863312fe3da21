"""Attribution precision/recall per cause x situation x scrape interval x generator, against a rule
baseline, plus how often non-engine stalls are called preemption and a confidence reliability table.

Two generators: kvtop's own simulator (``kvtop simulate`` presets) and the independent step-level
generator in eval/tracegen (different engine model, vLLM V1 / SGLang / never-preempting
semantics, a delivery model between engine and client). Every spike kvtop reports is labelled by
the truth stall of the same request that overlaps it most (eval.truth); the rule
baseline (eval/tracegen/baseline.py) judges the same spikes.

    python -m eval.attribution_matrix            # 2 seeds, 1/5/15 s scrapes (a few minutes)
    python -m eval.attribution_matrix --quick    # 1 seed, 1/5 s scrapes, shorter runs (~1 min)
    python -m eval.attribution_matrix --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from eval.scoring import precision_recall, reliability_table
from eval.tracegen import baseline
from eval.tracegen.generate import simulate as tg_simulate
from eval.tracegen.generate import write as tg_write
from eval.tracegen.situations import SITUATIONS
from eval.truth import NON_ENGINE_CAUSES, label_span, truth_intervals
from kvtop.analysis.scan import analyze_trace

CAUSES = ("preemption", "prefill_interference", "slow_decode")
SHORT = {"preemption": "preempt", "prefill_interference": "prefill", "slow_decode": "slow"}
SIM_PRESETS = ("preemption-storm", "cancel-heavy", "prefill-interference", "slow-decode", "healthy")
# every gap of slow-decode's ~400 streams is a spike once its batch has ramped up (300K+ spikes per
# 2-minute run, most of the matrix's time): one seed is plenty
ONE_SEED = ("slow-decode",)


def score_trace(path: str, itl_target_s: float) -> dict[str, Any]:
    rep = analyze_trace(path, itl_target_s=itl_target_s)
    truth = truth_intervals(path, engine_wide=True)
    spikes = rep.spikes
    truths = [label_span(s.request_id, s.t_start, s.t_end, truth, rep.itl_target_s) for s in spikes]
    ours = [s.cause for s in spikes]
    # the independent rule baseline reads spikes as `kvtop analyze --format json` prints them
    rules = baseline.classify([s.to_dict() for s in spikes], baseline.TraceIndex(path))
    return {"truth": truths, "kvtop": ours, "rules": rules, "conf": [float(s.confidence or 0.0) for s in spikes],
            "verdict": rep.verdict.action if rep.verdict else None}


def _pr(x: dict[str, Any]) -> str:
    p = "  - " if x["precision"] is None else f"{x['precision']:.2f}"
    r = "  - " if x["recall"] is None else f"{x['recall']:.2f}"
    return f"{p}/{r}"


def _nonengine(pred: list[str], truth: list[str | None]) -> tuple[int, int]:
    idx = [i for i, t in enumerate(truth) if t in NON_ENGINE_CAUSES]
    return sum(1 for i in idx if pred[i] == "preemption"), len(idx)


def _row(res: dict[str, Any]) -> str:
    cells = []
    for who in ("kvtop", "rules"):
        pairs = list(zip(res[who], res["truth"], strict=True))
        pr = precision_recall(pairs, CAUSES)
        ne, n = _nonengine(res[who], res["truth"])
        cells.append("  ".join(f"{_pr(pr[c]):>9}" for c in CAUSES) + f"  {f'{ne}/{n}':>7}")
    return " | ".join(cells)


def header_line() -> str:
    cols = "  ".join(f"{SHORT[c] + ' P/R':>9}" for c in CAUSES) + f"  {'nonE>pre':>7}"
    return f"{'generator':<9} {'situation':<21}{'scr':>4}{'spikes':>7} | kvtop: {cols} | rules: {cols}"


def reliability(results: list[dict[str, Any]]) -> list[str]:
    """Bins of stated confidence vs observed accuracy (spikes given a cause other than unknown)."""
    calls = [(c, pred == t) for res in results
             for pred, t, c in zip(res["kvtop"], res["truth"], res["conf"], strict=True) if pred != "unknown"]
    return reliability_table(calls)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 1 and 5 s scrapes, shorter runs")
    ap.add_argument("--seeds", type=int, nargs="+")
    ap.add_argument("--intervals", type=float, nargs="+")
    ap.add_argument("--generators", nargs="+", choices=["tracegen", "sim"], default=["tracegen", "sim"])
    ap.add_argument("--situations", nargs="+", choices=list(SITUATIONS), metavar="NAME")
    ap.add_argument("--presets", nargs="+", choices=list(SIM_PRESETS), metavar="PRESET")
    ap.add_argument("--itl-target-ms", type=float, default=100.0, metavar="N", help="ITL target (default 100)")
    ap.add_argument("--json", metavar="FILE", help="also write every spike's labels and causes as JSON")
    args = ap.parse_args()
    seeds = args.seeds or ([1] if args.quick else [1, 2])
    intervals = args.intervals or ([1.0, 5.0] if args.quick else [1.0, 5.0, 15.0])
    situations = (args.situations or list(SITUATIONS)) if "tracegen" in args.generators else []
    presets = (args.presets or list(SIM_PRESETS)) if "sim" in args.generators else []
    tg_dur = 60.0 if args.quick else None
    sim_dur = 60.0 if args.quick else 120.0
    t_start = time.perf_counter()
    from kvtop.sim.simulate import simulate_to_trace
    from kvtop.sim.workload import load_preset

    cells: dict[tuple[str, str, float], dict[str, Any]] = {}

    def add(key: tuple[str, str, float], res: dict[str, Any]) -> None:
        c = cells.setdefault(key, {"truth": [], "kvtop": [], "rules": [], "conf": [], "verdicts": []})
        for k in ("truth", "kvtop", "rules", "conf"):
            c[k].extend(res[k])
        c["verdicts"].append(res["verdict"])

    tgt = args.itl_target_ms / 1e3
    print(f"ITL target {args.itl_target_ms:g} ms; P/R = precision/recall, '-' = undefined; nonE>pre = "
          "non-engine stalls (slow reader, API merge/stall, host pause) called preemption / all of them")
    print(header_line())
    with tempfile.TemporaryDirectory() as d:
        for name in situations:
            for seed in seeds:
                g = tg_simulate(name, seed, tg_dur)
                for iv in intervals:
                    p = os.path.join(d, f"tg-{name}-{seed}-{iv}.jsonl")
                    tg_write(g, p, iv)
                    add(("tracegen", name, iv), score_trace(p, tgt))
                    os.unlink(p)
            for iv in intervals:
                c = cells[("tracegen", name, iv)]
                print(f"{'tracegen':<9} {name:<21}{iv:>4.0f}{len(c['truth']):>7} | {_row(c)}", flush=True)
        for preset in presets:
            for iv in intervals:
                for seed in seeds[:1] if preset in ONE_SEED else seeds:
                    p = os.path.join(d, f"sim-{preset}-{seed}-{iv}.jsonl")
                    simulate_to_trace(load_preset(preset), seed, sim_dur, p, scrape_interval_s=iv)
                    add(("sim", preset, iv), score_trace(p, tgt))
                    os.unlink(p)
                c = cells[("sim", preset, iv)]
                print(f"{'sim':<9} {preset:<21}{iv:>4.0f}{len(c['truth']):>7} | {_row(c)}", flush=True)
    print()
    print("totals")
    print(header_line())
    for gen in ("tracegen", "sim"):
        for iv in intervals:
            tot: dict[str, list[Any]] = {"truth": [], "kvtop": [], "rules": [], "conf": []}
            for (g_, _, iv_), c in cells.items():
                if g_ == gen and iv_ == iv:
                    for k in tot:
                        tot[k].extend(c[k])
            if tot["truth"]:
                print(f"{gen:<9} {'all':<21}{iv:>4.0f}{len(tot['truth']):>7} | {_row(tot)}")
    for gen in ("tracegen", "sim"):
        truths = [t for (g_, _, _), c in cells.items() if g_ == gen for t in c["truth"]]
        if truths:
            print(f"{gen}: {sum(t is None for t in truths)} of {len(truths)} spikes overlap no truth stall of "
                  f"their stream (scored as wrong whatever the cause)")
    for gen in ("tracegen", "sim"):
        res = [c for (g_, _, _), c in cells.items() if g_ == gen]
        if not res:
            continue
        print()
        print(f"confidence reliability, kvtop on {gen} (spikes given a cause; observed = share whose cause is right)")
        for line in reliability(res):
            print("  " + line)
    print(f"\n{time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{"generator": k[0], "situation": k[1], "scrape_interval_s": k[2], **v}
                       for k, v in cells.items()], f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
