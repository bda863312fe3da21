"""Fuzz suite, long profile: the same seeded mutators and invariants as tests/test_fuzz.py, at volume.

Every page goes through detection, all five adapters (``--all-adapters``, default on), the
scraper's normalisation, a Core fed clean -> mutated -> clean scrapes and the snapshot JSON check
(schema-valid, finite, non-negative); every trace through analyze (fast and streaming paths) and
replay; every scenario through advise; every workload, model config and config.toml through its
loader. Prints the counts and every failure (first 20); exit 1 on any failure.

    python -m bench.fuzz --cases 100000 [--seed 1] [--detected-only]
    python -m bench.fuzz --cases 20000 --per-kind [--kind scenario --kind config ...]

``--per-kind`` runs ``--cases`` cases of each kind alone and prints "F failures in N cases" per kind.
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
    ap.add_argument("--kind", action="append", choices=fuzzing.KINDS,
                    help="only this kind (repeatable); default: the mixed profile, or every kind with --per-kind")
    ap.add_argument("--per-kind", action="store_true", help="--cases cases of each kind, reported per kind")
    a = ap.parse_args()
    import resource

    lim = int(a.max_memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    if a.per_kind:
        summary = []
        failed = 0
        for kind in a.kind or fuzzing.KINDS:
            print(f"{kind}:", flush=True)
            total = _profile(a, (kind,))
            failed += total["failures"]
            summary.append(f"{kind:13s} {total['failures']} failures in {total['cases']:,} cases")
        print("per kind:")
        for line in summary:
            print("  " + line)
        return 1 if failed else 0
    return 1 if _profile(a, tuple(a.kind) if a.kind else None)["failures"] else 0


def _profile(a: argparse.Namespace, kinds: tuple[str, ...] | None) -> fuzzing.Stats:
    t0 = time.perf_counter()
    total = fuzzing.Stats()
    with tempfile.TemporaryDirectory() as d:
        done = 0
        while done < a.cases:
            n = min(a.report_every, a.cases - done)
            s = fuzzing.run(n, a.seed + done, Path(d), all_adapters=not a.detected_only, kinds=kinds)
            total.update(s)
            total.failures.extend(s.failures)
            for f in s.failures:
                print("  FAIL", f[:300], flush=True)
            done += n
            print(f"  {done:,} cases, {time.perf_counter() - t0:,.0f} s, failures {total['failures']}", flush=True)
    dt = time.perf_counter() - t0
    keys = ("cases", "pages", "adapter_parses", "refused_pages", "snapshots", "traces", "analyses", "replays",
            "refused_traces", "scenarios", "advised", "refused_scenarios", "workloads", "refused_workloads",
            "model_configs", "refused_model_configs", "configs", "refused_configs", "failures")
    print(f"fuzz: {dt:,.1f} s, seed {a.seed}")
    for k in keys:
        if total[k] or k in ("cases", "failures"):
            print(f"  {k:21s} {total[k]:>10,}")
    return total


if __name__ == "__main__":
    raise SystemExit(main())
