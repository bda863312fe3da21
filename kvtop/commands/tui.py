"""`kvtop tui` (and bare `kvtop`): the interactive console.

With no ``--url`` it looks for local engines: the config's ``url``, then a /metrics page on the
common serving ports of 127.0.0.1. Textual is imported only inside ``run``.
"""

from __future__ import annotations

import argparse
import os
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
    "Keys: 1-5 screens, p pause, space refresh, / filter, s sort, enter detail, ? help, q quit."
)

# vLLM / SGLang / TGI & llama.cpp / (common dev) / Triton metrics ports
PROBE_PORTS = (8000, 30000, 8080, 3000, 8002)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", default=[], metavar="URL",
                   help="engine base URL (repeatable); default: config, then probe local ports")
    p.add_argument("--interval", type=float, default=None, metavar="S", help="refresh interval in seconds (default 1)")
    p.add_argument("--theme", default=None, metavar="NAME", help="kvtop (default), kvtop-low (16 colours), or a Textual theme")
    p.add_argument("--replay", default=None, metavar="FILE", help="open a recorded trace instead of live engines")
    p.add_argument("--itl-target", type=float, default=None, metavar="S", help="inter-token latency target in seconds")


def config_path(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvtop" / "config.toml"


def load_config(explicit: str | None) -> dict[str, Any]:
    path = config_path(explicit)
    if not path.exists():
        if explicit:
            raise UsageError(f"config file not found: {path}")
        return {}
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"cannot read config {path}: {e}") from None


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


def _urls_from_config(cfg: dict[str, Any]) -> list[str]:
    v = cfg.get("url")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return list(v)
    raise UsageError("config: url must be a string or a list of strings")


def _ports_from_config(cfg: dict[str, Any]) -> tuple[int, ...]:
    v = cfg.get("probe_ports")
    if v is None:
        return PROBE_PORTS
    if not isinstance(v, list) or not all(isinstance(x, int) and 0 < x < 65536 for x in v):
        raise UsageError("config: probe_ports must be a list of port numbers")
    return tuple(v)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(getattr(args, "config", None))
    interval = args.interval if args.interval is not None else cfg.get("interval", 1.0)
    if not isinstance(interval, (int, float)) or not 0.05 <= float(interval) <= 3600:
        raise UsageError(f"--interval must be between 0.05 and 3600 seconds, got {interval}")
    itl_target = args.itl_target if args.itl_target is not None else cfg.get("itl_target_s")
    if itl_target is not None and (not isinstance(itl_target, (int, float)) or itl_target <= 0):
        raise UsageError(f"--itl-target must be a positive number of seconds, got {itl_target}")

    from textual.theme import BUILTIN_THEMES

    from kvtop.tui.app import THEMES  # Textual from here on

    theme = args.theme or cfg.get("theme")
    known = list(THEMES) + sorted(BUILTIN_THEMES)
    if theme is not None and theme not in known:
        raise UsageError(f"unknown theme {theme!r}; choose one of: {', '.join(known)}")

    from kvtop.core import Core

    if args.replay:
        path = Path(args.replay)
        if not path.is_file():
            raise UsageError(f"trace file not found: {path}")
        try:
            from kvtop.replay import ReplayFeed  # type: ignore[import-not-found]
        except ImportError:
            raise UsageError("replay is not available in this build (kvtop.replay missing)") from None
        core = Core(itl_target_s=itl_target, source_label=f"replay {path.name}")
        feed = ReplayFeed(core, path)
        title = "kvtop replay"
    else:
        urls = list(args.url) or _urls_from_config(cfg)
        if not urls:
            ports = _ports_from_config(cfg)
            urls = discover(ports)
            if not urls:
                sys.stderr.write(
                    "kvtop: no engine found on 127.0.0.1 ports "
                    f"{', '.join(map(str, ports))}; point kvtop at one with --url http://HOST:PORT "
                    "(or `url` in config.toml), or try `kvtop demo`\n"
                )
                return 2
        try:
            from kvtop.live import LiveRunner  # type: ignore[import-not-found]
        except ImportError:
            raise UsageError("live polling is not available in this build (kvtop.live missing); "
                             "try `kvtop demo` or `kvtop tui --replay FILE`") from None
        core = Core(itl_target_s=itl_target, source_label="live")
        feed = LiveRunner(core, urls=urls, interval=float(interval))
        title = "kvtop"

    from kvtop.tui.app import run_console

    return run_console(core, feed=feed, title=title, theme=theme, interval=float(interval))
