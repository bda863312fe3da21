"""LiveRunner: independent per-source schedules, refresh, sinks, clean stop."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import fixture_text
from page_server import PageServer

from kvtop.core import Core
from kvtop.feeds.live import LiveRunner
from kvtop.model.records import RequestRecord
from kvtop.pipeline import SourceOptions, live_feed

CAPTURE = fixture_text("vllm-0.32.0-cpu-live-idle.prom")


def watch(core: Core, urls: list[str], interval_s: float, timeout_s: float = 2.0,
          sinks: list | None = None) -> LiveRunner:
    """The pipeline's live runner over ``urls`` alone (no GPU, no host) into ``core``."""
    opts = SourceOptions(urls=tuple(urls), interval_s=interval_s, timeout_s=timeout_s, gpu=False, host=False)
    return live_feed(opts, core=core, sinks=sinks)


@pytest.fixture
def server():
    with PageServer() as s:
        yield s


async def test_slow_engine_does_not_slow_the_others(server):
    fast = server.route("/metrics", CAPTURE)
    slow = server.route("/slow/metrics", CAPTURE, delay_s=1.5)
    core = Core()
    r = watch(core, [server.url, server.url + "/slow"], interval_s=0.2, timeout_s=3.0)
    await r.run(duration_s=1.2)
    # the slow engine answered at most once in 1.2 s; the fast one was scraped again meanwhile (waiting
    # on the slow one would allow one scrape at most; how close to its 0.2 s cadence depends on load)
    assert len(slow.hits) == 1
    assert len(fast.hits) >= 2
    ups = {e.url: e.up for e in core.snapshot().engines}
    assert ups[server.url] is True


async def test_refresh_now_polls_immediately(server):
    route = server.route("/metrics", CAPTURE)
    r = watch(Core(), [server.url], interval_s=30.0)
    stop = asyncio.Event()
    task = asyncio.create_task(r.run(stop=stop))
    for _ in range(100):
        if route.hits:
            break
        await asyncio.sleep(0.02)
    assert len(route.hits) == 1
    r.refresh_now()
    for _ in range(100):
        if len(route.hits) == 2:
            break
        await asyncio.sleep(0.02)
    assert len(route.hits) == 2  # not waiting 30 s for the next tick
    t0 = time.monotonic()
    stop.set()
    await asyncio.wait_for(task, 25)
    assert time.monotonic() - t0 < 15  # stopping does not wait for the next 30 s tick


async def test_sinks_emit_and_clock(server):
    server.route("/metrics", CAPTURE)
    seen = []
    core = Core()
    r = watch(core, [server.url], interval_s=0.1, sinks=[seen.append])
    t_before = r.now()
    assert 0 <= t_before < 10  # the runner's clock starts at zero when it is made
    # the proxy / probe hand their records to emit() with the runner's clock
    r.emit(RequestRecord(t=r.now(), id="req-1", event="arrive", source="proxy"))
    await r.run(duration_s=0.35, final_poll=True)
    kinds = [type(x).__name__ for x in seen]
    # the first scrape and the final poll at least (more as the machine allows at a 0.1 s interval)
    assert kinds[0] == "RequestRecord" and kinds.count("EngineRecord") >= 2
    ts = [x.t for x in seen if type(x).__name__ == "EngineRecord"]
    assert ts == sorted(ts) and ts[-1] >= 0.35
    snap = core.snapshot()
    assert snap.gpu_status == "disabled (--no-gpu)"
    assert [q.id for q in snap.requests] == ["req-1"]


async def test_failing_sink_does_not_stop_monitoring(server):
    server.route("/metrics", CAPTURE)

    def broken(rec):
        raise OSError("disk full")

    core = Core()
    r = watch(core, [server.url], interval_s=0.1, sinks=[broken])
    await r.run(duration_s=0.25)
    snap = core.snapshot()
    assert snap.engines[0].up
    assert sum("record sink failed: disk full" in e.message for e in snap.events) == 1


async def test_engine_capabilities_from_adapter(server, tmp_path):
    from kvtop.plugin import load_plugin_file

    f = tmp_path / "nopre.py"
    f.write_text(
        "from kvtop.model.records import EngineRecord\n"
        "from kvtop.plugin import EngineAdapter\n"
        "class NoPre(EngineAdapter):\n"
        "    name = 'nopre'\n"
        "    preempts = False\n"
        "    @classmethod\n"
        "    def detect(cls, names):\n"
        "        return 1.0 if 'nopre_up' in names else 0.0\n"
        "    def parse(self, text, t):\n"
        "        return [EngineRecord(t=t, adapter='nopre', running=1.0)]\n"
    )
    load_plugin_file(f)
    server.route("/metrics", "nopre_up 1\n")
    core = Core()
    await watch(core, [server.url], interval_s=0.1).run(duration_s=0.15, final_poll=True)
    (e,) = core.snapshot().engines
    assert e.adapter == "nopre" and e.preempts is False
