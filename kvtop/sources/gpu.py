"""GPU source: one ``GpuRecord`` per GPU per poll, read through NVML (nvidia-ml-py, ``pynvml``).

Degradation follows docs/host-and-gpu.md §4: no library / no driver / version mismatch / no
GPU -> ``status`` holds a one-line reason and ``poll`` returns []; a field NVML does not support or
permit -> that field is None plus a note; a GPU that fell off the bus -> ``lost=True`` while the
others are still read. ``poll`` blocks (the 20 ms throughput API, driver round trips): callers run
it in a worker thread, never on the UI thread.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11
from types import ModuleType
from typing import Any

from kvtop.model.records import GpuRecord

# NVML return codes (nvml.h); compared by value so any binding object (or a fake) works.
_SUCCESS = 0
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18
_ARGUMENT_VERSION_MISMATCH = 25
_GPU_NOT_FOUND = 28

_FI_PCIE_TX_BYTES = 197  # NVML_FI_DEV_PCIE_COUNT_TX_BYTES (driver >= 555)
_FI_PCIE_RX_BYTES = 198  # NVML_FI_DEV_PCIE_COUNT_RX_BYTES
_PCIE_UTIL_TX, _PCIE_UTIL_RX = 0, 1
_MIG_ENABLE = 1

_ENGINE_ONLY = "engine + host only"
_INIT_REASONS = {
    _LIBRARY_NOT_FOUND: f"no NVIDIA driver library (libnvidia-ml.so.1) found: {_ENGINE_ONLY}",
    _DRIVER_NOT_LOADED: f"NVIDIA kernel driver not loaded (is `nvidia-smi` working?): {_ENGINE_ONLY}",
    _LIB_RM_VERSION_MISMATCH: ("NVIDIA driver/library version mismatch (driver upgraded without "
                               f"reloading the kernel module or rebooting): {_ENGINE_ONLY}"),
    _GPU_NOT_FOUND: f"no supported NVIDIA GPU found: {_ENGINE_ONLY}",
}

# Per-field codes meaning "this field will never work here": stop asking, keep the note.
_PERMANENT = {_NOT_SUPPORTED: "not supported", _NO_PERMISSION: "no permission (run as root to read it)",
              _FUNCTION_NOT_FOUND: "not in this driver"}
# Per-field codes an older driver gives for a field id it does not know.
_FIELD_UNKNOWN = {_NOT_SUPPORTED, _INVALID_ARGUMENT, _NOT_FOUND, _FUNCTION_NOT_FOUND, _NO_PERMISSION}

# A PCIe sample is timed by the NVML field timestamp when it agrees with the poll clock within
# this factor; otherwise (wall-clock step, driver without timestamps) by the poll clock.
_TS_AGREEMENT = 2.0

# A 20 ms sample that has not come back by then is a hung driver call: report None, move on.
_THROUGHPUT_TIMEOUT_S = 2.0

_VALUE_ATTR = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class _Lost(Exception):
    """The GPU answered GPU_IS_LOST: abandon this GPU's record for this poll."""


class _Gpu:
    """Cached handle and per-GPU state between polls."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.handle: Any = None
        self.uuid: str | None = None
        self.name: str | None = None
        self.skip: dict[str, str] = {}  # field -> note, for fields that will never work here
        # "counters" (field ids 197/198), "throughput" (20 ms API), "off", or None before the first try.
        self.pcie_mode: str | None = None
        self.prev: tuple[int, int, float, int] | None = None  # tx, rx, poll t, NVML timestamp (us)
        self.handle_error: BaseException | None = None
        self.no_mem_v2 = False
        self.no_mps = False  # MPS process queries fail on most setups: skip them without a note
        # the PCIe byte counters have read 2**32 or more: they are 64 bits wide (see _WIDE)
        self.wide = False
        self.resets = 0  # times a wide counter stepped back (a GPU reset, a driver reload)
        # the 20 ms samples asked for at the last poll: while one has not come back (a hung driver
        # call keeps its worker) none is asked again, so a hung GPU holds two workers, never more
        self.inflight: tuple[Future[int], Future[int]] | None = None
        self.listed_other = False  # NVML listed processes on it that are not the engine's (this poll)


# A counter below this that steps back did not wrap (a 64-bit wrap starts near 2**64).
_WRAP_64 = 1 << 63
# NVML says of the PCIe byte counters (fields 197/198) "Value can be wrapped"; the values shown
# in the wild stay under 2**32, and a real H200's went backwards while moving < 1 % of the bytes
# copied: they look 32 bits wide, which at PCIe speeds wraps several times a second, so no poll
# interval can rate them. Counters are used once a value has reached 2**32 (a 32-bit one never
# can); until then the 20 ms throughput sample measures the GPU.
_WIDE = 1 << 32
_RESETS_MAX = 3  # wide counters that step back more often than this are not counters at all


def _proc_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _code(e: BaseException | None) -> int | None:
    v = getattr(e, "value", None)
    return v if isinstance(v, int) else None


def _text(v: Any) -> str | None:
    if v is None:
        return None
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class GpuSource:
    def __init__(self, nvml: ModuleType | None = None, engine_pids: Callable[[], set[int]] | None = None,
                 measure_pcie_throughput: bool = True, pid_exists: Callable[[int], bool] | None = None) -> None:
        self._engine_pids = engine_pids
        self._measure_tp = measure_pcie_throughput
        self._pid_exists = pid_exists or _proc_exists
        self._gpus: list[_Gpu] = []
        self._pool: ThreadPoolExecutor | None = None
        self._initialized = False
        self._proc_fns: dict[str, str | None] = {}  # "compute"/"mps" -> working binding function name
        self.driver_version: str | None = None
        self.status = "ok"
        # the binding module (or a stand-in with the same functions); typed loosely on purpose
        self.nvml: Any = None
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except Exception as e:  # any import failure means "no NVML"
                self.status = f"NVIDIA NVML binding not importable (pip install nvidia-ml-py: {e}): {_ENGINE_ONLY}"
                self.nvml = None
                return
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as e:
            code = _code(e)
            self.status = (_INIT_REASONS.get(code) if code is not None else None) or f"NVML initialisation failed ({e}): {_ENGINE_ONLY}"
            return
        self._initialized = True
        try:
            self.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:  # informational only
            pass
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            code = _code(e)
            self.status = (_INIT_REASONS.get(code) if code is not None else None) or f"NVML cannot count GPUs ({e}): {_ENGINE_ONLY}"
            return
        if count == 0:
            self.status = _INIT_REASONS[_GPU_NOT_FOUND]
            return
        for i in range(count):
            g = _Gpu(i)
            self._acquire(g)
            self._gpus.append(g)

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._pool is not None:
            # Not waiting: a driver call that hangs must not hang the console's exit.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._initialized:
            self._initialized = False
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # shutting down anyway
                pass

    def __enter__(self) -> GpuSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def gpu_count(self) -> int:
        return len(self._gpus)

    def _acquire(self, g: _Gpu) -> None:
        """Handle, name and uuid; cached because re-acquiring handles every poll costs CPU."""
        nv = self.nvml
        try:
            g.handle = nv.nvmlDeviceGetHandleByIndex(g.index)
            g.handle_error = None
        except Exception as e:  # retried at the next poll; the record says why
            g.handle, g.handle_error = None, e
            return
        for attr, fn in (("name", "nvmlDeviceGetName"), ("uuid", "nvmlDeviceGetUUID")):
            try:
                setattr(g, attr, _text(getattr(nv, fn)(g.handle)))
            except Exception:
                pass

    # -- polling ------------------------------------------------------------------------------
    def poll(self, t: float) -> list[GpuRecord]:
        if not self._gpus or not self._initialized:
            return []
        pids, pid_note = self._read_engine_pids()
        records: dict[int, GpuRecord] = {}
        lost: set[int] = set()
        samples: dict[int, tuple[int, int, int] | None] = {}

        for g in self._gpus:
            g.listed_other = False
            if g.handle is None:
                self._acquire(g)
            rec = GpuRecord(t=t, index=g.index, uuid=g.uuid, name=g.name)
            records[g.index] = rec
            if g.handle is None:
                lost.add(g.index)
                continue
            try:
                samples[g.index] = self._read_counters(g, rec)
            except _Lost:
                lost.add(g.index)

        # The 20 ms API blocks per call: run every GPU and direction at once so 8 GPUs cost ~20 ms.
        futures: dict[int, tuple[Future[int], Future[int]]] = {}
        hung: set[int] = set()
        for g in self._gpus:
            narrow = g.pcie_mode == "counters" and not g.wide and self._measure_tp
            if g.index not in lost and (g.pcie_mode == "throughput" or narrow):
                if g.inflight is not None and not all(f.done() for f in g.inflight):
                    hung.add(g.index)
                    continue
                pool = self._executor()
                h = g.handle
                g.inflight = futures[g.index] = (pool.submit(self.nvml.nvmlDeviceGetPcieThroughput, h, _PCIE_UTIL_TX),
                                                 pool.submit(self.nvml.nvmlDeviceGetPcieThroughput, h, _PCIE_UTIL_RX))
        # one deadline for the poll: GPUs waited on one after another share it
        deadline = time.monotonic() + _THROUGHPUT_TIMEOUT_S

        for g in self._gpus:
            rec = records[g.index]
            if g.index in lost:
                continue
            try:
                self._read_fields(g, rec, pids)
                if g.index in futures:
                    self._collect_throughput(g, rec, futures[g.index], deadline)
                elif g.index in hung:
                    rec.pcie_source = "throughput_20ms"
                    rec.notes.append("pcie throughput: NVML has not answered the last sample yet (a hung driver "
                                     "call): none asked this poll")
                if g.pcie_mode == "counters":
                    self._counter_rates(g, rec, t, samples.get(g.index))
            except _Lost:
                lost.add(g.index)
            except Exception as e:  # a bug in one field must not stop monitoring
                rec.notes.append(f"gpu read failed: {type(e).__name__}: {e}")
            if pid_note:
                rec.notes.append(pid_note)

        if pids and all(r.engine_proc_mem_bytes == 0 for r in records.values()) and any(
                g.listed_other for g in self._gpus):
            # the engine's processes hold nothing on any GPU while others' hold memory: its GPU
            # workers are not the processes kvtop attributes to it (TGI's shards are the
            # launcher's, not the router's; Ray workers), so "0" would be a wrong answer
            for r in records.values():
                r.engine_proc_mem_bytes = None
                r.notes.append("engine memory: none of NVML's GPU processes is the engine's (its GPU workers are "
                               "not children of the process on its port?): unknown")
        out = []
        for g in self._gpus:
            rec = records[g.index]
            if g.index in lost and g.handle is None and _code(g.handle_error) != _GPU_IS_LOST:
                rec.notes.append(f"GPU not readable: NVML refused a handle ({g.handle_error})")
            elif g.index in lost:
                for f in futures.get(g.index, ()):
                    f.cancel()
                g.prev = None  # the counters of a recovered GPU start afresh
                rec = GpuRecord(t=t, index=g.index, uuid=g.uuid, name=g.name, lost=True,
                                notes=["GPU is lost (fell off the bus); other GPUs are still monitored"])
            else:
                rec.notes = list(dict.fromkeys([*(n for n in g.skip.values() if n), *rec.notes]))
            out.append(rec)
        return out

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(32, 2 * len(self._gpus)),
                                            thread_name_prefix="kvtop-pcie")
        return self._pool

    def _read_engine_pids(self) -> tuple[set[int] | None, str | None]:
        if self._engine_pids is None:
            return None, None
        try:
            return set(self._engine_pids()), None
        except Exception as e:
            return None, f"engine processes unknown ({type(e).__name__}: {e})"

    def _call(self, g: _Gpu, key: str, fn: str, *args: Any, **kw: Any) -> Any:
        """One NVML call mapped per docs/host-and-gpu.md §4; returns None when the field is unavailable."""
        if key in g.skip:
            return None
        f = getattr(self.nvml, fn, None)
        if f is None:
            g.skip[key] = f"{key}: not in this nvidia-ml-py"
            return None
        try:
            return f(*args, **kw)
        except Exception as e:
            code = _code(e)
            if code == _GPU_IS_LOST:
                raise _Lost from e
            if code in _PERMANENT:
                g.skip[key] = f"{key}: {_PERMANENT[code]}"
            elif code is None:  # not an NVML error: a binding/driver mismatch; do not retry
                g.skip[key] = f"{key}: {type(e).__name__}: {e}"
            return None

    # -- PCIe ---------------------------------------------------------------------------------
    def _fallback(self, g: _Gpu, why: str) -> None:
        g.prev = None
        if self._measure_tp:
            g.pcie_mode = "throughput"
            g.skip["pcie counters"] = f"pcie counters: {why}; using the 20 ms throughput sample"
        else:
            g.pcie_mode = "off"
            g.skip["pcie counters"] = f"pcie counters: {why}; 20 ms throughput sampling disabled"

    def _read_counters(self, g: _Gpu, rec: GpuRecord) -> tuple[int, int, int] | None:
        """Cumulative TX/RX byte counters and their NVML timestamp (us), or None this poll."""
        if g.pcie_mode not in (None, "counters"):
            return None
        fn = getattr(self.nvml, "nvmlDeviceGetFieldValues", None)
        if fn is None:
            self._fallback(g, "not in this nvidia-ml-py")
            return None
        try:
            vals = list(fn(g.handle, [_FI_PCIE_TX_BYTES, _FI_PCIE_RX_BYTES]))
        except Exception as e:
            code = _code(e)
            if code == _GPU_IS_LOST:
                raise _Lost from e
            if code in _FIELD_UNKNOWN or code is None:
                self._fallback(g, _PERMANENT.get(code or -1, "not available"))
            else:
                rec.notes.append(f"pcie counters: {e}")
            return None
        got: dict[int, int] = {}
        ts = 0
        for v in vals:
            ret = int(getattr(v, "nvmlReturn", _SUCCESS))
            if ret == _GPU_IS_LOST:
                raise _Lost
            if ret in _FIELD_UNKNOWN:
                # Drivers before 555 do not know field ids 197/198.
                self._fallback(g, _PERMANENT.get(ret, "not supported by this driver"))
                return None
            if ret != _SUCCESS:
                rec.notes.append(f"pcie counters: NVML return code {ret}")
                return None
            attr = _VALUE_ATTR.get(int(getattr(v, "valueType", 3)), "ullVal")
            got[int(v.fieldId)] = int(getattr(v.value, attr))
            ts = int(getattr(v, "timestamp", 0) or 0)
        if _FI_PCIE_TX_BYTES not in got or _FI_PCIE_RX_BYTES not in got:
            return None
        g.pcie_mode = "counters"
        tx, rx = got[_FI_PCIE_TX_BYTES], got[_FI_PCIE_RX_BYTES]
        if max(tx, rx) >= _WIDE:
            g.wide = True
        return tx, rx, ts

    def _counter_rates(self, g: _Gpu, rec: GpuRecord, t: float,
                       sample: tuple[int, int, int] | None) -> None:
        if sample is None:
            rec.pcie_source = rec.pcie_source or "field_counters"
            return
        tx, rx, ts = sample
        prev, g.prev = g.prev, (tx, rx, t, ts)
        if not g.wide:
            # possibly 32 bits wide (_WIDE): the 20 ms sample rated this poll; the sample is kept, so
            # the poll that first reads 2**32 or more rates the counters from it
            rec.notes.append("pcie counters: under 2**32 bytes so far, possibly 32 bits wide and wrapping several "
                             "times a second: " + ("the 20 ms throughput sample until they pass it" if self._measure_tp
                                                   else "no rate until they pass it"))
            return
        rec.pcie_source = "field_counters"
        rec.pcie_tx_bytes_total, rec.pcie_rx_bytes_total = tx, rx
        if prev is None:
            return  # first sample: a rate needs two
        ptx, prx, pt, pts = prev
        dt = t - pt
        if ts > 0 and pts > 0 and dt > 0:
            dts = (ts - pts) / 1e6
            # Prefer the driver's own sample times when they agree with the poll clock.
            if dt / _TS_AGREEMENT <= dts <= dt * _TS_AGREEMENT:
                dt = dts
        if dt <= 0:
            return
        dtx, drx = tx - ptx, rx - prx
        if (dtx < 0 and ptx < _WRAP_64) or (drx < 0 and prx < _WRAP_64):
            # 64-bit byte counters step back short of a wrap near 2**64 only when they start over
            # (a GPU reset, a driver reload): no rate for this interval, read afresh from here
            rec.pcie_tx_bytes_total = rec.pcie_rx_bytes_total = None  # not this counter's run: export none
            g.resets += 1
            if g.resets > _RESETS_MAX:
                rec.notes.append("pcie counters went backwards again: unreliable on this system, no rate for this "
                                 "interval")
                self._fallback(g, "not monotonic on this system")
                return
            rec.notes.append("pcie counters started over (a GPU reset or driver reload?): no rate for this interval")
            g.wide = max(tx, rx) >= _WIDE
            return
        # a genuine wrap of the unsigned 64-bit counter
        dtx += (1 << 64) if dtx < 0 else 0
        drx += (1 << 64) if drx < 0 else 0
        rec.pcie_tx_bytes_per_s = dtx / dt
        rec.pcie_rx_bytes_per_s = drx / dt

    def _collect_throughput(self, g: _Gpu, rec: GpuRecord, futs: tuple[Future[int], Future[int]],
                            deadline: float) -> None:
        rec.pcie_source = "throughput_20ms"
        out: list[float | None] = []
        for f in futs:
            try:
                # NVML documents the unit as KB/s (nvitop reads it as KiB/s): we use 1000.
                out.append(float(f.result(timeout=max(0.0, deadline - time.monotonic()))) * 1000.0)
            except FutureTimeout:
                rec.notes.append(f"pcie throughput: no answer from NVML within {_THROUGHPUT_TIMEOUT_S:g} s")
                out.append(None)
            except Exception as e:
                code = _code(e)
                if code == _GPU_IS_LOST:
                    raise _Lost from e
                if code in _PERMANENT:
                    g.pcie_mode = "off"
                    g.skip["pcie throughput"] = f"pcie throughput: {_PERMANENT[code]}"
                else:
                    rec.notes.append(f"pcie throughput: {type(e).__name__}: {e}")
                out.append(None)
        rec.pcie_tx_bytes_per_s, rec.pcie_rx_bytes_per_s = out
        if g.pcie_mode == "off":
            rec.pcie_source = None

    # -- everything else ----------------------------------------------------------------------
    def _read_fields(self, g: _Gpu, rec: GpuRecord, pids: set[int] | None) -> None:
        h = g.handle
        self._read_memory(g, rec)
        rec.pcie_link_gen = self._call(g, "pcie link gen", "nvmlDeviceGetCurrPcieLinkGeneration", h)
        rec.pcie_link_width = self._call(g, "pcie link width", "nvmlDeviceGetCurrPcieLinkWidth", h)
        rec.pcie_link_gen_max = self._call(g, "pcie max link gen", "nvmlDeviceGetMaxPcieLinkGeneration", h)
        rec.pcie_link_width_max = self._call(g, "pcie max link width", "nvmlDeviceGetMaxPcieLinkWidth", h)
        rec.pcie_replay_count = self._call(g, "pcie replay counter", "nvmlDeviceGetPcieReplayCounter", h)
        util = self._call(g, "utilization", "nvmlDeviceGetUtilizationRates", h)
        rec.util_pct = float(util.gpu) if util is not None else None
        mig = self._call(g, "mig", "nvmlDeviceGetMigMode", h)
        if mig is None and g.skip.get("mig") == f"mig: {_PERMANENT[_NOT_SUPPORTED]}":
            # a GPU without MIG (L4, L40S, consumer cards) answers NOT_SUPPORTED: MIG is off, which
            # is no news to repeat on every record
            g.skip["mig"] = ""
        rec.mig_mode = (int(mig[0]) == _MIG_ENABLE) if mig is not None else (False if g.skip.get("mig") == "" else None)
        if rec.mig_mode:
            self._read_mig(g, rec)
        rec.engine_proc_mem_bytes = self._engine_memory(g, rec, pids)

    def _read_memory(self, g: _Gpu, rec: GpuRecord) -> None:
        h = g.handle
        v2 = getattr(self.nvml, "nvmlMemory_v2", None)
        mem = None
        if v2 is not None and "memory v2" not in g.skip and not g.no_mem_v2:
            try:
                mem = self.nvml.nvmlDeviceGetMemoryInfo(h, version=v2)
            except Exception as e:
                code = _code(e)
                if code == _GPU_IS_LOST:
                    raise _Lost from e
                if code in (_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH, None):
                    g.skip["memory v2"] = "memory: v1 API only (no reserved figure; used includes reserved)"
                elif code in _PERMANENT:
                    g.no_mem_v2 = True  # the v1 call below reports the same refusal
                mem = None
        if mem is not None:
            rec.mem_reserved_bytes = int(mem.reserved)
        else:
            mem = self._call(g, "memory", "nvmlDeviceGetMemoryInfo", h)
        if mem is None:
            return
        if int(mem.total) == 0:
            # Unified memory (Grace / GB10): the GPU has no memory of its own to report.
            g.skip["memory unified"] = "memory: reported as 0 (unified memory: see host memory)"
            rec.mem_reserved_bytes = None
            return
        rec.mem_total_bytes = int(mem.total)
        rec.mem_used_bytes = int(mem.used)

    def _read_mig(self, g: _Gpu, rec: GpuRecord) -> None:
        """Per-instance memory into notes; their sum stands in when the parent query is refused."""
        h = g.handle
        n = self._call(g, "mig devices", "nvmlDeviceGetMaxMigDeviceCount", h)
        if not n:
            return
        used_sum = total_sum = 0
        seen = 0
        for i in range(int(n)):
            try:
                mh = self.nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except Exception as e:  # empty slots answer NOT_FOUND
                if _code(e) == _GPU_IS_LOST:
                    raise _Lost from e
                continue
            # each instance its own key: one that refuses must not switch off the others
            mem = self._call(g, f"mig #{i} memory", "nvmlDeviceGetMemoryInfo", mh)
            gi = self._call(g, f"mig #{i} instance id", "nvmlDeviceGetGpuInstanceId", mh)
            if mem is None:
                continue
            seen += 1
            used_sum += int(mem.used)
            total_sum += int(mem.total)
            label = f"gi {gi}" if gi is not None else f"#{i}"
            rec.notes.append(f"mig {label}: {int(mem.used) / 2**30:.1f} of {int(mem.total) / 2**30:.1f} GiB used")
        if seen and rec.mem_total_bytes is None:
            rec.mem_used_bytes, rec.mem_total_bytes = used_sum, total_sum
            rec.notes.append("memory: sum of MIG instances")

    def _processes(self, g: _Gpu, kind: str) -> list[Any] | None:
        """Running processes, probing _v3/_v2/unversioned (535.98 dropped the v3 symbols)."""
        base = "nvmlDeviceGetComputeRunningProcesses" if kind == "compute" else \
            "nvmlDeviceGetMPSComputeRunningProcesses"
        known = self._proc_fns.get(kind)
        names = [known] if known else [f"{base}_v3", f"{base}_v2", base]
        for name in names:
            f = getattr(self.nvml, name, None)
            if f is None:
                continue
            try:
                procs = list(f(g.handle))
            except Exception as e:
                code = _code(e)
                if code == _GPU_IS_LOST:
                    raise _Lost from e
                if code == _FUNCTION_NOT_FOUND or code == _ARGUMENT_VERSION_MISMATCH:
                    continue
                if code in _PERMANENT or code is None:
                    if kind == "mps":
                        g.no_mps = True
                    else:
                        g.skip["compute processes"] = f"compute processes: {_PERMANENT.get(code or -1, e)}"
                return None
            self._proc_fns[kind] = name
            return procs
        return None

    def _engine_memory(self, g: _Gpu, rec: GpuRecord, pids: set[int] | None) -> int | None:
        if not pids:  # not configured, or no engine process found: unknown, not zero
            return None
        procs = self._processes(g, "compute") if "compute processes" not in g.skip else None
        if procs is None:
            return None
        if not g.no_mps:
            procs += self._processes(g, "mps") or []
        g.listed_other = any(int(p.pid) not in pids for p in procs)
        by_pid: dict[int, int | None] = {}
        for p in procs:
            pid = int(p.pid)
            if pid in pids:
                by_pid[pid] = getattr(p, "usedGpuMemory", None)
        if not by_pid:
            listed = [int(p.pid) for p in procs]
            if listed and not any(self._pid_exists(pid) for pid in listed):
                # NVML names processes this host's /proc does not have: kvtop runs in another PID
                # namespace (a container without --pid=host), where the engine's are never matched
                rec.notes.append("engine memory: NVML's GPU processes are not in kvtop's PID namespace (run its "
                                 "container with --pid=host): unknown")
                return None
            return 0  # the engine holds nothing on this GPU (another workload's processes, or none)
        known = [int(m) for m in by_pid.values() if m is not None]
        if not known:
            rec.notes.append("engine memory: per-process memory n/a (MIG or WDDM)")
            return None
        if len(known) < len(by_pid):
            rec.notes.append("engine memory: some engine processes report no memory figure")
        return sum(known)
