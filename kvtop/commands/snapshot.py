"""`kvtop snapshot`: sample GPU, host and engines for a while, print one report, exit.

Headless: never imports Textual. Exit 0 when it reported; 2 with one line on stderr for bad
arguments or when none of the engines could be read at all (unreachable, not a metrics endpoint).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvtop.model.sanitize import redact_url

NAME = "snapshot"
HELP = "sample GPU, host and engines for a while and print one report (json or text)"
DESCRIPTION = (
    "Polls every source for --duration seconds at --interval, then prints one report: rates and "
    "latency quantiles cover the sampling window. Exit 0 when it reported; 2 on bad arguments or "
    "when no engine could be read."
)
ORDER = 20

DEFAULT_DURATION_S = 5.0
DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 2.0


def _probe_rate(text: str) -> float:
    from kvtop.sources.probe import probe_rate

    return probe_rate(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", default=None, metavar="URL",
                   help="engine base URL or its /metrics URL (repeat for several engines)")
    p.add_argument("--duration", default=None, metavar="SECONDS", help="sampling duration (default 5; 10s, 2m ok)")
    p.add_argument("--interval", default=None, metavar="SECONDS", help="poll interval (default 1)")
    p.add_argument("--format", choices=("json", "text"), default=None, help="output format (default text)")
    from kvtop.config import add_token_options

    add_token_options(p)
    p.add_argument("--adapter", default=None, metavar="NAME", help="engine adapter (default: auto-detect)")
    p.add_argument("--timeout", default=None, metavar="SECONDS", help="HTTP timeout per scrape (default 2)")
    p.add_argument("--itl-target-ms", dest="itl_target_ms", type=float, default=None, metavar="MS",
                   help="inter-token latency target")
    p.add_argument("--probe", type=_probe_rate, default=None, metavar="RATE",
                   help="send kvtop's own canary streams to the first engine at this many per second (off by default)")
    p.add_argument("--no-gpu", dest="gpu", action="store_const", const=False, default=None,
                   help="do not read the GPU (NVML)")
    p.add_argument("--no-host", dest="host", action="store_const", const=False, default=None,
                   help="do not read host memory")


def _analysis(itl_target_s: float | None) -> Any:
    """The live analysis the core feeds (``Core(analysis=...)``): spikes, causes and the verdict."""
    from kvtop.analysis.live import LiveAnalyzer

    return LiveAnalyzer(itl_target_s=itl_target_s)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import json

    from kvtop.config import engine_bases, load_config, parse_seconds, resolve, resolve_token
    from kvtop.errors import UsageError

    cfg = load_config(getattr(args, "config", None))
    # the same engine named twice would be scraped twice and counted once
    urls: list[str] = list(dict.fromkeys(u.strip().rstrip("/") for u in resolve(args, cfg, "url", [])))
    duration = parse_seconds(resolve(args, cfg, "duration", DEFAULT_DURATION_S), "--duration")
    interval = parse_seconds(resolve(args, cfg, "interval", DEFAULT_INTERVAL_S), "--interval")
    timeout = parse_seconds(resolve(args, cfg, "timeout", DEFAULT_TIMEOUT_S), "--timeout")
    fmt = resolve(args, cfg, "format", "text")
    token = resolve_token(args, cfg)
    adapter = resolve(args, cfg, "adapter")
    itl_ms = resolve(args, cfg, "itl_target_ms")
    gpu = bool(resolve(args, cfg, "gpu", True))
    host = bool(resolve(args, cfg, "host", True))

    if not 0 < duration <= 86400:
        raise UsageError(f"--duration must be between 0 and 86400 seconds, not {duration:g}")
    if not 0.05 <= interval <= 3600:
        raise UsageError(f"--interval must be between 0.05 and 3600 seconds, not {interval:g}")
    if not 0 < timeout <= 600:
        raise UsageError(f"--timeout must be between 0 and 600 seconds, not {timeout:g}")
    if fmt not in ("json", "text"):
        raise UsageError(f"format must be json or text, not {fmt!r}")
    if itl_ms is not None and not itl_ms > 0:
        raise UsageError(f"--itl-target-ms must be positive, not {itl_ms:g}")
    engine_bases(urls)
    if adapter is not None:
        from kvtop.plugin import PluginError, load_adapter

        try:
            load_adapter(adapter)
        except PluginError as e:
            raise UsageError(str(e)) from None
    if not urls and not gpu and not host:
        raise UsageError("nothing to sample: give --url URL (or drop --no-gpu / --no-host)")

    from kvtop.core import Core
    from kvtop.live import LiveRunner

    itl_target_s = None if itl_ms is None else itl_ms / 1000.0
    core = Core(window_s=duration, itl_target_s=itl_target_s, analysis=_analysis(itl_target_s))
    first_t: list[float] = []

    def note_first(rec: Any) -> None:
        if not first_t and getattr(rec, "kind", None) == "engine" and rec.up:
            first_t.append(rec.t)

    runner = LiveRunner(core, urls, interval_s=interval, gpu=gpu, host=host, token=token, probe_rate=args.probe,
                        adapter=adapter, timeout_s=timeout, sinks=[note_first])
    asyncio.run(runner.run(duration_s=duration, final_poll=True))
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

    if urls and not any(e.up for e in snap.engines):
        down = next((e for e in snap.engines if e.error), None)
        why = f"{down.url}: {down.error}" if down else "no engine answered"
        many = "" if len(urls) == 1 else f" (none of {len(urls)} engines)"
        raise UsageError(f"could not read any engine{many}: {why}")
    if not urls and snap.gpu_status != "ok" and snap.host is None:
        raise UsageError(f"no source could be read (GPU: {snap.gpu_status}; host: unavailable)")

    if fmt == "json":
        print(json.dumps(snap.to_json(), indent=2, allow_nan=False))
    else:
        from kvtop.render_text import render_text

        print(render_text(snap), end="")
    return 0
