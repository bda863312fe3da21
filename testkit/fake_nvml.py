"""A fake ``pynvml`` (nvidia-ml-py) module for tests on machines without a GPU.

It mirrors the parts of the real binding kvtop calls: the same function names and signatures,
``NVMLError`` with one subclass per code (named and numbered as the real ones, so code that
catches ``nvml.NVMLError_NotSupported`` or compares ``err.value`` behaves the same), and the
constants. Each GPU is a ``FakeGpu`` whose values and failures (per function or per field id) the
test sets; the fake keeps no other state, so a test reads exactly what it configured.
"""

from __future__ import annotations

import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

# Error codes: the values of nvml.h / nvidia-ml-py (test_fake_matches_real_binding checks them).
ERROR_CODES: dict[str, int] = {
    "UNINITIALIZED": 1,
    "INVALID_ARGUMENT": 2,
    "NOT_SUPPORTED": 3,
    "NO_PERMISSION": 4,
    "ALREADY_INITIALIZED": 5,
    "NOT_FOUND": 6,
    "INSUFFICIENT_SIZE": 7,
    "INSUFFICIENT_POWER": 8,
    "DRIVER_NOT_LOADED": 9,
    "TIMEOUT": 10,
    "IRQ_ISSUE": 11,
    "LIBRARY_NOT_FOUND": 12,
    "FUNCTION_NOT_FOUND": 13,
    "CORRUPTED_INFOROM": 14,
    "GPU_IS_LOST": 15,
    "RESET_REQUIRED": 16,
    "OPERATING_SYSTEM": 17,
    "LIB_RM_VERSION_MISMATCH": 18,
    "IN_USE": 19,
    "MEMORY": 20,
    "NO_DATA": 21,
    "ARGUMENT_VERSION_MISMATCH": 25,
    "GPU_NOT_FOUND": 28,
    "UNKNOWN": 999,
}

CONSTANTS: dict[str, int] = {
    "NVML_SUCCESS": 0,
    "NVML_PCIE_UTIL_TX_BYTES": 0,
    "NVML_PCIE_UTIL_RX_BYTES": 1,
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 94,
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 197,
    "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 198,
    "NVML_VALUE_TYPE_DOUBLE": 0,
    "NVML_VALUE_TYPE_UNSIGNED_INT": 1,
    "NVML_VALUE_TYPE_UNSIGNED_LONG": 2,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3,
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 4,
    "NVML_VALUE_TYPE_SIGNED_INT": 5,
    "NVML_DEVICE_MIG_DISABLE": 0,
    "NVML_DEVICE_MIG_ENABLE": 1,
    "nvmlMemory_v2": 0x02000028,
}

FI_TX = CONSTANTS["NVML_FI_DEV_PCIE_COUNT_TX_BYTES"]
FI_RX = CONSTANTS["NVML_FI_DEV_PCIE_COUNT_RX_BYTES"]


def _class_name(code_name: str) -> str:
    # NVML_ERROR_LIB_RM_VERSION_MISMATCH -> NVMLError_LibRmVersionMismatch, as the binding does.
    return "NVMLError_" + "".join(p.capitalize() for p in code_name.split("_"))


class NVMLError(Exception):
    """Like the binding's: ``NVMLError(code)`` builds the subclass for that code."""

    _by_value: dict[int, type] = {}
    value: int

    def __new__(cls, value: int):
        if cls is NVMLError:
            cls = NVMLError._by_value.get(value, NVMLError)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        for k, v in ERROR_CODES.items():
            if v == self.value:
                return k.replace("_", " ").title()
        return f"NVML Error with code {self.value}"


def _make_error_classes() -> dict[str, type]:
    out = {}
    for name, val in ERROR_CODES.items():
        def new(cls, *args, _val=val):
            return NVMLError.__new__(cls, _val)

        def init(self, *args):
            Exception.__init__(self, self.value)

        cls = type(_class_name(name), (NVMLError,), {"__new__": new, "__init__": init})
        NVMLError._by_value[val] = cls
        out[cls.__name__] = cls
    return out


ERROR_CLASSES = _make_error_classes()


def err(name: str) -> NVMLError:
    """``err("NOT_SUPPORTED")`` -> an instance of NVMLError_NotSupported."""
    return NVMLError(ERROR_CODES[name])


@dataclass
class FakeProc:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - the binding's attribute name
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


@dataclass
class FakeMig:
    gpu_instance_id: int
    mem_total: int
    mem_used: int
    fail: dict[str, str] = field(default_factory=dict)  # as FakeGpu.fail, for this instance's handle


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    mem_total: int = 80 * 2**30
    mem_used: int = 0
    mem_reserved: int = 0
    # Cumulative PCIe byte counters (field ids 197/198) and their NVML timestamp (us, 0 = unset):
    # a GPU that has moved some data since boot. ``counter_bits`` 32: the counters NVML says "can
    # be wrapped" and that look 32 bits wide in the wild (unsigned int, the bytes mod 2**32).
    tx_bytes: int = 3 << 40
    rx_bytes: int = 1 << 40
    counter_ts_us: int = 0
    counter_bits: int = 64
    # What nvmlDeviceGetPcieThroughput returns, in KB/s; while ``hang`` is set and not yet released
    # (an Event), the call blocks (a hung driver call on this GPU).
    tx_kbps: int = 0
    rx_kbps: int = 0
    hang: threading.Event | None = None
    link_gen: int = 5
    link_width: int = 16
    link_gen_max: int = 5
    link_width_max: int = 16
    replay: int = 0
    util: int = 0
    mig_current: int = 0
    mig_pending: int = 0
    migs: list[FakeMig] = field(default_factory=list)
    procs: list[FakeProc] = field(default_factory=list)
    mps_procs: list[FakeProc] = field(default_factory=list)
    # Function name -> error code name raised by that function for this GPU (e.g.
    # {"nvmlDeviceGetUtilizationRates": "NOT_SUPPORTED"}); "nvmlDeviceGetMemoryInfo_v2" is the
    # versioned memory call alone. Field id -> error code name sets that field's nvmlReturn.
    fail: dict[str, str] = field(default_factory=dict)
    field_fail: dict[int, str] = field(default_factory=dict)
    lost: bool = False  # every call raises GPU_IS_LOST


@dataclass
class _Handle:
    gpu: FakeGpu
    mig: FakeMig | None = None


class _Value:
    def __init__(self, ull: int) -> None:
        self.ullVal = ull
        self.uiVal = ull & 0xFFFFFFFF
        self.ulVal = ull
        self.sllVal = ull
        self.siVal = ull
        self.dVal = float(ull)
        self.usVal = ull & 0xFFFF


class _FieldValue:
    def __init__(self, field_id: int, ret: int, value: int, ts: int, bits: int = 64) -> None:
        self.fieldId = field_id
        self.scopeId = 0
        self.timestamp = ts
        self.latencyUsec = 0
        self.valueType = CONSTANTS["NVML_VALUE_TYPE_UNSIGNED_LONG_LONG" if bits == 64 else "NVML_VALUE_TYPE_UNSIGNED_INT"]
        self.nvmlReturn = ret
        self.value = _Value(value)


class _Struct:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FakeNvml(types.ModuleType):
    """Pass as ``GpuSource(nvml=FakeNvml([...]))``.

    ``init_error``: error code name nvmlInit raises (e.g. "LIBRARY_NOT_FOUND").
    ``missing``: function names this "binding" lacks entirely (an older nvidia-ml-py).
    ``throughput_barrier``: every nvmlDeviceGetPcieThroughput call waits on it, so a test can
    prove the calls run concurrently (serial calls would break the barrier).
    """

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: str | None = None,
                 missing: set[str] | None = None, driver_version: str = "580.159.03") -> None:
        super().__init__("pynvml")
        for k, v in CONSTANTS.items():
            setattr(self, k, v)
        for name, val in ERROR_CODES.items():
            setattr(self, "NVML_ERROR_" + name, val)
        for cname, cls in ERROR_CLASSES.items():
            setattr(self, cname, cls)
        self.NVMLError = NVMLError
        self.gpus = list(gpus or [])
        self.init_error = init_error
        self.driver_version = driver_version
        self.initialized = 0
        self.shutdowns = 0
        self.calls: list[str] = []
        self.throughput_barrier: threading.Barrier | None = None
        self.throughput_delay_s = 0.0  # the real call blocks ~20 ms per GPU and direction
        self._lock = threading.Lock()
        self._missing = set(missing or ())

    def __getattribute__(self, name: str) -> Any:
        # An older binding simply has no such attribute.
        if name in object.__getattribute__(self, "__dict__").get("_missing", ()):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    # -- helpers ------------------------------------------------------------------------------
    def _call(self, fn: str, h: _Handle) -> FakeGpu:
        with self._lock:
            self.calls.append(fn)
        g = h.gpu
        if g.lost:
            raise err("GPU_IS_LOST")
        if fn in g.fail and h.mig is None:  # the parent GPU's failures
            raise err(g.fail[fn])
        if h.mig is not None and fn in h.mig.fail:
            raise err(h.mig.fail[fn])
        return g

    # -- init / system ------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.init_error:
            raise err(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        if not self.initialized:
            raise err("UNINITIALIZED")
        self.initialized -= 1
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self.gpus):
            raise err("INVALID_ARGUMENT")
        g = self.gpus[index]
        if "nvmlDeviceGetHandleByIndex" in g.fail:
            raise err(g.fail["nvmlDeviceGetHandleByIndex"])
        return _Handle(g)

    # -- identity -----------------------------------------------------------------------------
    def nvmlDeviceGetName(self, h: _Handle) -> str:
        return self._call("nvmlDeviceGetName", h).name

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        return self._call("nvmlDeviceGetUUID", h).uuid

    # -- memory -------------------------------------------------------------------------------
    def nvmlDeviceGetMemoryInfo(self, h: _Handle, version: int | None = None) -> _Struct:
        g = self._call("nvmlDeviceGetMemoryInfo", h)
        if h.mig is not None:
            m = h.mig
            return _Struct(total=m.mem_total, used=m.mem_used, free=m.mem_total - m.mem_used)
        if version:
            if version != CONSTANTS["nvmlMemory_v2"]:
                raise err("ARGUMENT_VERSION_MISMATCH")
            if "nvmlDeviceGetMemoryInfo_v2" in g.fail:
                raise err(g.fail["nvmlDeviceGetMemoryInfo_v2"])
            return _Struct(version=version, total=g.mem_total, reserved=g.mem_reserved,
                           used=g.mem_used, free=g.mem_total - g.mem_used - g.mem_reserved)
        # v1: "used" is reserved + allocated.
        used = g.mem_used + g.mem_reserved
        return _Struct(total=g.mem_total, used=used, free=g.mem_total - used)

    # -- PCIe ---------------------------------------------------------------------------------
    def nvmlDeviceGetFieldValues(self, h: _Handle, field_ids: list[int]) -> list[_FieldValue]:
        g = self._call("nvmlDeviceGetFieldValues", h)
        out = []
        for fid in field_ids:
            ret = ERROR_CODES[g.field_fail[fid]] if fid in g.field_fail else 0
            val = {FI_TX: g.tx_bytes, FI_RX: g.rx_bytes,
                   CONSTANTS["NVML_FI_DEV_PCIE_REPLAY_COUNTER"]: g.replay}.get(fid)
            if val is None:
                ret, val = ERROR_CODES["INVALID_ARGUMENT"], 0
            if fid in (FI_TX, FI_RX):
                val %= 1 << g.counter_bits
            out.append(_FieldValue(fid, ret, val if ret == 0 else 0, g.counter_ts_us,
                                   g.counter_bits if fid in (FI_TX, FI_RX) else 64))
        return out

    def nvmlDeviceGetPcieThroughput(self, h: _Handle, counter: int) -> int:
        g = self._call("nvmlDeviceGetPcieThroughput", h)
        if g.hang is not None:
            g.hang.wait()
        if self.throughput_barrier is not None:
            self.throughput_barrier.wait()
        if self.throughput_delay_s:
            time.sleep(self.throughput_delay_s)
        return g.tx_kbps if counter == CONSTANTS["NVML_PCIE_UTIL_TX_BYTES"] else g.rx_kbps

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: _Handle) -> int:
        return self._call("nvmlDeviceGetCurrPcieLinkGeneration", h).link_gen

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: _Handle) -> int:
        return self._call("nvmlDeviceGetCurrPcieLinkWidth", h).link_width

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: _Handle) -> int:
        return self._call("nvmlDeviceGetMaxPcieLinkGeneration", h).link_gen_max

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: _Handle) -> int:
        return self._call("nvmlDeviceGetMaxPcieLinkWidth", h).link_width_max

    def nvmlDeviceGetPcieReplayCounter(self, h: _Handle) -> int:
        return self._call("nvmlDeviceGetPcieReplayCounter", h).replay

    # -- utilization / MIG --------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, h: _Handle) -> _Struct:
        return _Struct(gpu=self._call("nvmlDeviceGetUtilizationRates", h).util, memory=0)

    def nvmlDeviceGetMigMode(self, h: _Handle) -> list[int]:
        g = self._call("nvmlDeviceGetMigMode", h)
        return [g.mig_current, g.mig_pending]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: _Handle) -> int:
        self._call("nvmlDeviceGetMaxMigDeviceCount", h)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: _Handle, index: int) -> _Handle:
        g = self._call("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if index >= len(g.migs):
            raise err("NOT_FOUND")
        return _Handle(g, g.migs[index])

    def nvmlDeviceGetGpuInstanceId(self, h: _Handle) -> int:
        self._call("nvmlDeviceGetGpuInstanceId", h)
        if h.mig is None:
            raise err("INVALID_ARGUMENT")
        return h.mig.gpu_instance_id

    # -- processes ----------------------------------------------------------------------------
    def _procs(self, fn: str, h: _Handle, mps: bool = False) -> list[FakeProc]:
        g = self._call(fn, h)
        return list(g.mps_procs if mps else g.procs)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: _Handle) -> list[FakeProc]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v3", h)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: _Handle) -> list[FakeProc]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v2", h)

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> list[FakeProc]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses", h)

    def nvmlDeviceGetMPSComputeRunningProcesses_v3(self, h: _Handle) -> list[FakeProc]:
        return self._procs("nvmlDeviceGetMPSComputeRunningProcesses_v3", h, mps=True)

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, h: _Handle) -> list[FakeProc]:
        return self._procs("nvmlDeviceGetMPSComputeRunningProcesses_v2", h, mps=True)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h: _Handle) -> list[FakeProc]:
        return self._procs("nvmlDeviceGetMPSComputeRunningProcesses", h, mps=True)
