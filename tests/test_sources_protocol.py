"""The one Source protocol (kvtop/feeds/sources.py): what pipeline.live_sources wires for each
option, a new source run by the LiveRunner with no change to it, and the feeds' fleet flag."""

from __future__ import annotations

from kvtop.core import Core
from kvtop.feeds.live import LiveRunner
from kvtop.feeds.prometheus import PromFeed
from kvtop.feeds.sources import (
    EngineScrape,
    GpuPoll,
    HostPoll,
    PassiveCapture,
    ProbeStreams,
    ProxyRecorder,
    SourceContext,
)
from kvtop.feeds.static import StaticFeed
from kvtop.model.records import EngineRecord, RequestRecord
from kvtop.pipeline import SourceOptions, live_feed, live_sources, replay_feed


def test_live_sources_wires_each_option_once_in_start_order():
    opts = SourceOptions(urls=("http://127.0.0.1:8000", "http://127.0.0.1:8001/metrics"), probe_rate=2.0,
                         capture_port=0, proxy_listen=("127.0.0.1", 0), proxy_workers=3, timeout_s=1.5)
    sources = live_sources(opts, probe_max_tokens=7)
    assert [type(s) for s in sources] == [EngineScrape, EngineScrape, GpuPoll, HostPoll, ProbeStreams,
                                          PassiveCapture, ProxyRecorder]
    assert [s.name for s in sources[:2]] == ["engine http://127.0.0.1:8000", "engine http://127.0.0.1:8001/metrics"]
    assert [s.polled for s in sources] == [True, True, True, True, False, False, False]
    probe, capture, proxy = sources[4:]
    assert isinstance(probe, ProbeStreams) and probe.base_url == "http://127.0.0.1:8000"
    assert probe.rate_per_s == 2.0 and probe.max_tokens == 7 and probe.stop_timeout_s == 3.5
    assert isinstance(capture, PassiveCapture) and capture.port == 8000  # --capture: the first engine's port
    assert isinstance(proxy, ProxyRecorder) and proxy.upstream == "http://127.0.0.1:8000" and proxy.workers == 3

    bare = live_sources(SourceOptions(gpu=False, host=False))
    assert bare == []  # nothing asked, nothing wired (no probe or proxy without an engine either)


def test_live_feed_says_what_it_does_not_watch():
    core = Core()
    runner = live_feed(SourceOptions(gpu=False, host=False), core=core)
    assert runner.sources == [] and runner.core is core
    assert core.snapshot().gpu_status == "disabled (--no-gpu)"
    assert core.host_status == "off (--no-host)"


class _Counter:
    """A new polled source: one engine record per poll, numbered."""

    name = "counter"
    polled = True

    def __init__(self) -> None:
        self.ctx: SourceContext | None = None
        self.polls = 0
        self.stopped = 0

    async def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx

    async def poll(self, t: float) -> None:
        assert self.ctx is not None
        self.polls += 1
        self.ctx.emit(EngineRecord(t=t, adapter="counter", url="http://counter", running=float(self.polls)))

    async def stop(self) -> None:
        self.stopped += 1


class _Pusher:
    """A new pushing source: one request record when it starts, one when it stops."""

    name = "pusher"
    polled = False

    def __init__(self) -> None:
        self.ctx: SourceContext | None = None

    async def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        ctx.emit(RequestRecord(t=ctx.now(), id="p-1", event="arrive", source="probe"))

    async def poll(self, t: float) -> None:
        raise AssertionError("a pushing source is never polled")

    async def stop(self) -> None:
        assert self.ctx is not None
        self.ctx.emit(RequestRecord(t=self.ctx.now(), id="p-1", event="cancel", source="probe"))


async def test_a_new_source_runs_in_the_live_runner_unchanged():
    core = Core()
    seen: list[object] = []
    counter, pusher = _Counter(), _Pusher()
    runner = LiveRunner(core, [counter, pusher], interval_s=0.1, sinks=[seen.append])
    await runner.run(duration_s=0.35, final_poll=True)
    # polled on the runner's cadence (t = 0, 0.1, 0.2, 0.3) plus the final poll; closed once
    assert 4 <= counter.polls <= 6 and counter.stopped == 1
    kinds = [(type(r).__name__, getattr(r, "event", None)) for r in seen]
    # the pushing source starts before the first poll lands
    assert kinds[0] == ("RequestRecord", "arrive") and kinds.count(("EngineRecord", None)) == counter.polls
    assert kinds.count(("RequestRecord", "cancel")) == 1
    (eng,) = core.snapshot().engines
    assert eng.url == "http://counter" and eng.running == float(counter.polls)
    assert runner.source("pusher") is pusher and runner.source("proxy") is None


async def test_a_source_that_fails_to_start_stops_those_started_before_it():
    class _Refuses(_Pusher):
        name = "refuses"

        async def start(self, ctx: SourceContext) -> None:
            raise OSError(98, "Address already in use")

    stops: list[str] = []

    class _Tracked(_Pusher):
        async def stop(self) -> None:
            stops.append(self.name)

    runner = LiveRunner(Core(), [_Tracked(), _Refuses()], interval_s=0.1)
    try:
        await runner.start()
    except OSError as e:
        assert e.errno == 98
    else:
        raise AssertionError("start() must raise the bind failure")
    assert stops == ["pusher"]
    await runner.aclose()
    assert stops == ["pusher"]  # not stopped twice


def test_only_the_prometheus_feed_is_a_fleet_feed(tmp_path):
    from kvtop.model.trace import TraceWriter, make_header

    trace = tmp_path / "t.jsonl"
    TraceWriter(str(trace), make_header(engine={"adapter": "vllm"})).close()
    core = Core()
    prom = PromFeed(core, "http://127.0.0.1:9")
    assert prom.is_fleet is True
    prom.fleet.client.close()
    assert live_feed(SourceOptions(gpu=False, host=False), core=core).is_fleet is False
    assert StaticFeed(core).is_fleet is False
    feed = replay_feed(trace)
    try:
        assert feed.is_fleet is False
    finally:
        feed.close()
