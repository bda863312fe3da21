"""The witness's cost on a real engine: steps/s and output tokens/s of the tiny-model vLLM with and without it.

The same fixed workload (``--streams`` streams of ``--tokens`` tokens each, ``ignore_eos``, a KV cache
large enough that nothing is preempted, so both engines run the same steps) runs ``--rounds`` times on
vLLM started plainly and on vLLM started with ``--scheduler-cls kvtop.witness.vllm.WitnessScheduler``,
then once more plainly (the box drifts: the second plain series shows by how much). Engine steps are
vLLM's own count (``vllm:iteration_tokens_total``'s histogram count, one observation per step) and
output tokens its ``vllm:generation_tokens_total``, read from ``/metrics`` before and after each round;
the rate is over the round's wall time. Printed: per series the median steps/s and tokens/s, and the
witnessed series against the mean of the two plain ones.

    python -m bench.witness_steps [--streams 8] [--tokens 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from testkit.engines import servers
from testkit.engines.load import run_streams

# room for every stream's prompt and output at once: no preemption, the same steps with or without
KV_BYTES = 16 * 1024 * 1024


def counters(url: str) -> tuple[float, float]:
    """(engine steps, output tokens) so far, from vLLM's /metrics."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=30).text
    steps = tokens = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:iteration_tokens_total_count":
                steps += s.value
            elif s.name == "vllm:generation_tokens_total":
                tokens += s.value
    return steps, tokens


def series(py: Path, model: Path, witness: Path | None, streams: int, tokens: int, rounds: int) -> list[tuple[float, float]]:
    """(steps/s, tokens/s) of each round on one freshly started engine."""
    srv = servers.vllm_server(py, model, witness=witness, kv_bytes=KV_BYTES, max_model_len=2048)
    out = []
    try:
        srv.start(timeout=600)
        asyncio.run(run_streams(srv.url, servers.VLLM_MODEL_NAME, 2, 16, seed=1))  # warm-up, not counted
        for r in range(rounds):
            s0, k0 = counters(srv.url)
            t0 = time.monotonic()
            asyncio.run(run_streams(srv.url, servers.VLLM_MODEL_NAME, streams, tokens, seed=100 + r))
            wall = time.monotonic() - t0
            s1, k1 = counters(srv.url)
            out.append(((s1 - s0) / wall, (k1 - k0) / wall))
            print(f"  round {r + 1}: {s1 - s0:.0f} steps, {k1 - k0:.0f} tokens in {wall:.1f} s", flush=True)
    finally:
        srv.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.witness_steps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    py, model = servers.setup_vllm()
    res: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtop-witness-steps-") as d:
        for name, wfile in (("plain", None), ("witnessed", Path(d) / "witness.jsonl"), ("plain again", None)):
            print(f"{name}:", flush=True)
            res[name] = series(py, model, wfile, args.streams, args.tokens, args.rounds)
        logged = (Path(d) / "witness.jsonl").stat().st_size
    med = {k: (statistics.median(s for s, _ in v), statistics.median(t for _, t in v)) for k, v in res.items()}
    print(f"\n{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds each, medians:")
    for k, (s, t) in med.items():
        print(f"  {k:<12} {s:8.1f} steps/s {t:9.1f} tokens/s")
    base_s = (med["plain"][0] + med["plain again"][0]) / 2
    base_t = (med["plain"][1] + med["plain again"][1]) / 2
    drift = abs(med["plain"][0] - med["plain again"][0]) / base_s
    print(f"  witnessed / plain: steps/s {med['witnessed'][0] / base_s:.3f}, tokens/s {med['witnessed'][1] / base_t:.3f} "
          f"(the two plain series differ by {drift:.1%}: differences below that are noise)")
    print(f"  witness log: {logged / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
