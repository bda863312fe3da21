"""The console: renders ``Core.snapshot()`` on a timer; the feed (live, replay, demo) runs as a
worker that pushes records into the core, so polling never blocks the UI.

Screens (keys 1-5): Overview, Requests, Request detail, Advisor, Events. ``p`` pauses rendering
(and a replay feed), ``space`` refreshes now, ``?`` shows help generated from the bindings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import re
import signal
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Grid, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.markup import escape
from textual.screen import ModalScreen, Screen
from textual.theme import BUILTIN_THEMES, Theme
from textual.widgets import ContentSwitcher, DataTable, Footer, Input, Static, Tab, Tabs

from kvtop import units
from kvtop.pipeline import Feed, ReplayControls, StaticFeed
from kvtop.snapshot import Snapshot, SnapshotSource
from kvtop.views.tui import plot, render
from kvtop.views.tui.charts import Chart, chart_specs
from kvtop.views.tui.table import RowTable

if TYPE_CHECKING:  # the console reads a core only through SnapshotSource; a StaticFeed wants the type
    from kvtop.core import Core

WINDOWS = (60.0, 300.0, 900.0, 3600.0)
VIEWS: tuple[tuple[str, str], ...] = (
    ("overview", "Overview"), ("requests", "Requests"), ("detail", "Request"),
    ("advisor", "Advisor"), ("events", "Events"),
)

KVTOP_THEME = Theme(
    name="kvtop", primary="#5fafff", secondary="#af87ff", accent="#ffaf5f", warning="#ffaf00",
    error="#ff5f5f", success="#5fd75f", foreground="#d0d0d0", background="#121212", surface="#1c1c1c",
    panel="#262626", dark=True,
)
# Low colour: the terminal's own 16-colour palette (reads well over SSH and in tmux).
KVTOP_LOW_THEME = dataclasses.replace(BUILTIN_THEMES["ansi-dark"], name="kvtop-low")
THEMES = ("kvtop", "kvtop-low")


def known_themes() -> list[str]:
    """kvtop's own themes first, then every theme Textual ships."""
    return list(THEMES) + sorted(BUILTIN_THEMES)
_CONTEXT = {"window": "Overview charts", "cycle_sort": "Requests", "reverse_sort": "Requests", "filter": "Requests, Events",
            "step": "replay", "seek": "replay", "back": "closes filter / detail"}
_LONG_HELP = {"window": "History window: 1m → 5m → 15m → 1h", "quit": "Quit (also F10, Ctrl-C)",
              "help": "Help (also F1)", "toggle_pause": "Pause: freeze the screen (and a replay); data keeps coming",
              "refresh_now": "Refresh: poll every source and redraw now"}
_THEME_VAR = re.compile(r"\$([a-z][a-z0-9-]*)")


class Panel(Static):
    """A Static whose markup depends on its own width; re-rendered on resize."""

    def __init__(self, builder: Any = None, **kw: Any):
        super().__init__("", **kw)
        self.builder = builder
        self._shown: str | None = None

    def show(self, builder: Any) -> None:
        self.builder = builder
        self._redraw()

    def _redraw(self) -> None:
        if self.builder is not None:
            width = self.size.width or self.app.size.width
            markup = self.builder(width)
            if markup != self._shown:  # unchanged panels cost nothing (no re-parse, no repaint)
                # the same number of lines: no layout pass (the Overview holds dozens of widgets)
                relayout = self._shown is None or markup.count("\n") != self._shown.count("\n")
                self._shown = markup
                self.update(markup, layout=relayout)

    def on_resize(self) -> None:
        self._redraw()


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close", key_display="esc")]

    def __init__(self, rows: list[tuple[str, str]]):
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        kw = max((len(k) for k, _ in self.rows), default=4)
        body = "\n".join(f"  [b]{k.ljust(kw).replace('[', chr(92) + '[')}[/b]  {d}" for k, d in self.rows)
        extra = ("\n\n  [$text-muted]mouse: click a tab to switch screens, a column header to sort,"
                 " a row twice to open it; hover a chart for the time and values there[/]")
        with Vertical(id="help-box"):
            yield Static("[b]kvtop keys[/b]  (esc closes)", id="help-title")
            yield Static(body + extra, id="help-body")


class SeekScreen(ModalScreen[float | None]):
    BINDINGS = [Binding("escape", "dismiss_none", "Cancel")]

    def __init__(self, duration: float | None):
        super().__init__()
        self.duration = duration

    def compose(self) -> ComposeResult:
        with Vertical(id="seek-box"):
            total = f" of {units.duration_short(self.duration)}" if self.duration else ""
            yield Static(f"seek to (seconds from the start{total}):")
            yield Input(placeholder="e.g. 120", id="seek-input")

    def action_dismiss_none(self) -> None:
        self.dismiss(None)

    @on(Input.Submitted)
    def _submitted(self, ev: Input.Submitted) -> None:
        try:
            self.dismiss(max(0.0, float(ev.value)))
        except ValueError:
            self.notify(f"not a number of seconds: {ev.value!r}", severity="error")


class MainScreen(Screen[None]):
    # Panels collapse below 100 columns (one line per GPU, compact engines); from 220 columns
    # GPUs sit two to a row.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide"), (220, "-huge")]

    def compose(self) -> ComposeResult:
        yield Static("", id="topbar")
        yield Static("", id="banner")
        yield Tabs(*[Tab(f"{i + 1} {label}", id=f"tab-{key}") for i, (key, label) in enumerate(VIEWS)], id="tabs")
        with ContentSwitcher(initial="overview", id="switcher"):
            with Vertical(id="overview"):
                with VerticalScroll(id="ov-top"):
                    yield Static("[b]GPUs[/b]", classes="section")
                    yield Vertical(id="gpus")
                    yield Panel(id="host")
                    yield Static("[b]Engines[/b]", classes="section")
                    yield Vertical(id="engines")
                    yield Panel(id="summary")
                yield Static("", id="charts-head", classes="section")
                with VerticalScroll(id="charts"):
                    yield Grid(id="chart-grid")
            with Vertical(id="requests"):
                yield Static("", id="req-status")
                yield RowTable(render.COLUMNS, self.app.request_cells, id="req-table")  # type: ignore[attr-defined]
            with VerticalScroll(id="detail"):
                yield Panel(id="detail-body")
            with VerticalScroll(id="advisor"):
                yield Panel(id="advisor-body")
            with Vertical(id="events"):
                ev: DataTable[Any] = DataTable(id="ev-table", cursor_type="row", zebra_stripes=True)
                ev.add_column("t", key="t")
                ev.add_column("severity", key="severity")
                ev.add_column("kind", key="kind")
                ev.add_column("message", key="message")
                yield ev
        yield Input(placeholder="filter (words match id, state, class, cause); enter keeps, esc clears",
                    id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self.app.main_ready()  # type: ignore[attr-defined]


class KvtopApp(App[int]):
    CSS_PATH = "kvtop.tcss"
    TITLE = "kvtop"
    ENABLE_COMMAND_PALETTE = True

    BINDINGS = [
        # htop / btop / nvitop users reach for Ctrl-C and F10 to leave, F1 for help
        Binding("q,f10", "quit", "Quit", key_display="q"),
        # priority: the screen's own ctrl+c copies text; in a monitor it means quit (htop, nvitop)
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        Binding("question_mark,f1", "help", "Help", key_display="?"),
        Binding("p", "toggle_pause", "Pause"),
        Binding("space", "refresh_now", "Refresh"),
        # btop's convention: + lengthens the update interval, - shortens it
        Binding("plus,equals_sign", "interval(2)", "Poll less often (interval ×2)", key_display="+", show=False),
        Binding("minus", "interval(0.5)", "Poll more often (interval ÷2)", key_display="-", show=False),
        Binding("w", "window", "Window"),
        Binding("j", "nav(1)", "Down (also ↓)", show=False),
        Binding("k", "nav(-1)", "Up (also ↑)", show=False),
        Binding("1", "view('overview')", "Overview screen", show=False),
        Binding("2", "view('requests')", "Requests screen", show=False),
        Binding("3", "view('detail')", "Request detail screen", show=False),
        Binding("4", "view('advisor')", "Advisor screen", show=False),
        Binding("5", "view('events')", "Events screen", show=False),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("s", "cycle_sort", "Sort"),
        Binding("r", "reverse_sort", "Reverse", show=False),
        Binding("escape", "back", "Back", show=False),
        Binding("left_square_bracket", "step(-10)", "Back 10 s", key_display="["),
        Binding("right_square_bracket", "step(10)", "Forward 10 s", key_display="]"),
        Binding("g", "seek", "Seek to…"),
        # no description: kept out of the help screen, which every console snapshot shows
        Binding("f", "fleet", "", show=False),
    ]

    def __init__(self, core: Core, feed: Feed | None = None, title: str = "kvtop", theme: str | None = None,
                 interval: float = 1.0, taken_at: str | None = None, handle_signals: bool = False):
        super().__init__()
        # SIGTERM/SIGHUP end the console as q does (terminal restored, feed stopped); only for a
        # real run: tests share the process's signal handlers.
        self.handle_signals = handle_signals
        self._refresh_timer: Any = None
        self.core: SnapshotSource = core
        # a console over a core that something else fills still has a feed: one with nothing to run
        self.feed: Feed = feed if feed is not None else StaticFeed(core)
        self.replay: ReplayControls | None = self.feed.controls()
        self.title = title
        self.interval = interval
        # Fixed wall-clock text for screenshots and snapshot tests.
        self.taken_at = taken_at
        self.register_theme(KVTOP_THEME)
        self.register_theme(KVTOP_LOW_THEME)
        self._theme_name = theme or "kvtop"
        self.paused = False
        self.snap: Snapshot | None = None
        self.view_name = "overview"
        self.detail_id: str | None = None
        self.filter_text = ""
        self.sort_col = "max_gap"
        self.sort_reverse = True
        self.ticks = 0
        # request id -> (the RequestView, its cell markup, its cells): a row keeps its cells object
        # while its markup is unchanged, so the table reuses the painted line
        self._req_cache: dict[str, tuple[Any, tuple[str, ...], tuple[Text, ...]]] = {}
        self._cell_cache: dict[str, Text] = {}
        self._req_rows: dict[str, Any] = {}
        self._req_target: float | None = None
        self._events_key: tuple[Any, ...] | None = None
        self._banner_text: str | None = None
        self._stop = asyncio.Event()
        self._last_action: str | None = None
        self._gpu_panels: list[Panel] = []
        self._charts: list[Chart] = []
        self._chart_fit: tuple[int, int] | None = None
        self.window_s = WINDOWS[1]
        self._engine_panels: list[Panel] = []
        self.main = MainScreen()
        self._main_ready = False

    # -- lifecycle ------------------------------------------------------------------------------
    def get_default_screen(self) -> Screen[Any]:
        return self.main

    def on_mount(self) -> None:
        self.theme = self._theme_name
        self.theme_changed_signal.subscribe(self, self._on_theme_changed)
        self._update_headers()
        self.run_worker(self._run_feed(), name="feed", group="feed", exclusive=True)
        self._refresh_timer = self.set_interval(self.interval, self.tick, name="refresh")
        if self.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGHUP):
                loop.add_signal_handler(sig, self.exit)

    def main_ready(self) -> None:
        self._main_ready = True
        self.tick(force=True)
        from kvtop.sources.promfleet import PromFeed

        if isinstance(self.feed, PromFeed):
            self.action_fleet()  # pointed at Prometheus: the fleet is the first thing to see
        # Modules, widgets and styles live as long as the console: out of the collector's reach,
        # a full collection (every few seconds at 1,000+ requests) scans only the data. Fewer,
        # larger young collections: each refresh allocates tens of thousands of short-lived
        # objects that reference counting frees anyway (bench/tui_refresh.py: fewer 60 ms paints).
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)

    async def _run_feed(self) -> None:
        try:
            await self.feed.run(stop=self._stop)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a feed failing must not take the console down
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            self.core.event(self.core.now, "error", "source_error", f"feed stopped: {msg}")
            self.notify(f"data feed stopped: {msg}", severity="error", timeout=10)

    async def on_unmount(self) -> None:
        self._stop.set()
        if self.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    # -- rendering ------------------------------------------------------------------------------
    def take_snapshot(self) -> Snapshot:
        feed_core = self.feed.core
        if feed_core is not self.core:
            # a replay seeking backwards re-feeds the trace into a fresh core
            feed_core.paused = self.paused
            self.core = feed_core
            self._reset_tables()
        # a replay's clock is the trace position, not the last record's time; the charts may show
        # up to the longest window (w changes it without a new snapshot); the detail screen shows a
        # request's timeline
        s = self.core.snapshot(now=self.replay.t if self.replay is not None else None, history_s=WINDOWS[-1],
                               timeline=self.view_name == "detail", request_id=self.detail_id)
        if self.taken_at is not None:
            s = dataclasses.replace(s, taken_at=self.taken_at)
        return s

    def tick(self, force: bool = False) -> None:
        if self.paused and not force:
            return
        self.snap = self.take_snapshot()
        self.ticks += 1
        try:
            self.render_current()
        except NoMatches:  # the app is shutting down and its widgets are gone
            pass

    def render_current(self) -> None:
        s = self.snap
        if s is None or not self._main_ready:
            return
        with self.batch_update():
            self._render_topbar(s)
            view = self.view_name
            if view == "overview":
                self._render_overview(s)
            elif view == "requests":
                self._render_requests(s)
            elif view == "detail":
                self._render_detail(s)
            elif view == "advisor":
                self.query_one("#advisor-body", Panel).show(lambda w: render.advisor(s, w))
            elif view == "events":
                self._render_events(s)

    def _render_topbar(self, s: Snapshot) -> None:
        clock = s.taken_at[11:19] + "Z" if len(s.taken_at) >= 19 else s.taken_at
        state = "[$warning b]⏸ PAUSED[/]" if self.paused else "[$success]● live[/]"
        # "kvtop demo: preemption-storm" already names its source
        src = "" if s.source_label.split(" ")[-1] in self.title else escape(s.source_label)
        pos = ""
        replay = self.replay
        if replay is not None:
            t, d = replay.t, replay.duration
            pos = f"  replay {units.duration_short(t)}" + (f"/{units.duration_short(d)}" if d else "")
            if d:
                n = 20
                k = min(n, round(t / d * n)) if d > 0 else 0
                pos += f" [$primary]{'━' * k}[/][$text-muted]{'─' * (n - k)}[/]"
        n_run = sum(1 for r in s.requests if r.state in ("running", "preempted", "waiting"))
        self.main.query_one("#topbar", Static).update(
            f"[b]{escape(self.title)}[/b] {render.muted(src)}  {state}{pos}  "
            f"t={units.duration_short(s.t)}  {clock}  {render.muted(f'{len(s.engines)} engine(s) · {len(s.gpus)} GPU(s) · {n_run} live requests')}",
            layout=False,  # one line, always: a new text needs no layout pass
        )
        banner = self.main.query_one("#banner", Static)
        msgs = []
        notice = self.feed.notice
        if notice:
            msgs.append(escape(notice))
        if s.gpu_status != "ok":
            msgs.append(f"GPU: {escape(s.gpu_status)}")
        cap = s.capture
        if cap is not None:
            if cap.get("status") != "ok":
                msgs.append(f"capture: {escape(str(cap.get('status')))}")
            elif cap.get("kernel_drops") or cap.get("holes"):
                msgs.append(f"capture lost data: {cap.get('kernel_drops', 0)} kernel drop(s), "
                            f"{cap.get('holes', 0)} hole(s); those streams are marked incomplete")
        down = [e for e in s.engines if not e.up]
        if down:
            msgs.append(f"{len(down)} engine(s) down: " + ", ".join(escape(e.url) for e in down[:3]))
        text = "  ·  ".join(msgs)
        if text != self._banner_text:  # the banner's height follows its text: relayout only on change
            self._banner_text = text
            banner.update(text)
            banner.display = bool(msgs)

    @staticmethod
    def _panels(box: Vertical, have: list[Panel], n: int, cls: str) -> list[Panel]:
        """Grow or shrink ``have`` to ``n`` panels (at least one, for the "no data" line)."""
        n = max(1, n)
        if len(have) < n:
            new = [Panel(classes=cls) for _ in range(n - len(have))]
            box.mount_all(new)
            have = have + new
        elif len(have) > n:
            for p in have[n:]:
                p.remove()
            have = have[:n]
        return have

    def _render_overview(self, s: Snapshot) -> None:
        scr = self.main
        self._gpu_panels = self._panels(scr.query_one("#gpus", Vertical), self._gpu_panels, len(s.gpus), "gpu")
        if not s.gpus:
            why = "no GPU data yet" if s.gpu_status == "ok" else f"GPU: {s.gpu_status}"
            self._gpu_panels[0].show(lambda w: render.muted(escape(why)))
        for p, g in zip(self._gpu_panels, s.gpus, strict=False):
            p.show(lambda w, g=g: render.gpu_line(g, w))
        scr.query_one("#host", Panel).show(lambda w: render.host_line(s.host, w, s.host_status))
        self._engine_panels = self._panels(scr.query_one("#engines", Vertical), self._engine_panels,
                                           len(s.engines), "engine")
        if not s.engines:
            self._engine_panels[0].show(lambda w: render.muted("no engine data yet"))
        for p, e in zip(self._engine_panels, s.engines, strict=False):
            p.set_class(not e.up, "-down")
            p.show(lambda w, e=e: render.engine_lines(e, s.itl_target_s, w, self.interval))
        done, over = s.finished_total, s.gaps_over_target_total
        retired = render.muted(f"  · {done} ended request(s) off screen, {over} gap(s) over target") if done else ""
        scr.query_one("#summary", Panel).show(lambda w: render.summary_line(s) + retired)
        self._render_charts(s)

    def _fit_charts(self) -> None:
        """Columns from the width, row height from the height left under the panels."""
        box = self.main.query_one("#charts", VerticalScroll)
        grid = self.main.query_one("#chart-grid", Grid)
        width = box.size.width or self.size.width
        cols = 1 if width < 60 else 2 if width < 140 else 3
        rows = max(1, -(-len(self._charts) // cols))
        h = max(6, (box.size.height or 12) // rows)
        if self._chart_fit != (cols, h):
            self._chart_fit = (cols, h)
            grid.styles.grid_size_columns = cols
            grid.styles.grid_rows = f"{h}"
            # the panels above may have changed height too: fit again once laid out
            self.call_after_refresh(self._fit_charts)

    def _render_charts(self, s: Snapshot) -> None:
        """History charts under the panels: as many columns as the width allows, their height
        shared out of what the terminal has left (a taller terminal, taller charts)."""
        scr = self.main
        specs = chart_specs(s)
        grid = scr.query_one("#chart-grid", Grid)
        have = self._charts
        if len(have) < len(specs):
            new = [Chart() for _ in range(len(specs) - len(have))]
            grid.mount_all(new)
            have = have + new
        elif len(have) > len(specs):
            for c in have[len(specs):]:
                c.remove()
            have = have[: len(specs)]
        self._charts = have
        self._fit_charts()
        replay = self.replay is not None
        t1 = s.t
        t0 = t1 - self.window_s
        now_label = f"t={units.duration_short(t1)}" if replay else "now"
        for c, spec in zip(have, specs, strict=False):
            c.show(spec, t0, t1, now_label)
        head = f"last {plot.window_label(self.window_s)} · w: window · hover a chart for values · spikes by cause:"
        scr.query_one("#charts-head", Static).update(
            f"[b]History[/b] {render.muted(head)} "
            "[$error]▲ preemption[/] [$warning]▲ prefill[/] [$secondary]▲ slow decode[/]",
            layout=False,
        )

    def _render_requests(self, s: Snapshot) -> None:
        """Hand the table the rows in sort order; it asks for the cells of the rows it paints."""
        table = self.main.query_one("#req-table", RowTable)
        self._req_target = s.itl_target_s
        rows = [r for r in s.requests if render.matches(r, self.filter_text)]
        want = {r.id: r for r in rows}
        self._req_rows = want
        cache = self._req_cache
        for k in [k for k in cache if k not in want]:
            del cache[k]
        for r in rows:
            if r.id not in cache:
                table.fit(self.request_cells(r.id))  # columns fit every row, as it arrives
        # the id breaks ties so equal rows do not swap between ticks (two stable sorts: no key tuples)
        rows.sort(key=render.SORT_KEYS["id"], reverse=self.sort_reverse)
        rows.sort(key=render.SORT_KEYS[self.sort_col], reverse=self.sort_reverse)
        table.set_rows([r.id for r in rows])
        for k in table.visible_keys():
            table.fit(self.request_cells(k))
        self._update_headers()
        shown, total = len(rows), len(s.requests)
        flt = f"  filter: [b]{escape(self.filter_text)}[/b]" if self.filter_text else ""
        label = dict(render.COLUMNS)[self.sort_col]
        self.main.query_one("#req-status", Static).update(
            f"{shown} of {total} requests{flt}  {render.muted('sort: ' + label + (' ▼' if self.sort_reverse else ' ▲'))}"
            f"  {render.muted('enter: detail · s: sort · r: reverse · /: filter')}",
            layout=False,
        )

    def request_cells(self, rid: str) -> tuple[Text, ...]:
        """The cells of one request row, built when the table paints the row."""
        r = self._req_rows.get(rid)
        hit = self._req_cache.get(rid)
        if hit is not None and (r is None or hit[0] is r):
            return hit[2]
        if r is None:
            return ()
        markup = render.request_cells(r, self._req_target)
        if hit is not None and hit[1] == markup:
            self._req_cache[rid] = (r, markup, hit[2])
            return hit[2]
        cells = tuple(self.rich_cell(c) for c in markup)
        self._req_cache[rid] = (r, markup, cells)
        return cells

    def _update_headers(self) -> None:
        try:
            table = self.main.query_one("#req-table", RowTable)
        except NoMatches:
            return
        table.set_labels([label + ((" ▼" if self.sort_reverse else " ▲") if key == self.sort_col else "")
                          for key, label in render.COLUMNS])

    def _render_detail(self, s: Snapshot) -> None:
        tl = s.detail  # the selected request's, else the worst-gap one's (the core chose)
        rid = self.detail_id if self.detail_id is not None else (tl.id if tl is not None else None)
        rv = next((r for r in s.requests if r.id == rid), None) if rid else None
        spikes = s.analysis.spikes if s.analysis is not None else ()
        self.main.query_one("#detail-body", Panel).show(
            lambda w: render.detail(rv, tl, spikes, s.itl_target_s, s.t, w)
        )

    def _render_events(self, s: Snapshot) -> None:
        table = self.main.query_one("#ev-table", DataTable)
        evs = [e for e in s.events if not self.filter_text or self.filter_text.lower() in
               f"{e.kind} {e.severity} {e.message}".lower()]
        key = (len(s.events), s.events[-1] if s.events else None, self.filter_text)
        if key == self._events_key:
            return
        self._events_key = key
        # events change rarely and are bounded (500); newest first so 80x24 shows what just happened
        table.clear()
        for e in reversed(evs):
            sev = {"warning": "warn", "error": "crit"}.get(e.severity, "ok")
            table.add_row(*[self.rich_cell(c) for c in (f"{e.t:8.1f}s", render.sev(e.severity, sev),
                                                        escape(e.kind), escape(e.message))])

    def rich_cell(self, markup: str) -> Text:
        """DataTable cells are Rich text: resolve theme variables ($warning ...) to the current
        theme's colours so severity still follows the theme."""
        t = self._cell_cache.get(markup)
        if t is None:
            if len(self._cell_cache) > 20000:
                self._cell_cache.clear()
            t = Text.from_markup(_THEME_VAR.sub(self._theme_colour, markup), end="")
            if len(t.spans) == 1 and t.spans[0].start == 0 and t.spans[0].end == len(t.plain):
                # a whole-cell colour as the base style renders far cheaper than a span
                t = Text(t.plain, style=t.spans[0].style, end="")
            self._cell_cache[markup] = t
        return t

    def _theme_colour(self, m: re.Match[str]) -> str:
        v = self.theme_variables.get(m.group(1), "default")
        v = v.removeprefix("ansi_")
        return "dim" if m.group(1) == "text-muted" else v

    def _on_theme_changed(self, _theme: Theme) -> None:
        self._cell_cache = {}
        self._reset_tables()  # rebuilt cells take the new theme's colours
        self.render_current()

    def _reset_tables(self) -> None:
        # new cell objects: the requests table repaints every row from them on the next tick
        # (and keeps its cursor on the same request); the events table is rebuilt
        self._req_cache = {}
        self._events_key = None

    # -- actions --------------------------------------------------------------------------------
    def action_view(self, name: str) -> None:
        self.view_name = name
        scr = self.main
        if not self._main_ready:
            return
        scr.query_one("#switcher", ContentSwitcher).current = name
        tabs = scr.query_one("#tabs", Tabs)
        if tabs.active != f"tab-{name}":
            tabs.active = f"tab-{name}"
        if name == "requests":
            scr.query_one("#req-table", RowTable).focus()
        elif name == "events":
            scr.query_one("#ev-table", DataTable).focus()
        elif name == "detail" and self.snap is not None:
            self.snap = self.take_snapshot()  # with the chosen request's timeline
        self.render_current()
        self.refresh_bindings()

    @on(Tabs.TabActivated)
    def _tab(self, ev: Tabs.TabActivated) -> None:
        name = (ev.tab.id or "tab-overview").removeprefix("tab-")
        if name != self.view_name:
            self.action_view(name)

    @on(RowTable.RowSelected, "#req-table")
    def _open_detail(self, ev: RowTable.RowSelected) -> None:
        self.detail_id = ev.key
        self.action_view("detail")

    @on(RowTable.HeaderSelected, "#req-table")
    def _header_sort(self, ev: RowTable.HeaderSelected) -> None:
        col = ev.key
        if col == self.sort_col:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_col, self.sort_reverse = col, col in render.NUMERIC
        self.render_current()

    def action_cycle_sort(self) -> None:
        keys = [k for k, _ in render.COLUMNS]
        self.sort_col = keys[(keys.index(self.sort_col) + 1) % len(keys)]
        self.sort_reverse = self.sort_col in render.NUMERIC
        self.render_current()

    def action_reverse_sort(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self.render_current()

    def action_filter(self) -> None:
        box = self.main.query_one("#filter", Input)
        box.display = True
        box.value = self.filter_text
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, ev: Input.Changed) -> None:
        self.filter_text = ev.value.strip()
        self.render_current()

    @on(Input.Submitted, "#filter")
    def _filter_done(self, ev: Input.Submitted) -> None:
        ev.input.display = False
        self._focus_view()

    def _focus_view(self) -> None:
        if self.view_name in ("requests", "events"):
            self.main.query_one("#req-table" if self.view_name == "requests" else "#ev-table").focus()
        else:
            self.screen.set_focus(None)

    def action_back(self) -> None:  # type: ignore[override]
        box = self.main.query_one("#filter", Input)
        if box.display:
            box.display = False
            box.value = ""
            self.filter_text = ""
            self._focus_view()
            self.render_current()
        elif self.view_name == "detail":
            self.action_view("requests")
        elif self.filter_text:
            self.filter_text = ""
            self.render_current()

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.core.paused = self.paused
        if self.replay is not None:
            if self.paused:
                self.replay.pause()
            else:
                self.replay.resume()
        # re-render once so the header says PAUSED; the data stays frozen until resumed
        self.tick(force=True)

    async def action_refresh_now(self) -> None:
        self.feed.refresh_now()
        self.tick(force=True)

    def action_interval(self, factor: float) -> None:
        """Change the poll and refresh interval (the feed's sources follow on their next wait)."""
        new = min(3600.0, max(0.05, round(self.interval * factor, 3)))
        if new == self.interval:
            return
        self.interval = new
        self.feed.interval_s = new
        if self._refresh_timer is not None:
            self._refresh_timer.stop()
        self._refresh_timer = self.set_interval(new, self.tick, name="refresh")
        self.notify(f"poll interval {units.duration_short(new)}", timeout=2)
        self.tick(force=True)

    def action_window(self) -> None:
        """Cycle the history charts' time window."""
        i = WINDOWS.index(self.window_s) if self.window_s in WINDOWS else 0
        self.window_s = WINDOWS[(i + 1) % len(WINDOWS)]
        self.notify(f"history window {plot.window_label(self.window_s)}", timeout=2)
        self.render_current()

    def action_nav(self, delta: int) -> None:
        """j / k: the focused table's cursor, else scroll the screen."""
        w = self.focused
        if isinstance(w, RowTable):
            w.action_move(delta)
        elif isinstance(w, DataTable):
            (w.action_cursor_down if delta > 0 else w.action_cursor_up)()
        else:
            box = self.main.query(f"#{self.view_name}").first()
            if isinstance(box, VerticalScroll):
                (box.scroll_down if delta > 0 else box.scroll_up)(animate=False)

    def action_step(self, seconds: float) -> None:
        replay = self.replay
        if replay is None:
            return
        if seconds < 0:
            # stepping only moves forward; going back is a seek (a replay re-feeds from the start)
            replay.seek(max(0.0, replay.t + seconds))
        else:
            replay.step(seconds)
        self.tick(force=True)

    def action_seek(self) -> None:
        replay = self.replay
        if replay is None:
            return

        def done(t: float | None) -> None:
            if t is not None:
                replay.seek(t)
                self.tick(force=True)

        self.push_screen(SeekScreen(replay.duration), done)

    def action_fleet(self) -> None:
        from kvtop.views.tui.fleet import open_fleet

        open_fleet(self)

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.help_rows()))

    def help_rows(self) -> list[tuple[str, str]]:
        """One row per console binding, in binding order; keys that only act on some screens or
        only in replay say so."""
        rows: list[tuple[str, str]] = []
        seen: set[str] = set()
        for b in self.BINDINGS:
            assert isinstance(b, Binding)
            if not b.description or b.action in seen:
                continue
            seen.add(b.action)
            where = _CONTEXT.get(b.action.split("(")[0], "")
            desc = _LONG_HELP.get(b.action, b.description)
            rows.append((self.get_key_display(b), desc + (f"  [$text-muted]({where})[/]" if where else "")))
        rows.append((self.get_key_display(Binding(self.COMMAND_PALETTE_BINDING, "")),
                     "Command palette (every action, searchable)"))
        at = next((i for i, (_k, d) in enumerate(rows) if d.startswith("Filter")), len(rows))
        rows[at:at] = [("enter", "Open the request under the cursor  [$text-muted](Requests)[/]"),
                       ("↑ ↓ PgUp PgDn", "Move the cursor; ← → scroll a column  [$text-muted](Requests)[/]")]
        return rows

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("cycle_sort", "reverse_sort"):
            return self.view_name == "requests"
        if action == "filter":
            return self.view_name in ("requests", "events")
        if action in ("step", "seek"):
            return self.replay is not None
        return True

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for i, (key, label) in enumerate(VIEWS):
            yield SystemCommand(f"Screen: {label}", f"show the {label} screen (key {i + 1})",
                                lambda key=key: self.action_view(key))
        yield SystemCommand("Pause / resume", "stop or restart re-rendering (key p)", self.action_toggle_pause)
        yield SystemCommand("Refresh now", "take a snapshot now (key space)", self.action_refresh_now)
        yield SystemCommand("Help", "list the keys (key ?)", self.action_help)
        if self.view_name == "requests":
            yield SystemCommand("Sort: next column", "cycle the requests sort column (key s)", self.action_cycle_sort)
            yield SystemCommand("Filter", "filter the list (key /)", self.action_filter)


def run_console(core: Core, feed: Feed | None = None, title: str = "kvtop", theme: str | None = None,
                interval: float = 1.0) -> int:
    """Run the console until the user quits; returns the process exit code."""
    app = KvtopApp(core, feed=feed, title=title, theme=theme, interval=interval, handle_signals=True)
    rc = app.run()
    return int(rc or 0)
