"""`kvtop simulate`: run the simulated engine faster than real time and write a kvtop trace."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtop.commands._longrun import Interrupt, Progress, interrupted_note
from kvtop.commands._options import MAX_DURATION_S, check_output, replace_output, seconds_arg
from kvtop.errors import UsageError

NAME = "simulate"
HELP = "run the simulated paged-KV engine faster than real time and write a trace (with ground truth)"
ORDER = 60


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", metavar="NAME", help="built-in preset (see README: Simulated engine and presets)")
    src.add_argument("--workload", metavar="FILE", help="workload JSON file (same schema as the presets)")
    p.add_argument("--policy", metavar="NAME", help="recompute, swap, or a policy variant the preset defines")
    p.add_argument("--engine-flags", metavar="FLAGS", default=None,
                   help="vLLM flags to apply to the simulated engine, e.g. \"$(kvtop advise --trace T --emit-flags)\"")
    p.add_argument("--seed", type=int, default=1, help="random seed (same seed -> identical trace)")
    p.add_argument("--duration", type=seconds_arg, required=True, metavar="DURATION",
                   help="simulated time (600, 600s, 10m)")
    p.add_argument("-o", "--output", required=True, metavar="TRACE", help="trace file to write (JSON Lines)")
    p.add_argument("--force", action="store_true", help="overwrite TRACE if it already exists")
    p.add_argument("--scrape-interval", type=seconds_arg, default=1.0, metavar="DURATION",
                   help="simulated seconds between /metrics scrapes (default 1)")
    p.add_argument("--arrivals-from", metavar="TRACE",
                   help="what-if: replay the request arrivals (times, prompt and output lengths) of a recorded "
                        "trace instead of the workload's traffic, on the preset's engine and --policy")


def run(args: argparse.Namespace) -> int:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.sim.simulate import simulate_to_trace
    from kvtop.sim.workload import load_preset, load_workload_file, requests_from_trace

    if not 0 < args.duration <= MAX_DURATION_S:
        # a busy preset writes about 2,000 records per simulated second: a day is already tens of GB
        raise UsageError(f"--duration must be > 0 and at most {MAX_DURATION_S:g} simulated seconds (a day), "
                         f"not {args.duration:g}")
    if args.scrape_interval <= 0:
        raise UsageError("--scrape-interval must be > 0")
    wl = load_preset(args.preset) if args.preset else load_workload_file(args.workload)
    wl = wl.with_policy(args.policy)
    if args.engine_flags:
        from kvtop.sim.flags import apply_engine_flags

        wl = apply_engine_flags(wl, args.engine_flags)
    out = Path(args.output)
    check_output(args.output, args.force)  # never a second run appended, nor a pipe to block on
    specs = None
    if args.arrivals_from:
        specs = requests_from_trace(args.arrivals_from, wl, args.seed, args.duration)
    if args.force:
        replace_output(args.output)  # the writer appends
    progress = Progress(f"kvtop simulate: {out}")

    with Interrupt() as stop:
        def tick(t: float) -> bool:
            progress.update(t, args.duration, f"{t:.0f} of {args.duration:g} simulated s")
            return stop.requested

        try:
            res = simulate_to_trace(wl, args.seed, args.duration, str(out), policy=args.policy,
                                    scrape_interval_s=args.scrape_interval, requests=specs, tick=tick)
        finally:
            progress.close()
    if stop.requested:
        interrupted_note("simulate", f"stopped at {res.duration_s:g} of {args.duration:g} simulated s; {out} is a "
                                     "complete trace up to there")
    st = res.stats
    truth = ", ".join(f"{k} {v}" for k, v in sorted(res.truth_counts.items())) or "none"
    sys.stdout.write(
        f"{out}: {res.records} records, {res.requests} requests over {res.duration_s:g} simulated s "
        f"({wl.name}, {args.policy or wl.engine.preemption_mode}, seed {args.seed}); preemptions {st.preempt_events}, "
        f"finished {st.finished['stop'] + st.finished['length']}, aborted {st.finished['abort']}; truth: {truth}\n")
    return 0
