"""The fleet screen (`kvtop --prometheus URL`, key ``f``): one row per engine instance across hosts.

Rows join two things Prometheus holds: the engines' own metrics (read through the same Core as a
direct scrape: KV usage, running/waiting, preemptions/s, ITL p99) and, where a kvtop agent runs
next to an engine, the agent's verdict and its spikes by cause. ``s`` cycles the sort column,
``r`` reverses it, ``enter`` opens the selected instance, ``escape`` returns to the console.

Kept apart from kvtop/views/tui/app.py on purpose: the console binds the key, pushes this screen and hands it its snapshots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Static

from kvtop import units
from kvtop.snapshot import EngineView, Snapshot
from kvtop.views.tui import fmt

if TYPE_CHECKING:
    from kvtop.feeds.prometheus import PromFeed
    from kvtop.sources.promfleet import AgentView, Target
    from kvtop.views.tui.app import KvtopApp

CAUSE_SHORT = (("preemption", "pre"), ("prefill_interference", "fill"), ("slow_decode", "slow"), ("unknown", "unk"))
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class FleetRow:
    instance: str
    job: str | None
    adapter: str | None
    up: bool
    error: str | None
    kv_usage: float | None
    running: float | None
    waiting: float | None
    preemptions_per_s: float | None
    itl_p99_s: float | None
    itl_target_s: float | None
    agent: str | None  # the agent's scrape target, when one reports on this engine
    action: str | None
    mechanism: str | None
    confidence: float | None
    spikes: dict[str, float]
    engine: EngineView | None = None
    # the same two numbers as Prometheus computes them (rate(), histogram_quantile()): a cross-check
    prom_preemptions_per_s: float | None = None
    prom_itl_p99_s: float | None = None


def _host_port(addr: str) -> tuple[str, str]:
    p = urlsplit(addr if "://" in addr else "http://" + addr)
    return (p.hostname or "", str(p.port or ""))


def agent_for(instance: str, agents: dict[tuple[str, str], AgentView]) -> AgentView | None:
    """The agent view for an engine instance, ``agents`` keyed by (engine label, agent instance): an
    agent that names the engine by its exact address (one on the engine's host first), else one that
    watches the engine on its own host through loopback (``127.0.0.1:8000`` on the agent's node: every
    sidecar says that, so the agent's own host tells them apart)."""
    host, port = _host_port(instance)
    exact = [view for (label, _), view in agents.items() if label == instance]
    if exact:
        return next((v for v in exact if _host_port(v.instance)[0] == host), exact[0])
    for (label, _), view in agents.items():
        lh, lp = _host_port(label.split("/")[0])
        if lp == port and lh in LOOPBACK and _host_port(view.instance)[0] == host:
            return view
    return None


def fleet_rows(snap: Snapshot, targets: dict[tuple[str, str], Target], agents: dict[tuple[str, str], AgentView],
               computed: dict[str, tuple[float | None, float | None]] | None = None) -> list[FleetRow]:
    jobs = {tg.instance: tg for tg in targets.values()}
    rows = []
    for e in snap.engines:
        inst = e.url + (f"/{e.engine}" if e.engine not in (None, "", "0") else "")
        tg = jobs.get(e.url)
        a = agent_for(e.url, agents)
        pp, pq = (computed or {}).get(e.url, (None, None))
        rows.append(FleetRow(
            instance=inst, job=tg.job if tg else None, adapter=e.adapter, up=e.up,
            error=e.error or (tg.error if tg else None), kv_usage=e.kv_usage, running=e.running, waiting=e.waiting,
            preemptions_per_s=e.preemptions_per_s, itl_p99_s=e.itl_p99_s,
            itl_target_s=(a.itl_target_s if a else None) or snap.itl_target_s,
            agent=a.instance if a else None, action=a.action if a else None,
            mechanism=a.mechanism if a else None, confidence=a.confidence if a else None,
            spikes=dict(a.spikes) if a else {}, engine=e, prom_preemptions_per_s=pp, prom_itl_p99_s=pq,
        ))
    return rows


def _num(v: float | None, spec: str, scale: float = 1.0) -> str:
    return units.num(None if v is None else v * scale, "{:" + spec + "}")


SortKey = str | float  # a column sorts by text or by number (missing numbers as -1)

COLUMNS: tuple[tuple[str, str, Callable[[FleetRow], SortKey]], ...] = (
    ("instance", "instance", lambda r: r.instance),
    ("job", "job", lambda r: r.job or ""),
    ("engine", "engine", lambda r: r.adapter or ""),
    ("kv", "KV", lambda r: -1.0 if r.kv_usage is None else r.kv_usage),
    ("run", "run", lambda r: -1.0 if r.running is None else r.running),
    ("wait", "wait", lambda r: -1.0 if r.waiting is None else r.waiting),
    ("pre", "preempt/s", lambda r: -1.0 if r.preemptions_per_s is None else r.preemptions_per_s),
    ("itl", "ITL p99", lambda r: -1.0 if r.itl_p99_s is None else r.itl_p99_s),
    ("verdict", "agent verdict", lambda r: r.action or ""),
    ("spikes", "spikes pre/fill/slow/unk", lambda r: sum(r.spikes.values())),
)


def row_cells(r: FleetRow) -> tuple[str, ...]:
    if not r.up:
        return (escape(r.instance), escape(r.job or ""), r.adapter or "?", "[b red]down[/]", "", "", "", "",
                f"[red]{escape((r.error or 'unreachable')[:48])}[/]", "")
    itl = _num(r.itl_p99_s, ".0f", 1e3) + " ms" if r.itl_p99_s is not None else "n/a"
    if r.itl_p99_s is not None and r.itl_target_s:
        over = r.itl_p99_s > r.itl_target_s
        itl = f"[{'b red' if over else 'green'}]{itl}[/] / {r.itl_target_s * 1e3:.0f}"
    kv = _num(r.kv_usage, ".0%")
    if r.kv_usage is not None and r.kv_usage >= 0.9:
        kv = f"[b yellow]{kv}[/]"
    pre = _num(r.preemptions_per_s, ".2f")
    if r.preemptions_per_s:
        pre = f"[b yellow]{pre}[/]"
    if r.agent is None:
        verdict, spikes = "[dim]no agent[/]", ""
    else:
        conf = "" if r.confidence is None else f" ({r.confidence:.0%})"
        verdict = f"{r.action or '?'}{'/' + r.mechanism if r.mechanism and r.mechanism != 'none' else ''}{conf}"
        spikes = "/".join(f"{r.spikes.get(c, 0):.0f}" for c, _ in CAUSE_SHORT)
    return (escape(r.instance), escape(r.job or ""), r.adapter or "?", kv, _num(r.running, ".0f"), _num(r.waiting, ".0f"),
            pre, itl, verdict, spikes)


def instance_text(r: FleetRow) -> str:
    lines = [f"[b]{r.instance}[/b]  job {r.job or 'n/a'}  engine {r.adapter or 'n/a'}  "
             + ("[green]up[/]" if r.up else f"[b red]down[/] ({escape(r.error or '')})")]
    e = r.engine
    if e is not None:
        lines.append(f"model {escape(e.model or 'n/a')}")
        lines.append(f"KV usage {_num(e.kv_usage, '.1%')}   running {_num(e.running, '.0f')}   "
                     f"waiting {_num(e.waiting, '.0f')}")
        lines.append(f"preemptions {_num(e.preemptions_per_s, '.2f')}/s (total {_num(e.preemptions_total, '.0f')})")
        lines.append(f"ITL p50 {_num(e.itl_p50_s, '.0f', 1e3)} ms   p99 {_num(e.itl_p99_s, '.0f', 1e3)} ms   "
                     f"TTFT p99 {_num(e.ttft_p99_s, '.0f', 1e3)} ms")
        if r.prom_preemptions_per_s is not None or r.prom_itl_p99_s is not None:
            lines.append(f"[dim]as Prometheus computes them: preemptions {_num(r.prom_preemptions_per_s, '.2f')}/s   "
                         f"ITL p99 {_num(r.prom_itl_p99_s, '.0f', 1e3)} ms[/]")
        lines.append(f"tokens/s prompt {_num(e.prompt_tokens_per_s, '.0f')}   generation "
                     f"{_num(e.generation_tokens_per_s, '.0f')}")
        if e.kv_usage_history:
            lines.append("KV history " + fmt.spark(list(e.kv_usage_history), 60, top=1.0))
    lines.append("")
    if r.agent is None:
        lines.append("[dim]no kvtop agent reports on this engine: per-request causes need `kvtop agent` on its host[/]")
    else:
        lines.append(f"[b]kvtop agent[/b] {r.agent}: verdict {r.action or 'n/a'}"
                     + (f" / {r.mechanism}" if r.mechanism else "")
                     + ("" if r.confidence is None else f" (confidence {r.confidence:.0%})"))
        for c, _ in CAUSE_SHORT:
            lines.append(f"  {c.replace('_', ' '):<22} {r.spikes.get(c, 0):>8.0f} spikes in the window")
    lines.append("")
    lines.append("[dim]escape: back to the fleet[/]")
    return "\n".join(lines)


class InstanceScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,enter", "dismiss", "Back")]

    def __init__(self, row: FleetRow):
        super().__init__()
        self.row = row

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="fleet-instance"):
            yield Static(instance_text(self.row), id="fleet-instance-body")


class FleetScreen(Screen[None]):
    """``update(snapshot)`` with each of the console's snapshots (the first one at construction);
    ``rows`` turns a snapshot into the table's rows, ``status`` is the status line's tail."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "Console"),
        Binding("s", "cycle_sort", "Sort"),
        Binding("r", "reverse_sort", "Reverse"),
        Binding("enter", "open", "Open", show=False),
        Binding("q", "app.quit", "Quit"),
    ]
    DEFAULT_CSS = "FleetScreen #fleet-status { height: 1; padding: 0 1; } FleetScreen DataTable { height: 1fr; }"

    def __init__(self, rows: Callable[[Snapshot], list[FleetRow]], snapshot: Snapshot,
                 status: Callable[[], str] | None = None):
        super().__init__()
        self._rows_fn = rows
        self._status_fn = status or (lambda: "")
        self._snap = snapshot
        self.sort_col = "instance"
        self.sort_reverse = False
        self.rows: list[FleetRow] = []

    def compose(self) -> ComposeResult:
        yield Static("", id="fleet-status")
        table: DataTable[str] = DataTable(id="fleet-table", cursor_type="row", zebra_stripes=True)
        for key, label, _ in COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_rows()

    def update(self, snapshot: Snapshot) -> None:
        self._snap = snapshot
        if self.is_mounted:
            self.refresh_rows()

    def refresh_rows(self) -> None:
        rows = list(self._rows_fn(self._snap))
        key = next(k for c, _, k in COLUMNS if c == self.sort_col)
        rows.sort(key=lambda r: (key(r), r.instance), reverse=self.sort_reverse)
        self.rows = rows
        table = self.query_one("#fleet-table", DataTable)
        cur = table.cursor_row
        table.clear()
        for r in rows:
            table.add_row(*row_cells(r), key=r.instance)
        if rows:
            table.move_cursor(row=min(max(cur, 0), len(rows) - 1))
        agents = len({r.agent for r in rows if r.agent})
        hosts = len({r.instance.split(":")[0] for r in rows})
        arrow = "v" if self.sort_reverse else "^"
        self.query_one("#fleet-status", Static).update(
            f"[b]Fleet[/b]  {len(rows)} engine instance(s) on {hosts} host(s), {agents} kvtop agent(s)  "
            f"sort: {self.sort_col} {arrow}  {self._status_fn()}")

    def action_cycle_sort(self) -> None:
        names = [c for c, _, _ in COLUMNS]
        self.sort_col = names[(names.index(self.sort_col) + 1) % len(names)]
        self.sort_reverse = self.sort_col not in ("instance", "job", "engine", "verdict")
        self.refresh_rows()

    def action_reverse_sort(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self.refresh_rows()

    def action_open(self) -> None:
        table = self.query_one("#fleet-table", DataTable)
        if self.rows and 0 <= table.cursor_row < len(self.rows):
            self.app.push_screen(InstanceScreen(self.rows[table.cursor_row]))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()


def open_fleet(app: KvtopApp, snapshot: Snapshot) -> None:
    """Push the fleet screen for a console whose feed reads Prometheus (no-op otherwise); the
    console hands it its snapshots from then on."""
    if not app.feed.is_fleet:
        app.notify("the fleet screen needs --prometheus URL", severity="warning")
        return
    feed = cast("PromFeed", app.feed)  # the one fleet feed
    fleet = feed.fleet

    def rows(snap: Snapshot) -> list[FleetRow]:
        return fleet_rows(snap, fleet.targets, fleet.agents, getattr(fleet, "computed", None))

    def status() -> str:
        return f"[b red]{escape(fleet.error)}[/]" if fleet.error else f"[dim]{escape(feed.url)}[/]"

    app.push_screen(FleetScreen(rows, snapshot, status))
