"""TGI adapter against the synthesized v3.3 page (values read by hand from the file)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import fixture_text
from kvtop_plugins.tgi import TgiAdapter

SYNTH = "tgi-v3.3-SYNTH.prom"


@pytest.fixture(scope="module")
def rec():
    recs = TgiAdapter().parse(fixture_text(SYNTH), 2.0)
    assert len(recs) == 1
    return recs[0]


def test_queue_batch_and_capacity(rec):
    assert rec.warnings == []
    assert rec.waiting == 3  # line 20 tgi_queue_size
    assert rec.running == 8  # line 24 tgi_batch_current_size
    assert rec.kv_capacity_tokens == 180000  # line 31 tgi_batch_max_total_tokens
    assert rec.extra["batch_current_max_tokens"] == 9840  # line 28
    assert rec.extra["batch_token_reservation"] == pytest.approx(9840 / 180000)
    assert rec.kv_usage is None  # TGI exports budgets, not KV usage


def test_counters_without_total_suffix(rec):
    # lines 4, 8, 11: tgi_request_count 42, tgi_request_success 40, failure{err=validation} 2
    assert rec.extra["requests_total"] == 42
    assert rec.requests_finished_total == 42  # 40 success + 2 failures
    assert rec.extra["request_failures_by_err"] == {"validation": 2}
    assert rec.requests_aborted_total is None


def test_token_totals_from_histogram_sums(rec):
    assert rec.prompt_tokens_total == 1565  # line 297 tgi_request_input_length_sum
    assert rec.generation_tokens_total is None  # tgi_request_generated_tokens not in this subset


def test_durations(rec):
    assert rec.extra["queue_duration_count"] == 4  # line 72
    assert rec.extra["queue_duration_sum_s"] == pytest.approx(4.312)  # line 71
    itl = rec.itl  # mean time per token, lines 74-113
    assert rec.extra["itl_semantics"] == "per_request_mean_tpot"
    assert itl.count == 4 and itl.sum == pytest.approx(0.104)  # lines 113, 112
    b = dict(itl.buckets)
    assert b[0.029192926025390625] == 3  # line 89
    assert b[math.inf] == 4  # line 111
    assert rec.ttft is None  # TGI has no TTFT metric


def test_never_preempts_and_says_so(rec):
    assert TgiAdapter.preempts is False
    assert rec.preemptions_total is None
    assert any("never preempts" in n for n in rec.extra["notes"])
    assert "preemptions_total" not in TgiAdapter.fields


def test_no_model_label_until_info(rec):
    assert rec.model is None
    a = TgiAdapter()
    (r,) = a.parse(fixture_text(SYNTH), 0.0)
    info = {"model_id": "meta-llama/Llama-3.1-8B-Instruct", "version": "3.3.7", "max_input_tokens": 4095,
            "max_total_tokens": 4096, "max_concurrent_requests": 128}
    assert "/info" in a.extra_paths
    a.parse_extra("/info", json.dumps(info), [r])
    assert (r.model, r.version) == ("meta-llama/Llama-3.1-8B-Instruct", "3.3.7")
    assert r.kv_capacity_tokens == 180000  # the metrics value stays
    # --max-total-tokens bounds one request as vLLM's --max-model-len does: the advisor's current value
    assert r.limits == {"max_model_len": 4096}
    a.parse_extra("/info", "<html>oops", [r])
    assert any("/info" in w for w in r.warnings)


def test_info_of_older_tgi_states_its_batch_size_and_nothing_it_cannot_mean():
    """TGI 1.x-2.x's /info carries --max-batch-size where it was given (null otherwise); a value
    that is no whole number of at least one is no limit."""
    a = TgiAdapter()
    (r,) = a.parse(fixture_text(SYNTH), 0.0)
    a.parse_extra("/info", json.dumps({"max_total_tokens": 2048, "max_batch_size": 32,
                                       "max_batch_total_tokens": 50000}), [r])
    assert r.limits == {"max_model_len": 2048, "max_num_seqs": 32}
    for bad in (None, 0, -4, 1.5, "32", True):
        (r,) = a.parse(fixture_text(SYNTH), 0.0)
        a.parse_extra("/info", json.dumps({"max_total_tokens": bad, "max_batch_size": bad}), [r])
        assert r.limits == {}, bad


def test_summary_rendering_keeps_quantiles():
    page = (
        "# TYPE tgi_queue_size gauge\ntgi_queue_size 0\n"
        "# TYPE tgi_request_queue_duration summary\n"
        'tgi_request_queue_duration{quantile="0.5"} 0.02\n'
        'tgi_request_queue_duration{quantile="0.99"} 1.5\n'
        "tgi_request_queue_duration_sum 3\ntgi_request_queue_duration_count 10\n"
    )
    (r,) = TgiAdapter().parse(page, 0.0)
    assert r.extra["queue_duration_quantiles"] == {"0.5": 0.02, "0.99": 1.5}
    assert r.waiting == 0


def test_truncated_page_gives_partial_data_and_warning():
    text = fixture_text(SYNTH)
    cut = text.index('tgi_request_mean_time_per_token_duration_bucket{le="0.0129746337890625"}') + 20
    (r,) = TgiAdapter().parse(text[:cut], 0.0)
    assert r.warnings
    assert (r.waiting, r.running, r.kv_capacity_tokens) == (3, 8, 180000)
    assert r.extra["queue_duration_count"] == 4
    assert r.prompt_tokens_total is None  # line 297 was cut off


def test_garbled_page_gives_partial_data_and_warning():
    text = fixture_text(SYNTH).replace("tgi_batch_current_size 8", "tgi_batch_current_size {{{ 8")
    (r,) = TgiAdapter().parse(text, 0.0)
    assert any("unparseable" in w for w in r.warnings)
    assert r.running is None and r.waiting == 3
    # counters re-read line by line keep their wire names (no _total): still found
    assert r.extra["requests_total"] == 42 and r.requests_finished_total == 42


def test_settings():
    assert TgiAdapter.settings["max_batch_total_tokens"] == "--max-batch-total-tokens"
    assert TgiAdapter.settings["batched_tokens"] == "--max-batch-prefill-tokens"
