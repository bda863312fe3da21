"""Fit the attribution's confidences on one trace generator and show how reliable they are on the other.

A finding's confidence is ``CONFIDENCE[rule] x DISCOUNT[weakness]...`` (kvtop/analysis/attribution/
thresholds.py, which loads them from fitted.json beside it). This script runs kvtop's analysis over traces with exact truth, and fits:
* each rule's base: the share of its calls without any weakness that were right (where such calls
  are fewer than ``MIN_FIT`` or than half its calls, the share among all its calls with the
  discounts divided out; with fewer than ``MIN_FIT`` calls at all, the current value stays);
* each discount (coarse scrapes, sparse observation, merged chunks): right calls among those it
  applies to, over what the bases alone predicted for them (capped below 1: a weakness never
  raises confidence).
Rules the fitting generator rarely exercises (kvtop's simulator has no engine-wide slowdown, so
``slow/pace`` and ``prefill/dominant`` hardly fire there) are fit on the other generator's
``--rare-seeds`` (eval/tracegen seeds 3-6 by default), which the held-out table never uses.
Then it prints the reliability table (stated vs observed accuracy per confidence bin, spikes given
a cause other than unknown) on the fitting generator and on the held-out one.

The rules that name an engine cause (``preemption/*``, ``prefill/*``) are then fit again where the
real engine judged enough of their calls: on the witnessed vLLM rounds in eval/witness_rounds/
(``--witness-fit``, every other round from the first by default), each call scored against the
engine's own step log at 100 ms and at 2.5x the decode step, the discounts divided out, once on the
calls at loose targets (their bases) and once on those at tight ones (``Evidence.tight_target``:
their tight bases, ``confidence_tight``); their reliability is shown on the rounds held out
(``--witness-held-out``, the other half). The generators are worlds kvtop's authors wrote; where
the real engine says a rule is right less often than they do, the real engine decides. Slow-decode
rules keep the generators' fit: the log tells a decode step from time outside the engine less well.

    python -m eval.calibrate                       # fit on kvtop/sim (+ rare rules on tracegen 3-6), hold out tracegen 1-2
    python -m eval.calibrate --fit tracegen        # the reverse check
    python -m eval.calibrate --write               # also write kvtop/analysis/attribution/fitted.json
    python -m eval.calibrate --witness-fit none    # the generators alone

Only ``--fit sim`` may ``--write``: the shipped numbers are fit on kvtop's simulator (the engine-cause
rules on half the witnessed rounds) and judged on the independent generator (and the other half),
never chosen on the traces that report them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eval.scoring import reliability_table
from eval.truth import label, truth_intervals
from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.attribution import thresholds
from kvtop.analysis.engines import engine_semantics
from kvtop.model.trace import TraceReader

SIM_PRESETS = ("preemption-storm", "cancel-heavy", "prefill-interference", "slow-decode", "healthy")
CAUSE_OF = {"preemption": "preemption", "prefill": "prefill_interference", "slow": "slow_decode"}
MIN_FIT = 20
# rules kept at their hand-set value whatever the traces say: a preemption read from KV and queue
# gauges alone (the run ended before the counter could show it) rests on evidence that holds for
# every stream in a storm; its right calls on the traces come from the last seconds of a few runs
# ... and rules whose evidence neither generator produces: the engine's own per-request times
# (prefill/span) appear only in traces of a real vLLM, where the witness refits them; and a rule the
# two worlds disagree on: a recompute reading on a long shared stall was never right on tracegen
# seeds 3-6 (a host pause between scrape beats) while real vLLM's re-prefills last many decode steps
# and the log confirmed 4 of its 10 calls on rounds H-O: it stays stated as doubtful, not as wrong,
# until the witnessed rounds it is fit on judge enough of its calls (fit_witness)
KEEP_SET = ("preemption/unread", "prefill/span", "prefill/recompute-long")
# the rules the witness refits: they name an engine cause, which the engine's step log states exactly
ENGINE_RULES = ("preemption/", "prefill/")
MIN_BIN = 50
# the weight, in calls, of a rule's witnessed fit over both targets in its fit at one of them
WITNESS_PRIOR = 50
DRAWN = f" drawn toward its fit at any target ({WITNESS_PRIOR} calls' weight)"
MAX_DISCOUNT = 0.99
MAX_BASE = 0.99  # no rule is ever certain: a few thousand right calls do not make the next one sure
MIN_BASE = 0.01  # ... nor certainly wrong: a few dozen wrong calls do not prove the next one is


@dataclass
class Call:
    key: str
    discounts: tuple[str, ...]
    right: bool
    tight: bool = False  # judged at a tight target (``Evidence.tight_target``)


def analyze(path: str, itl_target_s: float) -> Analyzer:
    """kvtop analyze's path (scan.analyze_trace) keeping the analyzer, whose spikes carry their rule key."""
    from kvtop.analysis import fastscan

    reader = TraceReader(path)
    an = Analyzer(itl_target_s=itl_target_s)
    an.use_engine(engine_semantics((reader.header.get("engine") or {}).get("adapter")))
    an.set_header(reader.header)
    if fastscan.available():
        reader.close()
        fastscan.scan(path, an)
    else:
        for d in reader.dicts():
            an.feed_dict(d)
    an.finish()
    return an


def calls(path: str, itl_target_s: float) -> list[Call]:
    an = analyze(path, itl_target_s)
    truth = truth_intervals(path, engine_wide=True)
    out = []
    for g in an.spikes:
        # an unknown makes no claim to be right or wrong about: its confidence is set, never fit
        if g.cause == "unknown" or g.rule_key is None:
            continue
        t = label({"request_id": g.request_id, "t_start": g.t_start, "t_end": g.t_end}, truth, an.gaps.itl_target_s)
        out.append(Call(g.rule_key, tuple(g.discounts), t == str(g.cause), g.tight))
    return out


def witness_calls(path: str) -> list[Call]:
    """The engine-cause calls of kvtop's inference on one witnessed trace (its step records left
    out), each judged by the engine's own log, at the witness matrix's two targets."""
    from eval.witness_matrix import spike_key, targets, truth, without_witness

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        blind = without_witness(path, tmp)
        for _, tgt in targets(path):
            causes, _, _ = truth(path, tgt)
            for g in analyze(blind, tgt).spikes:
                if g.cause == "unknown" or g.rule_key is None or not g.rule_key.startswith(ENGINE_RULES):
                    continue
                t = causes.get(spike_key(g))
                if t is not None:
                    out.append(Call(g.rule_key, tuple(g.discounts), t == str(g.cause), g.tight))
    return out


def witness_rounds(spec: str) -> list[str]:
    """Witnessed rounds by letter (``witnessed.select``), ``odd`` / ``even`` (every other round in
    letter order, from the first / the second: the rounds' workloads changed as they were added, so
    halves taken this way hold the same mix where a run of letters holds one era's), or ``none``."""
    from eval import witnessed

    low = spec.lower()
    if low == "none":
        return []
    if low in ("odd", "even"):
        return witnessed.names()[low == "even"::2]
    return witnessed.select(spec)


def rounds_label(spec: str) -> str:
    """How a ``witness_rounds`` spec reads in the output and in fitted.json's ``how``."""
    low = spec.lower()
    if low in ("odd", "even"):
        return f"{low} (every other round, from {'A' if low == 'odd' else 'B'})"
    return spec.upper()


def witness_collect(rounds: list[str]) -> list[Call]:
    from eval import witnessed

    out: list[Call] = []
    with witnessed.traces(rounds) as paths:
        for p in paths:
            out += witness_calls(p)
    return out


def fit_witness(conf: dict[str, float], disc: dict[str, float], how: dict[str, str], cs: list[Call],
                source: str, tight: tuple[dict[str, float], dict[str, str]] | None = None) -> None:
    """Refit, in place, the bases of the engine-cause rules with at least ``MIN_FIT`` witnessed calls
    in ``cs`` (the discounts as fit, divided out): from the calls at loose targets into ``conf``, and
    from those at tight targets into ``tight``'s bases and their ``how`` (where given; else all calls
    into ``conf``)."""
    by_key: dict[tuple[str, bool], list[Call]] = defaultdict(list)
    pooled: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # rule -> [right, predicted] at any target
    for c in cs:
        by_key[(c.key, c.tight and tight is not None)].append(c)
        pooled[c.key][0] += c.right
        pooled[c.key][1] += discounted(c, disc)
    for (k, at_tight), xs in by_key.items():
        if k == "preemption/unread" or not k.startswith(ENGINE_RULES) or len(xs) < MIN_FIT:
            continue
        pred = sum(discounted(c, disc) for c in xs)
        # a few dozen calls at one kind of target say less than the rule's calls at both: they move the
        # rule's fit over both by their weight against WITNESS_PRIOR calls' worth of it
        right_all, pred_all = pooled[k]
        base = (sum(c.right for c in xs) + WITNESS_PRIOR * right_all / pred_all) / (pred + WITNESS_PRIOR)
        base = max(MIN_BASE, min(MAX_BASE, base))
        said = f"fit on {len(xs)} calls judged by real vLLM's step log ({source}"
        if at_tight and tight is not None:
            tight[0][k] = base
            tight[1][k] = said + ", at tight targets" + DRAWN + ", discounts divided out)"
        else:
            conf[k] = base
            how[k] = said + (", at loose targets" + DRAWN if tight is not None else "") + ", discounts divided out)"


def traces(gen: str, seeds: list[int], intervals: list[float], d: str) -> Iterator[str]:
    if gen == "sim":
        from kvtop.sim.simulate import simulate_to_trace
        from kvtop.sim.workload import load_preset

        for preset in SIM_PRESETS:
            for seed in seeds[:1] if preset == "slow-decode" else seeds:  # 300K spikes a run: one is plenty
                for iv in intervals:
                    p = os.path.join(d, f"sim-{preset}-{seed}-{iv}.jsonl")
                    simulate_to_trace(load_preset(preset), seed, 120.0, p, scrape_interval_s=iv)
                    yield p
                    os.unlink(p)
    else:
        from eval.tracegen.generate import simulate, write
        from eval.tracegen.situations import SITUATIONS

        for name in SITUATIONS:
            for seed in seeds:
                g = simulate(name, seed)
                for iv in intervals:
                    p = os.path.join(d, f"tg-{name}-{seed}-{iv}.jsonl")
                    write(g, p, iv)
                    yield p
                    os.unlink(p)


def collect(gen: str, seeds: list[int], intervals: list[float], itl_target_s: float) -> list[Call]:
    out: list[Call] = []
    with tempfile.TemporaryDirectory() as d:
        for p in traces(gen, seeds, intervals, d):
            out += calls(p, itl_target_s)
    return out


def stated(c: Call, conf: dict[str, float], disc: dict[str, float], tight: dict[str, float] | None = None) -> float:
    """The confidence the analysis states for the call: its rule's base (at a tight target, the tight
    one where the rule has it), discounted."""
    return thresholds.base(c.key, c.tight, conf, tight or {}) * discounted(c, disc)


def discounted(c: Call, disc: dict[str, float]) -> float:
    """The product of the call's discounts (1.0 without any)."""
    v = 1.0
    for n in c.discounts:
        v *= disc[n]
    return v


def fit(cs: list[Call], rare: list[Call] | None = None,
        rare_from: str = "rare") -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """(bases, discounts, how each base was obtained). A rule or discount with fewer than
    ``MIN_FIT`` calls in ``cs`` is fit on its calls in ``rare`` (``rare_from`` says where they came from)."""
    conf = dict(thresholds.CONFIDENCE)
    disc = dict(thresholds.DISCOUNT)
    how = {k: "set" for k in conf}
    by_key: dict[str, list[Call]] = defaultdict(list)
    for c in cs:
        by_key[c.key].append(c)
    src = {k: "" for k in conf}
    if rare:
        spare: dict[str, list[Call]] = defaultdict(list)
        for c in rare:
            spare[c.key].append(c)
        for k, xs in spare.items():
            if len(by_key.get(k, ())) < MIN_FIT <= len(xs):
                by_key[k], src[k] = xs, f", {rare_from}"
    for _ in range(3):  # bases and discounts depend on each other: a few rounds settle them
        for k, xs in by_key.items():
            if k in KEEP_SET:
                continue
            plain = [c for c in xs if not c.discounts]
            # the plain calls alone only where they are most of the rule's calls: a rule that mostly
            # fires on coarse scrapes or merged chunks is fit on all of them, discounts divided out
            if len(plain) >= MIN_FIT and 2 * len(plain) >= len(xs):
                conf[k] = max(MIN_BASE, min(MAX_BASE, sum(c.right for c in plain) / len(plain)))
                how[k] = f"fit on {len(plain)}{src.get(k, '')}"
            elif len(xs) >= MIN_FIT:
                # the discounts alone (a base fit to 0 in an earlier round must not divide)
                pred = sum(discounted(c, disc) for c in xs)
                conf[k] = max(MIN_BASE, min(MAX_BASE, sum(c.right for c in xs) / pred))
                how[k] = f"fit on {len(xs)}{src.get(k, '')} (discounts divided out)"
        for n in disc:
            xs = [c for k in by_key for c in by_key[k] if n in c.discounts]
            if len(xs) < MIN_FIT and rare:
                xs = [c for c in rare if n in c.discounts]
            if len(xs) < MIN_FIT:
                continue
            pred = sum(stated(c, conf, disc) for c in xs)
            disc[n] = min(MAX_DISCOUNT, disc[n] * sum(c.right for c in xs) / pred) if pred else disc[n]
    return conf, disc, how


def reliability(cs: list[Call], conf: dict[str, float], disc: dict[str, float],
                tight: dict[str, float] | None = None) -> tuple[list[str], float]:
    """The table, and the worst error among bins with at least MIN_BIN spikes."""
    return reliability_table([(stated(c, conf, disc, tight), c.right) for c in cs], MIN_BIN)


def per_rule(cs: list[Call], conf: dict[str, float], disc: dict[str, float],
             tight: dict[str, float] | None = None) -> list[str]:
    """Stated and observed accuracy per rule (a rule's calls at tight targets on a line of their own)."""
    by: dict[str, list[Call]] = defaultdict(list)
    for c in cs:
        by[c.key + (" (tight)" if c.tight else "")].append(c)
    out = [f"{'rule':<32}{'calls':>7}{'stated':>8}{'observed':>10}"]
    for k in sorted(by):
        xs = by[k]
        out.append(f"{k:<32}{len(xs):>7}{sum(stated(c, conf, disc, tight) for c in xs) / len(xs):>8.2f}"
                   f"{sum(c.right for c in xs) / len(xs):>10.2f}")
    return out


def fitted_json(conf: dict[str, float], disc: dict[str, float], how: dict[str, str],
                tight: dict[str, float] | None = None, how_tight: dict[str, str] | None = None) -> str:
    """The text of kvtop/analysis/attribution/fitted.json: the bases and discounts the analysis loads,
    how each base was obtained ("set", or "fit on N calls" and where they came from), and the bases
    at tight targets of the rules the real engine judged there often enough."""
    tight, how_tight = tight or {}, how_tight or {}
    doc = {"confidence": {k: round(v, 3) for k, v in conf.items()},
           "confidence_tight": {k: round(v, 3) for k, v in tight.items()},
           "discount": {k: round(v, 3) for k, v in disc.items()},
           "how": {k: how[k] for k in conf},
           "how_tight": {k: how_tight[k] for k in tight}}
    return json.dumps(doc, indent=1) + "\n"


def write_fitted(conf: dict[str, float], disc: dict[str, float], how: dict[str, str],
                 tight: dict[str, float], how_tight: dict[str, str]) -> None:
    # the data file beside thresholds.py (the package's copy, so an editable install reads it at once)
    path = Path(thresholds.__file__).with_name(thresholds.FITTED_FILE)
    path.write_text(fitted_json(conf, disc, how, tight, how_tight), encoding="utf-8")
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", choices=["sim", "tracegen"], default="sim", help="the generator to fit on (default sim)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--held-out-seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rare-seeds", type=int, nargs="*", default=[3, 4, 5, 6],
                    help="held-out-generator seeds that fit the rules the fitting generator rarely exercises "
                         "(never the held-out seeds; none: those rules keep their set values)")
    ap.add_argument("--intervals", type=float, nargs="+", default=[1.0, 5.0, 15.0])
    ap.add_argument("--itl-target-ms", type=float, default=100.0, metavar="N")
    ap.add_argument("--witness-fit", default="odd", metavar="ROUNDS",
                    help="witnessed vLLM rounds (eval/witness_rounds/) that refit the engine-cause rules: letters "
                         "(A-G, H,K), or odd / even: every other round, the first / the second (default odd; "
                         "none: the generators alone)")
    ap.add_argument("--witness-held-out", default="even", metavar="ROUNDS",
                    help="witnessed rounds their reliability is shown on (default even)")
    ap.add_argument("--write", action="store_true",
                    help="write kvtop/analysis/attribution/fitted.json (--fit sim only)")
    args = ap.parse_args()
    if args.write and args.fit != "sim":
        print("calibrate: --write only with --fit sim (the shipped numbers are fit on kvtop's simulator)", file=sys.stderr)
        return 2
    held = "tracegen" if args.fit == "sim" else "sim"
    if set(args.rare_seeds) & set(args.held_out_seeds):
        print("calibrate: --rare-seeds must not overlap --held-out-seeds (a confidence is never judged on the "
              "traces it was fit on)", file=sys.stderr)
        return 2
    try:
        wfit = witness_rounds(args.witness_fit)
        wheld = witness_rounds(args.witness_held_out)
    except ValueError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    if set(wfit) & set(wheld):
        print("calibrate: --witness-fit and --witness-held-out share rounds (a confidence is never judged on the "
              "rounds it was fit on)", file=sys.stderr)
        return 2
    tgt = args.itl_target_ms / 1e3
    t0 = time.perf_counter()
    train = collect(args.fit, args.seeds, args.intervals, tgt)
    rare = collect(held, args.rare_seeds, args.intervals, tgt) if args.rare_seeds else []
    test = collect(held, args.held_out_seeds, args.intervals, tgt)
    rs = sorted(args.rare_seeds)
    rare_from = "no spare seeds" if not rs else f"{held} seeds " + (
        f"{rs[0]}-{rs[-1]}" if rs == list(range(rs[0], rs[-1] + 1)) else ",".join(map(str, rs)))
    conf, disc, how = fit(train, rare, rare_from)
    tight: dict[str, float] = {}
    how_tight: dict[str, str] = {}
    wtrain = witness_collect(wfit)
    wtest = witness_collect(wheld)
    if wfit:
        fit_witness(conf, disc, how, wtrain, f"witness rounds {rounds_label(args.witness_fit)}", (tight, how_tight))
    print(f"fit on {args.fit} (seeds {args.seeds}, {len(train)} calls; rules it rarely exercises on {rare_from}, "
          f"{len(rare)} calls); held out: {held} (seeds {args.held_out_seeds}, {len(test)} calls); "
          f"scrapes {args.intervals} s, target {args.itl_target_ms:g} ms")
    print()
    print("fitted bases")
    for k, v in conf.items():
        print(f"  {k:<24}{v:>6.3f}  ({how[k]}; shipped {thresholds.CONFIDENCE.get(k, float('nan')):.3f})")
    print("fitted bases at tight targets")
    for k, v in tight.items():
        print(f"  {k:<24}{v:>6.3f}  ({how_tight[k]}; shipped "
              f"{thresholds.CONFIDENCE_TIGHT.get(k, thresholds.CONFIDENCE.get(k, float('nan'))):.3f})")
    print("fitted discounts  " + "  ".join(f"{k} {v:.3f} (shipped {thresholds.DISCOUNT[k]:.3f})" for k, v in disc.items()))
    held_w = f"witnessed rounds {rounds_label(args.witness_held_out)} (held out)"
    sets = [(f"{args.fit} (fitted on)", train, False), (f"{held} (held out)", test, True)]
    for name, cs, per in sets + ([(held_w, wtest, True)] if wtest else []):
        for title, c, d, t in (("fitted", conf, disc, tight),
                               ("shipped", thresholds.CONFIDENCE, thresholds.DISCOUNT, thresholds.CONFIDENCE_TIGHT)):
            lines, worst = reliability(cs, c, d, t)
            print()
            print(f"reliability on {name}, {title} confidences: worst error {worst:.3f} in bins of >= {MIN_BIN} spikes")
            for line in lines:
                print("  " + line)
        if per:
            print()
            print(f"per rule on {name}, fitted confidences")
            for line in per_rule(cs, conf, disc, tight):
                print("  " + line)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.write:
        write_fitted(conf, disc, how, tight, how_tight)
    return 0


if __name__ == "__main__":
    sys.exit(main())
