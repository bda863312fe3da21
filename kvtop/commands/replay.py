"""`kvtop replay`: feed a recorded trace through the same core a live run uses."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from kvtop.commands._longrun import INTERRUPTS, interrupted_note
from kvtop.commands._options import add_itl_option, itl_target_s, seconds_arg
from kvtop.commands.tui import replay_console
from kvtop.errors import UsageError
from kvtop.pipeline import replay_feed, run_for

NAME = "replay"
HELP = "replay a trace file (recorded speed or faster) through the console / a headless summary"
DESCRIPTION = (
    "Feed TRACE through the same core as a live run: in the console on a terminal (recorded speed; "
    "pause, step and seek there), else headless, printing the report as it stands at the end of the "
    "trace, or at --until."
)
ORDER = 35


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="trace file written by `kvtop record` / `kvtop proxy --record`")
    p.add_argument("--speed", type=float, default=None,
                   help="1 = recorded speed, 10 = ten times faster, 0 = as fast as possible "
                        "(default: 1 in the console, 0 headless)")
    p.add_argument("--headless", action="store_true",
                   help="no console: print the report at the end (the default when output is not a terminal)")
    p.add_argument("--until", type=seconds_arg, default=None, metavar="DURATION",
                   help="stop at this trace time (seconds from the start of the recording)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="headless output format")
    add_itl_option(p)


def run(args: argparse.Namespace) -> int:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.model.trace import TraceError

    if args.speed is not None and not (math.isfinite(args.speed) and args.speed >= 0):
        raise UsageError(f"--speed must be a number >= 0, not {args.speed:g}")
    target = itl_target_s(args, {})
    console = not args.headless and args.until is None and sys.stdout.isatty() and sys.stdin.isatty()
    speed = args.speed if args.speed is not None else (1.0 if console else 0.0)
    if console:
        return replay_console(args.trace, speed=speed, itl_target_s=target)
    try:
        feed = replay_feed(args.trace, speed=speed, itl_target_s=target, label="replay")
    except TraceError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot read trace {args.trace}: {e.strerror or e}") from None

    async def go() -> bool:
        # Ctrl-C / SIGTERM stop the replay where it is and still print the report (SIGTERM ended it
        # with no report, and a SIGINT that a script's shell ignores was never seen)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in INTERRUPTS:
            loop.add_signal_handler(sig, stop.set)
        if args.until is not None and speed == 0:
            feed.seek(args.until)
        elif args.until is not None:
            await run_for(feed, until=lambda: feed.t >= args.until or stop.is_set())
        else:
            await feed.run(stop=stop)
        return stop.is_set()

    try:
        if asyncio.run(go()):
            interrupted_note("replay", f"the report below is as it stood at trace time {feed.t:.1f} s")
    except KeyboardInterrupt:
        interrupted_note("replay", f"the report below is as it stood at trace time {feed.t:.1f} s")
    finally:
        feed.close()
    warning = feed.warning()
    if warning:
        print(f"kvtop: warning: {warning}", file=sys.stderr)
    snap = feed.core.snapshot(now=feed.t)
    if args.format == "json":
        print(json.dumps(snap.to_json(), indent=2, allow_nan=False))
        return 0
    from kvtop.views.text import render_text  # see the note at the top of run

    print(render_text(snap, trace=(feed.t, feed.duration)), end="")
    return 0
