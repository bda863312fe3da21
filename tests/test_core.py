"""Core: engine records from real-capture-derived pages -> snapshot rates, quantiles, restarts, DP engines."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from test_vllm_adapter import _two_engine_page
from vllm_pages import vllm_page

from kvtop.core import Core
from kvtop.model.records import EngineRecord
from kvtop.plugin import load_adapter

URL = "http://engine:8000"
SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "kvtop" / "schemas" / "snapshot.schema.json").read_text())


def feed(core: Core, text: str, t: float) -> list[EngineRecord]:
    recs = load_adapter("vllm")().parse(text, t)
    for r in recs:
        r.url = URL
        core.ingest(r)
    return recs


def two_scrapes(window_s: float = 60.0) -> Core:
    core = Core(window_s=window_s)
    feed(core, vllm_page(preemptions=0, prompt=1000, generation=3000, itl={"0.025": 100}), 0.0)
    feed(core, vllm_page(preemptions=4, prompt=3000, generation=8000, kv=0.97, running=12, waiting=3,
                         itl={"0.025": 180, "2.5": 20}), 10.0)
    return core


def test_rates_and_quantiles_from_two_scrapes():
    (e,) = two_scrapes().snapshot().engines
    assert e.up and e.adapter == "vllm" and e.engine == "0" and e.model == "tiny-llama"
    assert e.preemptions_total == 4
    assert e.preemptions_per_s == pytest.approx(4 / 10)
    assert e.prompt_tokens_per_s == pytest.approx(2000 / 10)
    assert e.generation_tokens_per_s == pytest.approx(5000 / 10)
    assert e.kv_usage == 0.97 and e.running == 12 and e.waiting == 3
    # ITL delta between the scrapes: 80 samples in (0.01, 0.025], 20 in (1.0, 2.5]
    # p50: rank 50 -> 0.01 + 0.015 * 50 / 80; p99: rank 99 -> 1.0 + 1.5 * 19 / 20
    assert e.itl_p50_s == pytest.approx(0.01 + 0.015 * 50 / 80)
    assert e.itl_p99_s == pytest.approx(1.0 + 1.5 * 19 / 20)
    assert e.ttft_p50_s is None  # no TTFT observations in the window
    assert e.kv_capacity_tokens == 1056 and e.block_size == 32
    assert e.stale_s == 0.0


def test_snapshot_json_matches_schema():
    core = two_scrapes()
    doc = core.snapshot().to_json()
    jsonschema.validate(doc, SCHEMA)
    e = doc["engines"][0]
    assert e["preemptions_per_s"] == pytest.approx(0.4)
    assert isinstance(e["kv_capacity_tokens"], int)


def test_counter_reset_gives_no_negative_or_huge_rate():
    core = two_scrapes()
    # engine restarted between t=10 and t=20: counters start again from 0
    feed(core, vllm_page(preemptions=1, prompt=500, generation=700, created=1.9e9), 20.0)
    (e,) = core.snapshot().engines
    assert e.restarts == 1
    # increase: 4 then +1 after the restart, over 20 s
    assert e.preemptions_per_s == pytest.approx(5 / 20)
    assert e.generation_tokens_per_s == pytest.approx((5000 + 700) / 20)
    assert e.prompt_tokens_per_s == pytest.approx((2000 + 500) / 20)
    assert any(ev.kind == "engine_restart" for ev in core.snapshot().events)


def test_restart_token_without_counter_drop_still_resets_baseline():
    core = Core(window_s=60)
    feed(core, vllm_page(preemptions=2, generation=100, created=1.0e9), 0.0)
    # restarted and already past the old values: created changed, counters did not drop
    feed(core, vllm_page(preemptions=3, generation=400, created=1.1e9), 10.0)
    (e,) = core.snapshot().engines
    assert e.restarts == 1
    assert e.generation_tokens_per_s == pytest.approx(400 / 10)  # not (400 - 100) / 10
    assert e.preemptions_per_s == pytest.approx(3 / 10)


def test_window_limits_rates_to_recent_samples():
    core = Core(window_s=5.0)
    feed(core, vllm_page(generation=0), 0.0)
    feed(core, vllm_page(generation=1000), 10.0)  # 100/s in the first 10 s
    feed(core, vllm_page(generation=1100), 20.0)  # 10/s in the next 10 s
    (e,) = core.snapshot().engines
    # the 5 s window ending at 20 uses the sample just before it (t=10) as its baseline
    assert e.generation_tokens_per_s == pytest.approx(10.0)


def test_engine_down_keeps_history_and_comes_back():
    core = two_scrapes()
    core.ingest(EngineRecord(t=12.0, adapter="vllm", url=URL, up=False, warnings=["cannot connect"]))
    snap = core.snapshot()
    (e,) = snap.engines
    assert not e.up and e.error == "cannot connect"
    assert e.stale_s == pytest.approx(2.0)  # last good scrape at t=10
    assert e.preemptions_total == 4  # history kept
    assert any(ev.kind == "engine_down" for ev in snap.events)
    feed(core, vllm_page(preemptions=4, prompt=3000, generation=8000), 14.0)
    (e,) = core.snapshot().engines
    assert e.up and e.error is None
    assert any(ev.kind == "engine_up" for ev in core.snapshot().events)


def test_down_before_first_scrape_is_replaced_by_real_engine():
    core = Core()
    core.ingest(EngineRecord(t=0.0, adapter="unknown", url=URL, up=False, warnings=["cannot connect"]))
    assert [e.up for e in core.snapshot().engines] == [False]
    feed(core, vllm_page(), 1.0)
    (e,) = core.snapshot().engines
    assert e.up and e.engine == "0"


def test_dp_engines_are_separate_views():
    core = Core(window_s=60)
    feed(core, _two_engine_page(), 0.0)
    page = _two_engine_page().replace('vllm:num_preemptions_total{engine="1",model_name="tiny-llama"} 5.0',
                                      'vllm:num_preemptions_total{engine="1",model_name="tiny-llama"} 25.0')
    assert page != _two_engine_page()
    feed(core, page, 10.0)
    views = {e.engine: e for e in core.snapshot().engines}
    assert set(views) == {"0", "1"}
    assert views["0"].preemptions_per_s == 0.0
    assert views["1"].preemptions_per_s == pytest.approx(20 / 10)
    assert views["1"].kv_capacity_tokens == 1280


def test_engine_capabilities():
    core = two_scrapes()
    core.set_engine_capabilities(URL, preempts=False)
    assert core.snapshot().engines[0].preempts is False


def test_snapshot_json_has_no_nan_for_any_caller():
    import json
    import math

    from kvtop.model.analysis import AnalysisReport, Number, Verdict
    from kvtop.snapshot import EngineView, Snapshot

    # a histogram without _sum gives a NaN median; a table of figures can hold one too
    verdict = Verdict("no_action", numbers={"numbers": Number([math.nan, 2.0], "", "measured")})
    snap = Snapshot(kvtop_version="x", taken_at="2026-01-01T00:00:00Z", t=1.0, window_s=1.0, gpu_status="ok",
                    engines=(EngineView(url="u", adapter="vllm", up=True, itl_p50_s=math.nan,
                                        prompt_tokens_per_s=math.inf, kv_usage=0.5),),
                    analysis=AnalysisReport(median_gap_s=math.nan, verdict=verdict))
    d = snap.to_json()
    e = d["engines"][0]
    assert e["itl_p50_s"] is None and e["prompt_tokens_per_s"] is None and e["kv_usage"] == 0.5
    assert d["analysis"]["verdict"]["numbers"]["numbers"]["value"] == [None, 2.0]
    assert d["analysis"]["median_gap_s"] is None
    json.dumps(d, allow_nan=False)  # strict JSON
