"""Soak: `kvtop record` with its recording proxy in front of the simulated engine, 200 concurrent
streams, analysis of the growing trace every few minutes; RSS and open fds of the recorder sampled
all along, requests sent counted against request records written.

Prints, for the recorder (its process and children): RSS and fd count at start / end, their
least-squares slope after a warm-up (MB/min, fds/min), the load (requests sent, completed, tokens),
the trace (arrive / finish / error / cancel records), requests lost (sent through the proxy but
absent from the trace) and every periodic analysis run's exit status and time.

The 30-minute soak of issue 14:

    python bench/soak.py --minutes 30 --streams 200

(on a shared box: ``nice python bench/soak.py --minutes 15``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

REPO = Path(__file__).resolve().parents[1]


def _kvtop(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "kvtop", *args], env=env, text=True, **kw)


def _wait_line(stream, pattern: str, timeout: float) -> re.Match:
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end:
        line = stream.readline()
        if not line:
            time.sleep(0.05)
            continue
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise SystemExit(f"no line matching {pattern!r} within {timeout}s: {''.join(seen)[-500:]}")


def _usage(proc: psutil.Process) -> tuple[float, int]:
    rss, fds = 0, 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
        except psutil.Error:
            pass
    return rss / (1 << 20), fds


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


async def _load(url: str, streams: int, stop_at: float, counts: dict[str, int], max_tokens: int) -> None:
    timeout = aiohttp.ClientTimeout(total=300, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async def one_stream(k: int) -> None:
            i = 0
            while time.monotonic() < stop_at:
                rid = f"soak-{k}-{i}"
                i += 1
                counts["sent"] += 1
                body = {"model": "sim", "prompt": "soak " * 40, "max_tokens": max_tokens, "stream": True}
                try:
                    async with s.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                        async for line in r.content:
                            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                                counts["chunks"] += 1
                        counts["completed" if r.status == 200 else "http_errors"] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    counts["client_errors"] += 1

        await asyncio.gather(*(one_stream(k) for k in range(streams)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--analyze-every-s", type=float, default=180.0)
    ap.add_argument("--preset", default="healthy")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvtop-soak-"))
    trace = tmp / "soak.jsonl"
    sim = _kvtop("sim-server", "--preset", a.preset, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    sim_url = _wait_line(sim.stdout, r"at (http://\S+)", 60).group(1)
    rec = _kvtop("record", "--url", sim_url, "--proxy-listen", "127.0.0.1:0", "-o", str(trace), "--no-gpu",
                 stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    proxy_url = _wait_line(rec.stderr, r"proxy (http://\S+) ->", 60).group(1)
    rp = psutil.Process(rec.pid)
    counts: dict[str, int] = {"sent": 0, "completed": 0, "chunks": 0, "http_errors": 0, "client_errors": 0}
    t0 = time.monotonic()
    stop_at = t0 + a.minutes * 60
    samples: list[tuple[float, float, int]] = []
    analyses: list[tuple[float, int, float]] = []

    async def monitor() -> None:
        next_analysis = t0 + a.analyze_every_s
        while time.monotonic() < stop_at:
            rss, fds = _usage(rp)
            now = time.monotonic()
            samples.append((now - t0, rss, fds))
            if now >= next_analysis:
                next_analysis += a.analyze_every_s
                ts = time.monotonic()
                p = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "kvtop", "analyze", str(trace), "--format", "json",
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                    env=dict(os.environ, PYTHONPATH=str(REPO)))
                rc = await p.wait()
                analyses.append((ts - t0, rc, time.monotonic() - ts))
            print(f"  {now - t0:6.0f} s  RSS {rss:7.1f} MB  fds {fds:4d}  sent {counts['sent']:,}  "
                  f"completed {counts['completed']:,}", flush=True)
            await asyncio.sleep(a.sample_s)

    async def go() -> None:
        await asyncio.gather(_load(proxy_url, a.streams, stop_at, counts, a.max_tokens), monitor())

    try:
        asyncio.run(go())
    finally:
        rec.send_signal(signal.SIGTERM)
        rec.wait(120)
        sim.send_signal(signal.SIGTERM)
        sim.wait(60)
    kinds: dict[str, int] = {}
    ids: set[str] = set()
    with open(trace, encoding="utf-8") as f:
        f.readline()
        for line in f:
            d = json.loads(line)
            if d.get("kind") == "request" and d.get("event") != "token":
                kinds[d["event"]] = kinds.get(d["event"], 0) + 1
                if d["event"] == "arrive":
                    ids.add(d["id"])
    warm = [s for s in samples if s[0] >= min(120.0, a.minutes * 60 / 4)]
    xs = [s[0] / 60 for s in warm]
    print(f"soak: {a.minutes:g} min, {a.streams} streams, preset {a.preset}, trace {trace.stat().st_size / 1e6:.0f} MB")
    print(f"  recorder RSS {samples[0][1]:.1f} -> {samples[-1][1]:.1f} MB, slope after warm-up "
          f"{_slope(xs, [s[1] for s in warm]):+.2f} MB/min")
    print(f"  recorder fds {samples[0][2]} -> {samples[-1][2]}, slope after warm-up "
          f"{_slope(xs, [float(s[2]) for s in warm]):+.3f} fds/min")
    print(f"  load: {counts}")
    print(f"  trace request records: {kinds}")
    print(f"  requests sent {counts['sent']:,}, arrive records {kinds.get('arrive', 0):,}, "
          f"lost {counts['sent'] - len(ids):,} (sent but no arrive record; the last in-flight ones "
          f"at stop are cancelled, not lost)")
    print(f"  analyze runs (t s, exit, duration s): {[(round(t), rc, round(d, 1)) for t, rc, d in analyses]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
