"""History charts: the bounded store, the chart layout, and the Overview over a simulated
preemption storm (KV pinned near 100 %, preemptions/s bars, spikes marked by cause, hover values)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kvtop.core import Core
from kvtop.history import MAX_POINTS, History, Ring
from kvtop.model.records import EngineRecord, Histogram
from kvtop.views.tui import plot

REPO = Path(__file__).resolve().parents[1]


def test_ring_keeps_the_last_points_and_columns_keep_each_columns_peak():
    r = Ring(maxlen=100)
    for i in range(1000):
        r.append(float(i), 1.0 if i != 990 else 50.0)
    assert len(r) < 130 and r.t[-1] == 999.0 and r.t[0] >= 1000 - 125
    cols = r.columns(900.0, 1000.0, 10)
    # 990 falls in the last column: an hour squeezed into few columns still shows the spike
    assert cols[-1] == 50.0 and cols[-2] == 1.0
    assert r.columns(0.0, 100.0, 4) == [None] * 4  # trimmed away
    assert r.at(989.6) == (990.0, 50.0)


def test_history_derives_rates_and_windowed_itl_quantiles_from_engine_records():
    h = History()
    buckets = [0.01, 0.05, 0.1, 0.5, float("inf")]

    def rec(t: float, pre: float, gen: float, slow: float) -> EngineRecord:
        # cumulative ITL histogram: 100 fast gaps a second, plus ``slow`` gaps of ~0.3 s so far
        fast = 100 * t
        counts = [0.0, fast, fast, fast + slow, fast + slow]
        return EngineRecord(t=t, url="u", adapter="vllm", kv_usage=0.5, running=4, waiting=2,
                            preemptions_total=pre, generation_tokens_total=gen, prompt_tokens_total=0.0,
                            itl=Histogram(list(zip(buckets, counts, strict=True)), fast + slow, 0.0))

    for t in range(0, 21):
        h.ingest(rec(float(t), pre=3.0 * t, gen=500.0 * t, slow=0.0 if t < 15 else 10.0 * (t - 14)))
    s = h.engine_series("u", None)
    assert s is not None
    assert s["preemptions_per_s"].last() == pytest.approx(3.0)
    assert s["generation_tokens_per_s"].last() == pytest.approx(500.0)
    # before the slow gaps the p99 sits in the 10-50 ms bucket; with 60 slow of ~1,060 it moves up
    early = s["itl_p99_s"].columns(9.0, 10.0, 1)[0]
    late = s["itl_p99_s"].last()
    assert early is not None and 0.01 < early <= 0.05
    assert late is not None and 0.1 < late <= 0.5
    # an engine restart (counters fall) is a reset, not a negative rate
    h.ingest(rec(21.0, pre=1.0, gen=100.0, slow=0.0))
    assert s["preemptions_per_s"].last() == pytest.approx(1.0)


def test_rates_name_the_span_they_cover_not_a_window_the_engine_was_not_read_for():
    """19 preemptions over the 30 s an engine was read: 0.63/s, which the console called "over 1m"
    in its 1 m window (over a minute it would be 0.32/s). The card and chart titles name 30s."""
    from kvtop.views.tui.charts import preempt_rate

    core = Core(window_s=60.0)
    for t in range(0, 31):
        core.ingest(EngineRecord(t=float(t), url="http://e:8000", adapter="vllm", kv_usage=0.5,
                                 preemptions_total=19.0 * t / 30))
    snap = core.snapshot(now=30.0)
    (e,) = snap.engines
    assert e.rates_over_s == 30.0 and e.preemptions_per_s == pytest.approx(19 / 30)
    assert preempt_rate(e, snap.window_s) == "0.63/s over 30s"
    for t in range(31, 121):
        core.ingest(EngineRecord(t=float(t), url="http://e:8000", adapter="vllm", kv_usage=0.5,
                                 preemptions_total=19.0))
    (e,) = core.snapshot(now=120.0).engines
    assert e.rates_over_s == 60.0 and preempt_rate(e, 60.0) == "0.00/s over 1m"


def test_history_memory_is_bounded():
    h = History()
    for t in range(3 * MAX_POINTS):
        h.ingest(EngineRecord(t=float(t), url="u", adapter="vllm", kv_usage=0.5))
    s = h.engine_series("u", None)
    assert s is not None and len(s["kv_usage"]) <= MAX_POINTS + MAX_POINTS // 4


def test_plot_rows_draw_levels_target_rule_and_overlay():
    rows = plot.plot_rows([0.0, 0.5, 1.0, None], [None, None, None, 1.0], top=1.0, height=2, ref=0.5, over=0.9)
    text = ["".join(t for t, _ in r) for r in rows]
    roles = [[role for t, role in r for _ in t] for r in rows]
    assert text[1][1:3] == "██"  # 0.5 and 1.0 fill the bottom row
    assert text[0][2] == "█" and roles[0][2] == plot.OVER  # 1.0 is over the 0.9 warning level
    assert text[0][1] == "┈"  # the reference rule where the bar leaves room
    assert text[0][3] == "━" and roles[0][3] == plot.LINE  # the secondary series at its level
    assert plot.scale_top([3.2, None], ref=None) == 5.0
    marks = {"slow_decode": [1.5, 3.2], "preemption": [1.6]}
    assert plot.mark_row(4, 0.0, 4.0, marks) == [None, "preemption", None, "slow_decode"]
    assert plot.marks_between(marks, 1.0, 2.0) == {"slow_decode": 1, "preemption": 1}


def _storm_core() -> Core:
    spec = importlib.util.spec_from_file_location("make_screenshots", REPO / "scripts" / "make_screenshots.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_screenshots"] = mod
    spec.loader.exec_module(mod)
    return mod.simulated_core(seconds=120.0)


async def test_overview_charts_show_the_preemption_storm():
    pytest.importorskip("textual")
    from kvtop.views.tui.app import KvtopApp
    from kvtop.views.tui.charts import Chart

    core = _storm_core()
    snap = core.snapshot()
    preempt_spikes = [s for s in snap.analysis.spikes if s.cause == "preemption"]
    assert preempt_spikes  # the storm the charts must show
    app = KvtopApp(core, interval=3600, taken_at="2026-01-01T00:00:00Z")
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.pause()
        await pilot.pause()
        charts = {c.spec.key: c for c in app.query(Chart)}
        assert {"e0kv", "e0itl", "e0pre", "e0q", "e0ttft", "e0tok", "g0m", "g0p", "host"} <= set(charts)
        # charts grow into the height left: a 45-row terminal gives them more than the minimum
        assert all(c.size.height > 6 for c in charts.values())
        kv = charts["e0kv"]
        kv_lines = [kv.render_line(y).text for y in range(kv.size.height)]
        last_kv = core.history.engine_series(snap.engines[0].url, snap.engines[0].engine)["kv_usage"].last()
        assert f"KV {last_kv * 100:.0f}%" in kv_lines[0]
        assert kv_lines[1].count("█") + kv_lines[1].count("▇") > 10  # pinned near the top row
        pre = charts["e0pre"]
        assert any("█" in pre.render_line(y).text for y in range(1, pre.size.height - 1))
        itl = charts["e0itl"]
        axis = itl.render_line(itl.size.height - 1)
        assert "P" in axis.text.split("─")[-1]  # preemption's letter: readable without colour
        red = app.theme_variables["error"].lower()
        assert any(seg.text.startswith("P") and seg.style and seg.style.color
                   and seg.style.color.name.lower() == red for seg in axis)
        # hover: time and the value of the nearest sample
        ring = charts["e0kv"].spec.ring
        x = 7 + (charts["e0kv"].size.width - 8) - 1  # the newest column
        text = kv.readout(x)
        assert text is not None and "KV cache usage at t=" in text
        t_hover = float(text.split("t=")[1].split("s")[0])
        near = ring.at(t_hover)
        assert f"KV {near[1] * 100:.0f}%" in text
        assert kv.readout(2) is None  # over the axis labels: nothing
        # the window selector narrows the time axis
        await pilot.press("w")
        await pilot.pause()
        assert app.views.overview.window_s == 900.0 and "-15m" in kv.render_line(kv.size.height - 1).text


async def test_charts_fit_80x24():
    pytest.importorskip("textual")
    from kvtop.views.tui.app import KvtopApp
    from kvtop.views.tui.charts import Chart

    app = KvtopApp(_storm_core(), interval=3600, taken_at="2026-01-01T00:00:00Z")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.pause()
        shown = [c for c in app.query(Chart) if c.region.height > 0]
        assert len(shown) >= 2  # two charts side by side stay on screen under the panels
        assert all(c.size.width >= 30 for c in shown)


async def test_replay_charts_end_at_the_replay_position_and_follow_a_seek(tmp_path):
    pytest.importorskip("textual")
    from kvtop.analysis.live import LiveAnalyzer
    from kvtop.feeds.replay import ReplayFeed
    from kvtop.sim.simulate import simulate_to_trace
    from kvtop.sim.workload import load_preset
    from kvtop.views.tui.app import KvtopApp
    from kvtop.views.tui.charts import Chart

    path = tmp_path / "storm.jsonl"
    simulate_to_trace(load_preset("preemption-storm"), 1, 90.0, str(path))

    def make_core() -> Core:
        return Core(itl_target_s=0.1, source_label="replay", analysis=LiveAnalyzer(itl_target_s=0.1))

    feed = ReplayFeed(path, make_core(), speed=1.0, core_factory=make_core)
    try:
        app = KvtopApp(feed.core, feed=feed, interval=3600, taken_at="2026-01-01T00:00:00Z")
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            await pilot.press("p")
            for _ in range(5):
                await pilot.press("]")
            await pilot.pause()
            t = feed.t
            assert t >= 45.0
            kv = next(c for c in app.query(Chart) if c.spec.key == "e0kv")
            # the window ends in the column that holds the replay position (columns are whole)
            col = (kv.t1 - kv.t0) / (kv.size.width - 8)
            assert t <= kv.t1 < t + col + 1e-6 and kv.now_label == f"t={t:.2f}s"
            assert 0 < kv.spec.ring.t[-1] <= t + 1.0  # nothing from past the replay position
            await pilot.press("g", "2", "0", "enter")
            await pilot.pause()
            kv = next(c for c in app.query(Chart) if c.spec.key == "e0kv")
            assert feed.t == pytest.approx(20.0) and 20.0 <= kv.t1 < 20.0 + col + 1e-6
            assert kv.spec.ring.t[-1] <= 21.0  # the re-fed core's history stops at the seek target
    finally:
        feed.close()
