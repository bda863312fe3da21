"""A NaN, an infinity or a counter stepping backwards on an engine page degrades that one field (with a
warning) and never loses the scrape, crashes the Core or breaks the snapshot's own schema (issue 14
items 1 and 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
from conftest import fixture_text
from vllm_pages import LB, vllm_page

from kvtop.core import Core
from kvtop.model.records import EngineRecord, Histogram
from kvtop.model.sanitize import sanitize_record
from kvtop.model.series import Series, counter_rate, histogram_quantile
from kvtop.sources.scrape import EngineScraper

URL = "http://engine:8000"
SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "kvtop" / "schemas" / "snapshot.schema.json").read_text())


def _scrape(text: str, t: float, adapter: str = "vllm") -> list[EngineRecord]:
    s = EngineScraper(URL, adapter=adapter)
    _, recs = s.normalize(text, t)
    for r in recs:
        r.url = URL
    return recs


def _replace(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


@pytest.mark.parametrize("bad", ["+Inf", "-Inf", "NaN"])
def test_non_finite_preemption_counter_degrades_one_field(bad):
    page = vllm_page(preemptions=3, prompt=100, generation=500, kv=0.5, running=4)
    page = _replace(page, f"vllm:num_preemptions_total{{{LB}}} 3.0", f"vllm:num_preemptions_total{{{LB}}} {bad}")
    (r,) = _scrape(page, 1.0)
    assert r.up and r.preemptions_total is None
    assert r.running == 4 and r.kv_usage == 0.5 and r.generation_tokens_total == 500
    if bad != "NaN":  # NaN is "no value" on a Prometheus page; infinities are invalid values
        assert any("preemptions_total" in w for w in r.warnings)
    core = Core(window_s=60)
    for rec in (r, *_scrape(vllm_page(preemptions=5, prompt=200, generation=900), 2.0)):
        core.ingest(rec)
    (e,) = core.snapshot().engines
    assert e.up and e.preemptions_total == 5
    jsonschema.validate(core.snapshot().to_json(), SCHEMA)


def test_non_finite_cache_config_label_does_not_lose_the_scrape():
    text = fixture_text("vllm-0.32.0-cpu-live-idle.prom")
    text = _replace(text, ',block_size="32"', ',block_size="inf"')
    text = _replace(text, 'kv_cache_size_tokens="1056"', 'kv_cache_size_tokens="nan"')
    text = _replace(text, 'kv_offloading_size="None"', 'kv_offloading_size="1e400"')
    (r,) = _scrape(text, 1.0)
    assert r.up and r.running is not None
    assert (r.block_size, r.kv_capacity_tokens, r.offload_capacity_bytes) == (None, None, None)


def test_infinite_preemption_burst_does_not_crash_the_core():
    core = Core(window_s=60)
    for t, p in ((0.0, 1.0), (1.0, math.inf), (2.0, 4.0)):
        core.ingest(EngineRecord(t=t, adapter="vllm", url=URL, preemptions_total=p))
    (e,) = core.snapshot().engines
    assert e.preemptions_total == 4


def test_backwards_and_negative_counters_never_give_negative_rates():
    core = Core(window_s=60)
    vals = [(0.0, 100.0, 5000.0, 0.5), (1.0, 91.0, 1662.0, -0.94), (2.0, -3.0, -20.0, 0.4), (3.0, 95.0, 1700.0, 0.3)]
    for t, pre, gen, kv in vals:
        core.ingest(EngineRecord(t=t, adapter="vllm", url=URL, preemptions_total=pre, generation_tokens_total=gen,
                                 kv_usage=kv))
    snap = core.snapshot()
    (e,) = snap.engines
    for name in ("preemptions_per_s", "generation_tokens_per_s", "kv_usage"):
        v = getattr(e, name)
        assert v is None or (math.isfinite(v) and v >= 0), (name, v)
    jsonschema.validate(snap.to_json(), SCHEMA)


def test_sanitiser_warns_per_field_and_keeps_the_rest():
    r = sanitize_record(EngineRecord(t=0, adapter="x", running=-1, waiting=2, kv_usage=math.nan,
                                     kv_capacity_tokens=float("inf"), block_size=16.0,  # type: ignore[arg-type]
                                     itl=Histogram([(0.1, 5.0), (math.inf, 3.0)], 3.0, 1.0)))
    assert (r.running, r.waiting, r.kv_usage, r.kv_capacity_tokens, r.block_size, r.itl) == (None, 2, None, None, 16, None)
    (w,) = r.warnings
    assert "running=-1" in w and "kv_capacity_tokens=inf" in w and "itl histogram" in w


def test_series_math_cannot_go_negative_or_non_finite():
    s = Series()
    for t, v in ((0, 10.0), (1, math.inf), (2, -50.0), (3, 5.0), (4, 8.0)):
        s.append(t, v)
    rate = counter_rate(s, 60)
    assert rate is not None and rate == pytest.approx((5.0 + 3.0) / 4)
    h = Histogram([(0.1, 10.0), (0.2, 4.0), (float("nan"), 3.0), (math.inf, 12.0)], math.nan, 0.0)
    q = histogram_quantile(0.99, h)
    assert q is not None and math.isfinite(q) and q >= 0
    assert histogram_quantile(0.5, Histogram([(0.1, -5.0), (math.inf, -5.0)], -5.0, 0.0)) is None


def test_kv_usage_above_one_is_clamped_or_dropped():
    assert sanitize_record(EngineRecord(t=0, adapter="x", kv_usage=1.02)).kv_usage == 1.0
    r = sanitize_record(EngineRecord(t=0, adapter="x", kv_usage=1e308))
    assert r.kv_usage is None and "kv_usage=1e+308" in r.warnings[0]


def test_a_kv_block_of_no_tokens_is_dropped_with_a_warning():
    """Found by the page fuzz (a Triton page whose `tokens_per` read 0): a block size under one token is
    no block, and a snapshot carrying it failed its own schema."""
    for v in (0, 0.5):
        r = sanitize_record(EngineRecord(t=0, adapter="x", block_size=v, kv_capacity_tokens=0))  # type: ignore[arg-type]
        assert r.block_size is None and r.kv_capacity_tokens == 0 and f"block_size={v}" in r.warnings[0]
    assert sanitize_record(EngineRecord(t=0, adapter="x", block_size=1)).block_size == 1
