"""Option groups shared by the commands that watch engines (snapshot, record, the console).

Each option is declared once here and range-checked once in ``source_options``; a command adds the
groups it needs and gets one typed ``SourceOptions`` back, resolved flag > environment > config file.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging
import math
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtop.config import add_token_options, engine_bases, http_url, parse_seconds, resolve, resolve_token
from kvtop.errors import RunFailure, UsageError
from kvtop.pipeline import DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S, SourceOptions
from kvtop.sources.capture.options import add_capture_argument, resolve_capture_port

if TYPE_CHECKING:
    from kvtop.feeds.live import LiveRunner
    from kvtop.model.records import EngineRecord
    from kvtop.sources.promapi import PromAuth

# Every command's parser is built from these groups on each start: what only a check or a run
# needs (aiohttp for the probe, the packet socket, Prometheus' client, the adapter registry) is
# imported inside the function that needs it.

# the longest run simulate and load plan: a day (their arrivals are drawn in memory first)
MAX_DURATION_S = 86400.0


def _probe_rate(text: str) -> float:
    from kvtop.sources.probe import probe_rate  # aiohttp: only when --probe is given

    return probe_rate(text)


DURATION_HINT = "10, 10s, 500ms, 2m, 1h"


def seconds_arg(text: str) -> float:
    """argparse ``type=`` for every duration and interval option: the one syntax (``10``, ``10s``,
    ``500ms``, ``2m``, ``1h``) that config.parse_seconds reads, so each command accepts the same."""
    try:
        v = parse_seconds(text, "a duration")
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v < 0:  # `replay --until -1` was accepted and meant nothing
        raise argparse.ArgumentTypeError(f"a duration is not negative: {text!r}")
    return v


def add_engine_options(p: argparse.ArgumentParser, *, url_help: str | None = None) -> None:
    """--url, --token, --adapter, --timeout, --interval: which engines, and how to scrape them."""
    p.add_argument("--url", action="append", default=None, metavar="URL",
                   help=url_help or "engine base URL or its /metrics URL (repeat for several engines)")
    p.add_argument("--interval", default=None, metavar="SECONDS", help="poll interval (default 1)")
    add_token_options(p)
    p.add_argument("--adapter", default=None, metavar="NAME", help="engine adapter (default: auto-detect)")
    p.add_argument("--timeout", default=None, metavar="SECONDS", help="HTTP timeout per scrape (default 2)")


def require_terminal(headless: str) -> None:
    """The full-screen console needs a terminal on stdin and stdout: without one (a script, CI, a
    pipe) it would draw escape codes nobody reads and never end. One line, exit 2, naming the
    headless way to get the same answer."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(f"the console needs a terminal (stdin and stdout are not both one); {headless}")


def probe_ports(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The local ports to look for an engine on when no --url is given (config ``probe_ports``)."""
    from kvtop.sources.discover import PROBE_PORTS  # httpx with it: only when looking for engines

    v = cfg.get("probe_ports")
    if v is None:
        return PROBE_PORTS
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x < 65536 for x in v):
        raise UsageError("config: probe_ports must be a list of port numbers")
    return tuple(v)


def discovered(opts: SourceOptions, cfg: dict[str, Any]) -> tuple[SourceOptions, str | None]:
    """Headless commands without --url look where the console looks: the engines answering /metrics
    on 127.0.0.1's usual serving ports. Returns the options with those URLs, and a note to print
    when none answered (None when some did)."""
    if opts.urls:
        return opts, None
    from kvtop.sources.discover import discover  # httpx: only when looking for engines

    ports = probe_ports(cfg)
    found = tuple(discover(ports))
    if not found:
        left = " and ".join(w for w, on in (("GPU", opts.gpu), ("host", opts.host)) if on)
        return opts, (f"no engine found on 127.0.0.1 ports {', '.join(map(str, ports))}; "
                      + (f"{left} only" if left else "nothing else to read (--no-gpu, --no-host)")
                      + " (point it at one with --url http://HOST:PORT)")
    capture = opts.capture_port
    if capture == 0:  # --capture without a port: the discovered engine's
        capture = resolve_capture_port(capture, engine_bases(list(found))[0])
    return dataclasses.replace(opts, urls=found, capture_port=capture), None


def add_host_options(p: argparse.ArgumentParser) -> None:
    """--no-gpu, --no-host: skip the local GPU (NVML) or host-memory sources."""
    p.add_argument("--no-gpu", dest="gpu", action="store_const", const=False, default=None,
                   help="do not read the GPU (NVML)")
    p.add_argument("--no-host", dest="host", action="store_const", const=False, default=None,
                   help="do not read host memory")


def add_probe_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probe", type=_probe_rate, default=None, metavar="RATE",
                   help="send kvtop's own canary streams to the first engine at this many per second "
                        "(off by default)")


def add_capture_option(p: argparse.ArgumentParser) -> None:
    """--capture [PORT] and --witness FILE: what kvtop sees of each request beyond the scrapes."""
    add_capture_argument(p)
    p.add_argument("--witness", default=None, metavar="FILE",
                   help="the engine's own step log, written by kvtop's witness inside the engine "
                        "(vLLM: --scheduler-cls kvtop.witness.vllm.WitnessScheduler); exact causes per stall")


def require_capture(opts: SourceOptions) -> None:
    """Headless commands: a capture that cannot open here is a one-line RunFailure (exit 1) saying
    how to grant the privilege. (The console runs on and shows the line in its banner instead.)"""
    if opts.capture_port is None:
        return
    if opts.capture_port == 0:
        raise UsageError("--capture without a PORT needs the engine's --url")
    from kvtop.sources.capture import CaptureUnavailable, check_capture  # the packet socket: see above

    try:
        check_capture(opts.capture_port)
    except CaptureUnavailable as e:
        raise RunFailure(str(e)) from None


def add_prometheus_options(p: argparse.ArgumentParser, what: str) -> None:
    """--prometheus URL (``what`` says what the command does with it), --selector and how to reach it."""
    p.add_argument("--prometheus", default=None, metavar="URL", help=what)
    p.add_argument("--selector", default=None, metavar="MATCHERS",
                   help='with --prometheus: extra label matchers, e.g. job="vllm",cluster="eu1"')
    add_prometheus_auth_options(p)


def add_prometheus_auth_options(p: argparse.ArgumentParser) -> None:
    """How to reach a Prometheus API behind a gateway (its bearer token is --token / --token-file)."""
    p.add_argument("--prometheus-user", default=None, metavar="USER",
                   help="with --prometheus: basic-auth user; the password from --prometheus-password-file or "
                        "KVTOP_PROMETHEUS_PASSWORD (also prometheus_user)")
    p.add_argument("--prometheus-password-file", default=None, metavar="FILE",
                   help="with --prometheus: read the basic-auth password from FILE (also prometheus_password_file)")
    p.add_argument("--prometheus-ca-file", default=None, metavar="FILE",
                   help="with --prometheus: PEM CA bundle that signs its TLS certificate (also prometheus_ca_file)")
    p.add_argument("--prometheus-header", action="append", default=None, metavar="'NAME: VALUE'",
                   help="with --prometheus: an extra request header, e.g. 'X-Scope-OrgID: team-a' (repeat; "
                        "also prometheus_headers)")


_SECRET_FILE_MAX_BYTES = 64 << 10
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token


def _secret_file(path: str, what: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(_SECRET_FILE_MAX_BYTES + 1)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path} is not UTF-8 text") from None
    if len(raw) > _SECRET_FILE_MAX_BYTES or not text or "\n" in text or not text.isprintable():
        raise UsageError(f"{what} {path} must hold one line")  # never the content: it is a secret
    return text


def prometheus_auth(args: argparse.Namespace, cfg: dict[str, Any]) -> PromAuth:
    """--token/--token-file, --prometheus-user + password, --prometheus-ca-file, --prometheus-header
    (flag > environment > config), checked: one-line UsageError, never echoing a secret."""
    from kvtop.sources.promapi import PromAuth, PromError, tls_context  # httpx: only for --prometheus

    if getattr(args, "prometheus", None):
        args.prometheus = http_url(args.prometheus, "--prometheus")  # every command that reads Prometheus comes here
    token = resolve_token(args, cfg)
    user = resolve(args, cfg, "prometheus_user")
    password = None
    pw_file = resolve(args, cfg, "prometheus_password_file")
    if pw_file is not None:
        password = _secret_file(str(pw_file), "password file")
    elif cfg.get("prometheus_password") is not None:
        password = str(cfg["prometheus_password"])
    if password is not None and user is None:
        raise UsageError("a Prometheus password needs --prometheus-user")
    if user is not None and token is not None:
        raise UsageError("give either a bearer token (--token) or basic auth (--prometheus-user) for Prometheus, not both")
    if user is not None and (":" in str(user) or not str(user).isprintable()):
        raise UsageError(f"--prometheus-user {user!r}: no ':' and no control characters")
    ca = resolve(args, cfg, "prometheus_ca_file")
    if ca is not None:
        try:
            with open(str(ca), "rb"):
                pass
        except OSError as e:
            raise UsageError(f"cannot read --prometheus-ca-file {ca}: {e.strerror or e}") from None
        try:
            tls_context(str(ca))  # a file that holds no certificate is the user's to fix, before any query
        except PromError as e:
            raise UsageError(str(e)) from None
    headers: list[tuple[str, str]] = []
    for h in resolve(args, cfg, "prometheus_headers", [], attr="prometheus_header"):
        name, sep, value = str(h).partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not _HEADER_NAME.fullmatch(name) or not value or not value.isprintable():
            raise UsageError(f"--prometheus-header wants 'NAME: VALUE' on one line, e.g. 'X-Scope-OrgID: team-a', "
                             f"not {name[:40]!r}")  # the name only: a header value may be a credential
        if name.lower() in ("authorization", "host", "content-length"):
            raise UsageError(f"--prometheus-header cannot set {name}: use --token or --prometheus-user")
        headers.append((name, value))
    return PromAuth(token=token, username=None if user is None else str(user), password=password,
                    ca_file=None if ca is None else str(ca), headers=tuple(headers))


def add_itl_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--itl-target-ms", dest="itl_target_ms", type=float, default=None, metavar="MS",
                   help="inter-token latency target")


def itl_target_s(args: argparse.Namespace, cfg: dict[str, Any]) -> float | None:
    """--itl-target-ms (or config) in seconds; None when unset."""
    itl_ms = resolve(args, cfg, "itl_target_ms")
    if itl_ms is None:
        return None
    if not (itl_ms > 0 and math.isfinite(itl_ms)):  # inf printed "ITL target: unknown" and judged nothing
        raise UsageError(f"--itl-target-ms must be a positive number, not {itl_ms:g}")
    return float(itl_ms) / 1000.0


def interval_s(args: argparse.Namespace, cfg: dict[str, Any]) -> float:
    v = parse_seconds(resolve(args, cfg, "interval", DEFAULT_INTERVAL_S), "--interval")
    if not 0.05 <= v <= 3600:
        raise UsageError(f"--interval must be between 0.05 and 3600 seconds, not {v:g}")
    return v


def timeout_s(args: argparse.Namespace, cfg: dict[str, Any], default: float = DEFAULT_TIMEOUT_S) -> float:
    """--timeout (or config) in seconds, checked once for every command."""
    v = parse_seconds(resolve(args, cfg, "timeout", default), "--timeout")
    if not 0 < v <= 600:
        raise UsageError(f"--timeout must be > 0 and at most 600 seconds, not {v:g}")
    return v


def selector(args: argparse.Namespace) -> str | None:
    """--selector, checked: one-line error for matchers Prometheus would refuse."""
    from kvtop.sources.promfleet import parse_selector  # Prometheus' client: see above

    try:
        parse_selector(args.selector)
    except ValueError as e:
        raise UsageError(str(e)) from None
    sel: str | None = args.selector
    return sel


def source_options(args: argparse.Namespace, cfg: dict[str, Any]) -> SourceOptions:
    """Resolve and check every option the groups above declare (absent groups take defaults)."""
    # the same engine named twice would be scraped twice and counted once
    urls = tuple(dict.fromkeys(u.strip().rstrip("/") for u in resolve(args, cfg, "url", [])))
    engine_bases(list(urls))
    timeout = timeout_s(args, cfg)
    adapter = resolve(args, cfg, "adapter")
    if adapter is not None:
        from kvtop.plugin import PluginError, load_adapter  # the adapter registry: see above

        try:
            load_adapter(adapter)
        except PluginError as e:
            raise UsageError(str(e)) from None
    probe = getattr(args, "probe", None)
    if probe is not None and not 0 < probe <= 100:
        raise UsageError(f"--probe must be > 0 and at most 100 per second, not {probe:g}")
    capture = getattr(args, "capture", None)
    if capture == 0 and urls:  # 0: the first engine's port (the console may still discover one)
        capture = resolve_capture_port(capture, engine_bases(list(urls))[0])
    return SourceOptions(
        urls=urls,
        interval_s=interval_s(args, cfg),
        timeout_s=timeout,
        token=resolve_token(args, cfg),
        adapter=adapter,
        gpu=bool(resolve(args, cfg, "gpu", True)),
        host=bool(resolve(args, cfg, "host", True)),
        probe_rate=probe,
        itl_target_s=itl_target_s(args, cfg),
        capture_port=capture,
        witness=_witness_path(args, cfg),
    )


async def first_scrape(runner: LiveRunner) -> list[EngineRecord]:
    """Scrape every engine once, before the run: a wrong URL fails in one timeout, not after the
    whole --duration. None answering is a RunFailure (exit 1) naming the URL and why (the runner's
    scrapers are closed first); the records come back for the caller to emit."""
    t = runner.now()
    results = await asyncio.gather(*(s.scrape(t) for s in runner.scrapers))
    recs = [r for rs in results for r in rs]
    if recs and not any(r.up for r in recs):
        await asyncio.gather(*(s.aclose() for s in runner.scrapers), return_exceptions=True)
        down = [f"{r.url}: {r.warnings[0] if r.warnings else 'no answer'}" for r in recs]
        what = "the engine at" if len(down) == 1 else f"any of {len(down)} engines:"
        raise RunFailure(f"could not read {what} {'; '.join(down[:3])}")
    return recs


WAIT_MAX_S = 86400.0


def add_wait_option(p: argparse.ArgumentParser, what: str) -> None:
    """--wait-for-engine SECONDS: start beside an engine that is still loading its model."""
    p.add_argument("--wait-for-engine", dest="wait_for_engine", default="0", metavar="SECONDS",
                   help=f"at start, retry an engine that does not answer for this long before {what} gives up with "
                        "exit 1 (default 0: fail at the first scrape; beside an engine still loading its model: 10m)")


def wait_seconds(args: argparse.Namespace) -> float:
    wait = parse_seconds(getattr(args, "wait_for_engine", None) or "0", "--wait-for-engine")
    if not 0 <= wait <= WAIT_MAX_S:
        raise UsageError(f"--wait-for-engine must be between 0 and {WAIT_MAX_S:g} seconds, not {wait:g}")
    return wait


async def awaited_first_scrape(runner: LiveRunner, wait_s: float, log: logging.Logger,
                               stop: asyncio.Event | None = None) -> list[EngineRecord]:
    """``first_scrape``, retried every poll interval for up to ``wait_s`` while no engine answers
    (said once, as a warning); the last failure is raised when the time is up or ``stop`` is set."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    interval = runner.interval_s
    said = False
    while True:
        try:
            return await first_scrape(runner)
        except RunFailure as e:
            if (stop is not None and stop.is_set()) or loop.time() + interval > deadline:
                raise
            if not said:
                said = True
                log.warning(f"waiting up to {wait_s:g} s for the engine: {e}", extra={"fields": {"event": "waiting"}})
            if stop is None:
                await asyncio.sleep(interval)
                continue
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass


def check_engines_now(runner: LiveRunner, wait_s: float = 0.0) -> None:
    """``first_scrape`` (waited for up to ``wait_s``) for a run whose loop starts later (the console):
    the answers go into the core and the scrapers' HTTP clients are closed again, since they belong
    to this event loop."""

    async def check() -> None:
        try:
            for rec in await awaited_first_scrape(runner, wait_s, logging.getLogger("kvtop.tui")):
                runner.emit(rec)
        finally:
            await asyncio.gather(*(s.aclose() for s in runner.scrapers), return_exceptions=True)

    asyncio.run(check())


def _witness_path(args: argparse.Namespace, cfg: dict[str, Any]) -> str | None:
    """--witness FILE: a file that exists must be a witness file; a missing one is waited for (the
    engine creates it when it starts), but its folder must exist."""
    path = resolve(args, cfg, "witness")
    if path is None:
        return None
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        raise UsageError(f"--witness {path}: is a folder; give the witness file (KVTOP_WITNESS_FILE of the engine)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--witness {path}: no such folder {folder}")
    if os.path.exists(path):
        from kvtop.sources.witness import WitnessError, WitnessReader

        try:
            WitnessReader(path, 0.0).read()
        except WitnessError as e:
            raise UsageError(str(e)) from None
        except OSError as e:
            raise UsageError(f"--witness {path}: {e.strerror}") from None
    else:
        # waited for, but said: a typo in the path would otherwise go unnoticed for the whole run
        logging.getLogger("kvtop").warning(f"--witness {path} does not exist yet: it is read once the engine "
                                           "creates it (the engine's KVTOP_WITNESS_FILE)")
    return path


_Addr = ipaddress.IPv4Address | ipaddress.IPv6Address


def _addresses(host: str) -> set[_Addr | str]:
    """The sockets a host name stands for, as far as is certain without DNS: an IP as itself (0.0.0.0
    and :: connect to loopback on Linux; ::ffff:a.b.c.d is IPv4), ``localhost`` as the hosts file
    says (127.0.0.1 only on some machines: the name alone does not prove ::1), any other name as
    itself, compared by name."""
    h = host.strip("[]").lower()
    if h == "localhost":
        try:
            found = {str(ai[4][0]) for ai in socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)}
        except OSError:
            return {h}
    else:
        found = {h}
    out: set[_Addr | str] = set()
    for a in found:
        try:
            ip = ipaddress.ip_address(a.split("%", 1)[0])
        except ValueError:
            out.add(a)
            continue
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_unspecified:  # connecting to 0.0.0.0 / :: reaches this host's loopback
            ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
        out.add(ip)
    return out


def _answers(listen_host: str, target: _Addr | str) -> bool:
    """Whether a listener bound to ``listen_host`` answers a connection to ``target``. A wildcard
    answers loopback of its own family only (asyncio sets IPV6_V6ONLY on ::); other local addresses
    would need the interface list, so only loopback counts as certain."""
    h = listen_host.strip("[]").lower()
    if h == "":
        return isinstance(target, ipaddress.IPv4Address | ipaddress.IPv6Address) and target.is_loopback
    if h in ("0.0.0.0", "::"):
        return (isinstance(target, ipaddress.IPv4Address | ipaddress.IPv6Address) and target.is_loopback
                and target.version == (4 if h == "0.0.0.0" else 6))
    return target in _addresses(h)


def refuse_self_proxy(listen: tuple[str, int], upstream: str, up_flag: str, listen_flag: str) -> None:
    """A one-line UsageError where a recording proxy on ``listen`` would forward to itself (each
    request would open another until the descriptors ran out). Only a certain loop is refused:
    127.0.0.1 and ::1 are different sockets, and an engine may well serve on the other one."""
    from yarl import URL

    u = URL(http_url(upstream, up_flag))
    host, port = listen
    if u.port != port or u.host is None:
        return
    if any(_answers(host, t) for t in _addresses(u.host)):
        raise UsageError(f"{up_flag} {upstream} is the proxy's own {listen_flag} address: it would forward to itself")


def check_output(output: str, force: bool) -> None:
    """A trace file a command is about to write: refused (one line) where it would append a second
    run to a trace (the old header's clock would time the new records). With ``force`` the caller
    replaces it with ``replace_output``."""
    out = Path(output)
    if out.is_dir():
        raise UsageError(f"{output} is a directory")
    if not out.parent.is_dir():  # a usage error, said before any engine is scraped
        raise UsageError(f"cannot write {output}: directory {out.parent} does not exist")
    if out.is_fifo() or out.is_socket():  # a writer would block on it until someone reads
        raise UsageError(f"{output} is a pipe or socket: give a trace file path")
    if out.exists() and out.stat().st_size > 0 and not force:
        raise UsageError(f"{output} already exists (use --force to overwrite)")


def replace_output(output: str) -> None:
    """Remove the trace ``--force`` overwrites (writers append). Only a regular file: run as root,
    ``-o /dev/null --force`` would otherwise delete the device."""
    p = Path(output)
    if p.is_file():
        p.unlink()


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether an output would overwrite an input (a missing file is no input to lose)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
