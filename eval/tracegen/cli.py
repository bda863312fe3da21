"""Write a kvtop trace from the independent generator.

    python -m eval.tracegen.cli --situation base --seed 1 -o trace.jsonl [--scrape-interval 5]
    python -m eval.tracegen.cli --list
"""

from __future__ import annotations

import argparse
import sys

from eval.tracegen.generate import generate
from eval.tracegen.situations import SITUATIONS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tracegen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--situation", choices=sorted(SITUATIONS), metavar="NAME",
                    help="one of: " + ", ".join(SITUATIONS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("-o", "--output", metavar="TRACE", help="trace file to write (overwritten)")
    ap.add_argument("--scrape-interval", type=float, default=1.0, metavar="S", help="seconds between scrapes")
    ap.add_argument("--duration", type=float, default=None, metavar="S", help="simulated seconds (default per situation)")
    ap.add_argument("--observed", type=float, default=None, metavar="FRAC",
                    help="share of streams the proxy records (default per situation)")
    ap.add_argument("--list", action="store_true", help="list the situations and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, s in SITUATIONS.items():
            print(f"{name:<12} {s.about}")
        return 0
    if not args.situation or not args.output:
        print("tracegen: --situation and -o are required (or --list)", file=sys.stderr)
        return 2
    if args.scrape_interval <= 0 or (args.duration is not None and args.duration <= 0):
        print("tracegen: --scrape-interval and --duration must be > 0", file=sys.stderr)
        return 2
    if args.observed is not None and not 0 < args.observed <= 1:
        print("tracegen: --observed must be in (0, 1]", file=sys.stderr)
        return 2
    try:
        summary = generate(args.situation, args.seed, args.output, args.scrape_interval, args.duration, args.observed)
    except OSError as e:
        print(f"tracegen: cannot write {args.output}: {e.strerror}", file=sys.stderr)
        return 2
    stalls = ", ".join(f"{k} {v}" for k, v in sorted(summary["stalls"].items())) or "none"
    print(f"{args.output}: {summary['records']} records, {summary['streams']} observed streams, "
          f"{summary['victims']} preemption victims (counter {summary['preemptions_counted']}); stalls: {stalls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
