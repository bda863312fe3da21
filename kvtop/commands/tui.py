"""`kvtop tui` (and bare `kvtop`): the interactive console.

With no ``--url`` it looks for local engines: the config's ``url``, then a /metrics page on the
common serving ports of 127.0.0.1 (``kvtop.sources.discover``). Textual is imported only inside
``run``: every command module is imported to build the parser, and the headless paths never load it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtop.commands._options import (
    add_capture_option,
    add_engine_options,
    add_host_options,
    add_itl_option,
    add_probe_option,
    add_prometheus_options,
    add_wait_option,
    check_engines_now,
    interval_s,
    itl_target_s,
    probe_ports,
    prometheus_auth,
    require_terminal,
    selector,
    source_options,
    timeout_s,
    wait_seconds,
)
from kvtop.config import load_config, resolve
from kvtop.errors import UsageError
from kvtop.pipeline import Feed, live_feed, probing_feed, prometheus_feed, replay_feed

if TYPE_CHECKING:  # the console's input type only: Textual loads when the console runs
    from kvtop.views.tui.compare import CompareInput

NAME = "tui"
HELP = "the interactive console (the default when no command is given)"
ORDER = 10
DESCRIPTION = (
    "Live console: GPUs, host, engines, requests, the advisor's verdict and events. "
    "Keys: 1-5 screens, w chart window, p pause, space refresh, +/- poll interval, / filter, s sort, "
    "enter detail, ? or F1 help, q or F10 quit. --replay A --compare B: two runs side by side."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_options(p, url_help="engine base URL (repeatable); default: config, then probe local ports")
    p.add_argument("--theme", default=None, metavar="NAME",
                   help="kvtop (default), kvtop-low (terminal's 16 colours, good over SSH), or a Textual theme")
    p.add_argument("--replay", default=None, metavar="FILE", help="open a recorded trace instead of live engines")
    p.add_argument("--compare", default=None, metavar="FILE",
                   help="with --replay A: open B beside it (figures A → B, history charts overlaid: A bars, B line)")
    p.add_argument("--ttft-target-ms", type=float, default=None, metavar="MS",
                   help="with --compare: the time-to-first-token contract goodput judges (as kvtop compare)")
    add_itl_option(p)
    add_probe_option(p)
    add_capture_option(p)
    add_host_options(p)
    add_wait_option(p, "the console")
    add_prometheus_options(p, "show every engine a Prometheus server scrapes (opens on the fleet screen, key f)")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(getattr(args, "config", None))
    theme = resolve(args, cfg, "theme")

    from kvtop.views.tui.app import known_themes  # the UI package (and Textual) from here on

    known = known_themes()
    if theme is not None and theme not in known:
        raise UsageError(f"unknown theme {theme!r}; choose one of: {', '.join(known)}")

    if args.replay and (getattr(args, "url", None) or getattr(args, "prometheus", None)):
        # the console shows one run: a recording, or live engines (it said nothing and showed the recording)
        raise UsageError("--replay shows a recorded trace; give it without --url / --prometheus")
    if wait_seconds(args) and (args.replay or getattr(args, "prometheus", None)):
        raise UsageError("--wait-for-engine waits for a live engine at --url: not with --replay / --prometheus")
    if getattr(args, "prometheus", None):
        return prometheus_console(args, cfg, theme)
    if args.compare is not None:
        if not args.replay:
            raise UsageError("--compare B needs --replay A (the baseline run)")
        ttft = args.ttft_target_ms
        if ttft is not None and not 0 < ttft <= 3_600_000:
            raise UsageError("--ttft-target-ms must be > 0 and at most 3600000 ms")
        return compare_console(Path(args.replay), Path(args.compare), theme=theme, itl_target_s=itl_target_s(args, cfg),
                               ttft_target_s=None if ttft is None else ttft / 1e3)
    if args.ttft_target_ms is not None:
        raise UsageError("--ttft-target-ms judges a comparison: use it with --replay A --compare B")
    if args.replay:
        path = Path(args.replay)
        if not path.is_file() and not path.is_dir():
            raise UsageError(f"trace file not found: {path}")
        return replay_console(path, theme=theme, interval=interval_s(args, cfg),
                              itl_target_s=itl_target_s(args, cfg))
    opts = source_options(args, cfg)
    wait = wait_seconds(args)
    if wait and not opts.urls:
        raise UsageError("--wait-for-engine waits for the engine at --url; without one the console keeps looking by itself")
    from kvtop.sources.discover import discover  # httpx: only when looking for engines

    feed: Feed
    if not opts.urls:
        ports = probe_ports(cfg)
        found = discover(ports)
        if not found and not (sys.stdin.isatty() and sys.stdout.isatty()):
            # no terminal to show the console in (a script, CI): say so and fail as headless commands do
            raise UsageError(
                f"no engine found on 127.0.0.1 ports {', '.join(map(str, ports))}, and the console needs a "
                "terminal (stdin and stdout are not both one); for a report without one: kvtop snapshot --url "
                "http://HOST:PORT (or `url` in config.toml), or try `kvtop demo --headless --duration 10`")
        require_terminal("for a report without one: kvtop snapshot (it looks on the same ports)")
        # No engine yet is not an error for the console: it shows the GPUs and the host and
        # keeps looking (headless commands still exit 2). --capture without a port takes the
        # (discovered) engine's, once there is one; without the privilege the console still
        # runs: its banner says how to grant it.
        feed = live_feed(dataclasses.replace(opts, urls=tuple(found)), label="live") if found \
            else probing_feed(opts, ports)
    else:
        require_terminal("for a report without one: kvtop snapshot --url URL")
        feed = live_feed(opts, label="live")
        check_engines_now(feed, wait)  # a wrong --url: one line, exit 1, instead of a console of errors

    from kvtop.views.tui.app import run_console  # loaded with known_themes above

    return run_console(feed.core, feed=feed, title="kvtop", theme=theme, interval=opts.interval_s)


def replay_console(path: str | Path, speed: float = 1.0, theme: str | None = None, interval: float = 1.0,
                   itl_target_s: float | None = None) -> int:
    """The console over a recorded trace: p pauses, [ ] step 10 s, g seeks (`kvtop replay` calls this)."""
    # the trace reader and the console (Textual) load only when it runs (see the module note)
    from kvtop.model.trace import TraceError
    from kvtop.views.tui.app import run_console

    try:
        feed = replay_feed(path, speed=speed, itl_target_s=itl_target_s)
    except TraceError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot read trace {path}: {e.strerror or e}") from None
    try:
        require_terminal(f"for a report without one: kvtop replay --headless {path}")
        return run_console(feed.core, feed=feed, title="kvtop replay", theme=theme, interval=interval)
    finally:
        feed.close()


def compare_input(path_a: Path, path_b: Path, itl_target_s: float | None = None,
                  ttft_target_s: float | None = None) -> CompareInput:
    """Both traces replayed to their end (history over the whole run) and ``kvtop compare``'s
    figures for the pair: what the compare console shows (a ``CompareInput``)."""
    from kvtop.analysis.compare import compare  # the analysis and the console: only when it runs
    from kvtop.model.trace import TraceError
    from kvtop.views.tui.compare import CompareInput

    snaps = []
    for path in (path_a, path_b):
        if not path.is_file():
            raise UsageError(f"trace file not found: {path}")
        try:
            feed = replay_feed(path, itl_target_s=itl_target_s)
        except TraceError as e:
            raise UsageError(str(e)) from None
        except OSError as e:
            raise UsageError(f"cannot read trace {path}: {e.strerror or e}") from None
        try:
            feed.seek(feed.duration)
            end = max(feed.duration, 1.0)
            snaps.append(feed.core.snapshot(now=end, history_s=end + 1.0))
        finally:
            feed.close()
    try:
        doc = compare(str(path_a), str(path_b), ttft_target_s=ttft_target_s, itl_target_s=itl_target_s).to_dict()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return CompareInput(snaps[0], snaps[1], path_a.name, path_b.name, doc)


def compare_console(path_a: Path, path_b: Path, theme: str | None = None, itl_target_s: float | None = None,
                    ttft_target_s: float | None = None) -> int:
    """Two traces side by side: `kvtop compare`'s figures and result over their charts overlaid."""
    for path in (path_a, path_b):
        if not path.is_file():
            raise UsageError(f"trace file not found: {path}")
    contract = f" --ttft-target-ms {ttft_target_s * 1e3:g}" if ttft_target_s is not None else ""
    require_terminal(f"for a report without one: kvtop compare {path_a} {path_b}{contract}")  # before reading both
    data = compare_input(path_a, path_b, itl_target_s, ttft_target_s)
    from kvtop.views.tui.compare import run_compare  # Textual: see the module note

    return run_compare(data, theme=theme)


def prometheus_console(args: argparse.Namespace, cfg: dict[str, Any], theme: str | None) -> int:
    """The console over what a Prometheus server scrapes: the fleet screen first, enter opens one."""
    from kvtop.views.tui.app import run_console  # Textual: see the module note

    if args.url or args.replay:
        raise UsageError("--prometheus reads engines from Prometheus: drop --url / --replay")
    interval = interval_s(args, cfg)
    sel = selector(args)
    require_terminal(f"for a report without one: kvtop snapshot --prometheus {args.prometheus}")
    feed = prometheus_feed(args.prometheus, selector=sel, itl_target_s=itl_target_s(args, cfg),
                           interval_s=max(interval, 2.0), timeout_s=timeout_s(args, cfg, 5.0),
                           auth=prometheus_auth(args, cfg), window_s=120.0, core_window_s=60.0)
    return run_console(feed.core, feed=feed, title="kvtop fleet", theme=theme, interval=interval)
