"""`kvtop compare A B`: two runs of the same traffic side by side, and whether B is better."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtop.errors import UsageError

NAME = "compare"
HELP = "compare two traces of the same traffic (before/after a change): goodput, ITL, TTFT, end-to-end, preemptions"
DESCRIPTION = (
    "Reads two traces (e.g. `kvtop load --from` the same recording against two engine configurations) and prints "
    "offered and completed requests, goodput (completions within --ttft-target-ms and --itl-target-ms), p50/p99 "
    "ITL and TTFT, p50/p99 end-to-end latency, output tokens/s, preemptions per completed request, time over "
    "target by cause and each run's verdict, then one line: improved, trade-off (better on the contract, worse on a "
    "figure it does not judge, e.g. TTFT without --ttft-target-ms), worse, mixed, no change, or not comparable "
    "(offered load or mix differ beyond the tolerance). Shedding more load (cancels, errors) or completing less is "
    "never better. --also pools more runs of the same pair, for a host whose noise one run cannot average out. "
    "JSON: kvtop/schemas/compare.schema.json."
)
ORDER = 47


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A.jsonl", help="the baseline trace")
    p.add_argument("b", metavar="B.jsonl", help="the trace to judge against it")
    p.add_argument("--also", nargs=2, action="append", default=[], metavar=("A2.jsonl", "B2.jsonl"),
                   help="another run of the same traffic on each configuration, pooled with A and B (counts, "
                        "goodput and time over the target summed, percentiles over every run); repeatable")
    p.add_argument("--ttft-target-ms", type=float, default=None, metavar="MS",
                   help="time-to-first-token contract for goodput (default: none)")
    p.add_argument("--itl-target-ms", type=float, default=None, metavar="MS",
                   help="inter-token contract for goodput (default: the target the analysis judges A against)")
    p.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace) -> int:
    from kvtop.analysis.compare import compare, render_text  # the analysis: only when the command runs
    from kvtop.model.trace import TraceError

    runs_a = [args.a, *(x for x, _ in args.also)]
    runs_b = [args.b, *(y for _, y in args.also)]
    for name in (*runs_a, *runs_b):
        if not Path(name).exists():  # a file, or an agent's --trace-dir of segments (as analyze reads)
            raise UsageError(f"{name}: no such trace file")
    for flag, v in (("--ttft-target-ms", args.ttft_target_ms), ("--itl-target-ms", args.itl_target_ms)):
        if v is not None and not 0 < v <= 3_600_000:
            raise UsageError(f"{flag} must be > 0 and at most 3600000 ms")
    try:
        c = compare(runs_a, runs_b,
                    ttft_target_s=None if args.ttft_target_ms is None else args.ttft_target_ms / 1e3,
                    itl_target_s=None if args.itl_target_ms is None else args.itl_target_ms / 1e3)
    except (ValueError, TraceError) as e:
        raise UsageError(str(e)) from None
    # each run's reading warnings, as analyze gives them (an adapter's note repeats per run: once here)
    for w in dict.fromkeys([*c.a.warnings, *c.b.warnings]):
        print(f"kvtop: warning: {w}", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(c.to_dict(), indent=2, allow_nan=False))
    else:
        print(render_text(c))
    return 0
