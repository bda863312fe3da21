#!/usr/bin/env python3
"""Exercise kvtop's GPU and host sources against the real NVML on a machine with a GPU.

    python3 -m bench.gpu_check [--interval 1.0] [--load] [--load-seconds 2] [--mib 256]

Prints every field GpuSource read for every GPU (two polls ``--interval`` apart, each timed),
every NVML call it made with its outcome (OK / NOT_SUPPORTED / ...) and latency, raw probes of
the APIs behind the PCIe figures, and HostSource's signals. ``--load`` (needs torch with CUDA)
copies a pinned host buffer to the GPU and back for ``--load-seconds`` per direction and prints
the GB/s the copy measured next to the GB/s NVML reported, and how each host pinned-memory signal
moved when the pinned buffer was allocated. Without a GPU it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
import types
from collections import defaultdict
from itertools import pairwise
from typing import Any

from kvtop.sources.gpu import GpuSource
from kvtop.sources.host import HostSource

GB = 1e9


class TracingNvml(types.ModuleType):
    """Wraps the real binding: every ``nvml*`` call is counted with its outcome and latency."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("pynvml")
        self._real = real
        self._lock = threading.Lock()
        self.stats: dict[str, dict[str, Any]] = defaultdict(lambda: {"n": 0, "s": 0.0, "outcomes": defaultdict(int)})

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr

        def traced(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            outcome = "OK"
            try:
                out = attr(*a, **kw)
                if name == "nvmlDeviceGetFieldValues":
                    codes = sorted({int(v.nvmlReturn) for v in out})
                    outcome = "OK" if codes == [0] else f"OK, per-field returns {codes}"
                return out
            except Exception as e:
                outcome = type(e).__name__
                raise
            finally:
                key = name + ("(version=v2)" if kw.get("version") else "")
                with self._lock:
                    s = self.stats[key]
                    s["n"] += 1
                    s["s"] += time.perf_counter() - t0
                    s["outcomes"][outcome] += 1

        return traced


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:,} ({v / 2**30:.2f} GiB)" if abs(v) >= 2**20 else f"{v:,}"
    return repr(v)


def print_record(rec: Any, indent: str = "    ") -> None:
    for f in dataclasses.fields(rec):
        v = getattr(rec, f.name)
        if f.name == "notes":
            for n in v:
                print(f"{indent}note: {n}")
            continue
        if f.name == "pinned_signals":
            for k, sv in v.items():
                print(f"{indent}signal {k!r}: {fmt(sv)}")
            continue
        if f.name == "pcie_tx_bytes_per_s" or f.name == "pcie_rx_bytes_per_s":
            print(f"{indent}{f.name}: {fmt(v)}" + (f"  = {v / GB:.3f} GB/s" if v is not None else ""))
            continue
        print(f"{indent}{f.name}: {fmt(v)}")


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def raw_probes(nv: Any, real: Any) -> None:
    """What the underlying APIs return, independent of GpuSource's interpretation."""
    section("raw NVML probes")
    for fn in ("nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion"):
        try:
            print(f"  {fn}: {getattr(real, fn)()}")
        except Exception as e:
            print(f"  {fn}: {type(e).__name__}")
    for i in range(real.nvmlDeviceGetCount()):
        print(f"  GPU {i}")
        try:
            h = real.nvmlDeviceGetHandleByIndex(i)
        except Exception as e:
            print(f"    handle: {type(e).__name__}")
            continue
        try:
            m1 = real.nvmlDeviceGetMemoryInfo(h)
            print(f"    memory v1: total={m1.total:,} used={m1.used:,} free={m1.free:,}")
        except Exception as e:
            print(f"    memory v1: {type(e).__name__}")
        try:
            m2 = real.nvmlDeviceGetMemoryInfo(h, version=real.nvmlMemory_v2)
            print(f"    memory v2: total={m2.total:,} reserved={m2.reserved:,} used={m2.used:,} free={m2.free:,}")
        except Exception as e:
            print(f"    memory v2: {type(e).__name__}")
        try:
            vals = real.nvmlDeviceGetFieldValues(h, [197, 198, 94])
            for v in vals:
                print(f"    field {v.fieldId}: return={v.nvmlReturn} type={v.valueType} "
                      f"ull={v.value.ullVal:,} timestamp_us={v.timestamp} latency_us={v.latencyUsec}")
            now_us = time.time() * 1e6
            print(f"    (wall clock now - field timestamp = {(now_us - vals[0].timestamp) / 1e3:,.1f} ms)")
        except Exception as e:
            print(f"    field values 197/198/94: {type(e).__name__}")
        for label, c in (("TX", 0), ("RX", 1)):
            t0 = time.perf_counter()
            try:
                kb = real.nvmlDeviceGetPcieThroughput(h, c)
                print(f"    nvmlDeviceGetPcieThroughput {label}: {kb} KB/s, call took "
                      f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
            except Exception as e:
                print(f"    nvmlDeviceGetPcieThroughput {label}: {type(e).__name__}")
        for fn in ("nvmlDeviceGetGpuMaxPcieLinkGeneration", "nvmlDeviceGetPcieSpeed",
                   "nvmlDeviceGetPcieLinkMaxSpeed", "nvmlDeviceGetMaxMigDeviceCount"):
            try:
                print(f"    {fn}: {getattr(real, fn)(h)}")
            except Exception as e:
                print(f"    {fn}: {type(e).__name__}")
        for fn in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
                   "nvmlDeviceGetMPSComputeRunningProcesses_v3"):
            try:
                procs = getattr(real, fn)(h)
                print(f"    {fn}: " + (", ".join(f"pid {p.pid}: {p.usedGpuMemory}" for p in procs) or "[]"))
            except Exception as e:
                print(f"    {fn}: {type(e).__name__}")


def print_calls(tr: TracingNvml) -> None:
    section("NVML calls made by GpuSource (count, mean ms, outcomes)")
    for name in sorted(tr.stats):
        s = tr.stats[name]
        outs = ", ".join(f"{k} x{v}" for k, v in sorted(s["outcomes"].items()))
        print(f"  {name:<52} {s['n']:>4}  {s['s'] / s['n'] * 1e3:8.3f} ms  {outs}")


def host_signals(host: HostSource) -> dict[str, int | None]:
    return dict(host.poll(0.0).pinned_signals)


def print_deltas(before: dict[str, int | None], after: dict[str, int | None]) -> None:
    for k in sorted(set(before) | set(after)):
        b, a = before.get(k), after.get(k)
        d = f"{a - b:+,}" if a is not None and b is not None else "n/a"
        print(f"    {k!r}: {fmt(b)} -> {fmt(a)}  delta {d}")


def register_probe(torch: Any, host: HostSource, n: int) -> None:
    """cudaHostRegister pins existing pageable pages (the FOLL_PIN path): which signals move?"""
    try:
        buf = torch.empty(n, dtype=torch.uint8)
        buf.fill_(1)
        cudart = torch.cuda.cudart()
        before = host_signals(host)
        err = cudart.cudaHostRegister(buf.data_ptr(), n, 0)
        after = host_signals(host)
        print(f"  cudaHostRegister of a {n:,} B pageable buffer (return {err}): signals before -> after")
        print_deltas(before, after)
        cudart.cudaHostUnregister(buf.data_ptr())
    except Exception as e:
        print(f"  cudaHostRegister probe skipped: {type(e).__name__}: {e}")


def load_test(gpu: GpuSource, host: HostSource, real: Any, secs: float, mib: int,
              last: list[Any], clock0: float) -> int:
    section(f"--load: pinned copies of {mib} MiB, {secs:.1f} s per direction")
    try:
        import torch
    except Exception as e:
        print(f"  torch not importable ({type(e).__name__}): load test skipped")
        return 0
    if not torch.cuda.is_available():
        print("  torch sees no CUDA device: load test skipped")
        return 0
    dev = torch.device("cuda:0")
    torch.ones(1, device=dev)  # create the context before measuring host memory
    uuid = None
    try:
        uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    except Exception:
        pass
    n = mib * 2**20
    before = host_signals(host)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)  # touch every page
    after = host_signals(host)
    print("  torch pin_memory (cudaHostAlloc): host signals before -> after allocating "
          f"{n:,} B:")
    print_deltas(before, after)
    register_probe(torch, host, n)
    devbuf = torch.empty(n, dtype=torch.uint8, device=dev)
    for _ in range(3):  # warm-up
        devbuf.copy_(pinned, non_blocking=True)
        pinned.copy_(devbuf, non_blocking=True)
    torch.cuda.synchronize()

    # torch's device 0 is not NVML's GPU 0 under CUDA_VISIBLE_DEVICES: match by UUID.
    index = next((r.index for r in last if uuid and r.uuid == uuid), last[0].index)
    print(f"  torch cuda:0 is NVML GPU {index} (uuid {uuid})")

    def pick(recs: list[Any]) -> Any:
        return next(r for r in recs if r.index == index)

    def counters() -> tuple[int, int] | None:
        try:
            h = real.nvmlDeviceGetHandleByIndex(index)
            v = real.nvmlDeviceGetFieldValues(h, [197, 198])
            if v[0].nvmlReturn or v[1].nvmlReturn:
                return None
            return int(v[0].value.ullVal), int(v[1].value.ullVal)
        except Exception:
            return None

    for direction, nvml_dir in (("host->device", "rx"), ("device->host", "tx")):
        samples_20ms: list[float] = []
        stop = threading.Event()

        def sampler(d: str = nvml_dir, stop: threading.Event = stop, samples_20ms: list[float] = samples_20ms) -> None:
            try:
                h = real.nvmlDeviceGetHandleByIndex(index)
                while not stop.is_set():
                    samples_20ms.append(real.nvmlDeviceGetPcieThroughput(h, 1 if d == "rx" else 0) * 1000.0)
            except Exception:
                pass

        # The counters' width (kvtop.sources.gpu._WIDE): read them every ~2 ms during the copies, far
        # faster than a 32-bit counter can wrap at PCIe speeds (2**32 B at 64 GB/s: 67 ms), and sum
        # the steps modulo 2**32 and 2**64: the sum that matches the bytes copied is the width.
        raw: list[tuple[int, int]] = []  # (valueType, value) of this direction's counter

        def counter_sampler(d: str = nvml_dir, stop: threading.Event = stop, raw: list[tuple[int, int]] = raw) -> None:
            try:
                h = real.nvmlDeviceGetHandleByIndex(index)
                fid = 198 if d == "rx" else 197
                while not stop.is_set():
                    v = real.nvmlDeviceGetFieldValues(h, [fid])[0]
                    if not v.nvmlReturn:
                        raw.append((int(v.valueType), int(v.value.ullVal)))
                    time.sleep(0.002)
            except Exception:
                pass

        c0 = counters()
        t_poll0 = time.monotonic() - clock0
        pick(gpu.poll(t_poll0))
        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        th2 = threading.Thread(target=counter_sampler, daemon=True)
        th2.start()
        copies = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < secs:
            for _ in range(4):
                if direction == "host->device":
                    devbuf.copy_(pinned, non_blocking=True)
                else:
                    pinned.copy_(devbuf, non_blocking=True)
            torch.cuda.synchronize()
            copies += 4
        elapsed = time.perf_counter() - t0
        stop.set()
        th.join(timeout=2)
        th2.join(timeout=2)
        t_poll1 = time.monotonic() - clock0
        rec = pick(gpu.poll(t_poll1))
        c1 = counters()
        copy_gbs = copies * n / elapsed / GB
        nvml_rate = rec.pcie_rx_bytes_per_s if nvml_dir == "rx" else rec.pcie_tx_bytes_per_s
        print(f"  engine_proc_mem_bytes (this process): {fmt(rec.engine_proc_mem_bytes)}; "
              f"GPU mem used {fmt(rec.mem_used_bytes)}; notes {rec.notes}")
        print(f"  {direction}: {copies} copies of {n:,} B in {elapsed:.3f} s = {copy_gbs:.2f} GB/s measured by the copy")
        if nvml_rate is not None:
            # The poll interval is longer than the copy loop; scale to the copy time to compare.
            poll_dt = t_poll1 - t_poll0
            print(f"    GpuSource {nvml_dir.upper()} ({rec.pcie_source}): {nvml_rate / GB:.2f} GB/s averaged over the "
                  f"{poll_dt:.3f} s poll interval; scaled to the copy time: {nvml_rate * poll_dt / elapsed / GB:.2f} GB/s")
        else:
            print(f"    GpuSource {nvml_dir.upper()}: None ({rec.pcie_source})")
        if c0 and c1:
            idx = 1 if nvml_dir == "rx" else 0
            moved = c1[idx] - c0[idx]
            other = c1[1 - idx] - c0[1 - idx]
            print(f"    raw counter {nvml_dir.upper()} delta {moved:,} B = {moved / (copies * n):.3f} x the bytes copied; "
                  f"opposite direction moved {other:,} B")
        if len(raw) > 1:
            steps = [(b[1] - a[1]) for a, b in pairwise(raw)]
            m32 = sum(x % (1 << 32) for x in steps)
            m64 = sum(x % (1 << 64) for x in steps)
            back = sum(1 for x in steps if x < 0)
            print(f"    counter width: valueType {sorted({t for t, _ in raw})}, {len(raw)} reads ~2 ms apart, "
                  f"largest value {max(v for _, v in raw):,}, {back} step(s) back; steps summed mod 2**32 "
                  f"{m32 / (copies * n):.3f} x the bytes copied, mod 2**64 {m64 / (copies * n):.3f} x "
                  "(the width is the one near 1; kvtop rates the counters only once they read >= 2**32)")
        if samples_20ms:
            s = sorted(samples_20ms)
            print(f"    nvmlDeviceGetPcieThroughput {nvml_dir.upper()} during the copies ({len(s)} samples, x1000): "
                  f"median {s[len(s) // 2] / GB:.2f} GB/s, max {s[-1] / GB:.2f} GB/s")
    del pinned, devbuf
    return 0


def fake_parallel_bench(n: int) -> int:
    """Poll cost on the throughput fallback with NVML's ~20 ms blocking per call simulated."""
    from testkit.fake_nvml import FI_RX, FI_TX, FakeGpu, FakeNvml

    nv = FakeNvml([FakeGpu(uuid=f"GPU-{i}", tx_kbps=1000 + i,
                           field_fail={FI_TX: "NOT_SUPPORTED", FI_RX: "NOT_SUPPORTED"}) for i in range(n)])
    nv.throughput_delay_s = 0.020
    src = GpuSource(nvml=nv)
    src.poll(0.0)  # first poll discovers the fallback and starts the threads
    runs = []
    for k in range(5):
        t0 = time.perf_counter()
        recs = src.poll(1.0 + k)
        runs.append(time.perf_counter() - t0)
    assert all(r.pcie_tx_bytes_per_s is not None for r in recs)
    t0 = time.perf_counter()
    h = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    for hh in h:
        for c in (0, 1):
            nv.nvmlDeviceGetPcieThroughput(hh, c)
    serial = time.perf_counter() - t0
    src.close()
    best = min(runs)
    print(f"{n} fake GPUs, 20 ms per throughput call: GpuSource.poll best of 5 {best * 1e3:.1f} ms "
          f"(median {sorted(runs)[2] * 1e3:.1f} ms); the same {2 * n} calls serially {serial * 1e3:.1f} ms; "
          f"ratio {best / serial:.3f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between the two polls")
    ap.add_argument("--load", action="store_true", help="generate PCIe traffic with torch and compare rates")
    ap.add_argument("--load-seconds", type=float, default=2.0)
    ap.add_argument("--mib", type=int, default=256, help="size of the pinned buffer for --load")
    ap.add_argument("--url", action="append", default=[], help="engine URL whose processes to attribute")
    ap.add_argument("--fake-gpus", type=int, default=0, metavar="N",
                    help="no GPU needed: time one poll of N fake GPUs on the 20 ms throughput path "
                         "(parallel) against the same calls made one after another")
    args = ap.parse_args()
    if args.fake_gpus > 0:
        return fake_parallel_bench(args.fake_gpus)
    if args.interval <= 0 or args.load_seconds <= 0 or args.mib <= 0:
        print("gpu_check: --interval, --load-seconds and --mib must be positive", file=sys.stderr)
        return 2

    try:
        import pynvml
    except Exception as e:
        print(f"gpu_check: no GPU check possible: nvidia-ml-py not importable ({type(e).__name__})")
        return 0
    tr = TracingNvml(pynvml)
    if args.url:
        from kvtop.sources.procs import EnginePids

        pids = EnginePids(args.url)
    else:
        me = os.getpid()  # with --load, this process is the GPU user to attribute

        def pids() -> set[int]:
            return {me}

    t_init = time.perf_counter()
    gpu = GpuSource(nvml=tr, engine_pids=pids)
    init_ms = (time.perf_counter() - t_init) * 1e3
    if gpu.status != "ok":
        print(f"gpu_check: no GPU: {gpu.status}")
        return 0
    host = HostSource(engine_pids=pids)
    rc = 0
    print(f"GpuSource status: {gpu.status}; driver {gpu.driver_version}; {gpu.gpu_count} GPU(s); init {init_ms:.1f} ms")
    try:
        t0 = time.monotonic()
        times = []
        for k in range(2):
            if k:
                time.sleep(args.interval)
            t = time.monotonic() - t0
            p0 = time.perf_counter()
            recs = gpu.poll(t)
            times.append((time.perf_counter() - p0) * 1e3)
            section(f"poll {k + 1} at t={t:.3f} s took {times[-1]:.1f} ms")
            for r in recs:
                print(f"  GPU {r.index}")
                print_record(r)
        p0 = time.perf_counter()
        recs = gpu.poll(time.monotonic() - t0)
        print(f"\none more poll (warm) took {(time.perf_counter() - p0) * 1e3:.2f} ms")
        print_calls(tr)
        raw_probes(tr, pynvml)
        section("HostSource")
        p0 = time.perf_counter()
        hr = host.poll(0.0)
        print(f"  poll took {(time.perf_counter() - p0) * 1e3:.2f} ms")
        print_record(hr)
        if args.load:
            rc = load_test(gpu, host, pynvml, args.load_seconds, args.mib, recs, t0)
    except Exception as e:  # report and keep the exit code honest
        import traceback

        traceback.print_exc()
        print(f"gpu_check: failed: {type(e).__name__}: {e}")
        rc = 1
    finally:
        gpu.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
