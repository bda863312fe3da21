"""`kvtop record`: headless recorder of engine, GPU, host and per-request records into one trace."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtop.commands._longrun import STOP_SIGNALS, EngineWatch, GuardedTrace, Progress
from kvtop.commands._options import (
    add_capture_option,
    add_engine_options,
    add_host_options,
    add_probe_option,
    add_wait_option,
    awaited_first_scrape,
    check_output,
    refuse_self_proxy,
    replace_output,
    require_capture,
    same_file,
    source_options,
    wait_seconds,
)
from kvtop.config import engine_bases, load_config, parse_seconds
from kvtop.errors import RunFailure, UsageError
from kvtop.model.sanitize import redact_url
from kvtop.pipeline import SourceOptions, live_feed

if TYPE_CHECKING:
    from kvtop.analysis.analyzer import Analyzer
    from kvtop.feeds.live import LiveRunner
    from kvtop.otlp import LiveExport

NAME = "record"
HELP = "record engine, GPU, host and (with --capture / --proxy-listen / --probe) per-request timings to a trace file"
DESCRIPTION = (
    "Headless: scrapes the engine(s), the GPU and the host every --interval and appends every record "
    "to the trace (JSON Lines, flushed at least once a second). With --proxy-listen, a recording proxy "
    "in front of the first --url records each request's token timeline; --capture observes the "
    "engine's own port passively (root or CAP_NET_RAW); --probe RATE sends kvtop's own small canary streams. Stops on Ctrl-C / SIGTERM or after --duration, flushing everything."
)
ORDER = 30

FLUSH_INTERVAL_S = 0.5  # checked every 0.25 s, so a record is on disk within ~0.75 s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="trace file to write")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it already exists")
    add_engine_options(p)
    p.add_argument("--proxy-listen", dest="proxy_listen", default=None, metavar="HOST:PORT",
                   help="run the recording proxy here, in front of the first --url (e.g. 127.0.0.1:8001)")
    p.add_argument("--proxy-workers", dest="proxy_workers", type=int, default=1, metavar="N",
                   help="run the proxy as N processes sharing the port (for more than ~25K chunks/s)")
    add_capture_option(p)
    add_probe_option(p)
    p.add_argument("--probe-max-tokens", dest="probe_max_tokens", type=int, default=32, metavar="N",
                   help="max_tokens of each probe stream (default 32)")
    p.add_argument("--duration", default=None, metavar="SECONDS", help="stop after this long (default: until Ctrl-C)")
    p.add_argument("--otlp-endpoint", dest="otlp_endpoint", default=None, metavar="URL",
                   help="also analyse live and export one OpenTelemetry span per finished request, a stall event per "
                        "spike, over OTLP/HTTP (e.g. http://127.0.0.1:4318; needs the otlp extra)")
    add_wait_option(p, "the recorder")
    add_host_options(p)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(getattr(args, "config", None))
    opts = source_options(args, cfg)
    # Not from the config: its "duration" is the snapshot window, not how long to record.
    duration = None if args.duration is None else parse_seconds(args.duration, "--duration")
    if not opts.urls:
        raise UsageError("give the engine to record: --url URL")
    check_output(args.output, args.force)
    if opts.witness is not None and same_file(args.output, opts.witness):
        raise UsageError(f"{args.output} is the --witness file the engine writes: give the trace another path")
    if duration is not None and not duration > 0:
        raise UsageError(f"--duration must be positive, not {duration:g}")
    if not 1 <= args.proxy_workers <= 64:
        raise UsageError("--proxy-workers must be between 1 and 64")
    if args.proxy_workers != 1 and not args.proxy_listen:
        raise UsageError("--proxy-workers sizes the recording proxy: give --proxy-listen HOST:PORT too")
    if not 1 <= args.probe_max_tokens <= 4096:
        raise UsageError("--probe-max-tokens must be between 1 and 4096")
    engine_bases(list(opts.urls))
    wait = wait_seconds(args)
    require_capture(opts)
    if args.otlp_endpoint:
        from kvtop import otlp

        try:
            args.otlp_endpoint = otlp.endpoint(args.otlp_endpoint)
            otlp.require_proto()
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.proxy_listen:
        from kvtop.sources.proxy import parse_listen  # aiohttp's server: only when there is a proxy

        try:
            listen = parse_listen(args.proxy_listen)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if opts.urls:
            refuse_self_proxy(listen, opts.urls[0], "--url", "--proxy-listen")
        opts = dataclasses.replace(opts, proxy_listen=listen, proxy_workers=args.proxy_workers)
    return asyncio.run(_record(args, opts, duration=duration, wait_s=wait))


async def _record(args: argparse.Namespace, opts: SourceOptions, duration: float | None, wait_s: float = 0.0) -> int:
    # the feeds and the trace writer load only when the command runs: the parser imports every command module
    from kvtop.feeds.sources import ProxyRecorder

    # Handlers first: a signal that lands while starting up must still stop the recorder in order.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    # the recorder keeps no analysis (the trace is for `kvtop analyze` / `kvtop replay`) unless its
    # spans are exported as it goes
    runner = live_feed(opts, label="record", analysis=bool(args.otlp_endpoint), probe_max_tokens=args.probe_max_tokens)
    extra: dict[str, object] = {}
    if opts.capture_port is not None:
        extra["capture_port"] = opts.capture_port
    if len(opts.urls) > 1:
        extra["urls"] = [redact_url(u) for u in opts.urls]
    writer, engine = await open_trace(runner, opts, args.output, args.force, "kvtop record", wait_s=wait_s, stop=stop,
                                      forwards=opts.proxy_listen is not None, **extra)

    try:
        try:
            await runner.start()  # the proxy listens (or says why not) before the line says so
        except OSError as e:
            await runner.aclose()
            # the run never started: its trace (a header and one scrape) would only block the retry
            writer.close()
            discard_trace(args.output)
            assert opts.proxy_listen is not None  # only the proxy raises OSError when it starts
            host, port = opts.proxy_listen
            raise RunFailure(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        proxy = runner.source("proxy")
        progress = Progress(f"kvtop record: {args.output}")
        tasks = [asyncio.create_task(_flush_loop(writer, stop, progress, runner.now, duration))]
        spans = None
        if args.otlp_endpoint:
            from kvtop.otlp import LiveExport

            spans = LiveExport(args.otlp_endpoint, time.time() - runner.now())
            tasks.append(asyncio.create_task(_otlp_loop(runner, spans, engine, opts.interval_s, stop)))
        what = f"{len(opts.urls)} engine(s)"
        if isinstance(proxy, ProxyRecorder):
            what += f", proxy {proxy.url} -> {redact_url(proxy.upstream)}"
        if opts.probe_rate:
            what += f", probe {opts.probe_rate:g}/s"
        if opts.capture_port is not None:
            what += f", capture :{opts.capture_port}"
        if spans is not None:
            what += f", OTLP spans to {spans.sender.url}"
        print(f"kvtop record: {what} -> {args.output} (Ctrl-C to stop)", file=sys.stderr, flush=True)
        try:
            # the proxy stops with the run: in-flight streams are cut off and recorded as cancelled
            await runner.run(duration_s=duration, stop=stop)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            progress.close()
            if spans is not None:
                _otlp_final(runner, spans, engine)
                await asyncio.to_thread(spans.close)
    finally:
        writer.close()
    writer.finish()  # the disk refused records: exit 1, saying how many
    print(f"kvtop record: {writer.count} record(s) written to {args.output}", file=sys.stderr)
    cap = runner.core.capture
    if cap is not None and cap.get("status") == "ok":
        print(f"kvtop record: capture :{cap['port']}: {cap['requests']} request(s), {cap['packets']} packet(s), "
              f"{cap['kernel_drops']} kernel drop(s), {cap['holes']} hole(s), {cap['tls_connections']} TLS and "
              f"{cap['http2_connections']} HTTP/2 connection(s) not observable"
              + (f", {cap['encoded_responses']} compressed response(s) unreadable" if cap.get("encoded_responses") else ""),
              file=sys.stderr)
    return 0


def discard_trace(output: str) -> None:
    """Remove the trace (and its token sidecar) of a run that failed before it began."""
    from kvtop.model.token_columns import sidecar_path

    for p in (output, sidecar_path(output)):
        if os.path.isfile(p):
            os.unlink(p)


async def open_trace(runner: LiveRunner, opts: SourceOptions, output: str, force: bool, recorder: str,
                     wait_s: float = 0.0, stop: asyncio.Event | None = None, forwards: bool = False,
                     **extra: object) -> tuple[GuardedTrace, dict[str, Any]]:
    """The trace a live run writes, and the header's engine: one scrape of every engine first (the header
    names the adapter and model; a dead URL fails now, or after ``wait_s`` of retries: exit 1, no
    trace), the header (``recorder``, the poll interval, the run clock's origin, ``extra``), then every
    record the runner emits. ``kvtop record`` and ``kvtop load`` both record through this."""
    from kvtop.model.trace import TraceWriteError, TraceWriter, clock_origin_unix, make_header

    log = logging.getLogger(recorder.replace(" ", "."))
    first = await awaited_first_scrape(runner, wait_s, log, stop)
    # an engine that stops answering mid-recording (or never did, of several) is said on stderr
    runner.sinks.append(EngineWatch(log).sink)
    # the header describes the first --url's engine (as its "url" says)
    up = next((r for r in first if r.up and r.url == runner.scrapers[0].shown_url), None)
    engine = {"adapter": up.adapter if up else None, "url": redact_url(opts.urls[0]), "model": up.model if up else None,
              "version": up.version if up else None}
    kv = {"bytes_per_token": None, "block_size": up.block_size if up else None,
          "capacity_tokens": up.kv_capacity_tokens if up else None}
    # the run clock's origin on the wall clock, to the microsecond: lines up traces of two recorders
    head: dict[str, object] = {"recorder": recorder, "interval_s": opts.interval_s,
                               "clock_t0_unix": clock_origin_unix(runner.now), **extra}
    try:
        if force:
            replace_output(output)
        # with the token sidecar (kvtop.model.token_columns): `kvtop analyze` reads it instead of
        # parsing the token lines
        writer = TraceWriter(output, make_header(engine=engine, kv=kv, **head), flush_interval_s=FLUSH_INTERVAL_S,
                             columns=True)
    except TraceWriteError:  # the header met a full disk: the run failed (exit 1), not its arguments
        await runner.aclose()
        raise
    except OSError as e:
        await runner.aclose()
        raise UsageError(f"cannot write {output}: {e.strerror or e}") from None
    # a recording proxy goes on forwarding its clients' traffic; a run that only records stops
    trace = GuardedTrace(writer, recorder, forwards, on_fail=None if forwards or stop is None else stop.set)
    runner.sinks.append(trace.write)
    for rec in first:
        runner.emit(rec)
    return trace, engine


async def _flush_loop(writer: GuardedTrace, stop: asyncio.Event, progress: Progress, now: Callable[[], float],
                      duration: float | None) -> None:
    start = now()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.25)
        except asyncio.TimeoutError:
            pass
        writer.flush_if_due()
        t = now() - start
        progress.update(t, duration, f"{writer.count} records, {t:.0f} s" + (f" of {duration:g} s" if duration else ""))


def _live_analyzer(runner: LiveRunner) -> Analyzer | None:
    from kvtop.analysis.live import LiveAnalyzer

    analysis = runner.core.analysis
    return analysis.an if isinstance(analysis, LiveAnalyzer) else None


async def _otlp_loop(runner: LiveRunner, spans: LiveExport, engine: dict[str, Any], interval_s: float,
                     stop: asyncio.Event) -> None:
    """Each interval, the requests that ended and settled go out as spans (``kvtop.otlp``)."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except asyncio.TimeoutError:
            pass
        an = _live_analyzer(runner)
        if an is not None:
            an.tick(runner.now())
            spans.tick(an, runner.now(), engine.get("model"), engine.get("adapter"))


def _otlp_final(runner: LiveRunner, spans: LiveExport, engine: dict[str, Any]) -> None:
    an = _live_analyzer(runner)
    if an is not None:
        spans.final(an, engine.get("model"), engine.get("adapter"))
