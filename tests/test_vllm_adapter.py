"""vLLM adapter against the captures in tests/fixtures/engines (expected numbers read by hand).

Line numbers in comments are 1-based lines of the fixture file named in the test.
"""

from __future__ import annotations

import math
import re

import pytest
from conftest import FIXTURES, fixture_text

from kvtop.model.series import histogram_quantile
from kvtop.plugin import detect_adapter, list_adapters
from kvtop.sources.prom import parse_page

VLLM_FILES = sorted(p.name for p in FIXTURES.glob("vllm-*.prom"))


@pytest.fixture(scope="module")
def adapter():
    from kvtop.plugin import load_adapter

    return load_adapter("vllm")()


def one(adapter, name: str, t: float = 0.0):
    recs = adapter.parse(fixture_text(name), t)
    assert len(recs) == 1
    return recs[0]


def test_registered_and_detected_from_every_vllm_fixture():
    assert "vllm" in {a.name for a in list_adapters()}
    for name in VLLM_FILES:
        cls = detect_adapter(parse_page(fixture_text(name)).names)
        assert cls is not None and cls.name == "vllm", name


@pytest.mark.parametrize("name", VLLM_FILES)
def test_every_vllm_fixture_parses(adapter, name):
    recs = adapter.parse(fixture_text(name), 1.5)
    assert recs, name
    for r in recs:
        assert r.adapter == "vllm" and r.t == 1.5
        # every capture carries the running gauge and a model_name label
        assert r.running is not None
        assert r.model


def test_v1_032_live_idle(adapter):
    r = one(adapter, "vllm-0.32.0-cpu-live-idle.prom")
    assert r.engine == "0"  # line 57: engine="0"
    assert r.model == "tiny-llama"  # line 57
    assert r.running == 0.0 and r.kv_usage == 0.0  # lines 57, 72
    assert r.preemptions_total == 0.0  # line 111
    # line 549 cache_config_info: kv_cache_size_tokens="1056" (= num_gpu_blocks 33 x block_size 32)
    assert r.block_size == 32
    assert r.kv_capacity_tokens == 1056 == 33 * 32
    assert r.offload_capacity_bytes is None  # kv_offloading_size="None"
    assert r.restart_token == pytest.approx(1.7959921882817874e09)  # line 120 prompt_tokens_created
    # ITL histogram (lines 317..): 20 bounds incl. +Inf, idle so empty
    assert r.itl is not None and len(r.itl.buckets) == 20 and r.itl.count == 0
    assert histogram_quantile(0.5, r.itl) is None
    assert r.requests_finished_total == 0.0 and r.requests_aborted_total == 0.0
    assert r.warnings == []


def test_v0_multiproc_capture(adapter):
    r = one(adapter, "vllm-v0-0.10-multiproc-qwen3-0.6b.prom")
    assert r.engine is None  # V0: no engine label
    assert r.model == "Qwen/Qwen3-0.6B"
    assert r.kv_usage == 0.0  # line 295: V0 alias gpu_cache_usage_perc
    assert r.prompt_tokens_total == 43952.0  # line 301
    assert r.generation_tokens_total == 4874.0  # line 304
    assert r.requests_finished_total == 38.0  # line 307 (only finished_reason="length" exported)
    assert r.requests_aborted_total is None  # no abort series on this page
    # line 6: num_gpu_blocks="2340", block_size="16", no kv_cache_size_tokens
    assert r.block_size == 16 and r.kv_capacity_tokens == 2340 * 16
    # swap_space="4.0" but num_cpu_blocks="0" and cpu_offload_gb="0.0": no usable offload pool
    assert r.offload_capacity_bytes is None
    # ITL from the V0 alias time_per_output_token_seconds (lines 57-78): count 4805
    assert r.itl is not None and r.itl.count == 4805.0
    assert r.itl.sum == pytest.approx(662.8116002082825)
    # p50: rank 2402.5 between le=0.1 (372, line 62) and le=0.15 (4054, line 63)
    assert histogram_quantile(0.5, r.itl) == pytest.approx(0.1 + 0.05 * (2402.5 - 372) / (4054 - 372))
    # p99: rank 4756.95 between le=0.2 (4720, line 64) and le=0.3 (4779)
    assert histogram_quantile(0.99, r.itl) == pytest.approx(0.2 + 0.1 * (4756.95 - 4720) / (4779 - 4720))
    # TTFT (lines 30-54): count 69
    assert r.ttft is not None and r.ttft.count == 69.0
    assert r.restart_token is None  # multiprocess mode has no *_created


@pytest.mark.parametrize(("labels", "pool"), [
    # V1 0.11's cache_config_info (vLLM issue "num_cpu_blocks metrics is None in cache_config_info"):
    # the default swap_space beside no CPU blocks, for V1 has no swap
    ('num_cpu_blocks="None",swap_space="4",cpu_offload_gb="0"', None),
    # --cpu-offload-gb 24 puts model weights in host memory, not KV
    ('num_cpu_blocks="None",swap_space="4",cpu_offload_gb="24"', None),
    # V0 that allocated swap blocks: its swap space is the host pool
    ('num_cpu_blocks="2048",swap_space="8",cpu_offload_gb="0"', 8 << 30),
])
def test_only_a_real_kv_host_pool_is_read_as_one(adapter, labels, pool):
    page = ('# TYPE vllm:cache_config_info gauge\n'
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="100",{labels}}} 1.0\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 1.0\n')
    [r] = adapter.parse(page, 1.0)
    assert r.offload_capacity_bytes == pool


def test_v1_kserve_head40_partial_capture(adapter):
    r = one(adapter, "vllm-v1-0.10or0.11-kserve-workshop-head40.prom")
    assert r.engine == "0" and r.model == "llama-vllm-single"  # line 6
    assert r.kv_usage == 0.0  # line 12
    assert r.prefix_queries_total == 0.0 and r.prefix_hits_total == 0.0  # lines 15, 21
    assert r.preemptions_total == 0.0  # line 27
    assert r.restart_token == pytest.approx(1.7769301736864982e09)  # line 36
    # grep | head -40 cut the page before request_success_total's samples and cache_config_info
    assert r.requests_finished_total is None and r.kv_capacity_tokens is None


def test_elided_docs_example_gives_partial_data_and_warning(adapter):
    r = one(adapter, "vllm-v0-design-doc-elided.prom")
    assert r.running == 8.0  # line 6
    assert r.generation_tokens_total == 27453.0  # line 10
    assert r.requests_finished_total == 1.0 + 131.0 + 0.0  # lines 14-16
    assert r.requests_aborted_total == 0.0  # line 16
    assert r.kv_usage is None and r.preemptions_total is None  # elided
    assert r.ttft is not None and r.ttft.count == 140.0  # line 28
    # no +Inf bucket: p50 rank 70 between le=0.02 (13, line 23) and le=0.04 (97, line 24)
    assert histogram_quantile(0.5, r.ttft) == pytest.approx(0.02 + 0.02 * (70 - 13) / (97 - 13))
    assert len(r.warnings) == 2 and "skipped 3 unparseable line" in r.warnings[0]
    assert "time_to_first_token_seconds has no +Inf bucket" in r.warnings[1]  # the docs elided it


def test_synthesized_page_with_preemptions(adapter):
    # SYNTH file: values invented, names real; not a "real capture" test.
    r = one(adapter, "vllm-main-2026-05-19-SYNTH.prom")
    assert r.kv_usage == 0.9871  # line 20
    assert r.preemptions_total == 7.0  # line 59
    assert r.requests_finished_total == 44.0  # lines 93-97: 40 + 4 + 0 + 0 + 0
    assert r.kv_capacity_tokens == 21000 * 16  # line 465
    # lines 247-267: 18000 samples <= 0.05 s, 7 in (2.5, 5.0]
    assert r.itl.count == 18007.0
    assert histogram_quantile(0.5, r.itl) == pytest.approx(0.025 + 0.025 * 9003.5 / 18000)
    assert histogram_quantile(0.9999, r.itl) == pytest.approx(2.5 + 2.5 * (18007 * 0.9999 - 18000) / 7)


def test_truncated_page_gives_partial_data_and_warning(adapter):
    text = fixture_text("vllm-0.32.0-cpu-live-idle.prom")
    line = 'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 0.0'  # line 111
    cut = text.index(line) + 30  # mid-way through the label set
    (r,) = adapter.parse(text[:cut], 0.0)
    assert r.running == 0.0 and r.kv_usage == 0.0 and r.model == "tiny-llama"  # before the cut
    assert r.preemptions_total is None  # the cut line
    assert r.kv_capacity_tokens is None  # cache_config_info (line 549) was after the cut
    assert any("partly invalid" in w for w in r.warnings)


def _two_engine_page() -> str:
    """The 0.32.0 capture as a 2-engine DP server: every engine="0" sample gets an engine="1" twin."""
    out = []
    for line in fixture_text("vllm-0.32.0-cpu-live-idle.prom").splitlines():
        out.append(line)
        if not line.startswith("#") and 'engine="0"' in line:
            twin = line.replace('engine="0"', 'engine="1"')
            if twin.startswith("vllm:num_preemptions_total{"):
                twin = re.sub(r" \S+$", " 5.0", twin)
            if twin.startswith("vllm:num_requests_running{"):
                twin = re.sub(r" \S+$", " 3.0", twin)
            if twin.startswith("vllm:cache_config_info{"):
                twin = twin.replace('num_gpu_blocks="33"', 'num_gpu_blocks="40"').replace(
                    'kv_cache_size_tokens="1056"', 'kv_cache_size_tokens="1280"')
            out.append(twin)
    return "\n".join(out) + "\n"


def test_dp_engines_one_record_each(adapter):
    recs = adapter.parse(_two_engine_page(), 0.0)
    by = {r.engine: r for r in recs}
    assert set(by) == {"0", "1"}
    assert by["0"].preemptions_total == 0.0 and by["1"].preemptions_total == 5.0
    assert by["0"].running == 0.0 and by["1"].running == 3.0
    assert by["0"].kv_capacity_tokens == 1056 and by["1"].kv_capacity_tokens == 1280
    assert all(r.model == "tiny-llama" and r.warnings == [] for r in recs)


def test_renamed_aliases_and_offload_counters(adapter):
    page = """\
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 40.0
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 1000.0
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 600.0
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 0.5
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 0.25
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 3.0
vllm:cache_config_info{block_size="16",engine="0",kv_offloading_size="2.5",num_gpu_blocks="100"} 1.0
"""
    (r,) = adapter.parse(page, 0.0)
    assert r.kv_usage == 0.75  # the new name wins over the deprecated alias
    assert r.prefix_hits_total == 10.0 and r.prefix_queries_total == 40.0
    assert r.offload_out_bytes_total == 1000.0 and r.offload_in_bytes_total == 600.0
    assert r.offload_out_seconds_total == 0.5 and r.offload_in_seconds_total == 0.25
    assert r.requests_finished_total == 10.0 and r.requests_aborted_total == 3.0
    assert r.kv_capacity_tokens == 1600 and r.offload_capacity_bytes == int(2.5 * (1 << 30))


def test_garbage_does_not_crash(adapter):
    for text in ("", "\x00\x01garbage{{{", "<html>nope</html>", "vllm:num_requests_running{engine=\"0\"} NaN\n"):
        recs = adapter.parse(text, 0.0)
        assert len(recs) == 1
        assert recs[0].running is None or math.isnan(recs[0].running) is False


def test_a_page_cut_inside_a_histogram_gives_no_histogram_and_says_so(adapter):
    from kvtop.model.series import HistogramSeries

    full = fixture_text("vllm-main-2026-05-19-SYNTH.prom")
    cut = full[: full.index('vllm:inter_token_latency_seconds_bucket{engine="0",le="1.0"')]
    [r] = adapter.parse(cut, 1.0)
    assert r.itl is None  # nine buckets and no +Inf: its count cannot be trusted
    assert any("inter_token_latency_seconds has no +Inf bucket" in w for w in r.warnings), r.warnings
    assert any("does not end with a newline" in w or "truncated" in w for w in r.warnings)
    # scrapes of an unchanged page, the middle one cut: nothing was observed in the window (the cut
    # page's buckets read as a reset made the lifetime's 18,007 gaps the window's)
    series = HistogramSeries()
    for t, text in ((0.0, full), (1.0, cut), (2.0, full)):
        [rec] = adapter.parse(text, t)
        series.append(t, rec.itl)
    d = series.window_delta(60.0, 2.0)
    assert d is not None and d.count == 0 and series.quantile(0.99, 60.0, 2.0) is None


def test_a_gauge_the_engine_exported_as_nan_is_na_and_said(adapter):
    page = re.sub(r"(vllm:kv_cache_usage_perc\{[^}]*\}) [0-9.e+-]+", r"\1 NaN",
                  fixture_text("vllm-0.32.0-cpu-live-idle.prom"))
    [r] = adapter.parse(page, 1.0)
    assert r.kv_usage is None
    assert r.warnings == ["vllm:kv_cache_usage_perc is not a number on the page: shown as n/a"]  # was unsaid
