"""The analysis stages below the rules: the one gap-candidate function, the histogram's batch add,
the per-stream store and the stall index, with hand-made numbers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvtop.analysis.gaps import GapTracker, LogHistogram, candidate
from kvtop.analysis.streams import StreamStore


def test_candidate_features_come_from_the_streams_recent_events() -> None:
    # a stream of 11 events / 14 tokens so far, its closing event carried 4 tokens after a 0.5 s silence
    g = candidate("r1", "e:8000", 10.0, 10.5, 0.5, "token", 4, 14, 11, [0.02, 0.03, 0.025, 0.2],
                  [1, 2, 1, 1], [0.02, 0.03, 0.025])
    assert (g.stream_baseline, g.calm_baseline, g.fast_baseline) == (0.03, 0.025, 0.02)
    assert g.tokens_per_event == 1.0  # (14 - 4) / (11 - 1)
    assert (g.tokens_before, g.chunk_n, g.burst_n, g.step_n_max, g.after) == (14, 4, 4, 2, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.burst_n = 9  # type: ignore[misc]
    # a cancel closes with no token event: the chunk size is the stream's own so far
    c = candidate("r1", None, 10.0, 11.0, 1.0, "cancel", 1, 12, 8, [], [], [])
    assert c.tokens_per_event == 1.5 and c.stream_baseline is None and c.step_n_max == 0


def test_histogram_batch_add_fills_the_same_bins_as_one_by_one() -> None:
    vals = [1e-7, 1e-6, 0.0123, 0.02, 0.02, 0.5, 3.0, 1e9]
    one, many = LogHistogram(), LogHistogram()
    for v in vals:
        one.add(v)
    many.add_array(np.array(vals))
    assert many.counts == one.counts and many.n == one.n == 8
    assert many.quantile(0.5) == one.quantile(0.5)


def test_histogram_quantile_is_the_first_bin_whose_running_count_reaches_it() -> None:
    """The quantile skips whole blocks of bins; it is still the first non-empty bin at which the
    running count reaches q of the sample, for samples on one side of a block edge or spread
    over all of them, q = 0 and q = 1 included."""
    import math
    import random

    def walk(h: LogHistogram, q: float) -> float | None:
        acc = 0
        for i, c in enumerate(h.counts):
            acc += c
            if acc >= q * h.n and c:
                return h.value_at(i)
        return None

    rnd = random.Random(2)
    tried = set()
    for _ in range(200):
        h = LogHistogram(bins=rnd.choice([64, 100, 800, 1200]))
        centre, spread = rnd.choice([1e-5, 0.025, 5.0, 1e4]), rnd.choice([0.01, 1.0, 4.0])
        for _ in range(rnd.randint(1, 400)):
            h.add(rnd.lognormvariate(math.log(centre), spread))
        for q in (0.0, 1e-9, 0.01, 0.5, 0.9, 0.99, 1.0):
            assert h.quantile(q) == walk(h, q)
        tried.add(next(i for i, c in enumerate(h.counts) if c) // 64)
    assert len(tried) > 3  # samples that start in several blocks of bins
    assert LogHistogram().quantile(0.5) is None


def test_store_drops_the_oldest_ended_stream_first_and_says_which() -> None:
    dropped: list[str] = []
    s = StreamStore(max_requests=2, on_drop=dropped.append)
    s.req("a")
    s.req("b").end_t = 1.0
    s.req("c")
    assert [r.id for r in s] == ["a", "c"] and dropped == ["b"]
    s.req("d")
    assert [r.id for r in s] == ["c", "d"] and dropped == ["b", "a"]
    assert s.get("zz") is None


def test_one_stream_through_the_tracker_feeds_the_store_and_the_stall_index() -> None:
    gt = GapTracker(itl_target_s=0.1)
    for rid in ("x", "y", "z"):
        gt.first_token(gt.req(rid), 0.0)
    for i in range(1, 28):
        t = round(0.02 * i, 6)
        if t <= 0.1:
            gt.token("x", t)
            gt.token("z", t)
        gt.token("y", t)  # y streams through x's silence
    gt.token("x", 0.5, 3)  # 0.4 s silence: a spike
    gt.token("z", 0.5)  # z fell silent with x and came back with it
    gt.end(gt.req("y"), 0.55, "finish")
    info = gt.streams.get("x")
    assert info is not None and (info.tokens, round(info.max_gap, 6), info.first_t) == (8, 0.4, 0.0)
    (sx, sz) = gt.take_all()
    assert (sx.request_id, round(sx.gap, 6), sx.chunk_n, round(sx.stream_baseline or 0, 6)) == ("x", 0.4, 3, 0.02)
    assert gt.stalls.active_at(0.3) == 3 and gt.stalls.active_at(0.6) == 2
    assert gt.stalls.departures(0.5, 0.6) == 1
    # of the others, z was silent over the same interval (fell silent and came back with it), y was not
    n, median, fresh, together, _, _ = gt.stalls.co_stalled(sx, settle=2.0)
    assert (n, round(median or 0, 6), fresh, together) == (1, 0.4, 1, 1)
