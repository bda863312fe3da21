"""`kvtop tui` (and bare `kvtop`): the interactive console.

With no ``--url`` it looks for local engines: the config's ``url``, then a /metrics page on the
common serving ports of 127.0.0.1. Textual is imported only inside ``run``.
"""

from __future__ import annotations

import argparse
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


def _probe_rate(text: str) -> float:
    from kvtop.sources.probe import probe_rate

    return probe_rate(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", default=None, metavar="URL",
                   help="engine base URL (repeatable); default: config, then probe local ports")
    p.add_argument("--interval", default=None, metavar="SECONDS", help="poll and refresh interval (default 1)")
    p.add_argument("--theme", default=None, metavar="NAME",
                   help="kvtop (default), kvtop-low (terminal's 16 colours, good over SSH), or a Textual theme")
    p.add_argument("--replay", default=None, metavar="FILE", help="open a recorded trace instead of live engines")
    from kvtop.config import add_token_options

    add_token_options(p)
    p.add_argument("--adapter", default=None, metavar="NAME", help="engine adapter (default: auto-detect)")
    p.add_argument("--timeout", default=None, metavar="SECONDS", help="HTTP timeout per scrape (default 2)")
    p.add_argument("--itl-target-ms", dest="itl_target_ms", type=float, default=None, metavar="MS",
                   help="inter-token latency target")
    p.add_argument("--no-gpu", dest="gpu", action="store_const", const=False, default=None,
                   help="do not read the GPU (NVML)")
    p.add_argument("--probe", type=_probe_rate, default=None, metavar="RATE",
                   help="send kvtop's own canary streams to the first engine at this many per second (off by default)")
    p.add_argument("--no-host", dest="host", action="store_const", const=False, default=None,
                   help="do not read host memory")


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


def _ports_from_config(cfg: dict[str, Any]) -> tuple[int, ...]:
    v = cfg.get("probe_ports")
    if v is None:
        return PROBE_PORTS
    if not isinstance(v, list) or not all(isinstance(x, int) and 0 < x < 65536 for x in v):
        raise UsageError("config: probe_ports must be a list of port numbers")
    return tuple(v)


def run(args: argparse.Namespace) -> int:
    from kvtop.config import load_config, parse_seconds, resolve, resolve_token

    cfg = load_config(getattr(args, "config", None))
    interval = parse_seconds(resolve(args, cfg, "interval", 1.0), "--interval")
    if not 0.05 <= interval <= 3600:
        raise UsageError(f"--interval must be between 0.05 and 3600 seconds, not {interval:g}")
    timeout = parse_seconds(resolve(args, cfg, "timeout", 2.0), "--timeout")
    if not 0 < timeout <= 600:
        raise UsageError(f"--timeout must be between 0 and 600 seconds, not {timeout:g}")
    itl_ms = resolve(args, cfg, "itl_target_ms")
    if itl_ms is not None and not itl_ms > 0:
        raise UsageError(f"--itl-target-ms must be positive, not {itl_ms:g}")
    itl_target_s = None if itl_ms is None else itl_ms / 1000.0
    theme = resolve(args, cfg, "theme")

    from kvtop.tui.app import known_themes  # the UI package (and Textual) from here on

    known = known_themes()
    if theme is not None and theme not in known:
        raise UsageError(f"unknown theme {theme!r}; choose one of: {', '.join(known)}")

    if args.replay:
        path = Path(args.replay)
        if not path.is_file():
            raise UsageError(f"trace file not found: {path}")
        return replay_console(path, theme=theme, interval=interval, itl_target_s=itl_target_s)
    else:
        urls: list[str] = list(resolve(args, cfg, "url", []))
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
        from kvtop.analysis.live import LiveAnalyzer
        from kvtop.core import Core
        from kvtop.live import LiveRunner

        core = Core(itl_target_s=itl_target_s, source_label="live", analysis=LiveAnalyzer(itl_target_s=itl_target_s))
        feed = LiveRunner(core, urls, interval_s=interval, gpu=bool(resolve(args, cfg, "gpu", True)),
                          host=bool(resolve(args, cfg, "host", True)), token=resolve_token(args, cfg),
                          adapter=resolve(args, cfg, "adapter"), timeout_s=timeout, probe_rate=args.probe)

    from kvtop.tui.app import run_console

    return run_console(core, feed=feed, title="kvtop", theme=theme, interval=interval)


def replay_console(path: str | Path, speed: float = 1.0, theme: str | None = None, interval: float = 1.0,
                   itl_target_s: float | None = None) -> int:
    """The console over a recorded trace: p pauses, [ ] step 10 s, g seeks (`kvtop replay` calls this)."""
    from kvtop.core import Core
    from kvtop.model.trace import TraceError
    from kvtop.replay import ReplayFeed
    from kvtop.tui.app import run_console

    label = f"replay {Path(path).name}"

    def make_core() -> Core:
        from kvtop.analysis.live import LiveAnalyzer

        return Core(itl_target_s=itl_target_s, source_label=label, analysis=LiveAnalyzer(itl_target_s=itl_target_s))

    try:
        feed = ReplayFeed(path, make_core(), speed=speed, core_factory=make_core)
    except TraceError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot read trace {path}: {e.strerror or e}") from None
    try:
        return run_console(feed.core, feed=feed, title="kvtop replay", theme=theme, interval=interval)
    finally:
        feed.close()
