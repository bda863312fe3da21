"""One ``ProxyPool`` worker process: a ``RecordingProxy`` that writes its records to stdout, or
(``--trace FILE``) to its own trace file, sparing the parent a JSON decode per record.

Run as ``python -m kvtop.sources.proxy.worker`` by the pool, never by users.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from kvtop.model.records import RequestRecord
from kvtop.model.sanitize import redact_url
from kvtop.model.trace import TraceWriter, _encode, _request_dict, clock_origin_unix, make_header
from kvtop.sources.proxy.eventloop import run
from kvtop.sources.proxy.server import RecordingProxy


async def _worker(upstream: str, host: str, port: int, offset: float, cls: str | None,
                  trace: str | None = None) -> int:
    out = sys.stdout.buffer
    loop = asyncio.get_running_loop()
    pending: list[bytes] = []
    scheduled = False

    def flush() -> None:
        nonlocal scheduled
        scheduled = False
        if pending:
            out.write(b"".join(pending))
            out.flush()
            pending.clear()

    def emit(rec: RequestRecord) -> None:
        nonlocal scheduled
        pending.append(_encode(_request_dict(rec)).encode() + b"\n")
        if not scheduled:
            scheduled = True
            loop.call_soon(flush)  # one write per loop iteration, not per record

    writer = None
    if trace is not None:
        writer = TraceWriter(trace, make_header(engine={"adapter": None, "url": redact_url(upstream)},
                                                recorder="kvtop proxy worker",
                                                clock_t0_unix=clock_origin_unix(lambda: time.monotonic() + offset)))
        emit = writer.write

        def flush_due() -> None:
            writer.flush_if_due()
            loop.call_later(0.5, flush_due)

        loop.call_later(0.5, flush_due)

    proxy = RecordingProxy(upstream, emit, lambda: time.monotonic() + offset, host=host, port=port, cls=cls,
                           reuse_port=True)
    try:
        await proxy.start()
    except OSError as e:
        print(f"cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    out.write(b'{"ready":%d}\n' % proxy.port)
    out.flush()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us in order

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def control() -> None:
        while True:
            line = await reader.readline()
            if not line:  # the parent is gone
                stop.set()
                return
            if line.startswith(b"ping "):
                flush()
                if writer is not None:
                    writer.flush()
                out.write(b'{"pong":%d}\n' % int(line[5:]))
                out.flush()

    ctl = asyncio.create_task(control())
    await stop.wait()
    await proxy.stop()
    flush()
    if writer is not None:
        writer.close()
    ctl.cancel()
    return 0


def _worker_main() -> int:
    p = argparse.ArgumentParser(prog="kvtop.sources.proxy.worker")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--offset", type=float, required=True)
    p.add_argument("--class", dest="cls")
    p.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop"))
    p.add_argument("--trace")
    a = p.parse_args()
    return run(_worker(a.upstream, a.host, a.port, a.offset, a.cls, a.trace), a.loop)


if __name__ == "__main__":
    raise SystemExit(_worker_main())
