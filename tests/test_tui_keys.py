"""Keys htop / btop / nvitop users reach for: +/- poll interval, j/k, F1 help."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from kvtop.core import Core  # noqa: E402
from kvtop.feeds.sample import FIXED_TAKEN_AT, sample  # noqa: E402
from kvtop.pipeline import SourceOptions, live_feed  # noqa: E402
from kvtop.views.tui.app import HelpScreen, KvtopApp  # noqa: E402
from kvtop.views.tui.table import RowTable  # noqa: E402


async def test_plus_and_minus_change_the_poll_interval_of_the_feed():
    core = Core()
    feed = live_feed(SourceOptions(interval_s=1.0, gpu=False, host=False), core=core)
    app = KvtopApp(core, feed=feed, interval=1.0, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("plus")
        await pilot.pause()
        assert app.interval == 2.0 and feed.interval_s == 2.0
        await pilot.press("minus", "minus", "minus")
        await pilot.pause()
        assert app.interval == 0.25 and feed.interval_s == 0.25
        for _ in range(12):
            await pilot.press("minus")
        assert app.interval == 0.05  # the same floor as --interval


async def test_j_and_k_move_the_requests_cursor_and_f1_opens_help():
    s = sample(requests=30, seconds=5)
    app = KvtopApp(s.core, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        table = app.query_one("#req-table", RowTable)
        start = table.cursor_row
        await pilot.press("j", "j", "j")
        assert table.cursor_row == start + 3
        await pilot.press("k")
        assert table.cursor_row == start + 2
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)


async def test_help_scrolls_where_the_terminal_is_shorter_than_the_keys():
    """At 80x24 the help box cut its last 12 rows (the seek, filter and sort keys, the mouse hint)
    and no key reached them; now arrows and j/k scroll it to the end."""
    s = sample(requests=5, seconds=5)
    app = KvtopApp(s.core, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        box = app.screen.query_one("#help-box")
        assert box.max_scroll_y > 0  # more keys than rows
        for _ in range(box.max_scroll_y):
            await pilot.press("j")
        await pilot.pause()
        assert box.scroll_y == box.max_scroll_y
        await pilot.press("k")
        assert box.scroll_y == box.max_scroll_y - 1


async def test_j_scrolls_the_overview_to_the_charts_below_the_fold():
    s = sample(requests=5, seconds=30)
    app = KvtopApp(s.core, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        charts = app.query_one("#charts")
        assert charts.max_scroll_y > 0 and charts.scroll_y == 0
        await pilot.press("j", "j", "j")
        await pilot.pause()
        assert charts.scroll_y == 3
