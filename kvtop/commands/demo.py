"""`kvtop demo`: the console against the built-in simulated engine and load generator."""

from __future__ import annotations

import argparse

NAME = "demo"
HELP = "run the console against a built-in simulated engine with generated traffic (no GPU needed)"
ORDER = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", metavar="NAME", default="preemption-storm",
                   help="simulated scenario (default preemption-storm; see README: Simulated engine and presets)")
    p.add_argument("--policy", metavar="NAME", help="recompute, swap, or a policy variant the preset defines")
    p.add_argument("--seed", type=int, default=1, help="traffic seed")
    p.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second (default 1)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between scrapes")
    p.add_argument("--headless", action="store_true", help="no console: print a text snapshot after --duration")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="seconds to run (required with --headless)")


def _render(snap) -> str:  # noqa: ANN001
    try:
        from kvtop.views.text import render_text
    except ImportError:
        return _summary(snap)
    return render_text(snap)


def _summary(snap) -> str:  # noqa: ANN001
    lines = [f"kvtop demo  t={snap.t:.1f}s  window {snap.window_s:.0f}s"]
    for e in snap.engines:
        def f(v, fmt="{:.0f}"):  # noqa: ANN001, ANN202
            return "n/a" if v is None else fmt.format(v)
        lines.append(f"engine {e.url} {e.model or ''}: KV {f(e.kv_usage and e.kv_usage * 100, '{:.0f}%')}, "
                     f"running {f(e.running)}, waiting {f(e.waiting)}, preemptions {f(e.preemptions_total)} "
                     f"({f(e.preemptions_per_s, '{:.2f}')}/s), gen {f(e.generation_tokens_per_s)} tok/s")
    reqs = snap.requests
    if reqs:
        gaps = [r.max_gap_s for r in reqs if r.max_gap_s is not None]
        lines.append(f"requests: {len(reqs)} tracked, {sum(r.state == 'running' for r in reqs)} streaming, "
                     f"worst token gap {max(gaps) * 1000:.0f} ms" if gaps else f"requests: {len(reqs)} tracked")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from kvtop.errors import UsageError
    from kvtop.pipeline import demo_feed
    from kvtop.sim.workload import load_preset

    if args.headless and args.duration is None:
        raise UsageError("--headless needs --duration S")
    if args.duration is not None and not args.duration > 0:
        raise UsageError("--duration must be > 0")
    if not args.speed > 0:
        raise UsageError("--speed must be > 0")
    if not args.interval > 0:
        raise UsageError("--interval must be > 0")
    wl = load_preset(args.preset).with_policy(args.policy)
    window = max(10.0, args.duration) if args.duration else 60.0
    feed = demo_feed(wl, seed=args.seed, speed=args.speed, interval_s=args.interval, window_s=window)
    core = feed.core

    if args.headless:
        async def headless() -> None:
            import signal

            # Ctrl-C / SIGTERM end the run early, in order, and still print the report.
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await feed.run(stop=stop, duration_s=args.duration)

        asyncio.run(headless())
        sys.stdout.write(_render(core.snapshot()))
        return 0
    from kvtop.views.tui.app import run_console

    return int(run_console(core=core, feed=feed, title=f"kvtop demo: {wl.name}") or 0)
