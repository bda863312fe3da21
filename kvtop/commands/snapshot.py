"""`kvtop snapshot`: sample GPU, host and engines for a while, print one report, exit.

Headless: never imports Textual. Exit 0 when it reported; 2 with one line on stderr for bad
arguments; 1 when none of the engines could be read at all (unreachable, not a metrics endpoint):
at the first scrape, so a wrong URL fails in one --timeout rather than after --duration.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from kvtop.commands._longrun import EngineWatch, Progress, interrupted_note
from kvtop.commands._options import (
    add_capture_option,
    add_engine_options,
    add_host_options,
    add_itl_option,
    add_probe_option,
    add_prometheus_options,
    discovered,
    first_scrape,
    itl_target_s,
    prometheus_auth,
    require_capture,
    selector,
    source_options,
    timeout_s,
)
from kvtop.config import load_config, parse_seconds, resolve
from kvtop.errors import RunFailure, UsageError
from kvtop.model.records import EngineRecord, Record
from kvtop.model.sanitize import redact_url
from kvtop.pipeline import live_feed, prometheus_feed

NAME = "snapshot"
HELP = "sample GPU, host and engines for a while and print one report (json or text)"
DESCRIPTION = (
    "Polls every source for --duration seconds at --interval, then prints one report: rates and "
    "latency quantiles cover the sampling window. Exit 0 when it reported; 2 on bad arguments; 1 "
    "when no engine could be read (checked at the first scrape)."
)
ORDER = 20

DEFAULT_DURATION_S = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_options(p)
    p.add_argument("--duration", default=None, metavar="SECONDS", help="sampling duration (default 5; 10s, 2m ok)")
    p.add_argument("--format", choices=("json", "text"), default=None, help="output format (default text)")
    add_itl_option(p)
    add_probe_option(p)
    add_capture_option(p)
    add_host_options(p)
    add_prometheus_options(p, "read every engine a Prometheus server scrapes instead of --url (--duration: look-back, default 5m)")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(getattr(args, "config", None))
    if getattr(args, "prometheus", None):
        return _prometheus(args, cfg)
    if getattr(args, "selector", None):
        raise UsageError("--selector picks the series of --prometheus; with --url there is none to pick")
    opts = source_options(args, cfg)
    duration = parse_seconds(resolve(args, cfg, "duration", DEFAULT_DURATION_S), "--duration")
    fmt = resolve(args, cfg, "format", "text")
    if not 0 < duration <= 86400:
        raise UsageError(f"--duration must be > 0 and at most 86400 seconds, not {duration:g}")
    if fmt not in ("json", "text"):
        raise UsageError(f"format must be json or text, not {fmt!r}")
    opts, none_found = discovered(opts, cfg)
    if not opts.urls and not opts.gpu and not opts.host:
        raise RunFailure(none_found or "nothing to sample")  # --no-gpu --no-host and no engine answers
    if none_found:
        print(f"kvtop snapshot: {none_found}", file=sys.stderr)
    require_capture(opts)
    urls = list(opts.urls)
    first_t: list[float] = []

    def note_first(rec: Record) -> None:
        if not first_t and isinstance(rec, EngineRecord) and rec.up:
            first_t.append(rec.t)

    runner = live_feed(opts, label="live", window_s=duration, sinks=[note_first])
    core = runner.core

    stop = asyncio.Event()

    async def sample() -> None:
        # Ctrl-C / SIGTERM end the window early: the report covers what was sampled until then
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        first = await first_scrape(runner)  # a wrong URL fails now, not after --duration
        # of several engines, one that does not answer (or stops) is said on stderr, as record says it
        runner.sinks.append(EngineWatch(logging.getLogger("kvtop.snapshot")).sink)
        for rec in first:
            runner.emit(rec)
        progress = Progress("kvtop snapshot: sampling")
        ticker = asyncio.create_task(_tick(progress, runner.now, duration))
        try:
            await runner.run(duration_s=duration, stop=stop, final_poll=True)
        finally:
            ticker.cancel()
            progress.close()

    asyncio.run(sample())
    # The window is what was actually sampled: from the first good engine sample to the final
    # poll, so rates and quantiles cover exactly the data they were computed from.
    start = first_t[0] if first_t else 0.0
    core.window_s = max(round(core.now - start, 3), 0.001)
    snap = core.snapshot()
    # Engines in the order the user named them (the core keeps first-answered order).
    order = {redact_url(u.strip().rstrip("/")): i for i, u in enumerate(urls)}
    snap = dataclasses.replace(
        snap, engines=tuple(sorted(snap.engines, key=lambda e: (order.get(e.url, len(order)), e.engine or "")))
    )

    # an engine that answered at some point of the window gives a report (its last error shown in it);
    # only a window in which no engine ever answered is a failed run
    if urls and not first_t:
        down = next((e for e in snap.engines if e.error), None)
        why = f"{down.url}: {down.error}" if down else "no engine answered"
        many = "" if len(urls) == 1 else f" (none of {len(urls)} engines)"
        raise RunFailure(f"could not read any engine{many}: {why}")
    if not urls and snap.gpu_status != "ok" and snap.host is None:
        raise RunFailure(f"no source could be read (GPU: {snap.gpu_status}; host: unavailable)")

    if stop.is_set():
        interrupted_note("snapshot", f"the report covers the {core.window_s:.1f} s sampled (of --duration {duration:g} s)")
    if fmt == "json":
        print(json.dumps(snap.to_json(), indent=2, allow_nan=False))
    else:
        # the text view loads only for a text report (the parser imports every command module)
        from kvtop.views.text import render_text

        print(render_text(snap), end="")
    return 0


async def _tick(progress: Progress, now: Callable[[], float], duration: float) -> None:
    start = now()
    while True:
        t = now() - start
        progress.update(t, duration, f"{t:.0f} of {duration:g} s")
        await asyncio.sleep(0.25)


def _prometheus(args: argparse.Namespace, cfg: dict[str, Any]) -> int:
    """`snapshot --prometheus URL`: one report over the last --duration of what Prometheus holds."""
    if args.url:
        raise UsageError("give either --url or --prometheus, not both")
    window = parse_seconds(args.duration, "--duration") if args.duration is not None else 300.0
    fmt = resolve(args, cfg, "format", "text")
    if not 1 <= window <= 7 * 86400:
        raise UsageError(f"--duration (the look-back) must be between 1 s and 7 days, not {window:g}")
    feed = prometheus_feed(args.prometheus, selector=selector(args), itl_target_s=itl_target_s(args, cfg),
                           window_s=window, step_s=max(1.0, min(15.0, window / 30)),
                           timeout_s=timeout_s(args, cfg, 10.0), auth=prometheus_auth(args, cfg))
    try:
        feed.poll_once()
    finally:
        feed.fleet.client.close()
    if feed.fleet.error and not feed.fleet.targets:
        raise RunFailure(feed.fleet.error)
    if not feed.fleet.targets:
        raise RunFailure(f"Prometheus at {feed.fleet.client.url} scrapes no engine (vLLM, SGLang, TGI, llama.cpp, "
                         "Triton metric names)" + (f" matching {args.selector}" if args.selector else ""))
    snap = feed.core.snapshot()
    if fmt == "json":
        print(json.dumps(snap.to_json(), indent=2, allow_nan=False))
    else:
        from kvtop.views.text import render_text  # see run

        print(render_text(snap), end="")
    return 0
