"""The engine's step per batch size, read from its own scrapes (kvtop/analysis/stepcurve.py)."""

from __future__ import annotations

from kvtop.analysis.stepcurve import StepCurve


def _scrape(t: float, running: float, itl_count: float, itl_sum: float, gen: float) -> dict:
    return {"t": t, "running": running, "itl": {"count": itl_count, "sum": itl_sum}, "generation_tokens_total": gen}


def test_each_interval_gives_the_mean_step_and_tokens_per_s_at_its_batch():
    c = StepCurve()
    # 100 sequences for 4 s at a 50 ms step: 2,000 tokens/s; then 200 at 80 ms: 2,500 tokens/s
    prev = _scrape(0, 100, 0, 0, 0)
    scrapes = [_scrape(t, 100, 2000 * t, 2000 * t * 0.05, 2000 * t) for t in (1, 2, 3, 4)]
    scrapes += [_scrape(4 + t, 200, 8000 + 2500 * t, 400 + 2500 * t * 0.08, 8000 + 2500 * t) for t in (1, 2, 3, 4)]
    for cur in scrapes:
        c.add(prev, cur)
        prev = cur
    # a histogram reset (count falls) and an idle interval add nothing; the one interval from 100 to 200
    # (a mean of 150) is too few to keep
    c.add(prev, _scrape(9, 200, 10, 1, 100))
    c.add(_scrape(9, 0, 10, 1, 100), _scrape(10, 0, 10, 1, 100))
    pts = c.points()
    assert [(p["running"], p["itl_ms"], p["tokens_per_s"], p["seconds"]) for p in pts] == [
        (100.0, 50.0, 2000.0, 4.0), (200.0, 80.0, 2500.0, 3.0)]


def test_a_bin_from_fewer_than_three_intervals_is_left_out():
    c = StepCurve()
    c.add(_scrape(0, 10, 0, 0, 0), _scrape(1, 10, 500, 10, 500))
    c.add(_scrape(1, 10, 500, 10, 500), _scrape(2, 10, 1000, 20, 1000))
    assert c.points() == []
    c.add(_scrape(2, 10, 1000, 20, 1000), _scrape(3, 10, 1500, 30, 1500))
    assert c.points() == [{"running": 10.0, "itl_ms": 20.0, "tokens_per_s": 500.0, "seconds": 3.0}]
