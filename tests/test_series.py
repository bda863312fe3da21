"""The bounded series store: counter rates across resets, windowed histogram-delta quantiles."""

from __future__ import annotations

import math

import pytest

from kvtop.model.records import Histogram
from kvtop.model.series import (
    HistogramSeries,
    Series,
    counter_increase,
    counter_rate,
    histogram_delta,
    histogram_quantile,
)

INF = math.inf


def H(*cum: float, bounds=(0.01, 0.05, 0.1, 0.5, INF), total: float | None = None) -> Histogram:
    """Cumulative histogram over ``bounds``; sum defaults to 0 (quantiles do not use it)."""
    assert len(cum) == len(bounds)
    return Histogram(list(zip(bounds, cum, strict=True)), cum[-1], 0.0 if total is None else total)


def test_series_memory_is_bounded():
    s = Series(maxlen=100)
    for i in range(10_000):
        s.append(float(i), float(i))
    assert len(s) == 100
    assert s.items()[0] == (9900.0, 9900.0)
    hs = HistogramSeries(maxlen=50)
    for i in range(1000):
        hs.append(float(i), H(0, 0, 0, 0, i))
    assert len(hs) == 50


def test_none_and_nan_samples_are_skipped():
    s = Series()
    s.append(0.0, None)
    s.append(1.0, math.nan)
    s.append(2.0, 5.0)
    assert s.items() == [(2.0, 5.0)]


def test_counter_increase_survives_reset():
    # 100 -> 150 (+50), restart: 20 (+20, counted from zero), 35 (+15)
    assert counter_increase([100, 150, 20, 35]) == 85
    assert counter_increase([5]) == 0
    assert counter_increase([]) == 0


def test_counter_rate_with_reset_is_never_negative_or_huge():
    s = Series()
    for t, v in [(0, 1000.0), (1, 1010.0), (2, 3.0), (3, 8.0)]:  # restart between t=1 and t=2
        s.append(t, v)
    rate = counter_rate(s, window_s=10)
    # increase 10 + 3 + 5 = 18 over 3 s
    assert rate == pytest.approx(6.0)
    # a naive last-minus-first would give (8 - 1000) / 3 = -330.7/s
    assert rate >= 0


def test_counter_rate_window_includes_sample_before_window():
    s = Series()
    for t in range(11):
        s.append(float(t), float(t * 2))  # 2/s
    assert counter_rate(s, window_s=1.0) == pytest.approx(2.0)  # samples at 9 and 10
    assert counter_rate(s, window_s=3.5) == pytest.approx(2.0)
    one = Series()
    one.append(0.0, 1.0)
    assert counter_rate(one, 10) is None


def test_mark_counter_reset_counts_value_in_full():
    # Restart known from a restart token; the new counter already exceeds the old value.
    s = Series()
    s.append(0.0, 100.0)
    s.mark_counter_reset(1.0)
    s.append(1.0, 130.0)
    # without the marker the increase would be 30; the engine actually did 130 since it restarted
    assert counter_rate(s, 10) == pytest.approx(130.0)


def test_histogram_delta_and_quantiles_hand_computed():
    older = H(10, 50, 80, 100, 100)
    newer = H(10, 60, 150, 190, 200)
    d = histogram_delta(older, newer)
    # per-bound deltas: 0, 10, 70, 90, 100 (cumulative), count 100
    assert [c for _, c in d.buckets] == [0, 10, 70, 90, 100]
    assert d.count == 100
    # p50: rank 50 in (0.05, 0.1] which holds ranks 10..70 -> 0.05 + 0.05 * (50 - 10) / 60
    assert histogram_quantile(0.5, d) == pytest.approx(0.05 + 0.05 * 40 / 60)
    # p90: rank 90 is the top of (0.1, 0.5] (ranks 70..90): 0.1 + 0.4 * 20 / 20
    assert histogram_quantile(0.9, d) == pytest.approx(0.5)
    # p99: rank 99 lands in the +Inf bucket -> the largest finite bound (a lower bound of the truth)
    assert histogram_quantile(0.99, d) == pytest.approx(0.5)


def test_histogram_quantile_empty_is_none():
    assert histogram_quantile(0.5, H(0, 0, 0, 0, 0)) is None
    assert histogram_quantile(0.5, Histogram([], 0, 0)) is None


def test_histogram_delta_reset_and_layout_change():
    old = H(100, 200, 300, 400, 400)
    after_restart = H(1, 2, 3, 4, 4)  # count dropped: everything in it is new
    assert histogram_delta(old, after_restart) is after_restart
    relaid = H(1, 2, 3, 4, 500, bounds=(0.02, 0.05, 0.1, 0.5, INF))
    assert histogram_delta(old, relaid) is relaid


def test_histogram_series_window_delta():
    hs = HistogramSeries()
    hs.append(0.0, H(0, 0, 0, 0, 0))
    hs.append(10.0, H(10, 10, 10, 10, 10))  # 10 fast samples (<= 0.01)
    hs.append(20.0, H(10, 10, 10, 30, 30))  # 20 samples in (0.1, 0.5]
    # window 10 s ending at 20: baseline is the snapshot at t=10 -> only the slow 20
    d = hs.window_delta(10.0)
    assert d.count == 20
    # all of them in (0.1, 0.5]: p50 rank 10 -> 0.1 + 0.4 * 10 / 20
    assert hs.quantile(0.5, 10.0) == pytest.approx(0.3)
    # window 20 s: all 30 samples; p50 rank 15 -> (0.1, 0.5] holds ranks 10..30 -> 0.1 + 0.4*5/20
    assert hs.quantile(0.5, 20.0) == pytest.approx(0.2)
    # a single snapshot gives no delta
    one = HistogramSeries()
    one.append(0.0, H(5, 5, 5, 5, 5))
    assert one.quantile(0.5, 60.0) is None


def test_histogram_series_sums_across_reset():
    hs = HistogramSeries()
    hs.append(0.0, H(0, 0, 0, 100, 100))
    hs.append(1.0, H(0, 0, 0, 110, 110))  # +10 slow
    hs.append(2.0, H(5, 5, 5, 5, 5))  # restart: 5 new fast ones
    d = hs.window_delta(10.0)
    assert d.count == 15
    assert [c for _, c in d.buckets] == [5, 5, 5, 15, 15]


def test_histogram_series_mark_reset_counts_new_content_in_full():
    hs = HistogramSeries()
    hs.append(0.0, H(0, 0, 0, 100, 100))
    hs.mark_reset(1.0)
    hs.append(1.0, H(200, 200, 200, 200, 200))  # restarted engine already past the old count
    d = hs.window_delta(10.0)
    assert d.count == 200 and d.buckets[0][1] == 200
