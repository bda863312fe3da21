"""The Requests table: only rows on screen are painted, lines are reused while their cells are the
same, the cursor follows its row through reorders, keys and clicks post the right messages."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from rich.text import Text  # noqa: E402
from textual.app import App, ComposeResult  # noqa: E402

from kvtop.views.tui.table import RowTable  # noqa: E402

COLS = (("id", "request"), ("tokens", "tokens"), ("cause", "last cause"))


class Host(App[None]):
    def __init__(self, n: int):
        super().__init__()
        self.rows = {f"r{i:04d}": (Text(f"r{i:04d}"), Text(str(i * 7)), Text("preemption" if i % 3 == 0 else "",
                                                                                style="red"))
                     for i in range(n)}
        self.asked: list[str] = []
        self.selected: list[str] = []
        self.headers: list[str] = []

    def cells(self, key: str):
        self.asked.append(key)
        return self.rows[key]

    def compose(self) -> ComposeResult:
        yield RowTable(COLS, self.cells, id="t")

    def on_row_table_row_selected(self, ev: RowTable.RowSelected) -> None:
        self.selected.append(ev.key)

    def on_row_table_header_selected(self, ev: RowTable.HeaderSelected) -> None:
        self.headers.append(ev.key)

    async def load(self, pilot) -> RowTable:
        """Every row measured (as the console does when rows arrive), in id order, table focused."""
        t = self.query_one(RowTable)
        for cells in self.rows.values():
            t.fit(cells)
        t.set_rows(sorted(self.rows))
        t.focus()
        await pilot.pause()
        return t


def text_of(strip) -> str:
    return "".join(seg.text for seg in strip)


async def test_only_rows_on_screen_are_painted_and_unchanged_lines_are_reused():
    app = Host(1000)
    async with app.run_test(size=(60, 21)) as pilot:
        t = await app.load(pilot)
        assert t.row_count == 1000
        # 21 lines: the header and 20 rows, so 20 of the 1,000 rows were asked for their cells
        assert len(set(app.asked)) == 20
        header = text_of(t.render_line(0))
        assert header.startswith(" request  tokens  last cause ")
        first = t.render_line(1)
        assert text_of(first).startswith(" r0000    0       preemption ")
        # the cursor row (row 0) carries the cursor style; the value's own colour is kept elsewhere
        cause = [seg for seg in t.render_line(4) if seg.text == "preemption"][0]  # r0003
        assert cause.style.color.name == "red"
        assert t.render_line(1) is first  # same cells, same cursor: the painted line is reused
        # a cell with several styles keeps each one, in the column's width
        app.rows["r0001"] = (Text("r0001"), Text.from_markup("[red]4[/][bold]2[/]"), Text(""))
        segs = [seg for seg in t.render_line(2) if seg.text in ("4", "2")]
        assert [(seg.text, seg.style.color.name, seg.style.bold) for seg in segs] == \
            [("4", "red", None), ("2", "#e0e0e0", True)]
        assert text_of(t.render_line(2)).startswith(" r0001    42      ")
        app.rows["r0000"] = (Text("r0000"), Text("1"), Text(""))
        assert t.render_line(1) is not first and text_of(t.render_line(1)).startswith(" r0000    1 ")


async def test_cursor_keys_scroll_and_select_and_the_cursor_follows_its_row():
    app = Host(200)
    async with app.run_test(size=(60, 11)) as pilot:
        t = await app.load(pilot)
        await pilot.press("down", "down", "enter")
        assert app.selected == ["r0002"]
        await pilot.press("end")
        assert t.cursor_row == 199 and int(t.scroll_y) == 200 - 10  # the last row on the last line
        assert text_of(t.render_line(10)).startswith(" r0199")
        await pilot.press("pageup")
        assert t.cursor_row == 199 - 9
        await pilot.press("home", "enter")
        assert t.cursor_row == 0 and int(t.scroll_y) == 0 and app.selected[-1] == "r0000"
        # reorder: the cursor stays on r0000 wherever it goes
        t.set_rows(sorted(app.rows, reverse=True))
        assert t.cursor_key == "r0000" and t.cursor_row == 199
        # a row that leaves: the cursor stays at its place
        t.set_rows(sorted(app.rows)[1:])
        assert t.cursor_row == 198 and t.cursor_key == "r0199"


async def test_clicks_on_the_header_and_on_a_row():
    app = Host(30)
    async with app.run_test(size=(60, 11)) as pilot:
        t = await app.load(pilot)
        await pilot.click(RowTable, offset=(t.column_x("tokens") + 1, 0))
        await pilot.click(RowTable, offset=(t.column_x("cause") + 3, 0))
        await pilot.click(RowTable, offset=(2, 4))
        await pilot.pause()
        assert app.headers == ["tokens", "cause"]
        assert app.selected == [] and t.cursor_row == 3  # the first click moves the cursor there
        await pilot.click(RowTable, offset=(2, 4))
        await pilot.pause()
        assert app.selected == ["r0003"]  # a click on the cursor's row opens it


async def test_a_table_wider_than_the_terminal_scrolls_sideways():
    app = Host(5)
    app.rows = {k: (Text(k * 6), v[1], v[2]) for k, v in app.rows.items()}  # 30-character ids
    async with app.run_test(size=(30, 8)) as pilot:
        t = await app.load(pilot)
        assert t.virtual_size.width == 32 + 8 + 12  # each column and its padding
        assert text_of(t.render_line(1)) == " " + ("r0000" * 6)[:29]  # cut at the 30-column edge
        await pilot.press("right")  # a column at a time, as far as the last column's right edge
        await pilot.pause()
        assert t.scroll_x == t.max_scroll_x == 52 - 30
        assert text_of(t.render_line(0)).endswith(" tokens  last cause ")
        await pilot.press("left")
        await pilot.pause()
        assert t.scroll_x == 0


async def test_the_cursor_row_never_hides_under_the_horizontal_scrollbar():
    app = Host(200)
    app.rows = {k: (Text(k * 8), v[1], v[2]) for k, v in app.rows.items()}  # wider than the terminal
    async with app.run_test(size=(40, 11)) as pilot:
        t = await app.load(pilot)
        lines = t.scrollable_content_region.height  # 11 less the scrollbar's line
        assert lines == 10
        for keys in (("end",), ("home", *["down"] * 9)):
            await pilot.press(*keys)
            await pilot.pause()
            assert t.cursor_row - int(t.scroll_y) + 1 <= lines - 1, keys  # header + rows above it
        # a label that grows (the sort arrow) widens the scrollable width at once
        before = t.virtual_size.width
        t.set_labels(["request", "tokens", "last cause ▼ and more"])
        assert t.virtual_size.width == before + len(" ▼ and more")
