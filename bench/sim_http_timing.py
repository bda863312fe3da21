"""How soon a client sees each token the simulated engine produces, over HTTP on loopback.

    python -m bench.sim_http_timing [--seconds 2.5] [--repeat 3]

`kvtop sim-server`'s engine at speed 1 and `kvtop loadgen`'s client in one process (the setup of
tests/test_sim_http.py, which asserts only the order: never before the step ends). Printed per run:
tokens seen, client time minus the engine's step end at p50/p95/p99/max, and the load average,
because the figure is event-loop slack and moves with how busy the machine is (measured before on a
shared 2-core box: median 3 ms, p99 12 ms when it was not saturated).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import defaultdict

from kvtop.model.records import RequestRecord
from kvtop.sim.loadgen import run_load
from kvtop.sim.server import SimServer
from kvtop.sim.workload import parse_workload

# the workload of tests/test_sim_http.py (copied: tests and benches never import each other)
SMALL = {
    "name": "small",
    "engine": {"bytes_per_token": 131072, "block_size": 16, "kv_cache_bytes": 8e9, "max_num_seqs": 64,
               "max_num_batched_tokens": 1024, "max_model_len": 4096, "itl_target_s": 0.1},
    "classes": [{"name": "interactive", "rate_per_s": 4,
                 "prompt": {"median": 200, "sigma": 0.3, "max": 800},
                 "output": {"median": 50, "sigma": 0.3, "min": 10, "max": 120}}],
}


def _times(recs: list[object]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        if isinstance(r, RequestRecord) and r.event in ("first_token", "token"):
            out[r.id].append(r.t)
    return out


async def one_run(seconds: float, seed: int) -> list[float]:
    wl = parse_workload(SMALL)
    server_recs: list[object] = []
    client_recs: list[object] = []
    async with SimServer(wl, speed=1.0, record=server_recs.append) as srv:
        await run_load(srv.url, wl, seconds, seed=seed, on_record=client_recs.append, clock=srv.sim_now)
    sim, cli = _times(server_recs), _times(client_recs)
    return sorted(c - s for rid, ts in cli.items() for s, c in zip(sim[rid], ts, strict=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"cpus={os.cpu_count()} load average {os.getloadavg()[0]:.1f}")
    for i in range(args.repeat):
        d = asyncio.run(one_run(args.seconds, seed=3 + i))
        if not d:
            print(f"run {i + 1}: no tokens")
            continue

        def pct(q: float, d: list[float] = d) -> float:
            return d[min(len(d) - 1, int(q * len(d)))] * 1e3

        print(f"run {i + 1}: {len(d)} tokens; client - engine step end: p50 {pct(0.5):.1f} ms, "
              f"p95 {pct(0.95):.1f} ms, p99 {pct(0.99):.1f} ms, max {d[-1] * 1e3:.1f} ms, "
              f"min {d[0] * 1e3:.2f} ms (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
