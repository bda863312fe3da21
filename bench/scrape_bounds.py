"""Cost of pathological metrics pages: a huge page, a huge page with one bad line, 3,000 engines.

Each case runs in its own process (so peak RSS is its own) and times the whole step a scrape does
after the body arrived: tolerant parse + the vLLM adapter + the record sanitiser.

  * 1M-lines:      1,000,000 gauge samples (one family, distinct labels), 30 MB of text;
  * 1M-lines+bad:  the same with one unparseable line in the middle;
  * 3000-engines:  the real vLLM 0.32.0 capture's per-engine gauges and counters repeated for
                   engine="0".."2999", read per engine as the adapter does.

``--baseline DIR`` runs the same cases against another checkout (e.g. a ``git worktree`` of an
older commit) in the same run, for a before/after table.

    python -m bench.scrape_bounds [--baseline DIR] [--unbounded] [--engines 3000] [--lines 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CAPTURE = REPO / "tests" / "fixtures" / "engines" / "vllm-0.32.0-cpu-live-idle.prom"


def big_page(lines: int, bad: bool) -> str:
    out = ["# TYPE vllm:num_requests_running gauge"]
    out += [f'vllm:num_requests_running{{engine="0",model_name="m",slot="{i}"}} 1' for i in range(lines)]
    if bad:
        out[lines // 2] = "vllm:num_requests_running{engine=0 oops"
    return "\n".join(out) + "\n"


def engines_page(n: int) -> str:
    text = CAPTURE.read_text(encoding="utf-8")
    head = [ln for ln in text.splitlines() if 'engine="0"' not in ln]
    # gauges and counters only (no histogram buckets, no *_created): ~55 series per engine
    per = [ln for ln in text.splitlines() if 'engine="0"' in ln and "_bucket" not in ln and "_created" not in ln]
    out = list(head)
    for e in range(n):
        tag = f'engine="{e}"'
        out += [ln.replace('engine="0"', tag) for ln in per]
    return "\n".join(out) + "\n"


def child(case: str, code: str, lines: int, engines: int, unbounded: bool) -> None:
    from plugins.vllm import VllmAdapter

    if unbounded:
        import kvtop.adapters.page as pg
        pg.MAX_SAMPLES, pg.PARSE_BUDGET_S = 1 << 62, float("inf")

    text = engines_page(engines) if case == "3000-engines" else big_page(lines, case.endswith("+bad"))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    recs = VllmAdapter().parse(text, 0.0)
    try:
        from kvtop.model.sanitize import sanitize_record
        for r in recs:
            sanitize_record(r)
    except ImportError:
        pass
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    warns = sorted({w[:70] for r in recs for w in r.warnings})
    print(json.dumps({"s": dt, "peak_rss_mb": rss / 1024, "rss_growth_mb": (rss - rss0) / 1024,
                      "records": len(recs), "lines": text.count("\n"), "warnings": warns}))


def run(case: str, code: str, lines: int, engines: int, unbounded: bool = False) -> dict:
    import site

    # -S: no site, so no editable-install finder decides which checkout is imported; the checkout
    # under test comes first on the child's path, then the installed dependencies
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([code, *site.getsitepackages()]))
    r = subprocess.run([sys.executable, "-S", __file__, "--child", case, "--code", code, "--lines", str(lines),
                        "--engines", str(engines)] + (["--unbounded"] if unbounded else []), capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", metavar="DIR", help="another kvtop checkout to measure in the same run")
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--engines", type=int, default=3000)
    ap.add_argument("--cases", default="1M-lines,1M-lines+bad,3000-engines")
    ap.add_argument("--unbounded", action="store_true",
                    help="also run this checkout with the series cap and parse budget lifted (raw cost)")
    ap.add_argument("--child")
    ap.add_argument("--code", default=str(REPO))
    a = ap.parse_args()
    if a.child:
        child(a.child, a.code, a.lines, a.engines, a.unbounded)
        return
    codes = [("this checkout", str(REPO), False)] + ([("unbounded", str(REPO), True)] if a.unbounded else []) + \
        ([("baseline", a.baseline, False)] if a.baseline else [])
    for case in a.cases.split(","):
        for label, code, unbounded in codes:
            r = run(case, code, a.lines, a.engines, unbounded)
            if "error" in r:
                print(f"{case:14s} {label:14s} error: {r['error']}")
                continue
            print(f"{case:14s} {label:14s} {r['s']:7.2f} s  peak RSS {r['peak_rss_mb']:7.0f} MB  "
                  f"{r['records']:5d} record(s) from {r['lines']:,} lines  warnings: {r['warnings']}")


if __name__ == "__main__":
    main()
