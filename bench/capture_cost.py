"""Passive capture's cost: CPU per captured chunk and per packet, and drops, against tcpdump.

    python -m bench.capture_cost [--streams 64,512] [--rate 50] [--seconds 6] [--clients 2] [--repeat 3] [--pin]

The same loopback SSE load as bench/proxy_overhead.py (a local upstream streaming ``--rate``
tokens per second per stream to client processes, no proxy in the path; its token events differ
only in their text, as vLLM's and SGLang's do, unless ``--stamp`` adds a send-time field to each)
is observed, in the same phase, by two processes at once:

  * kvtop's capture (``CaptureSource`` on the upstream port, every record written to a trace file,
    as ``kvtop record --capture`` does);
  * ``tcpdump -i lo -w /dev/null`` with the same port filter (the baseline: kernel filter plus
    copying every packet out, no parsing).

Printed per load: chunks/s on the wire, packets each saw, CPU microseconds per chunk and per packet
(process user+sys / count), kernel drops (PACKET_STATISTICS / tcpdump's own count), sequence holes,
and whether the capture's token count equals the tokens the clients received.

How it is measured: the capture process's user+system CPU from the start of the phase (``/proc``)
until it has processed every packet of it and closed its trace (its own ``getrusage`` at exit:
a capture starved of CPU catches up after the load stops, and that work counts), divided by the
tokens it wrote to its trace, so it is everything the capture does per chunk (ring reads,
reassembly, HTTP and SSE parsing, records, the trace file), not a micro-benchmark. On a box
where the load generator and the upstream share the capture's cores that CPU time is inflated by
their contention: ``--pin`` puts the capture on the last CPU and everything else on the others
(as the issue allows), and ``--repeat N`` runs each load N times and prints the lowest and the
median figure, which is the one to compare between versions.
``--replay FILE`` measures the capture's own work without the load's noise: the first time, it
records the raw ring blocks (TPACKET_V3, as the kernel wrote them) of one load of the first
``--streams`` value to FILE; then (and every later time) it replays FILE through
``CaptureSource.poll`` in this process (the ring walk, reassembly, parsing, records and the trace
file, no socket), ``--repeat`` times (at least 5), and prints the CPU per packet, lowest and median.
Replaying one FILE through two versions compares their code on the same packets.
Targets: issue 15, under 10 us of CPU per chunk and zero drops at 25,000 chunks/s on one core;
issue 23, 3 us per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.proxy_overhead import _free_port, _proc_cpu_split, run_load, upstream_main


def capture_main(port: int, record: str, ready: Any, q: mp.Queue, cpu: int | None = None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from kvtop.model.trace import TraceWriter, make_header
    from kvtop.sources.capture import CaptureSource

    writer = TraceWriter(record, make_header(engine={}, recorder="bench capture"))
    t0 = time.monotonic()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        cap = CaptureSource(port, writer.write, lambda: time.monotonic() - t0)
        cap.open()
        task = asyncio.create_task(cap.run(stop))
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.25)
            writer.flush_if_due()
        await task
        writer.close()
        st = cap.stats
        # its CPU once every queued packet is processed: a capture starved of CPU during the phase
        # catches up after it (the ring holds seconds), and that work belongs to the phase's chunks
        ru = resource.getrusage(resource.RUSAGE_SELF)
        q.put({"cpu_s": ru.ru_utime + ru.ru_stime, "sys_s": ru.ru_stime, "packets": st.packets,
               "drops": st.kernel_drops, "holes": st.holes, "requests": st.requests,
               "records": writer.count})

    asyncio.run(main())


def cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    user, system = _proc_cpu_split(pid)
    return user + system


def tokens_in(trace: str) -> int:
    n = 0
    with open(trace) as f:
        f.readline()
        for line in f:
            d = json.loads(line)
            if d.get("event") in ("first_token", "token", "resync"):
                n += d.get("n") or 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="64,512")
    ap.add_argument("--rate", type=float, default=50.0, help="tokens per second per stream")
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds per load")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--clients", type=int, default=2, help="load-generator processes")
    ap.add_argument("--upstream-procs", type=int, default=1)
    ap.add_argument("--stamp", action="store_true",
                    help="the upstream stamps each token event with its send time (a field that changes in "
                         "every chunk, as bench/proxy_overhead.py needs; engines' chunks differ only in text)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per load (lowest and median CPU per chunk printed)")
    ap.add_argument("--replay", metavar="FILE",
                    help="replay the ring blocks recorded in FILE (recorded from one load first if it does not exist)")
    ap.add_argument("--pin", action="store_true",
                    help="capture on the last CPU, load generator, upstream and tcpdump on the others")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.replay and os.path.exists(args.replay):
        return replay(args.replay, max(5, args.repeat))
    cap_cpu = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            ap.error("--pin needs at least 2 CPUs")
        cap_cpu = cpus[-1]
        os.sched_setaffinity(0, set(cpus[:-1]))  # the children started from here inherit it

    tcpdump = shutil.which("tcpdump")
    up_port = _free_port()
    tokens = int(args.rate * 4)
    readies = [mp.Event() for _ in range(args.upstream_procs)]
    ups = [mp.Process(target=upstream_main, args=(up_port, args.rate, tokens, ev, args.stamp), daemon=True)
           for ev in readies]
    for p in ups:
        p.start()
    for ev in readies:
        ev.wait(10)
    upstream = f"http://127.0.0.1:{up_port}"
    load = os.getloadavg()[0]
    pin = f"capture on CPU {cap_cpu}" if cap_cpu is not None else "no"
    print(f"cpus={os.cpu_count()} python={sys.version.split()[0]} rate={args.rate:g}/s seconds={args.seconds:g} "
          f"clients={args.clients} tcpdump={'yes' if tcpdump else 'not installed'} "
          f"pin={pin} load average {load:.1f}")
    if args.replay:
        record_ring(args, up_port, upstream, cap_cpu)
        for p in ups:
            p.terminate()
        return replay(args.replay, max(5, args.repeat))
    with tempfile.TemporaryDirectory() as d:
        for streams in [int(s) for s in args.streams.split(",")]:
            per_chunk = []
            for rep in range(args.repeat):
                per_chunk.append(_one_load(args, streams, rep, up_port, upstream, tcpdump, cap_cpu, d))
            if args.repeat > 1:
                per_chunk.sort()
                print(f"  {streams} streams, {args.repeat} runs: CPU per chunk lowest {per_chunk[0]:.1f} us, "
                      f"median {per_chunk[len(per_chunk) // 2]:.1f} us")
    for p in ups:
        p.terminate()
    return 0


def ring_recorder_main(port: int, path: str, ready: Any, done: Any, cpu: int | None) -> None:
    """Copies every ring block the kernel hands over, as it is, to ``path`` (after a JSON line)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from kvtop.sources.capture.opener import RING_BLOCK
    from kvtop.sources.capture.packets import PacketSocket

    sock = PacketSocket(port)
    blocks: list[bytes] = []

    def drain() -> None:
        for ring, first, _n in sock.ring_blocks():
            base = first - first % RING_BLOCK
            blocks.append(ring[base:base + RING_BLOCK])

    ready.set()
    while not done.is_set():
        time.sleep(0.05)
        drain()
    time.sleep(0.3)
    drain()
    sock.close()
    with open(path, "wb") as f:
        f.write(json.dumps({"port": port, "block": RING_BLOCK, "blocks": len(blocks)}).encode() + b"\n")
        f.writelines(blocks)


def record_ring(args: argparse.Namespace, up_port: int, upstream: str, cap_cpu: int | None) -> None:
    streams = int(args.streams.split(",")[0])
    ready, done = mp.Event(), mp.Event()
    rec = mp.Process(target=ring_recorder_main, args=(up_port, args.replay, ready, done, cap_cpu))
    rec.start()
    ready.wait(10)
    _, chunks = run_load(upstream, streams, args.clients, args.seconds, args.warmup)
    time.sleep(0.5)
    done.set()
    rec.join(60)
    print(f"recorded {streams} streams x {args.rate:g} tok/s ({chunks:,} chunks) to {args.replay}")


def replay(path: str, runs: int) -> int:
    """The recorded blocks through ``CaptureSource.poll`` ``runs`` times; prints CPU per packet."""
    import mmap
    import struct

    from kvtop.model.trace import TraceWriter, make_header
    from kvtop.sources.capture import CaptureSource

    with open(path, "rb") as f:
        meta = json.loads(f.readline())
        data = f.read()
    block = meta["block"]
    ring = mmap.mmap(-1, max(1, len(data)))
    ring[:len(data)] = data
    heads = [struct.unpack_from("@III", ring, i * block + 8) for i in range(len(data) // block)]

    class Replayed:
        """Stands in for the capture's PacketSocket: the recorded blocks, handed over once."""

        uses_ring = True
        has_queued = False
        kernel_drops = 0

        def ring_blocks(self) -> Any:
            for i, (_status, n, first) in enumerate(heads):
                yield ring, i * block + first, n

        def stats(self) -> tuple[int, int]:
            return 0, 0

        def close(self) -> None:
            pass

    times = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(runs):
            writer = TraceWriter(Path(d) / f"replay-{i}.jsonl", make_header(engine={}, recorder="bench replay"))
            cap = CaptureSource(meta["port"], writer.write, lambda: 0.0)
            cap._sock = Replayed()  # type: ignore[assignment]  # the recorded ring instead of a socket
            c0 = time.process_time()
            cap.poll()
            writer.close()
            times.append(time.process_time() - c0)
            packets, records = cap.stats.packets, writer.count
    times.sort()
    print(f"replay of {path}: {packets:,} packets, {records:,} records, {runs} runs: CPU per packet "
          f"lowest {times[0] / packets * 1e6:.2f} us, median {times[len(times) // 2] / packets * 1e6:.2f} us")
    return 0


def _one_load(args: argparse.Namespace, streams: int, rep: int, up_port: int, upstream: str, tcpdump: str | None,
              cap_cpu: int | None, d: str) -> float:
    """One run of one load: prints its figures, returns the capture's CPU microseconds per chunk."""
    record = str(Path(d) / f"capture-{streams}-{rep}.jsonl")
    q: mp.Queue = mp.Queue()
    ready = mp.Event()
    cap = mp.Process(target=capture_main, args=(up_port, record, ready, q, cap_cpu))
    cap.start()
    ready.wait(10)
    td = None
    if tcpdump:
        td = subprocess.Popen([tcpdump, "-i", "lo", "-w", "/dev/null", "-s", "0", "-B", "65536", "-n",
                               f"tcp port {up_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)
    c0_user, c0_sys = _proc_cpu_split(cap.pid)
    c0 = c0_user + c0_sys
    t0 = cpu_s(td.pid if td else None)
    wall0 = time.monotonic()
    _, chunks = run_load(upstream, streams, args.clients, args.seconds, args.warmup)
    wall = time.monotonic() - wall0
    t1 = cpu_s(td.pid if td else None)
    td_packets = td_drops = None
    if td is not None:
        td.send_signal(signal.SIGINT)
        err = td.communicate(timeout=10)[1].decode()
        m = re.search(r"(\d+) packets captured", err)
        td_packets = int(m[1]) if m else None
        m = re.search(r"(\d+) packets dropped by kernel", err)
        td_drops = int(m[1]) if m else None
    time.sleep(0.5)
    cap.terminate()
    st = q.get(timeout=30)
    cap.join(10)
    # every chunk the load generated in the phase (warm-up included) crossed the wire
    wire_chunks = chunks * (args.seconds + args.warmup) / args.seconds
    captured = tokens_in(record)
    c1 = st["cpu_s"]
    cpu_chunk = (c1 - c0) / captured * 1e6 if captured else float("nan")
    cpu_pkt = (c1 - c0) / st["packets"] * 1e6 if st["packets"] else float("nan")
    # the kernel's share: the ring's wake-ups, the trace's writes (the ring is filled by the sender's CPU)
    sys_chunk = (st["sys_s"] - c0_sys) / captured * 1e6 if captured else float("nan")
    print(f"\n{streams} streams x {args.rate:g} tok/s: {wire_chunks / wall:,.0f} chunks/s on the wire "
          f"({wall:.1f} s)")
    print(f"  kvtop capture: {st['packets']:,} packets, {captured:,} tokens in {st['requests']} requests; "
          f"CPU {cpu_chunk:.1f} us/chunk (system {sys_chunk:.1f}), {cpu_pkt:.1f} us/packet "
          f"({(c1 - c0) / wall * 100:.0f}% of a core); "
          f"kernel drops {st['drops']}, holes {st['holes']}")
    if td is not None and td_packets:
        print(f"  tcpdump -w /dev/null: {td_packets:,} packets; CPU {(t1 - t0) / td_packets * 1e6:.1f} "
              f"us/packet, {(t1 - t0) / max(1, captured) * 1e6:.1f} us per chunk "
              f"({(t1 - t0) / wall * 100:.0f}% of a core); kernel drops {td_drops}")
    return cpu_chunk


if __name__ == "__main__":
    raise SystemExit(main())
