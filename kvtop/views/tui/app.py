"""The console: takes a snapshot of the core on a timer and hands it to the view on screen; the
feed (live, replay, demo) runs as a worker that pushes records into the core, so polling never
blocks the UI.

Screens (keys 1-5), one widget each with ``update(snapshot)``: Overview (overview.py), Requests
(requests.py), Request detail (detail.py), Advisor (advisor.py), Events (events.py); the fleet
(fleet.py, key ``f``) is a screen of its own over a Prometheus feed. The app keeps what is the
console's: the top bar, the filter box, pause, the poll interval, the replay keys. ``p`` pauses
rendering (and a replay feed), ``space`` refreshes now, ``?`` shows help generated from the bindings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.markup import escape
from textual.screen import ModalScreen, Screen
from textual.theme import BUILTIN_THEMES, Theme
from textual.widget import Widget
from textual.widgets import ContentSwitcher, DataTable, Footer, Input, Static, Tab, Tabs

from kvtop import units
from kvtop.feeds.static import StaticFeed
from kvtop.snapshot import RequestTimeline, Snapshot, SnapshotSource
from kvtop.views.tui import plot, render
from kvtop.views.tui.advisor import AdvisorView
from kvtop.views.tui.charts import Chart
from kvtop.views.tui.detail import DetailView
from kvtop.views.tui.events import EventsView
from kvtop.views.tui.fleet import FleetScreen, open_fleet
from kvtop.views.tui.overview import WINDOWS, OverviewView
from kvtop.views.tui.requests import RequestsView
from kvtop.views.tui.table import RowTable
from kvtop.views.tui.widgets import Cells

if TYPE_CHECKING:  # protocols only: at run time kvtop.pipeline would load the core the views never touch
    from kvtop.pipeline import Feed, ReplayControls

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


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close", key_display="esc"),
                Binding("j", "line(1)", "Down", show=False), Binding("k", "line(-1)", "Up", show=False)]

    def __init__(self, rows: list[tuple[str, str]]):
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        kw = max((len(k) for k, _ in self.rows), default=4)
        body = "\n".join(f"  [b]{k.ljust(kw).replace('[', chr(92) + '[')}[/b]  {d}" for k, d in self.rows)
        extra = ("\n\n  [$text-muted]mouse: click a tab to switch screens, a column header to sort,"
                 " a row twice to open it; hover a chart for the time and values there[/]")
        # scrolls (arrows, j/k, PgUp/PgDn) where the terminal is shorter than the keys: 80x24 cut 12 rows
        with VerticalScroll(id="help-box"):
            yield Static("[b]kvtop keys[/b]  (esc closes; arrows or j/k scroll)", id="help-title")
            yield Static(body + extra, id="help-body")

    def on_mount(self) -> None:
        self.query_one("#help-box", VerticalScroll).focus()

    def action_line(self, n: int) -> None:
        self.query_one("#help-box", VerticalScroll).scroll_relative(y=n, animate=False)


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
            t = float(ev.value)
            if not math.isfinite(t):  # "nan" and "inf" parse; max(0.0, nan) rewound to the start
                raise ValueError
        except ValueError:
            self.notify(f"not a number of seconds: {ev.value!r}", severity="error")
            return
        self.dismiss(max(0.0, t))


def _until(tl: RequestTimeline | None, t: float) -> RequestTimeline | None:
    """A request's timeline as it stood at ``t`` (what came after a pause is not shown in its frame)."""
    if tl is None or tl.arrive_t > t:
        return None
    return dataclasses.replace(
        tl, end_t=tl.end_t if tl.end_t is not None and tl.end_t <= t else None,
        tokens=tuple(x for x in tl.tokens if x[0] <= t), marks=tuple(m for m in tl.marks if m[0] <= t),
        engine_marks=tuple(m for m in tl.engine_marks if m[0] <= t), steps=tuple(x for x in tl.steps if x[0] <= t))


View = OverviewView | RequestsView | DetailView | AdvisorView | EventsView


@dataclass(frozen=True)
class Views:
    """The console's screens, one widget each; each renders a Snapshot (``update``) and holds its own
    state (sort, filter, selection, window, caches)."""

    overview: OverviewView
    requests: RequestsView
    detail: DetailView
    advisor: AdvisorView
    events: EventsView

    def get(self, name: str) -> View:
        view: View = getattr(self, name)
        return view


class MainScreen(Screen[None]):
    # Panels collapse below 100 columns (one line per GPU, compact engines); from 220 columns
    # GPUs sit two to a row.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide"), (220, "-huge")]

    def __init__(self, views: Views, on_ready: Callable[[], None]):
        super().__init__()
        self.views = views
        self._on_ready = on_ready

    def compose(self) -> ComposeResult:
        yield Static("", id="topbar")
        yield Static("", id="banner")
        yield Tabs(*[Tab(f"{i + 1} {label}", id=f"tab-{key}") for i, (key, label) in enumerate(VIEWS)], id="tabs")
        with ContentSwitcher(initial="overview", id="switcher"):
            for key, _label in VIEWS:
                yield self.views.get(key)
        yield Input(placeholder="filter (words match id, state, class, cause); enter keeps, esc clears",
                    id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self._on_ready()


class KvtopApp(App[int]):
    CSS_PATH = "kvtop.tcss"
    TITLE = "kvtop"
    ENABLE_COMMAND_PALETTE = True

    # A view's keys (its KEYS) are bound here, on the app, so they work whatever has the focus (the
    # Overview holds nothing focusable) and the footer and the help list every key in one order;
    # check_action enables a view's keys only while it shows and the app hands the action to it.
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
        *OverviewView.KEYS,
        Binding("j", "nav(1)", "Down (also ↓)", show=False),
        Binding("k", "nav(-1)", "Up (also ↑)", show=False),
        Binding("1", "view('overview')", "Overview screen", show=False),
        Binding("2", "view('requests')", "Requests screen", show=False),
        Binding("3", "view('detail')", "Request detail screen", show=False),
        Binding("4", "view('advisor')", "Advisor screen", show=False),
        Binding("5", "view('events')", "Events screen", show=False),
        # the filter box is the console's: it narrows the Requests and the Events screens
        Binding("slash", "filter", "Filter", key_display="/"),
        *RequestsView.KEYS,
        Binding("escape", "back", "Back", show=False),
        Binding("left_square_bracket", "step(-10)", "Back 10 s", key_display="["),
        Binding("right_square_bracket", "step(10)", "Forward 10 s", key_display="]"),
        Binding("g", "seek", "Seek to…"),
        # no description: kept out of the help screen, which every console snapshot shows
        Binding("f", "fleet", "", show=False),
    ]
    # the views whose keys these are, enabled only while one of them shows (w is the Overview's but
    # stays on everywhere: the window it sets is there on the way back)
    _VIEW_ACTIONS = {"cycle_sort": ("requests",), "reverse_sort": ("requests",), "filter": ("requests", "events")}

    def __init__(self, core: SnapshotSource, feed: Feed | None = None, title: str = "kvtop", theme: str | None = None,
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
        self.filter_text = ""
        self.ticks = 0
        self.cells = Cells(lambda: self.theme_variables)
        self.views = Views(overview=OverviewView(interval, replay=self.replay is not None),
                           requests=RequestsView(self.cells), detail=DetailView(), advisor=AdvisorView(),
                           events=EventsView(self.cells))
        self._banner_text: str | None = None
        self._stop = asyncio.Event()
        self.main = MainScreen(self.views, self.main_ready)
        self._main_ready = False

    # -- lifecycle ------------------------------------------------------------------------------
    def get_default_screen(self) -> Screen[Any]:
        return self.main

    def on_mount(self) -> None:
        self.theme = self._theme_name
        self.theme_changed_signal.subscribe(self, self._on_theme_changed)
        self.run_worker(self._run_feed(), name="feed", group="feed", exclusive=True)
        self._refresh_timer = self.set_interval(self.interval, self.tick, name="refresh")
        if self.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGHUP):
                loop.add_signal_handler(sig, self.exit)

    def main_ready(self) -> None:
        self._main_ready = True
        self.tick(force=True)
        if self.feed.is_fleet:
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
                               timeline=self.view_name == "detail", request_id=self.views.detail.request_id)
        if self.taken_at is not None:
            s = dataclasses.replace(s, taken_at=self.taken_at)
        return s

    def _timeline(self) -> RequestTimeline | None:
        return self.core.snapshot(now=self.snap.t if self.snap is not None else None, timeline=True,
                                  request_id=self.views.detail.request_id).detail

    def tick(self, force: bool = False) -> None:
        if self.paused and not force:
            return
        self.snap = self.take_snapshot()
        self.ticks += 1
        try:
            self.render_current()
            for scr in self.screen_stack:  # the fleet, also under an instance it opened
                if isinstance(scr, FleetScreen):
                    scr.update(self.snap)
        except NoMatches:  # the app is shutting down and its widgets are gone
            pass

    def render_current(self) -> None:
        s = self.snap
        if s is None or not self._main_ready:
            return
        with self.batch_update():
            self._render_topbar(s)
            self.views.get(self.view_name).update(s)

    def _render_topbar(self, s: Snapshot) -> None:
        clock = s.taken_at[11:19] + "Z" if len(s.taken_at) >= 19 else s.taken_at
        replay = self.replay
        ended = replay is not None and replay.duration > 0 and replay.t >= replay.duration
        if self.paused:
            state = "[$warning b]⏸ PAUSED[/]"
        elif ended:
            state = "[$text-muted]■ end of trace[/]"  # nothing more will come: not "live"
        else:
            state = "[$success]● live[/]"
        # "kvtop demo: preemption-storm" already names its source
        src = "" if s.source_label.split(" ")[-1] in self.title else escape(s.source_label)
        pos = bar = ""
        if replay is not None:
            t, d = replay.t, replay.duration
            pos = f"replay {units.duration_short(t)}" + (f"/{units.duration_short(d)}" if d else "")
            if d:
                n = 20
                k = min(n, round(t / d * n)) if d > 0 else 0
                bar = f"[$primary]{'━' * k}[/][$text-muted]{'─' * (n - k)}[/]"
        n_run = sum(1 for r in s.requests if r.state in ("running", "preempted", "waiting"))
        # what an 80-column terminal drops first: the counts, the clock, the source, the bar
        width = max(20, (self.main.size.width or self.size.width) - 2)
        self.main.query_one("#topbar", Static).update(
            render.fit_line([
                (f"[b]{escape(self.title)}[/b]", 0), (render.muted(src), 4), (state, 0), (pos, 1), (bar, 3),
                (f"t={units.duration_short(s.t)}", 2), (clock, 5),
                (render.muted(f"{len(s.engines)} engine(s) · {len(s.gpus)} GPU(s) · {n_run} live requests"), 6),
            ], width),
            layout=False,  # one line, always: a new text needs no layout pass
        )
        banner = self.main.query_one("#banner", Static)
        msgs = []
        notice = self.feed.notice
        if notice:
            msgs.append(escape(notice))
        unread = replay.warning() if replay is not None else None
        if unread:  # the headless paths print it; the console said nothing of a corrupt trace
            msgs.append(escape(unread))
        # no GPU is not an alarm: the Overview's GPUs line says why (and the Events screen logs it)
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

    def _on_theme_changed(self, _theme: Theme) -> None:
        self.cells.reset()
        self._reset_tables()  # rebuilt cells take the new theme's colours
        self.render_current()

    def _reset_tables(self) -> None:
        # new cell objects: the requests table repaints every row from them on the next tick
        # (and keeps its cursor on the same request); the events table is rebuilt
        self.views.requests.reset()
        self.views.events.reset()

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
            if self.paused:
                # the frame stays frozen: only the chosen request's timeline is read, up to the frozen
                # moment (the core went on ingesting behind the pause)
                self.snap = dataclasses.replace(self.snap, detail=_until(self._timeline(), self.snap.t))
            else:
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
        self.views.detail.request_id = ev.key
        self.action_view("detail")

    @on(Chart.SpikesPicked)
    def _open_spike(self, ev: Chart.SpikesPicked) -> None:
        """A click on a chart's spike marks opens the request with the largest gap there (kept on the
        Requests screen for the last hour when it was among the worst)."""
        s = self.snap
        spikes = s.analysis.spikes if s is not None and s.analysis is not None else ()
        hit = [sp for sp in spikes if ev.t0 <= (sp.t_end or sp.t_start) <= ev.t1]
        if not hit:
            return
        worst = max(hit, key=lambda sp: (sp.gap_s, sp.request_id))
        kept = {r.id for r in s.requests} if s is not None else set()
        if worst.request_id not in kept:
            # it ended and left the console: say so rather than open "No request selected"
            held = [sp for sp in hit if sp.request_id in kept]
            alt = max(held, key=lambda sp: (sp.gap_s, sp.request_id)) if held else None
            gone = f"{worst.request_id} (gap {units.duration_short(worst.gap_s)}) ended and is no longer kept"
            self.notify(gone + (f"; showing {alt.request_id}, the largest gap there still kept" if alt else
                                "; no request of that moment is"), severity="warning")
            if alt is None:
                return
            worst = alt
        self.views.detail.request_id = worst.request_id
        self.action_view("detail")

    def action_cycle_sort(self) -> None:
        self.views.requests.cycle_sort()
        self.render_current()

    def action_reverse_sort(self) -> None:
        self.views.requests.reverse_sort()
        self.render_current()

    def action_filter(self) -> None:
        box = self.main.query_one("#filter", Input)
        box.display = True
        box.value = self.filter_text
        box.focus()

    def _set_filter(self, text: str) -> None:
        self.filter_text = self.views.requests.filter_text = self.views.events.filter_text = text

    @on(Input.Changed, "#filter")
    def _filter_changed(self, ev: Input.Changed) -> None:
        self._set_filter(ev.value.strip())
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
            self._set_filter("")
            self._focus_view()
            self.render_current()
        elif self.view_name == "detail":
            self.action_view("requests")
        elif self.filter_text:
            self._set_filter("")
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
        self.interval = self.views.overview.interval = new
        self.feed.interval_s = new
        if self._refresh_timer is not None:
            self._refresh_timer.stop()
        self._refresh_timer = self.set_interval(new, self.tick, name="refresh")
        self.notify(f"poll interval {units.duration_short(new)}", timeout=2)
        self.tick(force=True)

    def action_window(self) -> None:
        """Cycle the history charts' time window."""
        window = self.views.overview.cycle_window()
        self.notify(f"history window {plot.window_label(window)}", timeout=2)
        self.render_current()

    def action_nav(self, delta: int) -> None:
        """j / k: the focused table's cursor, else scroll the screen."""
        w = self.focused
        if isinstance(w, RowTable):
            w.action_move(delta)
        elif isinstance(w, DataTable):
            (w.action_cursor_down if delta > 0 else w.action_cursor_up)()
        else:
            view = self.views.get(self.view_name)
            box: Widget | None = w if isinstance(w, VerticalScroll) else view
            if box is not None and not isinstance(box, VerticalScroll):
                # a screen of several scroll areas (the Overview: panels, then charts): the last that
                # has more to show, so the charts below the fold are reached from the keyboard
                more = [b for b in box.query(VerticalScroll) if b.max_scroll_y > 0]
                box = more[-1] if more else None
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
        open_fleet(self, self.snap if self.snap is not None else self.take_snapshot())

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
        views = self._VIEW_ACTIONS.get(action)
        if views is not None:
            return self.view_name in views
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
        # every other key that does something here, from the bindings themselves (a hand-kept list
        # lacked the poll interval, the chart window, reverse sort and the replay's step and seek)
        for b in self.BINDINGS:
            assert isinstance(b, Binding)
            name = b.action.split("(", 1)[0]
            if not b.description or name in _PALETTE_OWN or not self.check_action(name, ()):
                continue
            yield SystemCommand(b.description, f"key {b.key_display or b.key.split(',')[0]}",
                                lambda action=b.action: self.run_action(action))


# actions the palette offers by name above (or the app's own Quit, or navigation)
_PALETTE_OWN = frozenset({"quit", "help", "view", "nav", "back", "toggle_pause", "refresh_now"})


def run_console(core: SnapshotSource, feed: Feed | None = None, title: str = "kvtop", theme: str | None = None,
                interval: float = 1.0) -> int:
    """Run the console until the user quits; returns the process exit code."""
    app = KvtopApp(core, feed=feed, title=title, theme=theme, interval=interval, handle_signals=True)
    rc = app.run()
    return int(rc or 0)
