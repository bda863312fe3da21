"""`kvtop agent`: the long-running node agent that publishes kvtop's findings to Prometheus."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvtop.commands._longrun import EngineWatch
from kvtop.commands._options import (
    add_capture_option,
    add_engine_options,
    add_host_options,
    add_itl_option,
    add_probe_option,
    add_wait_option,
    awaited_first_scrape,
    refuse_self_proxy,
    require_capture,
    source_options,
    wait_seconds,
)
from kvtop.config import load_config, parse_seconds
from kvtop.errors import UsageError

log = logging.getLogger("kvtop.agent")

if TYPE_CHECKING:
    from kvtop.agent import AgentOptions

NAME = "agent"
HELP = "headless node agent: live analysis served as Prometheus metrics (+ rotating trace segments)"
DESCRIPTION = (
    "Runs the console's sources and live analysis without a screen and serves them at "
    "http://LISTEN/metrics for Prometheus (default 127.0.0.1:9470; --listen 0.0.0.0:9470 to let a "
    "remote Prometheus scrape it). Per-request causes need observed streams: --capture reads them "
    "from the engine port's packets, --proxy-listen puts the recording proxy in front of the first "
    "--url, --probe sends canary streams. --trace-dir keeps "
    "compressed, size/age-rotated trace segments that `kvtop replay` opens."
)
ORDER = 35


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix) or t.endswith(suffix + "I"):
            t = t.removesuffix("I").removesuffix(suffix)
            mult = m
            break
    try:
        v = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 1G)") from None
    if not v >= 1:
        raise argparse.ArgumentTypeError(f"size must be positive, not {text!r}")
    return int(v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_options(p)
    p.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="where /metrics is served (default 127.0.0.1:9470, loopback only)")
    p.add_argument("--proxy-listen", dest="proxy_listen", default=None, metavar="HOST:PORT",
                   help="run the recording proxy here, in front of the first --url")
    add_probe_option(p)
    add_capture_option(p)
    p.add_argument("--probe-max-tokens", dest="probe_max_tokens", type=int, default=32, metavar="N",
                   help="max_tokens of each probe stream (default 32)")
    p.add_argument("--trace-dir", dest="trace_dir", default=None, metavar="DIR",
                   help="keep a rotating trace here (compressed segments `kvtop replay` opens)")
    p.add_argument("--trace-max-size", dest="trace_max_size", type=_size, default=None, metavar="SIZE",
                   help="start a new segment past this size (default 64M)")
    p.add_argument("--trace-max-age", dest="trace_max_age", default=None, metavar="SECONDS",
                   help="start a new segment after this long (default 10m)")
    p.add_argument("--trace-keep-size", dest="trace_keep_size", type=_size, default=None, metavar="SIZE",
                   help="delete the oldest segments beyond this total (default 1G)")
    p.add_argument("--trace-keep-age", dest="trace_keep_age", default=None, metavar="SECONDS",
                   help="delete segments older than this (default 24h)")
    p.add_argument("--otlp-endpoint", dest="otlp_endpoint", default=None, metavar="URL",
                   help="export one OpenTelemetry span per finished request, a stall event per spike, over OTLP/HTTP "
                        "(e.g. http://127.0.0.1:4318; needs the otlp extra)")
    p.add_argument("--duration", default=None, metavar="SECONDS", help="stop after this long (default: run until stopped)")
    add_wait_option(p, "the agent")
    add_itl_option(p)
    add_host_options(p)


def run(args: argparse.Namespace) -> int:
    # the agent (aiohttp, the analysis) loads only when it runs: the parser imports every command module
    from kvtop.agent import DEFAULT_LISTEN, AgentOptions
    from kvtop.sources.proxy import parse_listen

    cfg = load_config(getattr(args, "config", None))
    src = source_options(args, cfg)
    if not src.urls:
        raise UsageError("give the engine(s) to watch: --url URL")
    require_capture(src)
    duration = None if args.duration is None else parse_seconds(args.duration, "--duration")
    if duration is not None and not duration > 0:
        raise UsageError(f"--duration must be positive, not {duration:g}")
    if not 1 <= args.probe_max_tokens <= 4096:
        raise UsageError("--probe-max-tokens must be between 1 and 4096")
    wait = wait_seconds(args)
    # None until given: a segment limit without --trace-dir bounds nothing and is refused
    limits = {"--trace-max-size": args.trace_max_size, "--trace-max-age": args.trace_max_age,
              "--trace-keep-size": args.trace_keep_size, "--trace-keep-age": args.trace_keep_age}
    given = [f for f, v in limits.items() if v is not None]
    if given and not args.trace_dir:
        raise UsageError(f"{given[0]} bounds the trace segments: give --trace-dir DIR too")
    max_age = parse_seconds(args.trace_max_age or "10m", "--trace-max-age")
    keep_age = parse_seconds(args.trace_keep_age or "24h", "--trace-keep-age")
    max_size = args.trace_max_size if args.trace_max_size is not None else 64 << 20
    keep_size = args.trace_keep_size if args.trace_keep_size is not None else 1 << 30
    if not max_age > 0 or not keep_age > 0:
        raise UsageError("--trace-max-age and --trace-keep-age must be positive")
    try:
        listen = parse_listen(args.listen or DEFAULT_LISTEN, default_port=9470)
        proxy_listen = parse_listen(args.proxy_listen) if args.proxy_listen else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if proxy_listen is not None:
        refuse_self_proxy(proxy_listen, src.urls[0], "--url", "--proxy-listen")
    otlp_url = None
    if args.otlp_endpoint:
        from kvtop import otlp

        try:
            otlp_url = otlp.endpoint(args.otlp_endpoint)
            otlp.require_proto()
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.trace_dir:
        d = Path(args.trace_dir)
        if d.exists() and not d.is_dir():
            raise UsageError(f"--trace-dir {d} is not a directory")
        try:
            # request timings are operational data: a directory kvtop creates is the agent user's alone
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            # a directory that takes no file (/proc/self, read-only, full) fails now, not record by record
            fd, probe = tempfile.mkstemp(prefix=".kvtop-probe-", dir=d)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise UsageError(f"cannot write to --trace-dir {d}: {e.strerror or e}") from None

    opts = AgentOptions(
        sources=dataclasses.replace(src, proxy_listen=proxy_listen), listen=listen,
        probe_max_tokens=args.probe_max_tokens, trace_dir=args.trace_dir, trace_max_bytes=max_size, trace_max_age_s=max_age,
        trace_keep_bytes=keep_size, trace_keep_age_s=keep_age, otlp_endpoint=otlp_url,
    )
    return asyncio.run(_main(opts, duration, wait))


async def _main(opts: AgentOptions, duration: float | None, wait_s: float = 0.0) -> int:
    from kvtop.agent import build_agent  # see run

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    agent = build_agent(opts)
    # A wrong --url fails now, in one line (exit 1), rather than serving zeros for ever; with
    # --wait-for-engine the agent keeps trying for that long first (an engine still loading its model).
    watch = EngineWatch(log)
    agent.runner.sinks.append(watch.sink)
    first = await awaited_first_scrape(agent.runner, wait_s, log, stop)
    for rec in first:
        agent.runner.emit(rec)
    started = loop.time()
    await agent.run(stop, duration_s=duration)
    log.info(f"stopped after {loop.time() - started:.0f} s", extra={"fields": {"event": "stopped"}})
    return 0
