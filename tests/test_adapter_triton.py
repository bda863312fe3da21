"""Triton + TensorRT-LLM adapter against the backend README example.

The README's values are illustrative and mutually inconsistent (fraction 0.4875 while used=1 of
max=6239), so these tests check each parsed value against its line, never arithmetic between rows.
"""

from __future__ import annotations

import math

import pytest
from conftest import fixture_text
from kvtop_plugins.triton import TritonAdapter

DOC = "triton-trtllm-backend-readme-example.prom"


@pytest.fixture(scope="module")
def rec():
    recs = TritonAdapter().parse(fixture_text(DOC), 3.0)
    assert len(recs) == 1
    return recs[0]


def test_request_metrics(rec):
    assert rec.warnings == []
    assert rec.model == "tensorrt_llm" and rec.extra["model_version"] == "1"
    assert rec.running == 0  # line 9 request_type="active"
    assert rec.waiting == 1  # line 5 request_type="waiting"
    assert rec.extra["requests_max"] == 512  # line 8
    assert rec.extra["requests_scheduled"] == 1  # line 7
    assert rec.extra["requests_context"] == 1  # line 6


def test_kv_block_metrics(rec):
    assert rec.kv_usage == pytest.approx(0.4875)  # line 17 fraction (preferred over used/max)
    assert rec.block_size == 64  # line 18 tokens_per
    assert rec.extra["kv_blocks"] == {"max": 6239, "free": 6239, "used": 1}  # lines 21, 20, 19
    assert rec.kv_capacity_tokens == 6239 * 64  # max (line 21) x tokens_per (line 18), the definition


def test_nv_inference_counters_without_total(rec):
    assert rec.requests_finished_total == 0  # lines 37 + 40
    assert rec.extra["requests_failed_total"] == 0
    assert rec.extra["inference_count"] == 0  # line 43
    assert rec.extra["inference_queue_duration_us"] == 0  # line 52
    assert rec.extra["pending_requests"] == 0  # line 64
    assert rec.extra["runtime_memory_metrics"] == {"pinned": 0, "gpu": 1610236, "cpu": 0}  # lines 12-14
    assert rec.extra["general_metrics"]["timestamp"] == 1700074049  # line 30
    assert rec.extra["disaggregated_serving_metrics"] == {"kv_cache_transfer_ms": 0, "request_count": 0}  # 33-34
    assert rec.preemptions_total is None and rec.itl is None and rec.ttft is None


TWO_MODELS = """# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="llama",version="1"} 1000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="llama",version="1"} 250
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="llama",version="1"} 32
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="mistral",version="2"} 400
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="mistral",version="2"} 400
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="mistral",version="2"} 64
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="llama",request_type="active",version="1"} 5
nv_trt_llm_request_metrics{model="mistral",request_type="active",version="2"} 9
nv_trt_llm_request_metrics{model="mistral",request_type="waiting",version="2"} 4
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="ensemble",version="1"} 77
nv_inference_request_success{model="llama",version="1"} 70
nv_inference_request_failure{model="llama",version="1"} 3
# TYPE nv_inference_first_response_histogram_ms histogram
nv_inference_first_response_histogram_ms_bucket{model="llama",version="1",le="100"} 50
nv_inference_first_response_histogram_ms_bucket{model="llama",version="1",le="500"} 70
nv_inference_first_response_histogram_ms_bucket{model="llama",version="1",le="+Inf"} 73
nv_inference_first_response_histogram_ms_sum{model="llama",version="1"} 14600
nv_inference_first_response_histogram_ms_count{model="llama",version="1"} 73
"""


def test_one_record_per_trtllm_model_used_over_max_fallback():
    recs = {r.engine: r for r in TritonAdapter().parse(TWO_MODELS, 0.0)}
    assert set(recs) == {"llama", "mistral"}  # the ensemble has no nv_trt_llm_ series
    ll, mi = recs["llama"], recs["mistral"]
    assert ll.kv_usage == pytest.approx(0.25) and mi.kv_usage == pytest.approx(1.0)  # no fraction row
    assert ll.kv_capacity_tokens == 32000 and mi.kv_capacity_tokens == 25600
    assert (ll.running, ll.waiting, mi.running, mi.waiting) == (5, None, 9, 4)
    assert ll.requests_finished_total == 73 and mi.requests_finished_total is None
    # first-response histogram in ms becomes TTFT in seconds
    assert ll.ttft.count == 73 and ll.ttft.sum == pytest.approx(14.6)
    assert dict(ll.ttft.buckets) == {0.1: 50, 0.5: 70, math.inf: 73}


def test_triton_without_trtllm_is_flagged():
    page = "# TYPE nv_inference_pending_request_count gauge\nnv_inference_pending_request_count{model=\"m\",version=\"1\"} 2\n"
    (r,) = TritonAdapter().parse(page, 0.0)
    assert r.kv_usage is None and r.extra["pending_requests"] == 2
    assert any("not a TensorRT-LLM" in w for w in r.warnings)


def test_truncated_page_gives_partial_data_and_warning():
    text = fixture_text(DOC)
    cut = text.index('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"') + 40
    (r,) = TritonAdapter().parse(text[:cut], 0.0)
    assert r.warnings
    assert (r.running, r.waiting) == (0, 1)
    assert r.kv_usage == pytest.approx(0.4875) and r.block_size == 64
    assert r.kv_capacity_tokens is None  # the max row (line 21) was cut off


def test_garbled_page_gives_partial_data_and_warning():
    text = fixture_text(DOC).replace('request_type="active",version="1"} 0', 'request_type="active",version="1"} ??')
    (r,) = TritonAdapter().parse(text, 0.0)
    assert any("unparseable" in w for w in r.warnings)
    assert r.running is None and r.waiting == 1 and r.block_size == 64


def test_settings_name_config_parameters():
    s = TritonAdapter.settings
    assert "kv_cache_free_gpu_mem_fraction" in s["gpu_memory"]
    assert "batch_scheduler_policy" in s["admission"]
