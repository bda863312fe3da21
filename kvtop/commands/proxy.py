"""`kvtop proxy`: recording reverse proxy in front of an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from kvtop.commands._longrun import STOP_SIGNALS, GuardedTrace
from kvtop.commands._options import check_output, refuse_self_proxy, replace_output
from kvtop.config import http_url
from kvtop.errors import RunFailure, UsageError
from kvtop.model.sanitize import redact_url
from kvtop.pipeline import recording_proxy

if TYPE_CHECKING:
    from kvtop.model.records import RequestRecord

NAME = "proxy"
HELP = "recording reverse proxy for an OpenAI-compatible server (per-request token timings)"
DESCRIPTION = (
    "Forward /v1/* (and everything else) to --upstream unchanged and unbuffered, recording each "
    "completion's arrive/first_token/token/finish/cancel/error times. No prompt or completion text "
    "and no header is ever recorded. Binds loopback unless --listen names another address."
)
ORDER = 40


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:8001", metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1:8001; 0.0.0.0 only if you say so)")
    p.add_argument("--upstream", required=True, metavar="URL", help="engine base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--record", metavar="FILE", help="write request records to this trace file (JSONL)")
    p.add_argument("--force", action="store_true", help="overwrite the --record FILE if it already exists")
    p.add_argument("--class", dest="cls", metavar="LABEL", help="class label for every proxied request")
    p.add_argument("--quiet", action="store_true", help="no per-request line on stderr")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="forward in N processes sharing the port (one process tops out near 25K chunks/s)")
    p.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="event loop: uvloop when installed (pip install 'kvtop-console[fast]'), else asyncio (default auto)")


def run(args: argparse.Namespace) -> int:
    # the proxy (aiohttp) loads only when the command runs: the parser imports every command module
    from kvtop.sources.proxy import parse_listen
    from kvtop.sources.proxy.eventloop import LoopUnavailable, resolve_loop
    from kvtop.sources.proxy.eventloop import run as run_loop

    try:
        host, port = parse_listen(args.listen)
    except ValueError as e:
        raise UsageError(str(e)) from None

    if args.record:
        # appended under an older header, the records would be timed by that run's clock
        check_output(args.record, args.force)
    args.upstream = http_url(args.upstream, "--upstream")  # host:port gets http://, as the other commands take it
    if not 1 <= args.workers <= 64:
        raise UsageError("--workers must be between 1 and 64")
    refuse_self_proxy((host, port), args.upstream, "--upstream", "--listen")
    try:
        args.loop = resolve_loop(args.loop)
    except LoopUnavailable as e:
        raise UsageError(str(e)) from None
    return run_loop(_main(args, host, port), args.loop)


async def _main(args: argparse.Namespace, host: str, port: int) -> int:
    from kvtop.model.trace import TraceWriter, clock_origin_unix, make_header  # see run

    t0 = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    writer = None
    if args.record:
        try:
            if args.force:
                replace_output(args.record)
            writer = TraceWriter(args.record, make_header(engine={"adapter": None, "url": redact_url(args.upstream)},
                                                          recorder="kvtop proxy",
                                                          clock_t0_unix=clock_origin_unix(clock)))
        except OSError as e:
            raise UsageError(f"cannot write {args.record}: {e.strerror or e}") from None
    summary = _Summary(sys.stderr) if not args.quiet else None

    # a full disk stops the recording, never the traffic the proxy carries (GuardedTrace)
    trace = GuardedTrace(writer, "kvtop proxy", forwards=True) if writer is not None else None

    def emit(rec: RequestRecord) -> None:
        if trace is not None:
            trace.write(rec)
        if summary is not None:
            summary(rec)

    # Handlers first: a signal that lands while the proxy starts must still stop it in order.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    proxy = recording_proxy(args.upstream, (host, port), workers=args.workers, cls=args.cls, loop=args.loop)
    try:
        await proxy.open(emit, clock)
    except OSError as e:
        if writer is not None:
            writer.close()
        raise RunFailure(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    where = f", recording to {args.record}" if args.record else ""
    print(f"kvtop proxy: {proxy.url} -> {redact_url(args.upstream)}{where} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
            if trace is not None:
                trace.flush_if_due()  # an idle proxy still gets its last records onto disk
    finally:
        await proxy.stop()
        if trace is not None:
            trace.close()
    if trace is not None:
        trace.finish()  # the disk refused records: exit 1, saying how many
    print(f"kvtop proxy: stopped after {proxy.requests_seen} recorded request(s)", file=sys.stderr)
    return 0


@dataclass
class _Open:
    arrive_t: float
    first_t: float | None = None
    last_t: float | None = None
    tokens: int = 0
    max_gap_s: float = 0.0


class _Summary:
    """One stderr line per finished request: tokens, time to first token, largest gap."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._open: dict[str, _Open] = {}

    def __call__(self, rec: RequestRecord) -> None:
        if rec.event == "arrive":
            if len(self._open) >= 10000:  # bounded: forget the oldest open request
                self._open.pop(next(iter(self._open)))
            self._open[rec.id] = _Open(rec.t)
            return
        st = self._open.get(rec.id)
        if st is None:
            return
        if rec.event in ("first_token", "token"):
            if st.first_t is None:
                st.first_t = rec.t
            if st.last_t is not None:
                st.max_gap_s = max(st.max_gap_s, rec.t - st.last_t)
            st.last_t = rec.t
            st.tokens += rec.n or 1
        elif rec.event in ("finish", "cancel", "error"):
            del self._open[rec.id]
            ttft = f"{(st.first_t - st.arrive_t) * 1000:.0f}ms" if st.first_t is not None else "n/a"
            what = rec.event if rec.event != "error" else f"error {rec.status or ''} {rec.error or ''}".strip()
            print(f"{rec.id} {what} tokens={st.tokens} ttft={ttft} max_gap={st.max_gap_s * 1000:.0f}ms "
                  f"total={(rec.t - st.arrive_t) * 1000:.0f}ms", file=self.out, flush=True)
