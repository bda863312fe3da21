"""Simulated seconds per wall second: 20 requests/s with ~100 concurrent streams (issue 3 target: >= 100x).

By default runs a 600-simulated-second slice (arrivals from t=0, so it includes the ramp-up) and
extrapolates to one hour: the engine's cost per simulated second is flat once the batch is full
(per-step work is proportional to the batch, and the batch is stationary). ``--full`` runs the hour.

Three measurements on one core, same workload and seed:
  engine      the discrete-event engine alone (no records built)
  records     engine + every request/truth record built in memory (what a consumer receives)
  trace       ``kvtop simulate``'s path: records + /metrics scrape every second through the vLLM
              adapter + JSON Lines trace file

Speeds are given per CPU second of this process (``time.process_time``: "on one core", and
meaningful on a shared machine) and per wall second; each path runs ``--repeat`` times, best kept.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from kvtop.sim.simulate import Simulation, simulate_to_trace
from kvtop.sim.workload import parse_workload

WORKLOAD = {
    "name": "bench-20rps",
    "engine": {"model": "sim-llama-3.1-8b", "bytes_per_token": 131072, "block_size": 16, "kv_cache_bytes": 40e9,
               "max_num_seqs": 256, "max_num_batched_tokens": 2048, "max_model_len": 8192},
    "classes": [{"name": "interactive", "rate_per_s": 20,
                 "prompt": {"median": 400, "sigma": 0.6, "min": 16, "max": 4000},
                 "output": {"median": 140, "sigma": 0.6, "min": 8, "max": 2000}}],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slice", type=float, default=600.0, help="simulated seconds to run (default 600)")
    ap.add_argument("--full", action="store_true", help="run the whole simulated hour")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2, help="runs per path; the best is reported")
    a = ap.parse_args()
    dur = 3600.0 if a.full else a.slice
    wl = parse_workload(WORKLOAD)

    conc: list[int] = []

    def engine_only() -> float:
        sim = Simulation(wl, a.seed, dur, None, scrape_interval_s=None, tokens=False)
        eng = sim.engine
        step = eng.step

        def sampled(hook=None):  # noqa: ANN001, ANN202
            if eng.stats.steps % 200 == 0 and eng.t > 60:
                conc.append(eng.num_running)
            return step(hook)

        eng.step = sampled  # type: ignore[method-assign]
        t, c = time.perf_counter(), time.process_time()
        res = sim.run()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        print(f"  engine : {res.requests} requests, {res.steps} steps, {res.stats.generation_tokens} tokens")
        return wall, cpu

    def records() -> float:
        n = [0]

        def count(_r):  # noqa: ANN001, ANN202
            n[0] += 1

        t, c = time.perf_counter(), time.process_time()
        Simulation(wl, a.seed, dur, count, scrape_interval_s=None).run()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        print(f"  records: {n[0]} records")
        return wall, cpu

    def trace() -> float:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bench.jsonl")
            t, c = time.perf_counter(), time.process_time()
            res = simulate_to_trace(wl, a.seed, dur, path, scrape_interval_s=1.0)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            print(f"  trace  : {res.records} records, {os.path.getsize(path) / 1e6:.0f} MB")
        return wall, cpu

    print(f"workload: 20 req/s, prompt median 400, output median 140; {dur:.0f} simulated s"
          + ("" if a.full else " (extrapolated to 1 h: cost per simulated second is flat at steady state)"))
    results = {}
    for name, fn in (("engine", engine_only), ("records", records), ("trace", trace)):
        runs = [fn() for _ in range(max(1, a.repeat))]
        results[name] = (min(r[0] for r in runs), min(r[1] for r in runs))
    print(f"concurrent streams at steady state: median {statistics.median(conc):.0f}, max {max(conc)}")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'path':8} {'cpu s':>7} {'sim-s/cpu-s':>12} {'wall s':>7} {'sim-s/wall-s':>13}  "
          "target >= 100x real time on one core (baseline: real time = 1x)")
    for name, (wall, cpu) in results.items():
        sc, sw = dur / cpu, dur / wall
        print(f"{name:8} {cpu:7.2f} {sc:11.0f}x {wall:7.2f} {sw:12.0f}x  {'ok' if sc >= 100 else 'below target'}")


if __name__ == "__main__":
    main()
