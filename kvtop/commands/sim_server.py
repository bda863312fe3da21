"""`kvtop sim-server`: the simulated engine as an OpenAI-compatible server with vLLM's /metrics."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys

from kvtop.commands._options import seconds_arg
from kvtop.errors import RunFailure, UsageError

NAME = "sim-server"
HELP = "serve the simulated engine over HTTP (OpenAI-compatible streaming, vLLM /metrics)"
ORDER = 61


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", default=None, help="built-in preset (default: healthy)")
    src.add_argument("--workload", metavar="FILE", help="workload JSON file (engine part is used)")
    p.add_argument("--policy", metavar="NAME", help="recompute, swap, or a policy variant the preset defines")
    p.add_argument("--engine-flags", metavar="FLAGS", default=None,
                   help="vLLM flags to apply to the simulated engine, e.g. \"$(kvtop advise --trace T --emit-flags)\"")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: an ephemeral port, printed at start)")
    p.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second (default 1)")
    p.add_argument("--seed", type=int, default=1, help="seed for output lengths the client does not fix")
    p.add_argument("--duration", type=seconds_arg, default=None, metavar="DURATION",
                   help="stop after this long (wall clock; 30, 30s, 2m)")


def run(args: argparse.Namespace) -> int:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.sim.server import SimServer
    from kvtop.sim.workload import load_preset, load_workload_file

    if not (args.speed > 0 and math.isfinite(args.speed)):
        raise UsageError(f"--speed must be a positive number, not {args.speed:g}")
    if args.duration is not None and not args.duration > 0:
        raise UsageError(f"--duration must be positive, not {args.duration:g}")
    if not args.host.strip():
        # an empty host binds every interface; loopback unless the user names an address
        raise UsageError("--host is empty: give an address (127.0.0.1 by default; 0.0.0.0 for every interface)")
    if not 0 <= args.port <= 65535:
        raise UsageError("--port must be between 0 and 65535")
    wl = load_workload_file(args.workload) if args.workload else load_preset(args.preset or "healthy")
    wl = wl.with_policy(args.policy)
    if args.engine_flags:
        from kvtop.sim.flags import apply_engine_flags

        wl = apply_engine_flags(wl, args.engine_flags)

    async def main() -> None:
        # Ctrl-C and SIGTERM stop the server in order: streams hung up, port released, no traceback.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        srv = SimServer(wl, speed=args.speed, seed=args.seed, host=args.host, port=args.port)
        try:
            url = await srv.start()
        except OSError as e:
            raise RunFailure(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        sys.stdout.write(f"kvtop sim-server: {wl.name} ({wl.engine.model}, {wl.engine.preemption_mode}) "
                         f"at {url} (speed {args.speed:g}x); metrics at {url}/metrics\n")
        sys.stdout.flush()
        try:
            await asyncio.wait_for(stop.wait(), args.duration)
        except asyncio.TimeoutError:
            pass
        finally:
            await srv.stop()

    asyncio.run(main())
    return 0
