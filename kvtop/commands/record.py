"""`kvtop record`: headless recorder of engine, GPU, host and per-request records into one trace."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvtop.model.sanitize import redact_url

NAME = "record"
HELP = "record engine, GPU, host and (with --proxy-listen / --probe) per-request timings to a trace file"
DESCRIPTION = (
    "Headless: scrapes the engine(s), the GPU and the host every --interval and appends every record "
    "to the trace (JSON Lines, flushed at least once a second). With --proxy-listen, a recording proxy "
    "in front of the first --url records each request's token timeline; --probe RATE sends kvtop's "
    "own small canary streams. Stops on Ctrl-C / SIGTERM or after --duration, flushing everything."
)
ORDER = 30

FLUSH_INTERVAL_S = 0.5  # checked every 0.25 s, so a record is on disk within ~0.75 s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="trace file to write")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it already exists")
    p.add_argument("--url", action="append", default=None, metavar="URL",
                   help="engine base URL or its /metrics URL (repeat for several engines)")
    p.add_argument("--proxy-listen", dest="proxy_listen", default=None, metavar="HOST:PORT",
                   help="run the recording proxy here, in front of the first --url (e.g. 127.0.0.1:8001)")
    p.add_argument("--proxy-workers", dest="proxy_workers", type=int, default=1, metavar="N",
                   help="run the proxy as N processes sharing the port (for more than ~25K chunks/s)")
    p.add_argument("--probe", type=float, default=None, metavar="RATE",
                   help="send canary streams at this many per second (e.g. 0.2); off by default")
    p.add_argument("--probe-max-tokens", dest="probe_max_tokens", type=int, default=32, metavar="N",
                   help="max_tokens of each probe stream (default 32)")
    p.add_argument("--duration", default=None, metavar="SECONDS", help="stop after this long (default: until Ctrl-C)")
    p.add_argument("--interval", default=None, metavar="SECONDS", help="poll interval (default 1)")
    from kvtop.config import add_token_options

    add_token_options(p)
    p.add_argument("--adapter", default=None, metavar="NAME", help="engine adapter (default: auto-detect)")
    p.add_argument("--timeout", default=None, metavar="SECONDS", help="HTTP timeout per scrape (default 2)")
    p.add_argument("--no-gpu", dest="gpu", action="store_const", const=False, default=None,
                   help="do not read the GPU (NVML)")
    p.add_argument("--no-host", dest="host", action="store_const", const=False, default=None,
                   help="do not read host memory")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvtop.config import engine_bases, load_config, parse_seconds, resolve, resolve_token
    from kvtop.errors import UsageError

    cfg = load_config(getattr(args, "config", None))
    urls: list[str] = resolve(args, cfg, "url", [])
    # Not from the config: its "duration" is the snapshot window, not how long to record.
    duration = None if args.duration is None else parse_seconds(args.duration, "--duration")
    interval = parse_seconds(resolve(args, cfg, "interval", 1.0), "--interval")
    timeout = parse_seconds(resolve(args, cfg, "timeout", 2.0), "--timeout")
    token = resolve_token(args, cfg)
    adapter = resolve(args, cfg, "adapter")
    gpu = bool(resolve(args, cfg, "gpu", True))
    host = bool(resolve(args, cfg, "host", True))

    if not urls:
        raise UsageError("give the engine to record: --url URL")
    out = Path(args.output)
    if out.is_dir():
        raise UsageError(f"{args.output} is a directory")
    if out.exists() and out.stat().st_size > 0 and not args.force:
        # Appending would restart the trace clock mid-file under the old header.
        raise UsageError(f"{args.output} already exists (use --force to overwrite)")
    if duration is not None and not duration > 0:
        raise UsageError(f"--duration must be positive, not {duration:g}")
    if not 0.05 <= interval <= 3600:
        raise UsageError(f"--interval must be between 0.05 and 3600 seconds, not {interval:g}")
    if not 0 < timeout <= 600:
        raise UsageError(f"--timeout must be between 0 and 600 seconds, not {timeout:g}")
    if args.probe is not None and not 0 < args.probe <= 100:
        raise UsageError(f"--probe must be between 0 and 100 per second, not {args.probe:g}")
    if not 1 <= args.proxy_workers <= 64:
        raise UsageError("--proxy-workers must be between 1 and 64")
    if not 1 <= args.probe_max_tokens <= 4096:
        raise UsageError("--probe-max-tokens must be between 1 and 4096")
    bases = engine_bases(urls)
    listen = None
    if args.proxy_listen:
        from kvtop.proxy import parse_listen

        try:
            listen = parse_listen(args.proxy_listen)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if adapter is not None:
        from kvtop.plugin import PluginError, load_adapter

        try:
            load_adapter(adapter)
        except PluginError as e:
            raise UsageError(str(e)) from None
    opts = dict(urls=urls, base=bases[0], duration=duration, interval=interval, timeout=timeout, token=token,
                adapter=adapter, gpu=gpu, host=host, listen=listen)
    return asyncio.run(_record(args, opts))


async def _record(args: argparse.Namespace, o: dict[str, Any]) -> int:
    import asyncio
    import signal
    import sys

    from kvtop.core import Core
    from kvtop.errors import UsageError
    from kvtop.live import LiveRunner
    from kvtop.model.trace import TraceWriter, make_header

    # Handlers first: a signal that lands while starting up must still stop the recorder in order.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    core = Core(source_label="record")
    runner = LiveRunner(core, o["urls"], interval_s=o["interval"], gpu=o["gpu"], host=o["host"],
                        token=o["token"], adapter=o["adapter"], timeout_s=o["timeout"])
    # One scrape before the header is written, so the header names the adapter and model.
    first = await runner.scrapers[0].scrape(runner.now())
    up = next((r for r in first if r.up), None)
    engine = {"adapter": up.adapter if up else None, "url": redact_url(o["urls"][0]), "model": up.model if up else None,
              "version": up.version if up else None}
    kv = {"bytes_per_token": None, "block_size": up.block_size if up else None,
          "capacity_tokens": up.kv_capacity_tokens if up else None}
    extra: dict[str, Any] = {"recorder": "kvtop record", "interval_s": o["interval"]}
    if len(o["urls"]) > 1:
        extra["urls"] = [redact_url(u) for u in o["urls"]]
    try:
        if args.force:
            Path(args.output).unlink(missing_ok=True)
        writer = TraceWriter(args.output, make_header(engine=engine, kv=kv, **extra),
                             flush_interval_s=FLUSH_INTERVAL_S)
    except OSError as e:
        await runner.aclose()
        raise UsageError(f"cannot write {args.output}: {e.strerror or e}") from None
    runner.sinks.append(writer.write)
    for rec in first:
        runner.emit(rec)

    proxy = None
    try:
        if o["listen"] is not None:
            from kvtop.proxy import make_proxy

            host, port = o["listen"]
            proxy = make_proxy(o["base"], runner.emit, runner.now, host=host, port=port,
                               workers=args.proxy_workers)
            try:
                await proxy.start()
            except OSError as e:
                proxy = None
                raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None

        tasks = [asyncio.create_task(_flush_loop(writer, stop))]
        if args.probe:
            from kvtop.sources.probe import Probe

            probe = Probe(o["base"], args.probe, runner.emit, runner.now, max_tokens=args.probe_max_tokens)
            tasks.append(asyncio.create_task(probe.run(stop)))
        what = f"{len(o['urls'])} engine(s)"
        if proxy is not None:
            what += f", proxy {proxy.url} -> {redact_url(o['base'])}"
        if args.probe:
            what += f", probe {args.probe:g}/s"
        print(f"kvtop record: {what} -> {args.output} (Ctrl-C to stop)", file=sys.stderr, flush=True)
        try:
            await runner.run(duration_s=o["duration"], stop=stop)
        finally:
            stop.set()
            if proxy is not None:
                # In-flight streams are cut off now and recorded as cancelled (proxy_stopped).
                await proxy.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if proxy is not None:
            await proxy.stop()
        writer.close()
    print(f"kvtop record: {writer.count} record(s) written to {args.output}", file=sys.stderr)
    return 0


async def _flush_loop(writer: Any, stop: Any) -> None:
    import asyncio

    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.25)
        except asyncio.TimeoutError:
            pass
        writer.flush_if_due()
