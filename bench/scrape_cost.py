"""CPU cost of one scrape-and-normalize step vs prometheus-client's bare parse of the same page.

kvtop's step = everything after the HTTP body arrives: tolerant parse into a Page, the vLLM adapter
(normalised records), and Core.ingest of the records. The baseline is the bare
``text_string_to_metric_families`` walk over every sample, measured in the same run.
Target (issue 2): kvtop's step <= 1.3x the bare parse.

Usage: python bench/scrape_cost.py [--fixture PATH] [--rounds N] [--batch N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvtop.core import Core
from kvtop.sources.scrape import EngineScraper

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "tests" / "fixtures" / "engines" / "vllm-0.32.0-cpu-live-idle.prom"


def bare_parse(text: str) -> int:
    n = 0
    for fam in text_string_to_metric_families(text):
        n += len(fam.samples)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", default=str(DEFAULT))
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds (median reported)")
    ap.add_argument("--batch", type=int, default=20, help="pages per round")
    a = ap.parse_args()
    text = Path(a.fixture).read_text(encoding="utf-8")

    scraper = EngineScraper("http://bench:8000", adapter="vllm")
    core = Core()
    t_run = [0.0]

    def kvtop_step() -> int:
        t_run[0] += 1.0
        _, recs = scraper.normalize(text, t_run[0])
        for r in recs:
            r.url = scraper.url
            core.ingest(r)
        return len(recs)

    # warm up both (imports, adapter detection, caches)
    for _ in range(3):
        bare_parse(text)
        kvtop_step()

    bare, ours = [], []
    for _ in range(a.rounds):
        # interleave so machine noise hits both alike
        t0 = time.process_time()
        for _ in range(a.batch):
            bare_parse(text)
        bare.append((time.process_time() - t0) / a.batch)
        t0 = time.process_time()
        for _ in range(a.batch):
            kvtop_step()
        ours.append((time.process_time() - t0) / a.batch)

    b, k = statistics.median(bare), statistics.median(ours)
    print(f"page: {Path(a.fixture).name} ({len(text):,} bytes, {bare_parse(text)} samples)")
    print(f"prometheus-client bare parse : {b * 1e3:8.3f} ms CPU per page")
    print(f"kvtop scrape-and-normalize   : {k * 1e3:8.3f} ms CPU per page (parse + vLLM adapter + core.ingest)")
    print(f"ratio kvtop / bare           : {k / b:8.2f}x  (target <= 1.30x)")


if __name__ == "__main__":
    main()
