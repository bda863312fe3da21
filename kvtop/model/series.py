"""Bounded time series: rates that survive counter resets, quantiles from histogram bucket deltas.

Memory is bounded by ``maxlen`` samples per series whatever the run length.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Iterable, Sequence

from kvtop.model.records import Histogram


class Series:
    """A ring buffer of (t, value) samples, ``t`` monotonic and non-decreasing."""

    __slots__ = ("_t", "_v")

    def __init__(self, maxlen: int = 3600):
        self._t: deque[float] = deque(maxlen=maxlen)
        self._v: deque[float] = deque(maxlen=maxlen)

    def append(self, t: float, v: float | None) -> None:
        # Non-finite values and times would poison every rate and window after them: skip them.
        if v is None or not math.isfinite(v) or not math.isfinite(t):
            return
        if self._t and t < self._t[-1]:
            return  # out of order: bisect over the window needs sorted times
        self._t.append(t)
        self._v.append(float(v))

    def mark_counter_reset(self, t: float) -> None:
        """The counter's process restarted at ``t`` (known from a restart token, not from a drop).

        A zero sample makes the next value count in full, which a plain drop check would miss when
        the restarted counter has already climbed past its old value.
        """
        if self._t:
            self._t.append(t)
            self._v.append(0.0)

    def __len__(self) -> int:
        return len(self._t)

    def last(self) -> tuple[float, float] | None:
        return (self._t[-1], self._v[-1]) if self._t else None

    def values(self, n: int | None = None) -> list[float]:
        if n is None or n >= len(self._v):
            return list(self._v)
        return list(self._v)[-n:]

    def items(self) -> list[tuple[float, float]]:
        return list(zip(self._t, self._v, strict=False))

    def _window_start(self, window_s: float, now: float | None) -> int:
        end = self._t[-1] if now is None else now
        return bisect_left(self._t, end - window_s)

    def window(self, window_s: float, now: float | None = None) -> list[tuple[float, float]]:
        if not self._t:
            return []
        i = self._window_start(window_s, now)
        return [(self._t[k], self._v[k]) for k in range(i, len(self._t))]


def counter_increase(values: Iterable[float]) -> float:
    """Increase of a cumulative counter across samples, Prometheus-style.

    A drop means the process restarted and the counter began again from zero, so the
    post-reset value is the increase for that interval (never a negative or huge rate).
    """
    total = 0.0
    prev: float | None = None
    for v in values:
        if not math.isfinite(v) or v < 0:
            continue  # not a counter value: neither an increase nor a new baseline
        if prev is not None:
            total += v - prev if v >= prev else v
        prev = v
    return total


def counter_increase_over(series: Series, window_s: float, now: float | None = None) -> float:
    """The counter's increase since the last sample at or before ``now - window_s`` (0 with fewer
    than two samples)."""
    if len(series) < 2:
        return 0.0
    ts, vs = series._t, series._v
    i = max(0, bisect_right(ts, (ts[-1] if now is None else now) - window_s) - 1)
    return counter_increase(vs[k] for k in range(i, len(vs)))


def covered_span(series: Series, window_s: float, now: float) -> float | None:
    """The seconds of the window ending ``now`` that the series covers (the whole window, or since
    its first sample); None without a sample."""
    if not len(series):
        return None
    return round(max(0.0, min(window_s, now - series._t[0])), 3)


def counter_rate(series: Series, window_s: float, now: float | None = None) -> float | None:
    """Per-second increase over the window; ``None`` with fewer than two samples in it.

    The sample just before the window is included so a window of one scrape interval still has
    a delta (a 1 s window at a 1 s scrape interval is the common live case).
    """
    if len(series) < 2:
        return None
    ts, vs = series._t, series._v
    i = max(0, series._window_start(window_s, now) - 1)
    if len(ts) - i < 2:
        return None
    dt = ts[-1] - ts[i]
    if dt <= 0:
        return None
    return max(0.0, counter_increase(vs[k] for k in range(i, len(vs))) / dt)


def histogram_delta(older: Histogram | None, newer: Histogram) -> Histogram:
    """Observations between two cumulative snapshots; a reset (count drop) means ``newer`` is all new."""
    if older is None or newer.count < older.count or len(older.buckets) != len(newer.buckets):
        return newer
    if any(a[0] != b[0] for a, b in zip(older.buckets, newer.buckets, strict=False)):
        return newer  # bucket layout changed (engine upgrade): treat as a fresh start
    if any(b[1] < a[1] for a, b in zip(older.buckets, newer.buckets, strict=False)):
        return newer  # a bucket went backwards: a reset the total count hid
    return Histogram(
        [(le, c - o) for (le, c), (_, o) in zip(newer.buckets, older.buckets, strict=False)],
        newer.count - older.count,
        newer.sum - older.sum,
    )


def histogram_quantile(q: float, h: Histogram) -> float | None:
    """Quantile from cumulative buckets with linear interpolation inside the bucket (Prometheus).

    Returns ``None`` when there are no observations. A quantile landing in the +Inf bucket returns
    the largest finite upper bound (the honest lower bound of the true value).
    """
    if not 0.0 <= q <= 1.0:
        return None
    # Only finite, non-negative counts and non-NaN bounds take part: a quantile is never NaN or < 0.
    buckets: Sequence[tuple[float, float]] = sorted(
        (le, c) for le, c in h.buckets if not math.isnan(le) and math.isfinite(c) and c >= 0
    )
    if not buckets:
        return None
    count = h.count if math.isfinite(h.count) else 0.0
    total = buckets[-1][1] if math.isinf(buckets[-1][0]) else max(count, buckets[-1][1])
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if le < 0:
            continue  # latencies are never negative: a negative bound is not a bucket
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c <= prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, max(c, prev_c)
    return buckets[-1][0] if math.isfinite(buckets[-1][0]) and buckets[-1][0] >= 0 else prev_le


class HistogramSeries:
    """Bounded history of cumulative histogram snapshots, for windowed quantiles."""

    __slots__ = ("_items", "_cache")

    def __init__(self, maxlen: int = 3600):
        self._items: deque[tuple[float, Histogram]] = deque(maxlen=maxlen)
        self._cache: tuple[tuple[int, int, float, float], Histogram | None] | None = None  # (key, delta)

    def append(self, t: float, h: Histogram | None) -> None:
        if h is not None:
            self._items.append((t, h))

    def mark_reset(self, t: float) -> None:
        """The engine restarted: the next snapshot's content is all new (see Series.mark_counter_reset)."""
        if self._items:
            last = self._items[-1][1]
            self._items.append((t, Histogram([(le, 0.0) for le, _ in last.buckets], 0.0, 0.0)))

    def __len__(self) -> int:
        return len(self._items)

    def window_delta(self, window_s: float, now: float | None = None) -> Histogram | None:
        """Observations inside the window, summed across any resets.

        Between resets the per-scrape deltas telescope, so only each segment's ends are
        subtracted: O(snapshots) cheap comparisons plus O(buckets) per segment, not per scrape.
        The result is cached for the latest snapshot, since views ask for several quantiles.
        """
        if not self._items:
            return None
        end = self._items[-1][0] if now is None else now
        key = (id(self._items[-1]), len(self._items), window_s, end)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        # baseline: the last snapshot at or before the window start; none -> the oldest retained
        base_i = bisect_right(self._items, end - window_s, key=_item_t) - 1
        start = max(base_i, 0)
        if len(self._items) - start < 2:
            self._cache = (key, None)
            return None
        acc: Histogram | None = None
        prev: Histogram = self._items[start][1]
        base: Histogram | None = prev
        for i in range(start + 1, len(self._items)):
            h = self._items[i][1]
            if h.count < prev.count or len(h.buckets) != len(prev.buckets):
                # reset: close the segment; the new one counts from zero
                acc = _hist_add_opt(acc, _segment(base, prev))
                base = None
            prev = h
        acc = _hist_add_opt(acc, _segment(base, prev))
        self._cache = (key, acc)
        return acc

    def quantile(self, q: float, window_s: float, now: float | None = None) -> float | None:
        d = self.window_delta(window_s, now)
        return None if d is None else histogram_quantile(q, d)


def _item_t(item: tuple[float, Histogram]) -> float:
    return item[0]


def _segment(base: Histogram | None, last: Histogram) -> Histogram:
    """Observations from ``base`` to ``last`` within one reset-free segment (all of ``last`` if no base)."""
    return last if base is None else histogram_delta(base, last)


def _hist_add_opt(a: Histogram | None, b: Histogram) -> Histogram:
    return b if a is None else _hist_add(a, b)


def _hist_add(a: Histogram, b: Histogram) -> Histogram:
    if len(a.buckets) != len(b.buckets):
        return b
    return Histogram([(le, c + d) for (le, c), (_, d) in zip(a.buckets, b.buckets, strict=False)], a.count + b.count, a.sum + b.sum)
