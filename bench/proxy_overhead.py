"""Recording-proxy overhead: the same SSE load sent directly and through the proxy, in one run.

    python bench/proxy_overhead.py [--streams 64,512] [--rate 50] [--seconds 8] [--clients 4]

A fast local SSE upstream (``--upstream-procs`` processes sharing one port) streams tokens at
``--rate`` per second per stream, stamping each event with its send time (CLOCK_MONOTONIC is
system-wide, so another process can subtract it). Client processes keep ``--streams`` streams open
and measure, per chunk, receive time minus send time: directly, then through ``kvtop``'s
RecordingProxy (in its own process, recording every token to a trace file, as ``kvtop proxy
--record`` does). Printed per load:

  * chunk latency p50/p99 direct and proxied, and the added latency (proxied minus direct);
  * proxy CPU microseconds per forwarded chunk (the proxy process's user+sys time / chunks);
  * with ``--profile``: where the proxy's time goes (cProfile of the proxy process, top functions),
    and the recorder's own parse+record cost per chunk measured in isolation.

With ``--compare``: per load, direct once, then nginx (the Debian package, one worker, buffering off),
``kvtop proxy`` on asyncio and on uvloop (when installed), one after another on the same upstream:
added latency p50/p99 and CPU per forwarded chunk of each.

Targets (issue 4): p99 added latency < 1 ms at 512 streams; proxy CPU < 30 us per chunk.
Needs as many free cores as processes for meaningful latency figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- upstream ------------------------------------------------------------------------------------
def upstream_main(port: int, rate: float, tokens: int, ready: mp.Event, stamp: bool = True) -> None:
    """``stamp``: each token event carries its send time (``"ts"``) for the clients' latency; without
    it the events differ only in their text, as an engine's token chunks do."""
    from aiohttp import web

    period = 1.0 / rate
    pad = "x" * 24  # a typical small delta plus OpenAI framing

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        nxt = loop.time()
        try:
            for i in range(tokens):
                nxt += period
                delay = nxt - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if stamp:
                    await resp.write(
                        b'data: {"id":"cmpl-b","object":"text_completion","model":"m","choices":[{"index":0,'
                        b'"text":"%s%d","logprobs":null,"finish_reason":null}],"ts":%d}\n\n'
                        % (pad.encode(), i, time.monotonic_ns()))
                else:
                    await resp.write(
                        b'data: {"id":"cmpl-b","object":"text_completion","model":"m","choices":[{"index":0,'
                        b'"text":"%s%d","logprobs":null,"finish_reason":null}]}\n\n' % (pad.encode(), i))
            await resp.write(b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
                             b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_post("/bench/forward-only", complete)  # same stream on a path the proxy does not record
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, reuse_port=True, backlog=4096).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


# -- proxy ---------------------------------------------------------------------------------------
def proxy_main(port: int, upstream: str, record: str, ready: mp.Event, profile: str | None, workers: int,
               loop: str = "asyncio", per_worker_files: bool = False) -> None:
    from kvtop.model.trace import TraceWriter, make_header
    from kvtop.sources.proxy import make_proxy

    writer = TraceWriter(record, make_header(engine={"url": upstream}))
    t0 = time.monotonic()

    async def main() -> None:
        if per_worker_files:
            from kvtop.sources.proxy import ProxyPool

            proxy: Any = ProxyPool(upstream, writer.write, lambda: time.monotonic() - t0, port=port,
                                   workers=workers, loop=loop, trace_prefix=record)
        else:
            proxy = make_proxy(upstream, writer.write, lambda: time.monotonic() - t0, port=port, workers=workers,
                               loop=loop)
        await proxy.start()
        ready.set()
        while True:
            await asyncio.sleep(0.25)
            writer.flush_if_due()

    if profile:
        import cProfile
        import signal

        prof = cProfile.Profile()

        def dump(*_: object) -> None:
            prof.disable()
            prof.dump_stats(profile)
            os._exit(0)

        signal.signal(signal.SIGTERM, dump)
        prof.enable()
    from kvtop.sources.proxy.eventloop import run

    run(main(), loop)


# -- load clients --------------------------------------------------------------------------------
def client_main(url: str, streams: int, seconds: float, warmup: float, q: mp.Queue, path: str) -> None:
    import aiohttp

    lat_us: list[float] = []
    chunks = 0

    async def one(session: aiohttp.ClientSession, deadline: float, measure_from: float) -> None:
        nonlocal chunks
        buf = b""
        while time.monotonic() < deadline:
            async with session.post(url + path, json={"model": "m", "prompt": "p", "stream": True}) as r:
                async for data in r.content.iter_any():
                    now = time.monotonic_ns()
                    buf += data
                    while True:
                        i = buf.find(b"\n\n")
                        if i < 0:
                            break
                        ev, buf = buf[:i], buf[i + 2:]
                        j = ev.rfind(b'"ts":')
                        if j >= 0 and now / 1e9 >= measure_from:
                            sent = int(ev[j + 5:ev.index(b"}", j)])
                            lat_us.append((now - sent) / 1000)
                            chunks += 1
                        elif j < 0 and now / 1e9 >= measure_from and b'"finish_reason":null' in ev:
                            chunks += 1  # an unstamped upstream's token chunk: counted, not timed
                    if time.monotonic() >= deadline:
                        return

    async def main() -> None:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
            start = time.monotonic()
            deadline = start + warmup + seconds
            # stagger starts over one token period so the streams do not tick in lockstep
            tasks = []
            for _ in range(streams):
                tasks.append(asyncio.create_task(one(s, deadline, start + warmup)))
                await asyncio.sleep(0.02 / max(1, streams))
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    q.put((lat_us, chunks))


def _proc_cpu_s(pid: int) -> float:
    user, system = _proc_cpu_split(pid)
    return user + system


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _proc_cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and its live children (proxy workers): system is
    mostly the kernel's loopback TCP work."""
    tck = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(parts[1]) == pid:
            user += int(parts[11]) / tck
            system += int(parts[12]) / tck
    return user, system


def run_load(url: str, streams: int, clients: int, seconds: float, warmup: float,
             path: str = "/v1/completions") -> tuple[list[float], int]:
    q: mp.Queue = mp.Queue()
    per = [streams // clients + (1 if i < streams % clients else 0) for i in range(clients)]
    procs = [mp.Process(target=client_main, args=(url, n, seconds, warmup, q, path)) for n in per if n]
    for p in procs:
        p.start()
    lat: list[float] = []
    chunks = 0
    for _ in procs:
        l_, c = q.get()
        lat.extend(l_)
        chunks += c
    for p in procs:
        p.join()
    return lat, chunks


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def recorder_cost_us(n: int = 20000) -> float:
    """CPU of parsing + recording one chunk, in isolation (no network)."""
    from kvtop.model.trace import TraceWriter, make_header
    from kvtop.sources.sse import StreamRecorder

    with tempfile.TemporaryDirectory() as d:
        w = TraceWriter(Path(d) / "t.jsonl", make_header())
        rec = StreamRecorder("abc", w.write, 200, True)
        ev = (b'data: {"id":"cmpl-b","object":"text_completion","model":"m","choices":[{"index":0,'
              b'"text":"xxxxxxxxxxxxxxxxxxxxxxxx1","logprobs":null,"finish_reason":null}],"ts":1}\n\n')
        t = time.process_time()
        for i in range(n):
            rec.feed(ev, float(i))
        cost = (time.process_time() - t) / n * 1e6
        w.close()
    return cost


NGINX_CONF = """worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {d}/b; proxy_temp_path {d}/p; fastcgi_temp_path {d}/f; uwsgi_temp_path {d}/u;
  scgi_temp_path {d}/s;
  upstream up {{ server 127.0.0.1:{up}; keepalive 1024; }}
  server {{
    listen 127.0.0.1:{port} reuseport backlog=4096;
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""


def start_nginx(d: str, up_port: int) -> tuple[Any, int] | None:
    """nginx (the Debian package) as a streaming reverse proxy: one worker, buffering off."""
    import shutil
    import subprocess

    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if exe is None:
        return None
    port = _free_port()
    conf = Path(d) / "nginx.conf"
    conf.write_text(NGINX_CONF.format(d=d, up=up_port, port=port))
    proc = subprocess.Popen([exe, "-c", str(conf), "-p", d], stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    return None


def compare(args: argparse.Namespace, upstream: str, up_port: int) -> None:
    """direct / nginx / kvtop proxy on asyncio / on uvloop, one after another on the same upstream."""
    try:
        import uvloop  # noqa: F401

        loops = ["asyncio", "uvloop"]
    except ImportError:
        loops = ["asyncio"]
    with tempfile.TemporaryDirectory() as d:
        for streams in [int(x) for x in args.streams.split(",")]:
            lat_d, n_d = run_load(upstream, streams, args.clients, args.seconds, args.warmup)
            d50, d99 = pct(lat_d, 50), pct(lat_d, 99)
            print(f"\n{streams} streams: direct p50/p99 {d50:7.0f}/{d99:7.0f} us ({n_d / args.seconds:,.0f} chunks/s)")
            variants: list[tuple[str, Any, int, bool]] = [("nginx", None, 1, False)]
            variants += [(f"kvtop proxy ({lp})", lp, 1, False) for lp in loops]
            if args.workers > 1:
                lp = loops[-1]
                variants += [(f"kvtop proxy x{args.workers} ({lp})", lp, args.workers, False),
                             ("  same, per-worker files", lp, args.workers, True)]
            for name, lp, nw, own in variants:
                if lp is None:
                    started = start_nginx(d, up_port)
                    if started is None:
                        print("  nginx: not installed (apt-get install nginx-light)")
                        continue
                    proc, port = started
                    pid = proc.pid
                else:
                    port = _free_port()
                    ready = mp.Event()
                    proc = mp.Process(target=proxy_main, args=(port, upstream, str(Path(d) / f"t-{lp}-{nw}.jsonl"),
                                                               ready, None, nw, lp, own))
                    proc.start()
                    ready.wait(10)
                    pid = proc.pid
                c0 = sum(_proc_cpu_split(pid))
                lat, n = run_load(f"http://127.0.0.1:{port}", streams, args.clients, args.seconds, args.warmup)
                c1 = sum(_proc_cpu_split(pid))
                proc.terminate()
                if lp is None:
                    proc.wait(10)
                else:
                    proc.join(10)
                fwd = n * (args.seconds + args.warmup) / args.seconds
                print(f"  {name:28s} added p50/p99 {pct(lat, 50) - d50:7.0f}/{pct(lat, 99) - d99:7.0f} us; "
                      f"CPU {(c1 - c0) / fwd * 1e6:5.1f} us/chunk ({(c1 - c0) / (args.seconds + args.warmup) * 100:.0f}%"
                      f" of a core)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="64,512")
    ap.add_argument("--rate", type=float, default=50.0, help="tokens per second per stream")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per phase")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=4, help="load-generator processes")
    ap.add_argument("--upstream-procs", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="cProfile the proxy and print the top functions")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    ap.add_argument("--workers", type=int, default=1, help="proxy worker processes (kvtop proxy --workers)")
    ap.add_argument("--forward-only", action="store_true",
                    help="also measure the proxy's CPU on a path it forwards without recording")
    ap.add_argument("--compare", action="store_true",
                    help="direct / nginx / kvtop proxy on asyncio / on uvloop in one run (one process each)")
    args = ap.parse_args()

    ctx_ready = [mp.Event() for _ in range(args.upstream_procs)]
    up_port = _free_port()
    tokens = int(args.rate * 4)  # 4-second streams: reconnects are part of the load too
    ups = [mp.Process(target=upstream_main, args=(up_port, args.rate, tokens, ev), daemon=True) for ev in ctx_ready]
    for p in ups:
        p.start()
    for ev in ctx_ready:
        ev.wait(10)
    upstream = f"http://127.0.0.1:{up_port}"
    results = []
    print(f"cpus={os.cpu_count()} python={sys.version.split()[0]} rate={args.rate:g}/s "
          f"seconds={args.seconds:g} clients={args.clients} upstream_procs={args.upstream_procs} "
          f"proxy_workers={args.workers}")
    if args.compare:
        compare(args, upstream, up_port)
        for p in ups:
            p.terminate()
        return 0
    iso = recorder_cost_us()
    print(f"recorder alone (SSE parse + JSON decode + record + trace write): {iso:.1f} us/chunk")
    with tempfile.TemporaryDirectory() as d:
        for streams in [int(s) for s in args.streams.split(",")]:
            prof_path = str(Path(d) / f"proxy-{streams}.prof") if args.profile else None
            px_port = _free_port()
            ready = mp.Event()
            record = str(Path(d) / f"trace-{streams}.jsonl")
            px = mp.Process(target=proxy_main, args=(px_port, upstream, record, ready, prof_path, args.workers))
            px.start()
            ready.wait(10)
            lat_d, n_d = run_load(upstream, streams, args.clients, args.seconds, args.warmup)
            phase_s = args.seconds + args.warmup
            fwd_cpu_us = float("nan")
            if args.forward_only:
                # Same stream on a path the proxy forwards without recording: the pure aiohttp cost.
                c0 = _proc_cpu_s(px.pid)
                _, n_f = run_load(f"http://127.0.0.1:{px_port}", streams, args.clients, args.seconds,
                                  args.warmup, "/bench/forward-only")
                c1 = _proc_cpu_s(px.pid)
                fwd_cpu_us = (c1 - c0) / (n_f * phase_s / args.seconds) * 1e6 if n_f else float("nan")
            rss0 = _rss_mib(px.pid)
            u0, s0 = _proc_cpu_split(px.pid)
            lat_p, n_p = run_load(f"http://127.0.0.1:{px_port}", streams, args.clients, args.seconds, args.warmup)
            u1, s1 = _proc_cpu_split(px.pid)
            rss1 = _rss_mib(px.pid)
            cpu0, cpu1 = u0 + s0, u1 + s1
            # chunks forwarded in the whole proxied phase (warm-up included) ~ measured * (1 + warmup/seconds)
            forwarded = n_p * phase_s / args.seconds
            cpu_us = (cpu1 - cpu0) / forwarded * 1e6 if forwarded else float("nan")
            user_us = (u1 - u0) / forwarded * 1e6 if forwarded else float("nan")
            sys_us = (s1 - s0) / forwarded * 1e6 if forwarded else float("nan")
            px.terminate()
            px.join(10)
            trace_lines = sum(1 for _ in open(record))
            r = {
                "streams": streams, "chunks_direct": n_d, "chunks_proxied": n_p,
                "direct_p50_us": pct(lat_d, 50), "direct_p99_us": pct(lat_d, 99),
                "proxied_p50_us": pct(lat_p, 50), "proxied_p99_us": pct(lat_p, 99),
                "proxy_cpu_us_per_chunk": cpu_us, "proxy_cpu_util": (cpu1 - cpu0) / (args.seconds + args.warmup),
                "trace_lines": trace_lines, "forward_only_cpu_us_per_chunk": fwd_cpu_us,
                "proxy_user_us_per_chunk": user_us, "proxy_sys_us_per_chunk": sys_us,
                "proxy_rss_mib_before": rss0, "proxy_rss_mib_after": rss1,
            }
            r["added_p50_us"] = r["proxied_p50_us"] - r["direct_p50_us"]
            r["added_p99_us"] = r["proxied_p99_us"] - r["direct_p99_us"]
            results.append(r)
            print(f"streams={streams:4d}  chunks/s={n_p / args.seconds:8.0f}  "
                  f"latency direct p50/p99 {r['direct_p50_us']:7.0f}/{r['direct_p99_us']:7.0f} us  "
                  f"proxied p50/p99 {r['proxied_p50_us']:7.0f}/{r['proxied_p99_us']:7.0f} us  "
                  f"ADDED p50/p99 {r['added_p50_us']:6.0f}/{r['added_p99_us']:6.0f} us  "
                  f"proxy CPU {cpu_us:5.1f} us/chunk = user {user_us:.1f} + kernel {sys_us:.1f} "
                  f"({r['proxy_cpu_util'] * 100:.0f}% of a core)"
                  + (f"; forwarding alone (no recording) {fwd_cpu_us:5.1f} us/chunk" if args.forward_only else "")
                  + f"; proxy RSS {rss0:.0f} -> {rss1:.0f} MiB")
            if prof_path and os.path.exists(prof_path):
                import pstats

                st = pstats.Stats(prof_path)
                print(f"  proxy profile, {streams} streams (tottime, top 15):")
                st.sort_stats("tottime").print_stats(15)
    for p in ups:
        p.terminate()
    if args.json:
        Path(args.json).write_text(json.dumps({"recorder_alone_us": iso, "loads": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
