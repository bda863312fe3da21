"""Console refresh cost and CPU use, headless.

1. Refresh cost per tick with 8 GPUs, 2 engines and 1,000 live requests, for every screen:
   ``tick`` = Core.snapshot() + updating the widgets; ``paint`` = Textual laying out and rendering
   the changed regions (the wait for the screen to settle after the tick, minus an idle wait
   measured the same way). Baseline in the same run: Core.snapshot() alone. Target < 50 ms.
2. kvtop's own CPU over --seconds (default 60) at a 1 s interval: against synthetic feeds (the
   seeded sample generator in kvtop/feeds/sample.py advanced once a second, its own generation time
   reported separately), and against `kvtop demo` in-process (simulated engine + load generator +
   live runner), measured without and with the console so the console's share is the difference.
   Target < 5% of one core.

    python bench/tui_refresh.py [--ticks 20] [--seconds 60] [--requests 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from kvtop.feeds.sample import FIXED_TAKEN_AT, Sample
from kvtop.views.tui.app import KvtopApp

SIZE = (160, 50)


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]
    return f"mean {statistics.mean(xs):6.1f} ms  median {statistics.median(xs):6.1f}  p95 {p95:6.1f}"


async def refresh_cost(ticks: int, requests: int) -> None:
    s = Sample(gpus=8, engines=2, requests=requests, fine=False, seed=11).run(30)
    app = KvtopApp(s.core, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        snap_ms = []
        for _ in range(ticks):
            s.advance(1.0)
            t = time.perf_counter()
            s.core.snapshot()
            snap_ms.append((time.perf_counter() - t) * 1000)
        idle = []
        for _ in range(ticks):
            t = time.perf_counter()
            await pilot.pause()
            idle.append((time.perf_counter() - t) * 1000)
        idle_ms = statistics.median(idle)
        n_live = len(s.core.snapshot().requests)
        print(f"load: 8 GPUs, 2 engines, {n_live} requests in the table, terminal {SIZE[0]}x{SIZE[1]}")
        print(f"baseline Core.snapshot() alone:      {_stats(snap_ms)}")
        print(f"(idle settle wait, subtracted below: {idle_ms:.1f} ms)")
        for key, name in (("1", "overview"), ("2", "requests"), ("3", "detail"), ("4", "advisor"), ("5", "events")):
            await pilot.press(key)
            await pilot.pause()
            tick_ms, total_ms = [], []
            for _ in range(ticks):
                s.advance(1.0)
                t0 = time.perf_counter()
                app.tick()
                t1 = time.perf_counter()
                await pilot.pause()
                t2 = time.perf_counter()
                tick_ms.append((t1 - t0) * 1000)
                total_ms.append(max(0.0, (t2 - t0) * 1000 - idle_ms))
            print(f"{name:9s} tick (snapshot+widgets): {_stats(tick_ms)} | tick+paint: {_stats(total_ms)}")


class _Feed:
    """The console's Feed protocol over the sample generator, advanced once a second."""

    def __init__(self, sample: Sample):
        self.sample = sample
        self.gen_cpu = 0.0

    @property
    def core(self):  # noqa: ANN201
        return self.sample.core

    def refresh_now(self) -> None:
        pass

    def controls(self) -> None:
        return None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            c = time.process_time()
            self.sample.advance(1.0)
            self.gen_cpu += time.process_time() - c
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


async def cpu_use(seconds: float, requests: int, view: str) -> None:
    s = Sample(gpus=8, engines=2, requests=requests, fine=False, seed=11).run(10)
    feed = _Feed(s)
    app = KvtopApp(s.core, feed=feed, interval=1.0, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(view)
        await pilot.pause(2.0)
        c0, w0, g0 = time.process_time(), time.perf_counter(), feed.gen_cpu
        await asyncio.sleep(seconds)
        cpu, wall, gen = time.process_time() - c0, time.perf_counter() - w0, feed.gen_cpu - g0
    print(f"CPU over {wall:.0f} s at 1 s interval, screen {view}, {requests} requests (synthetic feed): "
          f"process {cpu / wall * 100:.1f}% of one core; feed generation {gen / wall * 100:.1f}%; "
          f"console (process - feed) {(cpu - gen) / wall * 100:.1f}%")


def _demo(core_window: float = 60.0):
    from kvtop.core import Core
    from kvtop.pipeline import demo_feed
    from kvtop.sim.workload import load_preset

    wl = load_preset("preemption-storm")
    core = Core(window_s=core_window, itl_target_s=wl.engine.itl_target_s, source_label=f"demo {wl.name}")
    return core, demo_feed(wl, seed=1, speed=1.0, interval_s=1.0, core=core)


async def demo_cpu(seconds: float) -> None:
    """`kvtop demo` in-process (simulated engine + load generator + live runner) for ``seconds``,
    once without the console and once with it on the overview at a 1 s refresh."""
    core, feed = _demo()
    c0, w0 = time.process_time(), time.perf_counter()
    await feed.run(duration_s=seconds)
    base = (time.process_time() - c0) / (time.perf_counter() - w0)
    core, feed = _demo()
    app = KvtopApp(core, feed=feed, interval=1.0, title="kvtop demo: preemption-storm")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(1.0)
        c0, w0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        with_ui = (time.process_time() - c0) / (time.perf_counter() - w0)
        n = len(app.snap.requests) if app.snap else 0
    print(f"kvtop demo (preemption-storm, seed 1), {seconds:.0f} s at 1 s interval, {n} requests tracked: "
          f"demo without console {base * 100:.1f}% of one core; with the console {with_ui * 100:.1f}%; "
          f"console's own share {(with_ui - base) * 100:.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--skip-cpu", action="store_true")
    args = ap.parse_args()
    asyncio.run(refresh_cost(args.ticks, args.requests))
    if not args.skip_cpu:
        asyncio.run(cpu_use(args.seconds, args.requests, "2"))
        asyncio.run(cpu_use(args.seconds, 64, "1"))
        asyncio.run(demo_cpu(args.seconds))


if __name__ == "__main__":
    main()
