"""Memory over a long run: does the console's data path stay flat?

The demo's data path without the HTTP hop: the simulated engine (healthy preset with its arrival
rate scaled to --rate requests/s, default 20) drives a ``Core`` with the live analysis, as
`kvtop demo` does, scraped once a simulated second, for --hours of simulated time. Every
--sample-s simulated seconds it takes a snapshot (what the console renders) and samples the
process RSS. It prints RSS at the start, the peak, the end, the number of requests the core
holds, and the slope of RSS over the second half of the run (MB per simulated hour; flat ~0).
Target: steady under ~150 MB at 20 requests/s.

    python bench/memory_soak.py [--hours 1] [--rate 20] [--sample-s 60]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import psutil

from kvtop.analysis.live import LiveAnalyzer
from kvtop.core import Core
from kvtop.sim.simulate import Simulation
from kvtop.sim.workload import load_preset

MB = 1 << 20


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=1.0, help="simulated hours (default 1)")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per simulated second (default 20)")
    ap.add_argument("--sample-s", type=float, default=60.0, help="simulated seconds between RSS samples")
    ap.add_argument("--no-analysis", action="store_true", help="the core alone (separates its share from the analysis')")
    args = ap.parse_args()

    wl = load_preset("healthy")
    base = sum(c.rate_per_s for c in wl.classes)
    # an engine big enough to keep up with the rate (a queue that grows would measure the queue)
    wl = dataclasses.replace(
        wl, engine=dataclasses.replace(wl.engine, max_num_seqs=512, num_gpu_blocks=4 * wl.engine.num_gpu_blocks,
                                   max_num_batched_tokens=4096),
        classes=list(dataclasses.replace(c, rate_per_s=c.rate_per_s * args.rate / base,
                                          prompt=dataclasses.replace(c.prompt, median=c.prompt.median // 2),
                                          output=dataclasses.replace(c.output, median=c.output.median // 2))
                      for c in wl.classes))
    e = wl.engine
    analysis = None if args.no_analysis else LiveAnalyzer(
        itl_target_s=e.itl_target_s, adapter="vllm", model=e.model, kv_bytes_per_token=e.bytes_per_token)
    core = Core(window_s=60.0, itl_target_s=e.itl_target_s, source_label="bench", analysis=analysis)
    proc = psutil.Process()
    duration = args.hours * 3600.0
    samples: list[tuple[float, float, int]] = []
    next_sample = [0.0]

    def emit(rec) -> None:  # noqa: ANN001
        core.ingest(rec)
        if rec.t >= next_sample[0]:
            next_sample[0] += args.sample_s
            snap = core.snapshot()
            samples.append((rec.t, proc.memory_info().rss / MB, len(snap.requests)))

    gc.collect()
    rss0 = proc.memory_info().rss / MB
    w0 = time.perf_counter()
    res = Simulation(wl, seed=1, duration_s=duration, emit=emit).run()
    wall = time.perf_counter() - w0
    half = [s for s in samples if s[0] >= duration / 2]
    slope = _slope([s[0] / 3600 for s in half], [s[1] for s in half]) if len(half) >= 3 else float("nan")
    peak = max(s[1] for s in samples)
    print(f"{'core alone' if args.no_analysis else 'core + live analysis'}: "
          f"{args.hours:g} simulated h at {args.rate:g} req/s ({res.requests} requests, {res.records} records) "
          f"in {wall:.0f} s wall")
    print(f"RSS: before {rss0:.0f} MB, after 1st sample {samples[0][1]:.0f} MB, peak {peak:.0f} MB, "
          f"end {samples[-1][1]:.0f} MB; slope over the second half {slope:+.1f} MB per simulated hour")
    fin: tuple[object, ...] = getattr(core, "finished_requests", tuple)()  # absent before finished requests were summarised
    print(f"requests held by the core: {len(core.requests)} with timelines, {len(fin)} "
          f"summaries; shown in the snapshot at the end: {samples[-1][2]}")
    for t, rss, n in samples[:: max(1, len(samples) // 8)]:
        print(f"  t={t:7.0f} s  RSS {rss:6.0f} MB  requests on screen {n}")


if __name__ == "__main__":
    main()
