"""How faithfully `kvtop load --from` reproduces a recorded trace's traffic.

    python -m bench.load_fidelity                 # preemption-storm + cancel-heavy, 60 simulated s at x2
    python -m bench.load_fidelity --preset healthy --duration 120 --rate-scale 1

Inter-arrival quantiles are wall-clock gaps divided by the rate scale: a gap of a few milliseconds
(healthy's p10 at x4 is 3 ms) is within the event loop's scheduling jitter on a busy host, so keep
the scaled gaps well above that (the default presets' p10 is 17-31 ms at x2).

For each preset: ``kvtop simulate`` writes the source trace (the simulated engine's own record of
every arrival, prompt length, output length and cancel); the same preset is served by the
simulated HTTP server at ``--rate-scale`` times real time, and ``kvtop load --from`` the source
trace at the same ``--rate-scale`` records the reproduction through the recording proxy. The
script then prints, source against reproduction (the reproduction's times multiplied back by the
rate scale): request count, prompt and output length quantiles (p10/p50/p90/p99, output over the
requests that finished in the source), inter-arrival quantiles (p10/p50/p90/p99), cancels, and the
relative error of each; ``ok`` when every figure is within 5 %. Exit 1 when one is not.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtop.model.trace import TraceReader
from kvtop.sim.server import SimServer
from kvtop.sim.workload import load_preset

REPO = Path(__file__).resolve().parents[1]
QS = (0.1, 0.5, 0.9, 0.99)
LIMIT = 0.05


def _kvtop(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kvtop", *args], capture_output=True, text=True, env=env, check=False)


def _requests(path: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for d in TraceReader(path).dicts():
        if d.get("kind") != "request":
            continue
        rid, ev = d["id"], d["event"]
        if ev == "arrive":
            out[rid] = {"t": d["t"], "prompt": d.get("prompt_tokens"), "end": None, "out": None}
        elif rid in out and ev in ("finish", "cancel", "error") and out[rid]["end"] is None:
            out[rid]["end"] = ev if d.get("error") not in ("proxy_stopped",) else "stopped"
            out[rid]["out"] = d.get("completion_tokens")
            out[rid]["prompt"] = out[rid]["prompt"] or d.get("prompt_tokens")
    return out


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)] if s else float("nan")


def _rel(a: float, b: float) -> float:
    return abs(b - a) / abs(a) if a else (0.0 if b == a else float("inf"))


async def _reproduce(preset: str, src: Path, out: Path, rate_scale: float, workers: int) -> str:
    async with SimServer(load_preset(preset), speed=rate_scale) as srv:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvtop", "load", "--from", str(src), "--url", srv.url, "-o", str(out),
            "--rate-scale", f"{rate_scale:g}", "--no-gpu", "--no-host", "--proxy-workers", str(workers),
            env={**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")},
            stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"kvtop load failed: {err.decode().strip()}")
    return err.decode().strip().splitlines()[-1]


def fidelity(preset: str, duration: float, rate_scale: float, tmp: Path,
             workers: int = 1) -> list[tuple[str, float, float, float]]:
    src, out = tmp / f"{preset}.src.jsonl", tmp / f"{preset}.load.jsonl"
    r = _kvtop("simulate", "--preset", preset, "--duration", f"{duration:g}", "-o", str(src))
    if r.returncode != 0:
        raise SystemExit(r.stderr.strip())
    line = asyncio.run(_reproduce(preset, src, out, rate_scale, workers))
    print(f"  {line}")
    a, b = _requests(src), _requests(out)
    rows: list[tuple[str, float, float, float]] = []

    def row(name: str, va: float, vb: float) -> None:
        rows.append((name, va, vb, _rel(va, vb)))

    row("requests", len(a), len(b))
    pa = [float(x["prompt"]) for x in a.values() if x["prompt"]]
    pb = [float(x["prompt"]) for x in b.values() if x["prompt"]]
    for q in QS:
        row(f"prompt tokens p{round(q * 100)}", _q(pa, q), _q(pb, q))
    done = [rid for rid, x in a.items() if x["end"] == "finish" and rid in b]
    oa = [float(a[rid]["out"]) for rid in done if a[rid]["out"]]
    ob = [float(b[rid]["out"]) for rid in done if b[rid]["out"]]
    for q in QS:
        row(f"output tokens p{round(q * 100)}", _q(oa, q), _q(ob, q))
    ta = sorted(x["t"] for x in a.values())
    tb = sorted(x["t"] * rate_scale for x in b.values())
    ia = [y - x for x, y in zip(ta, ta[1:], strict=False)]
    ib = [y - x for x, y in zip(tb, tb[1:], strict=False)]
    for q in QS:
        row(f"inter-arrival p{round(q * 100)} (s)", _q(ia, q), _q(ib, q))
    row("client cancels", sum(x["end"] == "cancel" for x in a.values()),
        sum(x["end"] == "cancel" for x in b.values()))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", help="preset(s) to reproduce (default: preemption-storm, cancel-heavy)")
    ap.add_argument("--duration", type=float, default=60.0, help="simulated seconds of source traffic")
    ap.add_argument("--rate-scale", type=float, default=2.0, help="replay this many times faster (server too)")
    ap.add_argument("--proxy-workers", type=int, default=2, help="kvtop load --proxy-workers (default 2)")
    args = ap.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory() as td:
        for preset in args.preset or ["preemption-storm", "cancel-heavy"]:
            print(f"{preset}: {args.duration:g} simulated s, reproduced at x{args.rate_scale:g}")
            rows = fidelity(preset, args.duration, args.rate_scale, Path(td), args.proxy_workers)
            w = max(len(r[0]) for r in rows)
            print(f"  {'figure':{w}}  {'source':>10}  {'reproduced':>10}  error")
            for name, va, vb, err in rows:
                flag = "ok" if err <= LIMIT else "OVER 5 %"
                bad += err > LIMIT
                print(f"  {name:{w}}  {va:>10.4g}  {vb:>10.4g}  {err:6.1%}  {flag}")
    print("all figures within 5 %" if not bad else f"{bad} figure(s) beyond 5 %")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
