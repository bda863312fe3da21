"""Fuzz suite, long profile: the same seeded mutators and invariants as tests/test_fuzz.py, at volume.

Every page goes through detection, all five adapters (``--all-adapters``, default on), the
scraper's normalisation, a Core fed clean -> mutated -> clean scrapes and the snapshot JSON check
(schema-valid, finite, non-negative); every trace through analyze (fast and streaming paths) and
replay; every scenario through advise. Prints the counts and every failure (first 20); exit 1 on
any failure.

    python -m bench.fuzz --cases 100000 [--seed 1] [--detected-only]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from testkit import fuzzing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--detected-only", action="store_true", help="pages through the detected adapter (+1 random)")
    ap.add_argument("--report-every", type=int, default=5000)
    ap.add_argument("--max-memory-gb", type=float, default=4.0,
                    help="address-space limit: a runaway case fails with MemoryError instead of exhausting the host")
    a = ap.parse_args()
    import resource

    lim = int(a.max_memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    t0 = time.perf_counter()
    total = fuzzing.Stats()
    with tempfile.TemporaryDirectory() as d:
        done = 0
        while done < a.cases:
            n = min(a.report_every, a.cases - done)
            s = fuzzing.run(n, a.seed + done, Path(d), all_adapters=not a.detected_only)
            total.update(s)
            total.failures.extend(s.failures)
            for f in s.failures:
                print("  FAIL", f[:300], flush=True)
            done += n
            print(f"  {done:,} cases, {time.perf_counter() - t0:,.0f} s, failures {total['failures']}", flush=True)
    dt = time.perf_counter() - t0
    keys = ("cases", "pages", "adapter_parses", "refused_pages", "snapshots", "traces", "analyses", "replays",
            "refused_traces", "scenarios", "advised", "refused_scenarios", "failures")
    print(f"fuzz: {dt:,.1f} s, seed {a.seed}")
    for k in keys:
        print(f"  {k:18s} {total[k]:>10,}")
    return 1 if total["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
