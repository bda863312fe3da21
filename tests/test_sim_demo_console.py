"""`kvtop demo` in the console: the DemoFeed runs as the console's feed (Textual Pilot)."""

from __future__ import annotations

import asyncio

import pytest

from kvtop.core import Core
from kvtop.pipeline import demo_feed
from kvtop.sim.workload import load_preset

tui = pytest.importorskip("kvtop.views.tui.app")


async def test_console_runs_the_demo_feed_and_sees_the_simulated_engine():
    wl = load_preset("healthy")
    core = Core(window_s=30.0, itl_target_s=wl.engine.itl_target_s, source_label="demo healthy")
    feed = demo_feed(wl, seed=2, speed=1.0, interval_s=0.5, core=core)
    app = tui.KvtopApp(core, feed=feed, title="kvtop demo")
    async with app.run_test() as pilot:
        for _ in range(60):
            await pilot.pause(0.1)
            snap = core.snapshot()
            if snap.engines and snap.engines[0].running and snap.requests:
                break
        snap = core.snapshot()
        assert snap.engines and snap.engines[0].up and snap.engines[0].model == "sim-llama-3.1-8b"
        assert snap.engines[0].kv_capacity_tokens == 152576
        assert any(r.tokens > 0 for r in snap.requests)  # the load generator's streams reach the core
        await pilot.press("q")
    for _ in range(300):  # bounds a hang only
        if feed.server is not None and feed.server._task is None:
            break
        await asyncio.sleep(0.1)
    assert feed.server is not None and feed.server._task is None  # server stopped with the console
