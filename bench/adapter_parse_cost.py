"""CPU time per parse for each built-in adapter on its engine's fixtures, next to prometheus-client's
bare parse of the same page in the same run (ratio = adapter / bare parse).

    python bench/adapter_parse_cost.py [--repeat N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvtop.plugin import load_adapter

FIX = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "engines"
PAGES = {
    "sglang": "sglang-v0.4.3-docs-production-metrics.prom",
    "tgi": "tgi-v3.3-SYNTH.prom",
    "llamacpp": "llamacpp-b9014-cassette-metrics-idle.prom",
    "triton": "triton-trtllm-backend-readme-example.prom",
}


def _cpu(fn, repeat: int) -> float:
    fn()  # warm
    t0 = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=300)
    a = ap.parse_args()
    print(f"{'adapter':<9} {'page':<46} {'bytes':>6} {'bare µs':>9} {'adapter µs':>11} {'ratio':>6}")
    for name, page in PAGES.items():
        text = (FIX / page).read_text()
        ad = load_adapter(name)()
        bare = _cpu(lambda text=text: [s for f in text_string_to_metric_families(text) for s in f.samples], a.repeat)
        full = _cpu(lambda ad=ad, text=text: ad.parse(text, 0.0), a.repeat)
        print(f"{name:<9} {page:<46} {len(text):>6} {bare * 1e6:>9.0f} {full * 1e6:>11.0f} {full / bare:>6.2f}")


if __name__ == "__main__":
    main()
