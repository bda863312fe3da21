"""Pilot tests: drive the console with keys and assert what is on screen, from deterministic data."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("textual")

from tui_support import RENDER_VERDICT, FakeReplay, TickFeed, screen_text  # noqa: E402

from kvtop.core import Core  # noqa: E402
from kvtop.feeds.sample import FIXED_TAKEN_AT, Sample, sample  # noqa: E402
from kvtop.views.tui.app import KvtopApp  # noqa: E402

SIZE = (120, 40)


def _table_ids(app: KvtopApp) -> list[str]:
    table = app.main.query_one("#req-table")
    return [table.get_row_at(i)[0].plain for i in range(table.row_count)]


async def test_screens_switch_with_number_keys_and_tabs():
    s = sample(verdict=RENDER_VERDICT)
    app = KvtopApp(s.core, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        text = screen_text(app)
        assert "GPU0" in text and "GPU1" in text and "Engines" in text
        # the sample's GPU1 link runs at Gen3 under load while its max is Gen5
        assert "Gen3x16▼ (max Gen5x16)" in text
        await pilot.press("2")
        assert re.search(r"request\s+state\s+class\s+tokens", screen_text(app))
        await pilot.press("4")
        text = screen_text(app)
        assert "verdict: SWAP" in text and "confidence 78%" in text
        assert "--kv-offloading-size 16" in text
        await pilot.press("5")
        assert "link_downtrained" in screen_text(app)
        # mouse: clicking the first tab returns to the overview
        await pilot.click("#tab-overview")
        await pilot.pause()
        assert app.view_name == "overview" and "GPU0" in screen_text(app)


async def test_overview_numbers_match_the_snapshot():
    s = sample()
    app = KvtopApp(s.core, taken_at=FIXED_TAKEN_AT)
    snap = s.core.snapshot()
    e = snap.engines[0]
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        text = screen_text(app)
    # KV 0.9334 is over the 0.90 warning threshold; rates and totals as the core computed them
    assert f"{e.kv_usage * 100:.1f}%" == "93.3%" and "93.3%" in text
    # the sample's engine was read from its first scrape (t=1 s) to t=40 s of the 1 m window: its rate
    # covers those 39 s and says so
    assert e.rates_over_s == 39.0
    assert f"preempt {e.preemptions_per_s:.2f}/s over 39s ({e.preemptions_total:.0f} total)" in text
    assert "(target 100ms)" in text
    assert "pinned 24.0G (pinned (all GUP))" in text
    # 13.4 GB/s of GPU0's Gen5 x16 link (63.0 GB/s per direction) is 21%
    g0 = snap.gpus[0].record
    assert f"{g0.pcie_tx_bytes_per_s / 1e9:.1f} GB/s {g0.pcie_tx_bytes_per_s / 63.008e9 * 100:.0f}%" in text


async def test_requests_sort_cycles_and_reverses():
    s = sample()
    app = KvtopApp(s.core, taken_at=FIXED_TAKEN_AT)
    reqs = s.core.snapshot().requests
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2")
        # default: worst max gap first
        want = [r.id for r in sorted(reqs, key=lambda r: (r.max_gap_s or -1.0, r.id), reverse=True)]
        assert _table_ids(app) == want
        assert "sort: max gap ▼" in screen_text(app)
        await pilot.press("s")  # next column: spikes, most first
        want = [r.id for r in sorted(reqs, key=lambda r: (r.spikes, r.id), reverse=True)]
        assert _table_ids(app) == want
        assert "sort: spikes ▼" in screen_text(app)
        await pilot.press("r")
        assert _table_ids(app) == list(reversed(want))
        for _ in range(3):  # preempt, last cause, then wraps around to the id column, A→Z
            await pilot.press("s")
        assert app.views.requests.sort_col == "id"
        assert _table_ids(app) == sorted(r.id for r in reqs)
        # mouse: clicking the "tokens" header sorts by tokens, most first
        table = app.main.query_one("#req-table")
        x = table.column_x("tokens") + 1
        await pilot.click("#req-table", offset=(x, 0))
        await pilot.pause()
        assert app.views.requests.sort_col == "tokens"
        assert _table_ids(app) == [r.id for r in sorted(reqs, key=lambda r: (r.tokens, r.id), reverse=True)]


async def test_filter_keeps_matching_rows_and_escape_clears():
    s = sample()
    app = KvtopApp(s.core, taken_at=FIXED_TAKEN_AT)
    reqs = s.core.snapshot().requests
    batch = sorted(r.id for r in reqs if r.cls == "batch")
    assert 0 < len(batch) < len(reqs)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2", "slash", *"batch", "enter")
        await pilot.pause()
        assert sorted(_table_ids(app)) == batch
        assert f"{len(batch)} of {len(reqs)} requests  filter: batch" in screen_text(app)
        # words narrow further: only batch requests whose last spike was a preemption
        await pilot.press("slash", "space", *"preemption", "enter")
        both = sorted(r.id for r in reqs if r.cls == "batch" and r.last_cause == "preemption")
        assert sorted(_table_ids(app)) == both
        await pilot.press("slash", "escape")
        assert len(_table_ids(app)) == len(reqs)


async def test_enter_opens_the_request_detail_and_escape_goes_back():
    s = sample()
    app = KvtopApp(s.core, taken_at=FIXED_TAKEN_AT)
    snap = s.core.snapshot()
    target = max(snap.requests, key=lambda r: (r.preempt_spikes, r.id))
    spikes = [x for x in snap.analysis.spikes if x.request_id == target.id]
    pre = [x for x in spikes if x.cause == "preemption"][0]
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2")
        table = app.main.query_one("#req-table")
        table.move_cursor(row=table.get_row_index(target.id))
        await pilot.press("enter")
        await pilot.pause()
        text = screen_text(app)
        assert app.view_name == "detail"
        assert text.count(target.id) >= 1
        assert f"spikes {target.spikes} ({target.preempt_spikes} preemption)" in text
        # the preemption stall is listed with its gap, its multiple of the 100 ms target and confidence
        gap = pre.gap_s
        assert f"gap {gap:.2f}s ×{gap / 0.1:.1f} target  preemption confidence 86%" in text
        assert re.search(r"tokens │.*━", text)  # the stall drawn on the timeline
        assert re.search(r"engine │.*P", text)  # preemption counter rise overlaid
        await pilot.press("escape")
        assert app.view_name == "requests"


async def test_pause_freezes_the_view_and_resume_catches_up():
    s = Sample(seed=3)
    s.run(5)
    feed = TickFeed(s, period=0.02)
    app = KvtopApp(s.core, feed=feed, interval=0.05, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.2)
        await pilot.press("p")
        text = screen_text(app)
        assert "PAUSED" in text
        frozen = re.search(r"t=(\S+)", text).group(1)
        await pilot.pause(0.3)
        assert s.t > float(frozen.rstrip("s")) + 3  # data kept arriving...
        assert re.search(r"t=(\S+)", screen_text(app)).group(1) == frozen  # ...but the view held still
        # opening a request's detail keeps the frozen frame (it took a fresh snapshot, t jumped on)
        await pilot.press("3")
        await pilot.pause(0.1)
        text = screen_text(app)
        assert app.view_name == "detail" and "PAUSED" in text
        assert re.search(r"t=(\S+)", text).group(1) == frozen
        assert app.snap.detail is None or all(t <= app.snap.t for t, _n in app.snap.detail.tokens)
        await pilot.press("1")
        await pilot.pause(0.1)
        assert re.search(r"t=(\S+)", screen_text(app)).group(1) == frozen
        await pilot.press("p")
        await pilot.pause(0.1)
        text = screen_text(app)
        assert "PAUSED" not in text and "● live" in text
        assert re.search(r"t=(\S+)", text).group(1) != frozen


async def test_space_refreshes_now_through_the_feed():
    s = Sample(seed=3)
    s.run(5)
    feed = TickFeed(s, period=3600)  # the feed itself stays idle after its first tick
    app = KvtopApp(s.core, feed=feed, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        before = app.ticks
        await pilot.press("space")
        await pilot.pause()
        assert feed.refreshes == 1 and app.ticks == before + 1
        assert f"t={s.t:.2f}s" in screen_text(app)


async def test_help_lists_the_bindings():
    app = KvtopApp(sample().core, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        text = screen_text(app)
        for key, what in (("q", "Quit"), ("p", "Pause"), ("/", "Filter"), ("s", "Sort"), ("esc", "Back"),
                          ("enter", "Open the request"), ("1", "Overview screen"), ("5", "Events screen")):
            assert re.search(rf"\s{re.escape(key)}\s+{what}", text), (key, what)
        await pilot.press("escape")
        await pilot.pause()
        assert "kvtop keys" not in screen_text(app)


async def test_command_palette_lists_console_actions():
    app = KvtopApp(sample().core, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        names = [c.title for c in app.get_system_commands(app.screen)]
        assert {"Screen: Overview", "Screen: Advisor", "Pause / resume", "Refresh now", "Help"} <= set(names)
        # every key's action is there too, where it does something
        assert {"Window", "Poll less often (interval ×2)", "Poll more often (interval ÷2)"} <= set(names)
        assert "Reverse" not in names and "Seek to…" not in names  # the Requests screen's; a replay's
        app.action_view("requests")
        await pilot.pause()
        names = [c.title for c in app.get_system_commands(app.screen)]
        assert {"Sort", "Reverse", "Filter"} <= set(names) and len(names) == len(set(names))
        before = app.interval
        await pilot.press("ctrl+p", *"poll less")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert app.interval == 2 * before  # the palette ran the key's own action
        app.action_view("overview")
        await pilot.pause()
        await pilot.press("ctrl+p", *"advisor")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert app.view_name == "advisor"


async def test_replay_step_and_seek():
    s = Sample(seed=5)
    s.run(10)
    feed = FakeReplay(s, duration=300.0)
    app = KvtopApp(s.core, feed=feed, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert "replay 10.00s/300s" in screen_text(app)
        assert {"Back 10 s", "Forward 10 s", "Seek to…"} <= {c.title for c in app.get_system_commands(app.screen)}
        await pilot.press("right_square_bracket")
        assert feed.calls[-1] == ("seek", 20.0) and ("step", 10.0) in feed.calls
        assert "replay 20.00s/300s" in screen_text(app) and "t=20.00s" in screen_text(app)
        await pilot.press("g")
        await pilot.pause()
        await pilot.press(*"45", "enter")
        await pilot.pause()
        assert feed.calls[-1] == ("seek", 45.0)
        assert "replay 45.00s/300s" in screen_text(app) and "t=45.00s" in screen_text(app)
        # "nan" parses as a float: it rewound the replay to the start without a word
        await pilot.press("g")
        await pilot.pause()
        await pilot.press(*"nan", "enter")
        await pilot.pause()
        assert feed.calls[-1] == ("seek", 45.0) and app.screen is not app.main
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("p")
        assert feed.paused and feed.calls[-1] == ("pause", None)
        await pilot.press("p")
        assert not feed.paused


async def test_replay_keys_are_inactive_for_live_feeds():
    app = KvtopApp(sample().core, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        await pilot.pause()
        assert app.screen is app.main  # no seek dialog
        assert "Seek" not in screen_text(app)


async def test_events_newest_first_and_filtered():
    s = sample()
    events = s.core.snapshot().events
    app = KvtopApp(s.core, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("5")
        table = app.main.query_one("#ev-table")
        assert table.row_count == len(events)
        assert table.get_row_at(0)[3].plain == events[-1].message  # newest on top
        await pilot.press("slash", *"link", "enter")
        rows = [table.get_row_at(i)[2].plain for i in range(table.row_count)]
        assert rows == ["link_downtrained"] == [e.kind for e in events if "link" in f"{e.kind} {e.message}"]
        # the filter the Requests screen set narrows this list too: it says so (it was an empty list)
        assert f"1 of {len(events)} events  filter: link" in screen_text(app)
        # words, in any order, as the Requests filter reads them ("burst 1" matched nothing)
        await pilot.press("slash", *("backspace",) * 4, *"burst 1", "enter")
        want = [e for e in events if "burst" in e.kind and " 1 " in f" {e.message} "]
        assert want and table.row_count == len(want)


async def test_real_replay_feed_pause_seek_and_seek_back(tmp_path):
    from kvtop.feeds.replay import ReplayFeed
    from kvtop.model.trace import TraceWriter, make_header

    path = tmp_path / "trace.jsonl"
    with TraceWriter(path, make_header()) as w:
        Sample(seed=9, sink=w.write).run(60)
    reference = Sample(seed=9).run(20).core  # the same records, fed to t=20 directly

    def make_core() -> Core:
        return Core(itl_target_s=0.1, source_label="replay trace.jsonl")

    feed = ReplayFeed(path, make_core(), speed=1.0, core_factory=make_core)
    app = KvtopApp(feed.core, feed=feed, interval=0.1, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p")
        assert feed.paused and "PAUSED" in screen_text(app)
        await pilot.press("g")
        await pilot.pause()
        await pilot.press(*"30", "enter")
        await pilot.pause()
        assert feed.t == 30.0 and "replay 30.00s/60.00s" in screen_text(app)
        assert "t=30.00s" in screen_text(app)
        first_core = app.core
        await pilot.press("left_square_bracket")  # back 10 s: a fresh core re-fed to t=20
        await pilot.pause()
        assert feed.t == 20.0 and app.core is feed.core and app.core is not first_core
        await pilot.press("2")
        want = {r.id for r in reference.snapshot(now=20.0).requests}
        assert set(_table_ids(app)) == want
        assert "t=20.00s" in screen_text(app)
    feed.close()


async def test_a_replay_of_a_corrupt_trace_says_so_in_the_banner(tmp_path):
    """Malformed lines in a trace: replay --headless and analyze warn of them; the console showed
    only "end of trace". Its banner now says what the reader skipped."""
    from kvtop.feeds.replay import ReplayFeed
    from kvtop.model.trace import TraceWriter, make_header

    path = tmp_path / "trace.jsonl"
    with TraceWriter(path, make_header()) as w:
        Sample(seed=9, sink=w.write).run(20)
    lines = path.read_text().splitlines(keepends=True)
    for at in (400, 200, 100):
        lines.insert(at, "not json at all\n")
    path.write_text("".join(lines))

    def make_core() -> Core:
        return Core(itl_target_s=0.1, source_label="replay trace.jsonl")

    feed = ReplayFeed(path, make_core(), speed=1.0, core_factory=make_core)
    app = KvtopApp(feed.core, feed=feed, interval=0.1, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p", "g")
        await pilot.pause()
        await pilot.press(*"20", "enter")
        await pilot.pause()
        await pilot.press("space")
        await pilot.pause()
        assert "skipped 3 malformed lines (more than" in screen_text(app)
    feed.close()


async def test_a_changed_verdict_is_logged_as_an_event():
    s = sample(verdict=RENDER_VERDICT)
    app = KvtopApp(s.core, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        s.analysis.verdict = dict(s.analysis.verdict, action="recompute", confidence=0.61)
        await pilot.press("space")  # the refresh that sees the new verdict logs it
        await pilot.press("5")
        assert "advisor: swap -> recompute (confidence 61%)" in screen_text(app)
        assert "verdict_change" in screen_text(app)


async def test_a_theme_change_recolours_the_requests_and_keeps_the_cursor_on_its_request():
    s = sample()
    app = KvtopApp(s.core, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2", "down", "down")
        await pilot.pause()
        table = app.main.query_one("#req-table")
        key = table.cursor_key
        row = [r for r in s.core.snapshot().requests if r.preempt_spikes][0]
        before = table.get_row_at(table.get_row_index(row.id))[8]  # "preempt": an error colour
        app.theme = "kvtop-low"
        await pilot.pause()
        after = table.get_row_at(table.get_row_index(row.id))[8]
        assert table.cursor_key == key and table.cursor_row == 2
        assert after.plain == before.plain == str(row.preempt_spikes)
        assert str(before.style) == "#fe5f5f" and str(after.style) == "red"  # $error in each theme


async def test_a_click_on_a_spike_of_a_request_no_longer_kept_says_so():
    # the click opened "No request selected. Pick one on the Requests screen" for a request that had
    # ended and left the console
    import dataclasses

    from kvtop.views.tui.charts import Chart

    s = sample()
    app = KvtopApp(s.core, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        snap = app.snap
        worst = max(snap.analysis.spikes, key=lambda sp: (sp.gap_s, sp.request_id))
        span = Chart.SpikesPicked(worst.t_end - 0.01, worst.t_end + 0.01)
        app.snap = dataclasses.replace(snap, requests=tuple(r for r in snap.requests if r.id != worst.request_id))
        app._open_spike(span)
        await pilot.pause()
        assert any(f"{worst.request_id} (gap" in n.message and "no longer kept" in n.message
                   for n in app._notifications)
        assert app.view_name != "detail" or app.views.detail.request_id != worst.request_id
        app.snap = snap
        app._open_spike(span)
        await pilot.pause()
        assert app.view_name == "detail" and app.views.detail.request_id == worst.request_id
