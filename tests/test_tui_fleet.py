"""The fleet screen: three engine instances on three hosts, two of them with a kvtop agent.
SVG snapshot (pytest-textual-snapshot) plus behaviour: sort, open an instance, the console hook."""

from __future__ import annotations

import pytest
from textual.app import App

from kvtop.core import Core
from kvtop.model.records import EngineRecord, Histogram
from kvtop.sources.promfleet import AgentView, Target
from kvtop.views.tui.fleet import FleetScreen, InstanceScreen, agent_for, fleet_rows

pytest.importorskip("pytest_textual_snapshot")

BOUNDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, float("inf")]


def _itl(counts: list[int]) -> Histogram:
    cum: list[float] = []
    s = 0.0
    for c in counts:
        s += c
        cum.append(s)
    return Histogram(list(zip(BOUNDS, cum, strict=True)), s, 0.05 * s)


def fleet_state() -> tuple[Core, dict, dict]:
    core = Core(window_s=60, itl_target_s=0.1)
    engines = {
        # (instance, kv, running, waiting, preemptions at t=0 and t=60, ITL observations per bucket 0 -> 60 s)
        "10.0.0.5:8000": (0.97, 48, 12, (100, 160), [0, 0, 0, 0, 0, 0, 0, 0], [400, 900, 300, 80, 60, 40, 20, 0]),
        "10.0.0.6:8000": (0.55, 20, 0, (3, 3), [0, 0, 0, 0, 0, 0, 0, 0], [600, 700, 90, 10, 0, 0, 0, 0]),
        "10.0.0.7:30000": (0.81, 33, 4, (0, 0), [0, 0, 0, 0, 0, 0, 0, 0], [300, 500, 300, 150, 40, 10, 0, 0]),
    }
    for inst, (kv, run, wait, (p0, p1), h0, h1) in engines.items():
        adapter = "sglang" if inst.endswith(":30000") else "vllm"
        for t, pre, h in ((0.0, p0, h0), (60.0, p1, h1)):
            core.ingest(EngineRecord(t=t, adapter=adapter, url=inst, model="llama-3.1-8b", kv_usage=kv, running=run,
                                     waiting=wait, preemptions_total=pre, itl=_itl(h)))
    core.ingest(EngineRecord(t=60.0, adapter="vllm", url="10.0.0.9:8000", up=False,
                             warnings=["Prometheus cannot scrape it (up == 0)"]))
    targets = {("vllm", i): Target("vllm", i, "vllm") for i in ("10.0.0.5:8000", "10.0.0.6:8000", "10.0.0.9:8000")}
    targets[("sglang", "10.0.0.7:30000")] = Target("sglang", "10.0.0.7:30000", "sglang")
    agents = {
        ("10.0.0.5:8000", "10.0.0.5:9470"): AgentView("10.0.0.5:9470", "admission", "recompute", 0.72, 0.1,
                                                      {"preemption": 57, "prefill_interference": 4, "slow_decode": 1,
                                                       "unknown": 2}),
        # this agent scrapes its engine through loopback: joined by host + port
        ("127.0.0.1:30000", "10.0.0.7:9470"): AgentView("10.0.0.7:9470", "chunked_prefill", "none", 0.55, 0.1,
                                                        {"preemption": 0, "prefill_interference": 23, "slow_decode": 2,
                                                         "unknown": 1}),
    }
    return core, targets, agents


class FleetApp(App[None]):
    def __init__(self) -> None:
        super().__init__()
        self.core, self.targets, self.agents = fleet_state()

    def on_mount(self) -> None:
        self.push_screen(FleetScreen(lambda snap: fleet_rows(snap, self.targets, self.agents), self.core.snapshot(60.0),
                                     lambda: "[dim]http://prometheus:9090[/]"))


def test_fleet_screen_snapshot(snap_compare):
    assert snap_compare(FleetApp(), terminal_size=(150, 14))


def test_rows_join_engines_with_their_agents():
    core, targets, agents = fleet_state()
    rows = {r.instance: r for r in fleet_rows(core.snapshot(60.0), targets, agents)}
    assert set(rows) == {"10.0.0.5:8000", "10.0.0.6:8000", "10.0.0.7:30000", "10.0.0.9:8000"}
    r5 = rows["10.0.0.5:8000"]
    assert r5.preemptions_per_s == pytest.approx(1.0)  # 60 preemptions in 60 s
    assert r5.action == "admission" and r5.spikes["preemption"] == 57 and r5.job == "vllm"
    assert r5.itl_p99_s is not None and r5.itl_target_s is not None and r5.itl_p99_s > r5.itl_target_s
    assert rows["10.0.0.7:30000"].agent == "10.0.0.7:9470"  # loopback-watching agent on that host
    assert rows["10.0.0.6:8000"].agent is None
    assert not rows["10.0.0.9:8000"].up and "up == 0" in (rows["10.0.0.9:8000"].error or "")
    assert agent_for("10.0.0.8:8000", agents) is None


def test_sidecars_that_name_their_engine_alike_stay_on_their_own_rows():
    # every node's sidecar watches "127.0.0.1:8000": keyed by engine label alone, one host's verdict
    # and spikes were shown on the other's row, and the other had "no agent"
    a = AgentView("hostA:9470", "admission", "swap", 0.99, 0.1, {"preemption": 268})
    b = AgentView("hostB:9470", "insufficient_data", None, 0.2, 0.1, {})
    agents = {("127.0.0.1:8000", "hostA:9470"): a, ("127.0.0.1:8000", "hostB:9470"): b}
    assert agent_for("hostA:8000", agents) is a and agent_for("hostB:8000", agents) is b
    assert agent_for("hostC:8000", agents) is None


async def test_sort_and_open_an_instance():
    app = FleetApp()
    async with app.run_test(size=(150, 14)) as pilot:
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        assert [r.instance for r in screen.rows][0] == "10.0.0.5:8000"
        for _ in range(6):  # instance -> job -> engine -> kv -> run -> wait -> preempt/s
            await pilot.press("s")
        assert screen.sort_col == "pre" and screen.rows[0].instance == "10.0.0.5:8000"
        await pilot.press("r")
        assert screen.rows[-1].instance == "10.0.0.5:8000"
        await pilot.press("s")  # ITL p99, highest first
        assert screen.sort_col == "itl" and screen.rows[0].instance == "10.0.0.5:8000"
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, InstanceScreen)
        text = str(app.screen.query_one("#fleet-instance-body").render())
        assert "10.0.0.5:8000" in text and "admission" in text and "57 spikes" in text
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, FleetScreen)


async def test_console_opens_the_fleet_screen_for_a_prometheus_feed():
    from kvtop.feeds.prometheus import PromFeed
    from kvtop.views.tui.app import KvtopApp

    core, targets, agents = fleet_state()

    class Feed(PromFeed):  # the Prometheus feed's surface without a server behind it
        url = "http://prometheus:9090"
        interval_s = 3600.0
        notice = None

        class fleet:  # noqa: N801
            error = None
            targets: dict = {}
            agents: dict = {}

        def __init__(self, core: Core):  # no super().__init__: nothing to connect to
            self.core = core

        async def run(self, *, stop=None) -> None:  # noqa: ANN001
            await stop.wait()

        def refresh_now(self) -> None:
            pass

        def controls(self) -> None:
            return None

    Feed.fleet.targets = targets
    Feed.fleet.agents = agents
    app = KvtopApp(core, feed=Feed(core), interval=3600)
    async with app.run_test(size=(150, 30)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, FleetScreen)
        assert len(app.screen.rows) == 4
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, FleetScreen)
        await pilot.press("f")
        await pilot.pause()
        assert isinstance(app.screen, FleetScreen)


async def test_an_unreachable_prometheus_is_said_in_the_status_line_not_a_crash():
    import socket

    from kvtop.pipeline import prometheus_feed
    from kvtop.views.tui.app import KvtopApp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    feed = prometheus_feed(f"http://127.0.0.1:{port}", timeout_s=1.0, interval_s=1.0)
    app = KvtopApp(feed.core, feed=feed, interval=0.2)
    async with app.run_test(size=(150, 20)) as pilot:
        for _ in range(40):
            await pilot.pause(0.1)
            if feed.fleet.error:
                break
        await pilot.pause(0.5)
        assert isinstance(app.screen, FleetScreen)
        status = str(app.screen.query_one("#fleet-status").render())
        # the OS's reason keeps its brackets (it is text, not markup)
        assert f"cannot connect to Prometheus at http://127.0.0.1:{port}: [Errno" in status
