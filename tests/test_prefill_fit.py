"""How the engine's prefill time grows with the prompt, fitted to its own per-request times, and the
chunked-prefill step the advisor prices from it.

A chunk's tokens attend to every position before them, so a long prompt's last chunk is its slowest
step. The attention coefficient ``k_att`` scales with the model's layers and heads over its size; the
advisor used an 8B-class figure wherever the model was not named, and on a 270M model on a CPU the
real llama-server's last 64-token chunk of a 1,500-token prompt took about twice its first
(docs/real-engines.md §6). Where prompts of several lengths were seen, the engine's own times give
both the price of a token at a prompt's start and ``k_att`` on this hardware.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import jsonschema
import pytest
from conftest import REPO, fixture_text

from kvtop import __version__
from kvtop.analysis.advice import chunking
from kvtop.analysis.advice.advisor import GENERIC_K_ATT
from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.attribution.request_times import fit_prefill
from kvtop.analysis.report import build_report

A, K, FIXED = 2.5e-3, 3.0e-4, 0.05  # 400 tokens/s at the start; the 1,500th position costs 1.9x the first


def engine_ttft(n: int, cached: int = 0) -> float:
    return FIXED + A * (n - cached) + A * K * (n * n - cached * cached)


def _trace(an: Analyzer, prompts: list[int], contended: float = 0.0, seed: int = 3,
           curve: Callable[[int], float] = engine_ttft) -> None:
    """Requests of the given prompt lengths, one at a time, each with the engine's own TTFT; a share
    ``contended`` of them shared their steps with others and took up to 3x as long."""
    rng = random.Random(seed)
    for i, p in enumerate(prompts):
        t0 = 20.0 * i
        ttft = curve(p) * (rng.uniform(1.5, 3.0) if rng.random() < contended else rng.uniform(1.0, 1.05))
        rid = f"p{i}"
        an.feed_dict({"kind": "request", "t": t0, "id": rid, "event": "arrive", "prompt_tokens": p})
        an.feed_dict({"kind": "request", "t": round(t0 + ttft, 6), "id": rid, "event": "first_token", "n": 1})
        an.feed_dict({"kind": "request", "t": round(t0 + ttft + 0.05, 6), "id": rid, "event": "finish",
                      "completion_tokens": 2, "prompt_tokens": p, "engine_ttft_s": round(ttft, 6)})


def test_the_fit_prices_a_long_prompts_last_chunk_where_a_flat_rate_cannot():
    """Prompts of 100-2,000 tokens, a quarter of them slowed by company in their steps: the fit finds
    the curve from the least contended, and prices the last 64-token chunk of a 1,500-token prompt
    within 10 % (its true cost 0.301 s); the median tokens / TTFT, a flat rate, prices it 0.22 s."""
    an = Analyzer(itl_target_s=0.3)
    _trace(an, [100, 250, 500, 1000, 1500, 2000] * 4, contended=0.25)
    rep = build_report(an).engine_request_times
    assert rep is not None and rep.prefill_fit is not None
    fit = rep.prefill_fit
    assert (fit.prompts, fit.shortest_tokens, fit.longest_tokens) == (24, 100, 2000)
    truth = chunking.t_step(1436, 64, 0.0, A, K)
    priced = chunking.t_step(1436, 64, 0.0, fit.s_per_token, fit.k_att)
    flat = 64 / rep.engine_prefill_tokens_per_s
    assert truth == pytest.approx(0.301, abs=1e-3)
    assert priced == pytest.approx(truth, rel=0.10), (priced, truth, fit)
    assert flat < 0.8 * truth, flat
    # the first chunk is cheap: it is the position, not the chunk, that costs
    assert chunking.t_step(0, 64, 0.0, fit.s_per_token, fit.k_att) == pytest.approx(64 * A, rel=0.15)


def test_the_advisor_reads_the_fit_as_measured():
    """The verdict's prefill rate and ``k_att`` come from the fit, marked measured, with what it read."""
    an = Analyzer(itl_target_s=0.3)
    _trace(an, [100, 250, 500, 1000, 1500, 2000] * 2)
    v = build_report(an).verdict
    assert v is not None
    rate, k = v.numbers["prefill_rate"], v.numbers["k_att"]
    assert rate.source == k.source == "measured" and rate.low  # the steps ran the batch's decodes too
    assert "fitted to the engine's own TTFT of 12 requests of 100-2000" in rate.note, rate.note
    assert rate.value == pytest.approx(1 / A, rel=0.1) and k.value == pytest.approx(K, rel=0.25)


@pytest.mark.parametrize("prompts, why", [
    ([1000] * 12, "one length: the price of a position cannot be told from a token's"),
    ([700, 900, 1100, 1300] * 3, "lengths within 2x"),
    ([100, 2000] * 6, "two lengths: a curve of three terms needs three"),
])
def test_no_fit_without_prompts_of_several_lengths(prompts, why):
    """Without the spread the advisor keeps the flat rate, named as the low estimate it is."""
    an = Analyzer(itl_target_s=0.3)
    _trace(an, prompts)
    rep = build_report(an).engine_request_times
    assert rep is not None and rep.prefill_fit is None, why
    v = build_report(an).verdict
    assert v is not None
    rate = v.numbers["prefill_rate"]
    assert "median prompt tokens / the engine's own TTFT" in rate.note and rate.low


def test_cached_positions_still_make_the_computed_ones_dearer():
    """A prompt whose first 1,000 tokens came from the prefix cache computes its last 500 at the
    prices of positions 1,000-1,500, not 0-500: the fit reads both."""
    samples = [(n - c, c, engine_ttft(n, c)) for n, c in [(200, 0), (600, 0), (1500, 1000), (2000, 1000),
                                                           (400, 0), (1200, 0), (1800, 1200)] * 2]
    fit = fit_prefill(samples)
    assert fit is not None
    assert fit.k_att == pytest.approx(K, rel=0.02) and fit.s_per_token == pytest.approx(A, rel=0.02)
    # read as if nothing were cached, the dear late positions look cheap: k_att comes out far low,
    # or not at all
    blind = fit_prefill([(c + n, 0, t) for n, c, t in samples])
    assert blind is None or blind.k_att is None or blind.k_att < 0.5 * K


def test_a_fit_that_misses_its_points_is_not_believed():
    """Times that no curve of this form follows (here: falling with length) give no fit."""
    assert fit_prefill([(n, 0, 10.0 / n) for n in (100, 200, 400, 800, 1600)]) is None


def test_three_lengths_fit_no_more_than_two_terms():
    """Three bins: the three-term curve would pass through them whatever they were, so it is not
    tried. A line with a fixed part follows these three within 10 %: the rate is fitted, but k_att
    is not measured (None), and the advisor keeps the one it had rather than take 0. A fourth length
    separates the terms."""
    def curve(n: int) -> float:
        return 2.0 + 1e-3 * n + 1e-6 * n * n

    exact = [(n, 0, curve(n)) for n in (100, 400, 1600)]
    line = fit_prefill(exact)
    assert line is not None and line.k_att is None and line.fixed_s > 1.0
    an = Analyzer(itl_target_s=0.3)
    _trace(an, [100, 400, 1600] * 3, curve=curve)
    v = build_report(an).verdict
    assert v is not None and "fitted" in v.numbers["prefill_rate"].note
    assert v.numbers["k_att"].source == "assumed", v.numbers["k_att"]
    four = exact + [(800, 0, curve(800))]
    fit = fit_prefill(four)
    assert fit is not None and fit.fixed_s == pytest.approx(2.0, rel=1e-3) and fit.k_att == pytest.approx(1e-3)


def test_the_fit_reads_back_from_the_report():
    """`analyze --format json` carries the fit in the shape its schema names, and reads it back."""
    an = Analyzer(itl_target_s=0.3)
    _trace(an, [100, 250, 500, 1000, 1500, 2000] * 2)
    full = build_report(an)
    doc = json.loads(json.dumps(full.to_json(__version__)))
    schema = json.loads((REPO / "kvtop" / "schemas" / "analysis.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(schema).validate(doc)
    assert doc["engine_request_times"]["prefill_fit"]["longest_tokens"] == 2000
    assert type(full).from_dict(doc).engine_request_times == full.engine_request_times


def _captured(batch: int) -> list[tuple[int, int, float]]:
    """The real llama-server's ``timings`` for prompts of 108-2,006 tokens sent one at a time
    (tests/fixtures/engines/SOURCES.md), as (computed, cached, seconds)."""
    rows = json.loads(fixture_text(f"llamacpp-11434-prompt-timings-batch{batch}.json"))
    return [(r["timings"]["prompt_n"], r["timings"]["cache_n"], r["timings"]["prompt_ms"] / 1e3) for r in rows]


def test_on_the_real_llamacpp_the_fit_finds_attention_the_assumed_coefficient_misses():
    """A 270M model on a CPU: the fitted curve follows the engine's own times (median miss under
    10 %), its attention coefficient is several times the 8B-class figure the advisor assumes where
    the engine names no model (3.4x at the default batch of 2,048, 10x at 64), and the coefficient
    belongs to the batch it was measured at: the same prompts in 64-token steps grow faster with
    length (each small step reads every earlier position's KV again)."""
    fits = {}
    for batch in (2048, 64):
        samples = _captured(batch)
        fit = fit_prefill(samples)
        assert fit is not None and (fit.shortest_tokens, fit.longest_tokens) == (108, 2006), fit
        misses = sorted(abs(fit.fixed_s + fit.s_per_token * c + fit.s_per_token * fit.k_att * c * c - t) / t
                        for c, _, t in samples)
        assert misses[len(misses) // 2] < 0.10, (batch, misses)
        assert fit.k_att > 3 * GENERIC_K_ATT, (batch, fit)
        fits[batch] = fit
    assert fits[64].k_att > 2 * fits[2048].k_att, fits
    # the last 64-token chunk of a 1,500-token prompt against its first, by the batch-64 fit
    f = fits[64]
    ratio = chunking.t_step(1436, 64, 0.0, f.s_per_token, f.k_att) / chunking.t_step(0, 64, 0.0, f.s_per_token, f.k_att)
    assert 1.3 < ratio < 1.8, ratio
