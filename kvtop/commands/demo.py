"""`kvtop demo`: the console against the built-in simulated engine and load generator."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import TYPE_CHECKING

from kvtop.commands._longrun import interrupted_note
from kvtop.commands._options import require_terminal, seconds_arg
from kvtop.errors import UsageError
from kvtop.pipeline import demo_feed

if TYPE_CHECKING:
    from kvtop.snapshot import Snapshot

NAME = "demo"
HELP = "run the console against a built-in simulated engine with generated traffic (no GPU needed)"
ORDER = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", metavar="NAME", default="preemption-storm",
                   help="simulated scenario (default preemption-storm; see README: Simulated engine and presets)")
    p.add_argument("--policy", metavar="NAME", help="recompute, swap, or a policy variant the preset defines")
    p.add_argument("--seed", type=int, default=1, help="traffic seed")
    p.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second (default 1)")
    p.add_argument("--interval", type=seconds_arg, default=1.0, metavar="DURATION",
                   help="time between scrapes (default 1s; 500ms, 2s ok)")
    p.add_argument("--headless", action="store_true", help="no console: print a text snapshot after --duration")
    p.add_argument("--duration", type=seconds_arg, default=None, metavar="DURATION",
                   help="seconds to run (required with --headless)")


def _render(snap: Snapshot) -> str:
    from kvtop.views.text import render_text  # only for --headless (see run)

    return render_text(snap)


def run(args: argparse.Namespace) -> int:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.sim.workload import load_preset

    if args.headless and args.duration is None:
        raise UsageError("--headless needs --duration S")
    if args.duration is not None and not args.duration > 0:
        raise UsageError("--duration must be > 0")
    # beyond ~100x the simulated engine and its load generator fall behind the wall clock (a 2 s run
    # at 1000x took 9.5 s), and an infinite speed never reached --duration
    if not 0 < args.speed <= 100:
        raise UsageError(f"--speed must be > 0 and at most 100, not {args.speed:g}")
    if not args.interval > 0:
        raise UsageError("--interval must be > 0")
    wl = load_preset(args.preset).with_policy(args.policy)
    if not args.headless:
        require_terminal("for a report without one: kvtop demo --headless --duration 10")
    window = max(10.0, args.duration) if args.duration else 60.0
    feed = demo_feed(wl, seed=args.seed, speed=args.speed, interval_s=args.interval, window_s=window)
    core = feed.core

    if args.headless:
        async def headless() -> None:
            # Ctrl-C / SIGTERM end the run early, in order, and still print the report.
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await feed.run(stop=stop, duration_s=args.duration)
            if stop.is_set():
                interrupted_note("demo", "the report below covers the run until now")

        asyncio.run(headless())
        # the window is what was sampled (a 2 s run said "window 10.0 s", one stopped after 6 s of
        # 60 "window 60.0 s"), as `kvtop snapshot` reports it
        span = max((e.rates_over_s or 0.0 for e in core.snapshot().engines), default=0.0)
        if span > 0:
            core.window_s = min(core.window_s, round(span, 3))
        sys.stdout.write(_render(core.snapshot()))
        return 0
    from kvtop.views.tui.app import run_console  # Textual: only the console, never headless

    return int(run_console(core=core, feed=feed, title=f"kvtop demo: {wl.name}") or 0)
