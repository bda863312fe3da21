"""SGLang adapter against the docs capture and hand-written pages in SGLang's current wire format."""

from __future__ import annotations

import math

import pytest
from conftest import fixture_text
from kvtop_plugins.sglang import SglangAdapter

DOCS = "sglang-v0.4.3-docs-production-metrics.prom"


@pytest.fixture(scope="module")
def docs_rec():
    recs = SglangAdapter().parse(fixture_text(DOCS), 5.0)
    assert len(recs) == 1  # labels are model_name only: one engine
    return recs[0]


def test_docs_capture_gauges_and_counters(docs_rec):
    r = docs_rec
    assert r.adapter == "sglang" and r.t == 5.0 and r.warnings == []
    assert r.model == "meta-llama/Llama-3.1-8B-Instruct"  # model_name label, every line
    assert r.running == 162  # line 109
    assert r.waiting == 2826  # line 118
    assert r.kv_usage == pytest.approx(0.28)  # line 12
    assert r.prompt_tokens_total == 8128902  # line 6: 8.128902e+06
    assert r.generation_tokens_total == 7557572  # line 9: 7.557572e+06
    assert r.extra["cache_hit_rate"] == pytest.approx(0.007507552643049313)  # line 15
    assert r.extra["num_used_tokens"] == 123859  # line 112
    assert r.extra["gen_throughput"] == pytest.approx(86.50814177726902)  # line 115


def test_docs_capture_capacity_is_an_estimate(docs_rec):
    # no max_total_num_tokens on this old page: 123859 (line 112) / 0.28 (line 12) = 442353.57
    assert docs_rec.kv_capacity_tokens == 442354
    assert docs_rec.extra["kv_capacity_source"].startswith("estimate")
    assert docs_rec.block_size is None


def test_docs_capture_has_no_retraction_data(docs_rec):
    assert docs_rec.preemptions_total is None
    assert docs_rec.prefix_hits_total is None  # no cached_tokens_total in 0.4.3


def test_docs_capture_histograms_old_itl_name(docs_rec):
    itl = docs_rec.itl
    # old name time_per_output_token_seconds (lines 61-83)
    assert docs_rec.extra["itl_metric"] == "sglang:time_per_output_token_seconds"
    assert docs_rec.extra["itl_semantics"] == "per_token"
    assert itl.count == 7400757  # line 83
    assert itl.sum == pytest.approx(866964.5791549598)  # line 63
    assert dict(itl.buckets)[0.1] == 4950195  # line 73
    assert dict(itl.buckets)[math.inf] == 7400757  # line 82
    ttft = docs_rec.ttft
    assert ttft.count == 11008  # line 40
    assert ttft.sum == pytest.approx(2351897.9474117756)  # line 18
    assert dict(ttft.buckets)[1.0] == 27  # line 30
    # func_latency_seconds{name=...} (lines 84-106) is not an engine instance
    assert any("per generated token" in n for n in docs_rec.extra["notes"])


# Current SGLang (2026): scheduler series carry ranks, tokenizer series only model_name/engine_type.
# --enable-metrics-for-all-schedulers adds tp_rank="1" copies of the scheduler gauges.
def _sched(name: str, typ: str, per_rank: dict[tuple[str, str], float]) -> str:
    out = [f"# TYPE {name} {typ}"]
    for (dp, tp), v in per_rank.items():
        out.append(
            f'{name}{{dp_rank="{dp}",engine_type="unified",model_name="Qwen/Qwen3-8B",'
            f'moe_ep_rank="0",pp_rank="0",tp_rank="{tp}"}} {v}'
        )
    return "\n".join(out)


def _hist(name: str, labels: str, buckets: list[tuple[str, float]], s: float) -> str:
    out = [f"# TYPE {name} histogram"]
    for le, c in buckets:
        out.append(f'{name}_bucket{{{labels}le="{le}"}} {c}')
    out.append(f"{name}_sum{{{labels.rstrip(',')}}} {s}")
    out.append(f"{name}_count{{{labels.rstrip(',')}}} {buckets[-1][1]}")
    return "\n".join(out)


TOK = 'engine_type="unified",model_name="Qwen/Qwen3-8B",'
SCHED0 = 'dp_rank="0",engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0",'

MODERN = "\n".join(
    [
        _sched("sglang:num_running_reqs", "gauge", {("0", "0"): 12, ("1", "0"): 7, ("0", "1"): 12, ("1", "1"): 7}),
        _sched("sglang:num_queue_reqs", "gauge", {("0", "0"): 3, ("1", "0"): 0, ("0", "1"): 3, ("1", "1"): 0}),
        _sched("sglang:token_usage", "gauge", {("0", "0"): 0.97, ("1", "0"): 0.41}),
        _sched("sglang:max_total_num_tokens", "gauge", {("0", "0"): 500000, ("1", "0"): 500000}),
        _sched("sglang:page_size", "gauge", {("0", "0"): 16, ("1", "0"): 16}),
        _sched("sglang:num_retracted_requests_total", "counter", {("0", "0"): 9, ("1", "0"): 0}),
        _sched("sglang:num_retracted_reqs", "gauge", {("0", "0"): 2, ("1", "0"): 0}),
        _sched("sglang:num_retracted_input_tokens_total", "counter", {("0", "0"): 18000, ("1", "0"): 0}),
        _sched("sglang:hicache_host_used_tokens", "gauge", {("0", "0"): 250000, ("1", "0"): 1000}),
        _sched("sglang:hicache_host_total_tokens", "gauge", {("0", "0"): 2000000, ("1", "0"): 2000000}),
        _sched("sglang:evicted_tokens_total", "counter", {("0", "0"): 640000, ("1", "0"): 64}),
        _sched("sglang:load_back_tokens_total", "counter", {("0", "0"): 320000, ("1", "0"): 0}),
        _hist("sglang:eviction_duration_seconds", SCHED0, [("0.01", 30), ("+Inf", 40)], 1.25),
        _hist("sglang:load_back_duration_seconds", SCHED0, [("0.01", 10), ("+Inf", 20)], 0.75),
        "# TYPE sglang:prompt_tokens_total counter",
        f"sglang:prompt_tokens_total{{{TOK.rstrip(',')}}} 1000000.0",
        "# TYPE sglang:generation_tokens_total counter",
        f"sglang:generation_tokens_total{{{TOK.rstrip(',')}}} 400000.0",
        "# TYPE sglang:cached_tokens_total counter",
        f'sglang:cached_tokens_total{{cache_source="device",{TOK.rstrip(",")}}} 200000.0',
        f'sglang:cached_tokens_total{{cache_source="host",{TOK.rstrip(",")}}} 50000.0',
        "# TYPE sglang:num_requests_total counter",
        f"sglang:num_requests_total{{{TOK.rstrip(',')}}} 900.0",
        "# TYPE sglang:num_aborted_requests_total counter",
        f"sglang:num_aborted_requests_total{{{TOK.rstrip(',')}}} 31.0",
        _hist("sglang:inter_token_latency_seconds", TOK, [("0.01", 300000), ("0.1", 390000), ("+Inf", 400000)], 5200.0),
        _hist("sglang:time_to_first_token_seconds", TOK, [("0.1", 100), ("1.0", 800), ("+Inf", 900)], 400.0),
    ]
) + "\n"


@pytest.fixture(scope="module")
def modern():
    return {r.engine: r for r in SglangAdapter().parse(MODERN, 1.0)}


def test_one_record_per_dp_rank_tp1_copies_skipped(modern):
    assert set(modern) == {"0", "1"}
    r0, r1 = modern["0"], modern["1"]
    assert (r0.running, r0.waiting) == (12, 3)  # tp_rank 1 copies would have made 24 / 6
    assert (r1.running, r1.waiting) == (7, 0)
    assert r0.extra["ranks_skipped"] == {"tp_rank": ["1"]}
    assert r0.extra["engine_type"] == "unified" and r1.extra["dp_rank"] == "1"
    assert r0.model == r1.model == "Qwen/Qwen3-8B"


def test_dp_attention_keeps_every_dp_group_whose_ranks_are_global():
    # --enable-dp-attention, TP 8 / DP 2: each group's reporting scheduler is its attention-TP rank 0,
    # global tp_rank 0 and 4 (and its own MoE EP rank); with metrics for all schedulers the others
    # report copies. DP rank 1 is the saturated one: it must not be dropped as a "copy".
    def rows(name: str, per: dict[tuple[str, str], float]) -> list[str]:
        return [f"# TYPE {name} gauge"] + [
            f'{name}{{dp_rank="{dp}",engine_type="unified",model_name="m",moe_ep_rank="{tp}",pp_rank="0",'
            f'tp_rank="{tp}"}} {v}' for (dp, tp), v in per.items()]

    page = "\n".join([
        *rows("sglang:num_running_reqs", {("0", "0"): 10, ("0", "1"): 10, ("1", "4"): 20, ("1", "5"): 20}),
        *rows("sglang:num_queue_reqs", {("0", "0"): 1, ("1", "4"): 5}),
        *rows("sglang:token_usage", {("0", "0"): 0.3, ("1", "4"): 0.99}),
        "# TYPE sglang:num_retracted_requests_total counter",
        *rows("sglang:num_retracted_requests_total", {("0", "0"): 0, ("1", "4"): 42})[1:],
    ]) + "\n"
    recs = {r.engine: r for r in SglangAdapter().parse(page, 1.0)}
    assert set(recs) == {"0", "1"}
    assert (recs["1"].running, recs["1"].waiting, recs["1"].kv_usage) == (20, 5, pytest.approx(0.99))
    assert recs["1"].preemptions_total == 42
    assert (recs["0"].running, recs["0"].preemptions_total) == (10, 0)
    assert recs["0"].extra["ranks_skipped"] == {"tp_rank": ["1", "5"], "moe_ep_rank": ["1", "5"]}


def test_modern_capacity_retraction_kv(modern):
    r0, r1 = modern["0"], modern["1"]
    assert r0.kv_usage == pytest.approx(0.97) and r1.kv_usage == pytest.approx(0.41)
    assert r0.kv_capacity_tokens == 500000 and r0.block_size == 16
    assert r0.extra["kv_capacity_source"] == "sglang:max_total_num_tokens"
    assert r0.preemptions_total == 9 and r1.preemptions_total == 0
    assert r0.extra["retracted_reqs_last_interval"] == 2
    assert r0.extra["retracted_input_tokens_total"] == 18000
    assert "notes" not in r0.extra or not any("only the gauge" in n for n in r0.extra["notes"])


def test_modern_hicache_tier(modern):
    r0 = modern["0"]
    assert r0.extra["hicache_host_used_tokens"] == 250000
    assert r0.extra["hicache_host_total_tokens"] == 2000000
    assert r0.extra["offload_out_tokens_total"] == 640000
    assert r0.extra["offload_in_tokens_total"] == 320000
    assert r0.offload_out_seconds_total == pytest.approx(1.25)  # eviction_duration_seconds_sum
    assert r0.offload_in_seconds_total == pytest.approx(0.75)
    assert r0.offload_out_bytes_total is None  # tokens, not bytes
    assert modern["1"].offload_out_seconds_total is None  # the histograms were only on dp 0


def test_tokenizer_metrics_only_on_lowest_dp_rank(modern):
    r0, r1 = modern["0"], modern["1"]
    assert r0.prompt_tokens_total == 1000000 and r0.generation_tokens_total == 400000
    assert r0.prefix_hits_total == 250000  # device 200000 + host 50000 (no "total" source)
    assert r0.prefix_queries_total == 1000000
    assert r0.requests_finished_total == 900 and r0.requests_aborted_total == 31
    assert r0.itl.count == 400000 and r0.itl.sum == pytest.approx(5200.0)
    assert r0.extra["itl_metric"] == "sglang:inter_token_latency_seconds"
    assert r0.ttft.count == 900
    assert r1.prompt_tokens_total is None and r1.itl is None  # not double-counted
    assert any("dp_rank 0" in n for n in r1.extra["notes"])


def test_tokenizer_series_without_engine_type_join_the_scheduler_record():
    page = (
        'sglang:num_running_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 5.0\n'
        'sglang:prompt_tokens_total{model_name="m"} 1234.0\n'
    )
    (r,) = SglangAdapter().parse(page, 0.0)
    assert (r.running, r.prompt_tokens_total, r.engine) == (5, 1234, None)


def test_cache_source_total_preferred():
    page = (
        "# TYPE sglang:cached_tokens_total counter\n"
        'sglang:cached_tokens_total{cache_source="device",model_name="m"} 70.0\n'
        'sglang:cached_tokens_total{cache_source="host",model_name="m"} 30.0\n'
        'sglang:cached_tokens_total{cache_source="total",model_name="m"} 100.0\n'
        'sglang:num_running_reqs{model_name="m"} 1.0\n'
    )
    (r,) = SglangAdapter().parse(page, 0.0)
    assert r.prefix_hits_total == 100


def test_only_old_retraction_gauge_is_not_faked_as_counter():
    page = (
        'sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 4.0\n'
        'sglang:num_retracted_reqs{engine_type="unified",model_name="m",tp_rank="0"} 3.0\n'
    )
    (r,) = SglangAdapter().parse(page, 0.0)
    assert r.preemptions_total is None
    assert r.extra["retracted_reqs_last_interval"] == 3
    assert any("num_retracted_reqs" in n and "n/a" in n for n in r.extra["notes"])


def test_capacity_from_num_pages_times_page_size():
    page = 'sglang:num_pages{model_name="m"} 1000.0\nsglang:page_size{model_name="m"} 64.0\nsglang:num_used_tokens{model_name="m"} 16000.0\n'
    (r,) = SglangAdapter().parse(page, 0.0)
    assert r.kv_capacity_tokens == 64000 and r.block_size == 64
    assert r.kv_usage == pytest.approx(0.25)  # no token_usage: 16000 / 64000


def test_truncated_docs_page_gives_partial_data_and_warning():
    text = fixture_text(DOCS)
    cut = text.index("sglang:num_used_tokens{") + 30  # inside line 112
    (r,) = SglangAdapter().parse(text[:cut], 0.0)
    assert r.warnings
    assert r.running == 162 and r.prompt_tokens_total == 8128902  # lines before the cut survive
    assert r.waiting is None  # line 118 was cut off


def test_garbled_page_gives_partial_data_and_warning():
    text = fixture_text(DOCS).replace(
        'sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28',
        "sglang:token_usage{model_name=\x00\x17garbage 0.28",
    )
    (r,) = SglangAdapter().parse(text, 0.0)
    assert any("unparseable" in w for w in r.warnings)
    assert r.kv_usage is None and r.running == 162 and r.waiting == 2826


def test_histogram_cut_before_inf_warns():
    text = fixture_text(DOCS)
    cut = text.index('sglang:time_to_first_token_seconds_bucket{le="+Inf"')
    (r,) = SglangAdapter().parse(text[:cut], 0.0)
    assert any("+Inf" in w for w in r.warnings)


def test_not_sglang_page():
    (r,) = SglangAdapter().parse(fixture_text("tgi-v3.3-SYNTH.prom"), 0.0)
    assert r.running is None and any("no sglang" in w for w in r.warnings)


def test_contract_attributes():
    a = SglangAdapter
    assert a.preempts is True
    assert a.settings["max_seqs"] == "--max-running-requests"
    assert a.settings["chunked_prefill"] == "--chunked-prefill-size"
    from kvtop.plugin import NORMALIZED_FIELDS

    assert a.fields <= set(NORMALIZED_FIELDS)
