"""`kvtop tui` (and bare `kvtop`): the interactive console.

With no ``--url`` it looks for local engines: the config's ``url``, then a /metrics page on the
common serving ports of 127.0.0.1. Textual is imported only inside ``run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtop.errors import UsageError

NAME = "tui"
HELP = "the interactive console (the default when no command is given)"
ORDER = 10
DESCRIPTION = (
    "Live console: GPUs, host, engines, requests, the advisor's verdict and events. "
    "Keys: 1-5 screens, w chart window, p pause, space refresh, +/- poll interval, / filter, s sort, "
    "enter detail, ? or F1 help, q or F10 quit."
)

# vLLM / SGLang / TGI & llama.cpp / (common dev) / Triton metrics ports
PROBE_PORTS = (8000, 30000, 8080, 3000, 8002)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtop.commands._options import (
        add_capture_option,
        add_engine_options,
        add_host_options,
        add_itl_option,
        add_probe_option,
        add_prometheus_options,
    )

    add_engine_options(p, url_help="engine base URL (repeatable); default: config, then probe local ports")
    p.add_argument("--theme", default=None, metavar="NAME",
                   help="kvtop (default), kvtop-low (terminal's 16 colours, good over SSH), or a Textual theme")
    p.add_argument("--replay", default=None, metavar="FILE", help="open a recorded trace instead of live engines")
    add_itl_option(p)
    add_probe_option(p)
    add_capture_option(p)
    add_host_options(p)
    add_prometheus_options(p, "show every engine a Prometheus server scrapes (opens on the fleet screen, key f)")


def looks_like_metrics(text: str) -> bool:
    """A Prometheus exposition: comment lines with HELP/TYPE, or at least one `name value` sample."""
    for line in text.splitlines()[:200]:
        if line.startswith(("# HELP ", "# TYPE ")):
            return True
    return False


def discover(ports: tuple[int, ...] | list[int] = PROBE_PORTS, host: str = "127.0.0.1",
             timeout_s: float = 0.5) -> list[str]:
    """Base URLs of local servers answering /metrics with a Prometheus page, in port order."""
    import httpx

    def probe(port: int) -> str | None:
        url = f"http://{host}:{port}"
        try:
            r = httpx.get(url + "/metrics", timeout=timeout_s)
        except httpx.HTTPError:
            return None
        return url if r.status_code == 200 and looks_like_metrics(r.text) else None

    with ThreadPoolExecutor(max_workers=max(1, len(ports))) as ex:
        found = list(ex.map(probe, ports))
    return [u for u in found if u]


class ProbingFeed:
    """The console's feed when no engine answered at start: GPU and host polling run at once while
    the local ports are probed every ``probe_every_s``; the first engines found are scraped from
    then on (the same clock, so history carries on). ``notice`` is the banner while nothing is found."""

    def __init__(self, make_runner: Any, ports: tuple[int, ...], probe_every_s: float = 5.0,
                 host: str = "127.0.0.1"):
        self.make_runner = make_runner  # urls -> LiveRunner
        self.ports = ports
        self.host = host
        self.probe_every_s = probe_every_s
        self.runner = make_runner([])
        self.core = self.runner.core  # the Feed protocol's core: one for the whole run
        self.urls: list[str] = []
        self.notice: str | None = (
            f"no engine found on {host} ports {', '.join(map(str, ports))} (still looking every "
            f"{probe_every_s:g} s): point kvtop at one with --url http://HOST:PORT or `url` in config.toml, "
            "or try `kvtop demo`")

    @property
    def interval_s(self) -> float:
        return float(self.runner.interval_s)

    @interval_s.setter
    def interval_s(self, v: float) -> None:
        self.runner.interval_s = v

    def refresh_now(self) -> None:
        self.runner.refresh_now()

    def controls(self) -> None:
        return None

    async def run(self, stop: Any = None) -> None:
        import asyncio

        outer = stop or asyncio.Event()
        inner = asyncio.Event()
        task = asyncio.create_task(self.runner.run(stop=inner))
        try:
            while not outer.is_set() and not self.urls:
                try:
                    await asyncio.wait_for(outer.wait(), self.probe_every_s)
                    break
                except asyncio.TimeoutError:
                    pass
                found = await asyncio.to_thread(discover, self.ports, self.host)
                if found and not outer.is_set():
                    self.urls = found
                    inner.set()
                    await task
                    old = self.runner
                    self.runner = self.make_runner(found)
                    self.runner._t0 = old._t0  # one run clock across the switch
                    self.runner.interval_s = old.interval_s  # and the interval +/- may have changed
                    self.notice = None
                    self.core.event(self.runner.now(), "info", "engine_up", "engine found: " + ", ".join(found))
                    inner = asyncio.Event()
                    task = asyncio.create_task(self.runner.run(stop=inner))
            if not task.done():
                await outer.wait()
        finally:
            inner.set()
            await asyncio.gather(task, return_exceptions=True)


def _capture_port(url: str) -> int | None:
    from kvtop.sources.capture.options import resolve_capture_port

    return resolve_capture_port(0, url)


def _ports_from_config(cfg: dict[str, Any]) -> tuple[int, ...]:
    v = cfg.get("probe_ports")
    if v is None:
        return PROBE_PORTS
    if not isinstance(v, list) or not all(isinstance(x, int) and 0 < x < 65536 for x in v):
        raise UsageError("config: probe_ports must be a list of port numbers")
    return tuple(v)


def run(args: argparse.Namespace) -> int:
    from kvtop.commands._options import interval_s, itl_target_s, source_options
    from kvtop.config import load_config, resolve

    cfg = load_config(getattr(args, "config", None))
    theme = resolve(args, cfg, "theme")

    from kvtop.views.tui.app import known_themes  # the UI package (and Textual) from here on

    known = known_themes()
    if theme is not None and theme not in known:
        raise UsageError(f"unknown theme {theme!r}; choose one of: {', '.join(known)}")

    if getattr(args, "prometheus", None):
        return prometheus_console(args, cfg, theme)
    if args.replay:
        path = Path(args.replay)
        if not path.is_file() and not path.is_dir():
            raise UsageError(f"trace file not found: {path}")
        return replay_console(path, theme=theme, interval=interval_s(args, cfg),
                              itl_target_s=itl_target_s(args, cfg))
    opts = source_options(args, cfg)
    from kvtop.pipeline import live_feed, make_core

    feed: Any
    if not opts.urls:
        ports = _ports_from_config(cfg)
        found = discover(ports)
        if not found and not (sys.stdin.isatty() and sys.stdout.isatty()):
            # no terminal to show the console in (a script, CI): say so and fail as headless commands do
            sys.stderr.write(
                "kvtop: no engine found on 127.0.0.1 ports "
                f"{', '.join(map(str, ports))}; point kvtop at one with --url http://HOST:PORT "
                "(or `url` in config.toml), or try `kvtop demo`\n"
            )
            return 2
        if not found:
            # No engine yet is not an error for the console: it shows the GPUs and the host and
            # keeps looking (headless commands still exit 2).
            core = make_core("live", opts.itl_target_s)

            def make_runner(urls: list[str]) -> Any:
                o = dataclasses.replace(opts, urls=tuple(urls))
                if o.capture_port == 0:  # --capture without a port: the engine's, once there is one
                    o = dataclasses.replace(o, capture_port=_capture_port(urls[0]) if urls else None)
                return live_feed(o, label="live", core=core)

            feed = ProbingFeed(make_runner, ports)
        else:
            opts = dataclasses.replace(opts, urls=tuple(found))
    if opts.urls:
        if opts.capture_port == 0:  # --capture without a port: the (discovered) engine's
            opts = dataclasses.replace(opts, capture_port=_capture_port(opts.urls[0]))
        # without the privilege the console still runs: its banner says how to grant it
        feed = live_feed(opts, label="live")

    from kvtop.views.tui.app import run_console

    return run_console(feed.core, feed=feed, title="kvtop", theme=theme, interval=opts.interval_s)


def replay_console(path: str | Path, speed: float = 1.0, theme: str | None = None, interval: float = 1.0,
                   itl_target_s: float | None = None) -> int:
    """The console over a recorded trace: p pauses, [ ] step 10 s, g seeks (`kvtop replay` calls this)."""
    from kvtop.model.trace import TraceError
    from kvtop.pipeline import replay_feed
    from kvtop.views.tui.app import run_console

    try:
        feed = replay_feed(path, speed=speed, itl_target_s=itl_target_s)
    except TraceError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot read trace {path}: {e.strerror or e}") from None
    try:
        return run_console(feed.core, feed=feed, title="kvtop replay", theme=theme, interval=interval)
    finally:
        feed.close()


def prometheus_console(args: argparse.Namespace, cfg: dict[str, Any], theme: str | None) -> int:
    """The console over what a Prometheus server scrapes: the fleet screen first, enter opens one."""
    from kvtop.commands._options import interval_s, itl_target_s, selector, timeout_s
    from kvtop.config import resolve_token
    from kvtop.pipeline import prometheus_feed
    from kvtop.views.tui.app import run_console

    if args.url or args.replay:
        raise UsageError("--prometheus reads engines from Prometheus: drop --url / --replay")
    interval = interval_s(args, cfg)
    feed = prometheus_feed(args.prometheus, selector=selector(args), itl_target_s=itl_target_s(args, cfg),
                           interval_s=max(interval, 2.0), timeout_s=timeout_s(args, cfg, 5.0),
                           token=resolve_token(args, cfg), window_s=120.0, core_window_s=60.0)
    return run_console(feed.core, feed=feed, title="kvtop fleet", theme=theme, interval=interval)
