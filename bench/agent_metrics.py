"""`kvtop agent`'s /metrics cost with 1,000 live requests, and its series count per engine / per GPU.

Measured in one run:
  render  ``AgentMetrics.render()`` (what one Prometheus scrape of /metrics costs the agent);
  tick    the agent's once-per-interval refresh (Core snapshot + analysis report + families);
  base    prometheus-client rendering a plain registry with the same number of samples
          (one labelled gauge): the floor any exporter of that size pays; the ratio is printed.
Series: the sample count with 1, 2 and 3 engines and with 0 and 2 GPUs; the differences are the
series each engine / GPU adds (bounded: they do not depend on the number of requests).
Target (issue 16): render stays under a few ms at 1,000 live requests.

Usage: python bench/agent_metrics.py [--requests N] [--rounds N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtop.analysis.live import LiveAnalyzer
from kvtop.core import Core
from kvtop.model.records import EngineRecord, GpuRecord, Histogram, RequestRecord
from kvtop.views.exporter import AgentMetrics


def build(requests: int, engines: int = 1, gpus: int = 1, seed: int = 1) -> tuple[Core, AgentMetrics]:
    rnd = random.Random(seed)
    core = Core(itl_target_s=0.1, max_requests=max(5000, 2 * requests),
                analysis=LiveAnalyzer(itl_target_s=0.1, max_requests=max(5000, 2 * requests)))
    m = AgentMetrics(request_engine="10.0.0.5:8000")

    def emit(r) -> None:  # noqa: ANN001
        core.ingest(r)
        m.sink(r)

    hist = Histogram([(0.05, 10.0), (0.1, 20.0), (float("inf"), 25.0)], 25.0, 1.0)
    for sec in range(0, 31):
        t = float(sec)
        for e in range(engines):
            emit(EngineRecord(t=t, adapter="vllm", url=f"http://10.0.0.{5 + e}:8000", kv_usage=0.9,
                              running=64, waiting=8, preemptions_total=float(t), itl=hist, ttft=hist))
        for g in range(gpus):
            emit(GpuRecord(t=t, index=g, uuid=f"GPU-{g}", mem_used_bytes=70 << 30, mem_total_bytes=80 << 30,
                           pcie_tx_bytes_per_s=5e9, pcie_rx_bytes_per_s=2e9, pcie_link_gen=4, pcie_link_gen_max=4,
                           pcie_link_width=16, pcie_link_width_max=16, pcie_replay_count=0, util_pct=90))
    # 1,000 streams still running: 40 tokens each, 25 ms apart, one in twenty with a 400 ms stall
    recs = []
    for i in range(requests):
        t0 = rnd.uniform(0.0, 20.0)
        recs.append(RequestRecord(t=t0, id=f"req-{i}", event="arrive", source="proxy", prompt_tokens=500))
        t = t0 + 0.2
        recs.append(RequestRecord(t=t, id=f"req-{i}", event="first_token", n=1))
        for k in range(40):
            t += 0.4 if (i % 20 == 0 and k == 20) else 0.025
            recs.append(RequestRecord(t=t, id=f"req-{i}", event="token", n=1))
    recs.sort(key=lambda r: r.t)
    for r in recs:
        emit(r)
    core.now = 31.0
    return core, m


def tick(core: Core, m: AgentMetrics) -> None:
    m.update(core.snapshot(core.now), core.analysis.counters() if core.analysis else None)


def samples(m: AgentMetrics) -> int:
    return sum(len(f.samples) for f in text_string_to_metric_families(m.render().decode()))


def median_ms(fn, rounds: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=50)
    a = ap.parse_args()

    core, m = build(a.requests)
    live = sum(1 for r in core.snapshot().requests if r.state == "running")
    tick(core, m)
    n = samples(m)
    render = median_ms(m.render, a.rounds)
    tick_ms = median_ms(lambda: tick(core, m), max(5, a.rounds // 5))

    reg = CollectorRegistry()
    g = Gauge("bench_plain", "same number of samples", ["i"], registry=reg)
    for i in range(n):
        g.labels(str(i)).set(i)
    base = median_ms(lambda: generate_latest(reg), a.rounds)

    print(f"live requests in the core: {live}")
    print(f"/metrics samples: {n}, {len(m.render())} bytes")
    print(f"render (one scrape of /metrics): median {render:.2f} ms")
    print(f"plain prometheus-client registry, same sample count: median {base:.2f} ms "
          f"(kvtop / plain = {render / base:.2f}x)")
    print(f"agent tick (snapshot + analysis report + families, once per interval): median {tick_ms:.1f} ms")

    counts = {}
    for engines, gpus in ((1, 0), (2, 0), (3, 0), (1, 2)):
        c, mm = build(50, engines=engines, gpus=gpus)
        tick(c, mm)
        counts[(engines, gpus)] = samples(mm)
    per_engine = counts[(2, 0)] - counts[(1, 0)]
    assert counts[(3, 0)] - counts[(2, 0)] == per_engine
    print(f"series: 1 engine, no GPU: {counts[(1, 0)]}; each further engine adds {per_engine}; "
          f"each GPU adds {(counts[(1, 2)] - counts[(1, 0)]) // 2}")
    big, bm = build(a.requests)
    tick(big, bm)
    small, sm = build(50)
    tick(small, sm)
    print(f"series with 50 vs {a.requests} live requests: {samples(sm)} vs {samples(bm)} (independent of load)")


if __name__ == "__main__":
    main()
