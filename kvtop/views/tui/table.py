"""A keyed table that paints only the rows on screen.

The Requests screen holds every live request (1,000+ rows) and every value in it changes each tick.
Textual's DataTable re-renders through per-cell strips, measures all rows and rebuilds its row
index on every reorder; with 1,400 rows that cost more than the whole refresh budget. Here the rows
are just keys in display order; the cells of a row are asked for (``cells``) only when the row is
painted, and a painted line is reused while its cells are the same objects.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

Cells = Sequence[Text]
LineShape = tuple[bool, int, int, int]  # on the cursor, odd row, horizontal scroll, width
PAD = 1  # blank cells each side of a value, as DataTable


class _Picked(Message):
    def __init__(self, table: RowTable, key: str):
        super().__init__()
        self.table = table
        self.key = key

    @property
    def control(self) -> RowTable:  # lets @on(..., "#id") match the table
        return self.table


class RowTable(ScrollView, can_focus=True):
    """Header + rows; a row cursor; ``RowSelected`` on enter or a click on the cursor's row,
    ``HeaderSelected`` on a header click. The owner sets the order (``set_rows``) and answers ``cells(key)``."""

    COMPONENT_CLASSES = {"rowtable--header", "rowtable--cursor", "rowtable--even-row"}
    DEFAULT_CSS = """
    RowTable {
        background: $surface;
        color: $foreground;
        &:focus {
            background-tint: $foreground 5%;
            & > .rowtable--cursor {
                background: $block-cursor-background;
                color: $block-cursor-foreground;
                text-style: $block-cursor-text-style;
            }
            & > .rowtable--header {
                background-tint: $foreground 5%;
            }
        }
        &:dark > .rowtable--even-row {
            background: $surface-darken-1 40%;
        }
        & > .rowtable--header {
            text-style: bold;
            background: $panel;
            color: $foreground;
        }
        &:ansi > .rowtable--header {
            background: ansi_bright_blue;
            color: ansi_default;
        }
        & > .rowtable--even-row {
            background: $surface-lighten-1 50%;
        }
        & > .rowtable--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
    }
    """
    BINDINGS = [
        Binding("enter", "select", "Select", show=False),
        Binding("up", "move(-1)", "Up", show=False),
        Binding("down", "move(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "move(-1e9)", "First row", show=False),
        Binding("end", "move(1e9)", "Last row", show=False),
        Binding("left", "column(-1)", "Column left", show=False),
        Binding("right", "column(1)", "Column right", show=False),
    ]

    class RowSelected(_Picked):
        """Enter or a click on a row: ``key`` is the row's."""

    class HeaderSelected(_Picked):
        """A click on the header: ``key`` is the column's."""

    def __init__(self, columns: Sequence[tuple[str, str]], cells: Callable[[str], Cells], **kw: Any):
        super().__init__(**kw)
        self.columns = [k for k, _ in columns]
        self._labels = [Text(label) for _, label in columns]
        self._cells = cells
        self._keys: list[str] = []
        self._index: dict[str, int] = {}
        self._widths = [cell_len(t.plain) for t in self._labels]
        self._shown = list(range(len(self.columns)))  # the columns drawn (a narrow terminal hides some)
        self.cursor_row = 0
        self._lines: dict[str, tuple[tuple[Cells, LineShape], Strip]] = {}  # key -> (what it was made from, line)
        self._style_key: tuple[Style, bool, str] | None = None  # what the styles below were read for
        self._styles: tuple[Style, Style, Style, Style] | None = None  # base, header, even row, cursor

    # -- the owner's side ------------------------------------------------------------------------
    def set_labels(self, labels: Sequence[str]) -> None:
        self._labels = [Text(x) for x in labels]
        if self._fit(self._labels):  # e.g. the sort arrow widened a column
            self._resize()
        self.refresh()

    def set_rows(self, keys: list[str]) -> None:
        """The rows, in display order; the cursor stays on its row when that row is still here."""
        if keys == self._keys:
            self.refresh()
            return
        cur = self.cursor_key
        self._keys = list(keys)
        self._index = {k: i for i, k in enumerate(self._keys)}
        if len(self._lines) > 4 * len(keys) + 256:
            self._lines = {k: v for k, v in self._lines.items() if k in self._index}
        row = self._index.get(cur, self.cursor_row) if cur is not None else self.cursor_row
        self.cursor_row = max(0, min(row, len(keys) - 1))
        self._resize()
        self.refresh()

    def set_hidden(self, keys: Sequence[str]) -> None:
        """Columns not to draw (the owner decides which a narrow terminal can spare)."""
        shown = [i for i, k in enumerate(self.columns) if k not in keys]
        if shown != self._shown:
            self._shown = shown
            self._lines = {}
            self._resize()
            self.refresh()

    def column_widths(self) -> dict[str, int]:
        """Each column's fitted width (its widest value or label), hidden ones included."""
        return dict(zip(self.columns, self._widths, strict=True))

    @property
    def shown_columns(self) -> list[str]:
        return [self.columns[i] for i in self._shown]

    def fit(self, cells: Cells) -> None:
        """Widen the columns to hold these cells (columns only grow, so they do not jitter)."""
        if self._fit(cells):
            self._resize()
            self.refresh()

    # -- queries ---------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self._keys)

    @property
    def cursor_key(self) -> str | None:
        return self._keys[self.cursor_row] if 0 <= self.cursor_row < len(self._keys) else None

    def get_row_index(self, key: str) -> int:
        return self._index[key]

    def get_row_at(self, index: int) -> list[Text]:
        return list(self._cells(self._keys[index]))

    def _edges(self) -> list[int]:
        """Where each column starts, in table cells from the left edge, then the table's width."""
        edges = [0]
        for i in self._shown:
            edges.append(edges[-1] + self._widths[i] + 2 * PAD)
        return edges

    def column_x(self, key: str) -> int:
        return self._edges()[self._shown.index(self.columns.index(key))]

    @property
    def _rows_on_screen(self) -> int:
        # the content region: a horizontal scrollbar takes the bottom line
        return max(1, self.scrollable_content_region.height - 1)

    def visible_keys(self) -> list[str]:
        top = int(self.scroll_y)
        return self._keys[top: top + self._rows_on_screen]

    # -- cursor ----------------------------------------------------------------------------------
    def move_cursor(self, row: int) -> None:
        if not self._keys:
            return
        self.cursor_row = max(0, min(int(row), len(self._keys) - 1))
        rows_on_screen = self._rows_on_screen
        top = int(self.scroll_y)
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False)
        elif self.cursor_row >= top + rows_on_screen:
            self.scroll_to(y=self.cursor_row - rows_on_screen + 1, animate=False)
        self.refresh()

    def action_move(self, delta: float) -> None:
        self.move_cursor(self.cursor_row + int(max(-1e9, min(1e9, delta))))

    def action_page(self, direction: int) -> None:
        self.move_cursor(self.cursor_row + direction * max(1, self._rows_on_screen - 1))

    def action_column(self, direction: int) -> None:
        """Scroll sideways a column at a time (a table wider than the terminal)."""
        edges = self._edges()
        x = int(self.scroll_x)
        if direction > 0:
            nxt = next((e for e in edges if e > x), x)
        else:
            nxt = next((e for e in reversed(edges) if e < x), 0)
        self.scroll_to(x=nxt, animate=False)

    def action_select(self) -> None:
        key = self.cursor_key
        if key is not None:
            self.post_message(self.RowSelected(self, key))

    def on_click(self, event: events.Click) -> None:
        x, y = event.x + int(self.scroll_x), event.y
        if y == 0:
            col = bisect_right(self._edges(), x) - 1
            if 0 <= col < len(self._shown):
                self.post_message(self.HeaderSelected(self, self.columns[self._shown[col]]))
            return
        row = int(self.scroll_y) + y - 1
        if 0 <= row < len(self._keys):
            # the first click puts the cursor on the row, a click on the cursor's row opens it
            if row == self.cursor_row:
                self.action_select()
            else:
                self.move_cursor(row)

    # -- painting --------------------------------------------------------------------------------
    def _fit(self, cells: Cells) -> bool:
        grew = False
        for i, t in enumerate(cells[: len(self._widths)]):
            w = cell_len(t.plain)
            if w > self._widths[i]:
                self._widths[i] = w
                grew = True
        if grew:
            self._lines = {}
        return grew

    def _resize(self) -> None:
        self.virtual_size = Size(self._edges()[-1], len(self._keys) + 1)

    def render_lines(self, crop: Region) -> list[Strip]:
        self._load_styles()  # once per paint, not per line: rich_style walks the ancestors each time
        return super().render_lines(crop)

    def _load_styles(self) -> tuple[Style, Style, Style, Style]:
        base = self.rich_style
        key = (base, self.has_focus, self.app.theme)
        if self._styles is None or self._style_key != key:
            get = self.get_component_rich_style
            self._style_key = key
            self._styles = (base, get("rowtable--header"), get("rowtable--even-row"), get("rowtable--cursor"))
            self._lines = {}
        return self._styles

    def _row_styles(self) -> tuple[Style, Style, Style, Style]:
        # a line asked for outside a paint (tests) reads them now
        return self._styles if self._styles is not None else self._load_styles()

    def _line(self, cells: Cells, row_style: Style, post: Style | None) -> list[Segment]:
        segs: list[Segment] = []
        pad = " " * PAD
        for i in self._shown:
            w = self._widths[i]
            t = cells[i] if i < len(cells) else Text()
            if t.spans:
                parts = [(seg.text, seg.style or Style.null()) for seg in t.render(self.app.console)]
            else:
                parts = [(t.plain, t.style if isinstance(t.style, Style) else Style.parse(t.style or "none"))]
            used = 0
            segs.append(Segment(pad, row_style))
            for text, style in parts:
                if used + cell_len(text) > w:
                    text = text[: max(0, w - used)]
                st = row_style + style
                segs.append(Segment(text, st + post if post is not None else st))
                used += cell_len(text)
            segs.append(Segment(" " * (w - used) + pad, row_style))
        return segs

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        base, header, even, cursor = self._row_styles()
        sx = int(self.scroll_x)
        if y == 0:
            segs = self._line(self._labels, base + header, None)
            return Strip(segs).crop_extend(sx, sx + width, base + header)
        i = int(self.scroll_y) + y - 1
        if i >= len(self._keys):
            return Strip.blank(width, base)
        key = self._keys[i]
        cells = self._cells(key)
        on_cursor = i == self.cursor_row
        made_of = (on_cursor, i % 2, sx, width)
        hit = self._lines.get(key)
        # the owner hands back the same cells object while a row is unchanged
        if hit is not None and hit[0][0] is cells and hit[0][1] == made_of:
            return hit[1]
        row_style = base + even if i % 2 == 0 else base
        if on_cursor:
            row_style += cursor
        strip = Strip(self._line(cells, row_style, cursor if on_cursor else None)).crop_extend(sx, sx + width,
                                                                                              row_style)
        self._lines[key] = ((cells, made_of), strip)
        return strip

    def on_resize(self) -> None:
        self._lines = {}

