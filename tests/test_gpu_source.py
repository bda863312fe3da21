"""GpuSource against a fake NVML binding: every failure mode of docs/host-and-gpu.md §4."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest

from kvtop.sources.gpu import GpuSource
from testkit.fake_nvml import (
    CONSTANTS,
    ERROR_CLASSES,
    ERROR_CODES,
    FI_RX,
    FI_TX,
    FakeGpu,
    FakeMig,
    FakeNvml,
    FakeProc,
)

GiB = 2**30


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(name="NVIDIA H200", uuid="GPU-aaaa", mem_total=141 * GiB, mem_used=70 * GiB,
                mem_reserved=GiB // 2, link_gen=5, link_width=16, link_gen_max=5, link_width_max=16,
                replay=3, util=87),
        FakeGpu(name="NVIDIA H200", uuid="GPU-bbbb", mem_total=141 * GiB, mem_used=10 * GiB,
                mem_reserved=GiB // 4, link_gen=2, link_width=8, link_gen_max=5, link_width_max=16,
                replay=0, util=5),
    ]


# -- init failures -------------------------------------------------------------------------------

@pytest.mark.parametrize("code, phrase", [
    ("LIBRARY_NOT_FOUND", "no NVIDIA driver library (libnvidia-ml.so.1) found"),
    ("DRIVER_NOT_LOADED", "driver not loaded"),
    ("LIB_RM_VERSION_MISMATCH", "version mismatch"),
    ("GPU_NOT_FOUND", "no supported NVIDIA GPU found"),
])
def test_init_failure_gives_reason_and_no_records(code, phrase):
    nv = FakeNvml(two_gpus(), init_error=code)
    src = GpuSource(nvml=nv)
    assert phrase in src.status
    assert src.status.endswith("engine + host only")
    assert "\n" not in src.status
    assert src.poll(1.0) == []
    src.close()
    assert nv.shutdowns == 0  # never initialised, so nothing to shut down


def test_unexpected_init_error_still_degrades():
    src = GpuSource(nvml=FakeNvml(two_gpus(), init_error="NO_PERMISSION"))
    assert src.status.startswith("NVML initialisation failed (")
    assert src.status.endswith("engine + host only")
    assert src.poll(1.0) == []


def test_zero_gpus_is_no_gpu():
    src = GpuSource(nvml=FakeNvml([]))
    assert "no supported NVIDIA GPU found" in src.status
    assert src.poll(0.0) == []


def test_binding_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    src = GpuSource()
    assert "nvidia-ml-py" in src.status
    assert src.poll(0.0) == []
    src.close()


def _have_libnvml() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_have_libnvml(), reason="this machine has an NVIDIA driver")
def test_real_binding_without_driver_library():
    src = GpuSource()  # the real nvidia-ml-py, on a machine without libnvidia-ml.so.1
    assert src.status == "no NVIDIA driver library (libnvidia-ml.so.1) found: engine + host only"
    assert src.poll(0.0) == []
    src.close()


# -- healthy read ----------------------------------------------------------------------------------

def test_healthy_gpus_every_field():
    nv = FakeNvml(two_gpus())
    src = GpuSource(nvml=nv)
    assert src.status == "ok"
    assert src.driver_version == "580.159.03"
    r0, r1 = src.poll(5.0)
    assert (r0.index, r0.uuid, r0.name, r0.t, r0.lost) == (0, "GPU-aaaa", "NVIDIA H200", 5.0, False)
    # v2 memory API: used is allocated memory, reserved separate.
    assert (r0.mem_total_bytes, r0.mem_used_bytes, r0.mem_reserved_bytes) == (141 * GiB, 70 * GiB, GiB // 2)
    assert (r0.pcie_link_gen, r0.pcie_link_width, r0.pcie_link_gen_max, r0.pcie_link_width_max) == (5, 16, 5, 16)
    assert (r1.pcie_link_gen, r1.pcie_link_width) == (2, 8)
    assert r0.pcie_replay_count == 3 and r1.pcie_replay_count == 0
    assert r0.util_pct == 87.0 and r1.util_pct == 5.0
    assert r0.mig_mode is False
    assert r0.pcie_source == "field_counters"
    assert r0.pcie_tx_bytes_per_s is None  # first sample: a rate needs two
    assert r0.engine_proc_mem_bytes is None  # no engine pids configured
    assert r0.notes == []
    src.close()
    assert nv.shutdowns == 1
    src.close()
    assert nv.shutdowns == 1


# -- per-field failures ----------------------------------------------------------------------------

def test_not_supported_and_no_permission_fields_are_none_others_read():
    gpus = two_gpus()
    gpus[0].fail = {"nvmlDeviceGetUtilizationRates": "NOT_SUPPORTED",
                    "nvmlDeviceGetPcieReplayCounter": "NO_PERMISSION",
                    "nvmlDeviceGetCurrPcieLinkWidth": "NOT_SUPPORTED"}
    nv = FakeNvml(gpus)
    src = GpuSource(nvml=nv)
    r0, r1 = src.poll(1.0)
    assert r0.util_pct is None and r0.pcie_replay_count is None and r0.pcie_link_width is None
    assert r0.pcie_link_gen == 5 and r0.pcie_link_width_max == 16
    assert r0.mem_used_bytes == 70 * GiB
    assert "utilization: not supported" in r0.notes
    assert "pcie replay counter: no permission (run as root to read it)" in r0.notes
    assert "pcie link width: not supported" in r0.notes
    # The other GPU is unaffected.
    assert r1.util_pct == 5.0 and r1.pcie_replay_count == 0 and r1.notes == []
    # A field known to be unsupported is not asked again, but its note stays on every record.
    before = nv.calls.count("nvmlDeviceGetUtilizationRates")
    r0b, _ = src.poll(2.0)
    assert nv.calls.count("nvmlDeviceGetUtilizationRates") == before + 1  # GPU 1 only
    assert "utilization: not supported" in r0b.notes
    assert r0b.notes.count("utilization: not supported") == 1


def test_memory_v2_missing_falls_back_to_v1():
    gpus = two_gpus()
    gpus[0].fail = {"nvmlDeviceGetMemoryInfo_v2": "FUNCTION_NOT_FOUND"}
    src = GpuSource(nvml=FakeNvml(gpus))
    r0, r1 = src.poll(1.0)
    # v1 "used" is reserved + allocated; no reserved figure.
    assert r0.mem_used_bytes == 70 * GiB + GiB // 2
    assert r0.mem_reserved_bytes is None and r0.mem_total_bytes == 141 * GiB
    assert any(n.startswith("memory: v1 API only") for n in r0.notes)
    assert r1.mem_reserved_bytes == GiB // 4


def test_unified_memory_total_zero_is_none():
    gpus = [FakeGpu(name="NVIDIA GB10", mem_total=0, mem_used=0)]
    r, = GpuSource(nvml=FakeNvml(gpus)).poll(1.0)
    assert r.mem_total_bytes is None and r.mem_used_bytes is None
    assert any("unified memory" in n for n in r.notes)


def test_non_nvml_exception_in_a_field_never_raises():
    class Broken(FakeNvml):
        def nvmlDeviceGetPcieReplayCounter(self, h):
            raise RuntimeError("ctypes went wrong")

    r0, r1 = GpuSource(nvml=Broken(two_gpus())).poll(1.0)
    assert r0.pcie_replay_count is None and r0.util_pct == 87.0
    assert any("RuntimeError" in n for n in r0.notes)


def test_function_missing_from_binding():
    nv = FakeNvml(two_gpus(), missing={"nvmlDeviceGetPcieReplayCounter", "nvmlMemory_v2"})
    r0, _ = GpuSource(nvml=nv).poll(1.0)
    assert r0.pcie_replay_count is None
    assert r0.mem_used_bytes == 70 * GiB + GiB // 2  # v1 path
    assert "pcie replay counter: not in this nvidia-ml-py" in r0.notes


# -- GPU lost ------------------------------------------------------------------------------------------

def test_gpu_lost_mid_run_other_gpu_still_read():
    gpus = two_gpus()
    src = GpuSource(nvml=FakeNvml(gpus))
    r0, r1 = src.poll(1.0)
    assert not r0.lost and r0.mem_used_bytes == 70 * GiB
    gpus[0].lost = True
    gpus[1].mem_used = 12 * GiB
    r0, r1 = src.poll(2.0)
    assert r0.lost is True
    assert (r0.index, r0.uuid) == (0, "GPU-aaaa")  # identity kept so the operator knows which one
    assert r0.mem_used_bytes is None and r0.util_pct is None and r0.pcie_link_gen is None
    assert any("lost" in n for n in r0.notes)
    assert r1.lost is False and r1.mem_used_bytes == 12 * GiB and r1.util_pct == 5.0


def test_gpu_lost_in_field_counters_and_throughput_paths():
    gpus = two_gpus()
    gpus[1].field_fail = {FI_TX: "NOT_SUPPORTED", FI_RX: "NOT_SUPPORTED"}
    gpus[1].tx_kbps = 100
    src = GpuSource(nvml=FakeNvml(gpus))
    src.poll(1.0)
    gpus[0].field_fail = {FI_TX: "GPU_IS_LOST"}
    gpus[1].fail = {"nvmlDeviceGetPcieThroughput": "GPU_IS_LOST"}
    r0, r1 = src.poll(2.0)
    assert r0.lost and r1.lost


def test_handle_refused_at_init_is_reported_not_fatal():
    gpus = two_gpus()
    gpus[0].fail = {"nvmlDeviceGetHandleByIndex": "NO_PERMISSION"}
    src = GpuSource(nvml=FakeNvml(gpus))
    assert src.status == "ok"
    r0, r1 = src.poll(1.0)
    assert r0.lost is False and r0.mem_used_bytes is None
    assert any("refused a handle" in n for n in r0.notes)
    assert r1.mem_used_bytes == 10 * GiB
    del gpus[0].fail["nvmlDeviceGetHandleByIndex"]  # e.g. permissions fixed: picked up next poll
    r0, _ = src.poll(2.0)
    assert r0.mem_used_bytes == 70 * GiB and r0.uuid == "GPU-aaaa"


# -- PCIe traffic -------------------------------------------------------------------------------------

def test_field_counters_rate_from_two_polls():
    gpus = two_gpus()
    g = gpus[0]
    src = GpuSource(nvml=FakeNvml(gpus))
    base = 5 << 40  # a GPU that has moved 5 TiB since boot: past 2**32, so 64 bits wide
    g.tx_bytes, g.rx_bytes = base + 1_000_000_000, base + 500_000_000
    r0, _ = src.poll(10.0)
    assert r0.pcie_source == "field_counters" and r0.pcie_tx_bytes_per_s is None
    # the raw counters from the first poll on (the agent exports them as _bytes_total counters)
    assert (r0.pcie_tx_bytes_total, r0.pcie_rx_bytes_total) == (base + 1_000_000_000, base + 500_000_000)
    g.tx_bytes += 6_000_000_000  # 6 GB over 2 s = 3 GB/s
    g.rx_bytes += 1_000_000_000  # 1 GB over 2 s = 0.5 GB/s
    r0, r1 = src.poll(12.0)
    assert r0.pcie_tx_bytes_per_s == pytest.approx(3.0e9)
    assert r0.pcie_rx_bytes_per_s == pytest.approx(5.0e8)
    assert r1.pcie_tx_bytes_per_s == 0.0 and r1.pcie_rx_bytes_per_s == 0.0
    # The counters start over (a GPU reset, a driver reload): no rate for that interval, nothing
    # exported as a counter, and until they pass 2**32 again the 20 ms sampler measures the GPU.
    g.tx_bytes, g.rx_bytes = 10, 20
    g.tx_kbps, g.rx_kbps = 55_000_000, 1_000  # 55 GB/s and 1 MB/s in NVML's KB/s
    r0, r1 = src.poll(13.0)
    assert r0.pcie_tx_bytes_per_s is None and r0.pcie_rx_bytes_per_s is None
    assert r0.pcie_tx_bytes_total is None
    assert any("started over" in n for n in r0.notes)
    assert r1.pcie_source == "field_counters"  # the other GPU keeps its counters
    r0, _ = src.poll(15.0)
    assert r0.pcie_source == "throughput_20ms" and r0.pcie_tx_bytes_total is None
    assert r0.pcie_tx_bytes_per_s == pytest.approx(55e9) and r0.pcie_rx_bytes_per_s == pytest.approx(1e6)
    assert any("possibly 32 bits wide" in n for n in r0.notes)
    # past 2**32 again: the counters, rated from the last sample the sampler's polls kept
    g.tx_bytes = 10 + 8_000_000_000
    r0, _ = src.poll(17.0)
    assert r0.pcie_source == "field_counters" and r0.pcie_tx_bytes_per_s == pytest.approx(4e9)
    # counters that keep stepping back are no counters: the 20 ms sampler for good
    for i in range(6):
        g.tx_bytes = (5 << 40) if i % 2 == 0 else 10
        r0, _ = src.poll(18.0 + i)
    assert any("went backwards again" in n for n in r0.notes)
    r0, _ = src.poll(30.0)
    assert r0.pcie_source == "throughput_20ms" and any("not monotonic" in n for n in r0.notes)


def test_counters_32_bits_wide_are_never_rated_the_20ms_sample_is():
    # NVML: "Value can be wrapped"; at 25 GB/s a 32-bit counter wraps every 0.17 s, so the difference
    # of two polls a second apart is any number: 10 GB/s read as 1.41 GB/s, without a word
    g = FakeGpu(counter_bits=32, tx_kbps=10_000_000)
    src = GpuSource(nvml=FakeNvml([g]))
    for i in range(4):
        g.tx_bytes += 10_000_000_000
        r, = src.poll(1.0 + i)
        assert r.pcie_source == "throughput_20ms" and r.pcie_tx_bytes_per_s == pytest.approx(10e9)
        assert r.pcie_tx_bytes_total is None  # a counter mod 2**32 is no byte counter to export
        assert any("possibly 32 bits wide" in n for n in r.notes)
    # without the sampler: no rate, and why
    g2 = FakeGpu(counter_bits=32)
    r, = GpuSource(nvml=FakeNvml([g2]), measure_pcie_throughput=False).poll(1.0)
    assert r.pcie_tx_bytes_per_s is None and any("no rate until they pass it" in n for n in r.notes)


def test_field_counters_64_bit_wrap_is_a_rate_not_a_fallback():
    gpus = [FakeGpu()]
    g = gpus[0]
    src = GpuSource(nvml=FakeNvml(gpus))
    g.tx_bytes, g.rx_bytes = (1 << 64) - 1_000_000_000, 0
    src.poll(1.0)
    g.tx_bytes = 3_000_000_000  # wrapped: 4 GB moved in 2 s
    (r,) = src.poll(3.0)
    assert r.pcie_source == "field_counters"
    assert r.pcie_tx_bytes_per_s == pytest.approx(2e9)


def test_field_counters_use_nvml_timestamps_when_consistent():
    gpus = [FakeGpu()]
    g = gpus[0]
    src = GpuSource(nvml=FakeNvml(gpus))
    g.tx_bytes, g.counter_ts_us = 0, 1_700_000_000_000_000
    src.poll(10.0)
    # The driver sampled 2.5 s apart although kvtop polled 2.0 s apart: 5 GB / 2.5 s = 2 GB/s.
    g.tx_bytes, g.counter_ts_us = 5_000_000_000, 1_700_000_002_500_000
    r, = src.poll(12.0)
    assert r.pcie_tx_bytes_per_s == pytest.approx(2.0e9)
    # Wall clock stepped by an hour: the timestamps disagree with the poll clock, use the poll clock.
    g.tx_bytes, g.counter_ts_us = 9_000_000_000, 1_700_003_602_500_000
    r, = src.poll(14.0)
    assert r.pcie_tx_bytes_per_s == pytest.approx(2.0e9)  # 4 GB / 2.0 s


def test_fallback_to_20ms_throughput_api_in_parallel():
    gpus = two_gpus()
    for g in gpus:  # a driver older than 555 does not know field ids 197/198
        g.field_fail = {FI_TX: "INVALID_ARGUMENT", FI_RX: "INVALID_ARGUMENT"}
    gpus[0].tx_kbps, gpus[0].rx_kbps = 12_345, 678
    gpus[1].tx_kbps, gpus[1].rx_kbps = 0, 25_000_000
    nv = FakeNvml(gpus)
    # All four calls (2 GPUs x 2 directions) must be in flight at once to pass this barrier;
    # serial calls would break it after the timeout and leave the rates empty.
    nv.throughput_barrier = threading.Barrier(4, timeout=10)
    src = GpuSource(nvml=nv)
    r0, r1 = src.poll(1.0)
    assert r0.pcie_source == "throughput_20ms"
    assert r0.pcie_tx_bytes_per_s == 12_345_000.0  # KB/s (NVML docs) -> bytes/s
    assert r0.pcie_rx_bytes_per_s == 678_000.0
    assert r1.pcie_tx_bytes_per_s == 0.0 and r1.pcie_rx_bytes_per_s == 25_000_000_000.0
    assert "pcie counters: not supported by this driver; using the 20 ms throughput sample" in r0.notes
    r0, _ = src.poll(2.0)  # the counters are not asked again
    assert r0.pcie_tx_bytes_per_s == 12_345_000.0
    assert nv.calls.count("nvmlDeviceGetFieldValues") == 2  # once per GPU, first poll only
    src.close()


def test_hung_throughput_call_times_out(monkeypatch):
    monkeypatch.setattr("kvtop.sources.gpu._THROUGHPUT_TIMEOUT_S", 0.2)
    gpus = [FakeGpu(tx_kbps=7, util=33, field_fail={FI_TX: "NOT_SUPPORTED", FI_RX: "NOT_SUPPORTED"})]
    nv = FakeNvml(gpus)
    nv.throughput_barrier = threading.Barrier(3, timeout=1.0)  # two calls can never pass it
    src = GpuSource(nvml=nv)
    r, = src.poll(1.0)
    assert r.pcie_tx_bytes_per_s is None and r.pcie_rx_bytes_per_s is None
    assert r.util_pct == 33.0
    assert "pcie throughput: no answer from NVML within 0.2 s" in r.notes
    src.close()


def test_a_gpu_whose_throughput_call_hangs_never_starves_the_others(monkeypatch):
    # each poll asked the hung GPU again: its calls piled up in the pool's workers until every GPU's
    # sample timed out, and each timeout was waited for in turn (2 s x 2 calls x GPUs a poll)
    monkeypatch.setattr("kvtop.sources.gpu._THROUGHPUT_TIMEOUT_S", 0.2)
    release = threading.Event()
    gpus = [FakeGpu(uuid=f"GPU-{i}", tx_kbps=5_000 + i, field_fail={FI_TX: "NOT_SUPPORTED", FI_RX: "NOT_SUPPORTED"})
            for i in range(4)]
    gpus[0].hang = release
    nv = FakeNvml(gpus)
    src = GpuSource(nvml=nv)
    try:
        for poll in range(8):
            recs = src.poll(float(poll))
            assert [r.pcie_tx_bytes_per_s for r in recs[1:]] == [5_001_000.0, 5_002_000.0, 5_003_000.0], poll
            assert recs[0].pcie_tx_bytes_per_s is None
        assert any("has not answered the last sample" in n for n in recs[0].notes)
        assert nv.calls.count("nvmlDeviceGetPcieThroughput") == 2 + 3 * 2 * 8  # the hung GPU asked once
        release.set()
        time.sleep(0.1)
        recs = src.poll(9.0)
        assert recs[0].pcie_tx_bytes_per_s == 5_000_000.0  # answered again: asked again
    finally:
        release.set()
        src.close()


def test_throughput_sampling_disabled():
    gpus = [FakeGpu(tx_kbps=5, field_fail={FI_TX: "NOT_SUPPORTED", FI_RX: "NOT_SUPPORTED"})]
    nv = FakeNvml(gpus)
    r, = GpuSource(nvml=nv, measure_pcie_throughput=False).poll(1.0)
    assert r.pcie_tx_bytes_per_s is None and r.pcie_source is None
    assert "nvmlDeviceGetPcieThroughput" not in nv.calls
    assert any("20 ms throughput sampling disabled" in n for n in r.notes)


def test_throughput_api_not_supported_either():
    gpus = [FakeGpu(field_fail={FI_TX: "NOT_SUPPORTED", FI_RX: "NOT_SUPPORTED"},
                    fail={"nvmlDeviceGetPcieThroughput": "NOT_SUPPORTED"}, util=40)]
    src = GpuSource(nvml=FakeNvml(gpus))
    r, = src.poll(1.0)
    assert r.pcie_tx_bytes_per_s is None and r.pcie_rx_bytes_per_s is None and r.pcie_source is None
    assert "pcie throughput: not supported" in r.notes and r.util_pct == 40.0
    r, = src.poll(2.0)
    assert r.pcie_source is None and "pcie throughput: not supported" in r.notes


# -- MIG -------------------------------------------------------------------------------------------

def test_mig_mode_and_per_instance_memory():
    mig_gpu = FakeGpu(name="NVIDIA A100-SXM4-80GB", mig_current=1, migs=[
        FakeMig(gpu_instance_id=1, mem_total=20 * GiB, mem_used=5 * GiB),
        FakeMig(gpu_instance_id=2, mem_total=40 * GiB, mem_used=10 * GiB + GiB // 2),
    ])
    # Without privileges the parent handle refuses the aggregate memory (docs/host-and-gpu.md §3).
    mig_gpu.fail = {"nvmlDeviceGetMemoryInfo": "NO_PERMISSION", "nvmlDeviceGetUtilizationRates": "NOT_SUPPORTED"}
    plain = FakeGpu(mig_current=0)
    consumer = FakeGpu(name="NVIDIA GeForce RTX 4090", fail={"nvmlDeviceGetMigMode": "NOT_SUPPORTED"})
    r_mig, r_plain, r_consumer = GpuSource(nvml=FakeNvml([mig_gpu, plain, consumer])).poll(1.0)
    assert r_mig.mig_mode is True
    assert r_mig.mem_used_bytes == 15 * GiB + GiB // 2 and r_mig.mem_total_bytes == 60 * GiB
    assert "mig gi 1: 5.0 of 20.0 GiB used" in r_mig.notes
    assert "mig gi 2: 10.5 of 40.0 GiB used" in r_mig.notes
    assert "memory: sum of MIG instances" in r_mig.notes
    assert "memory: no permission (run as root to read it)" in r_mig.notes
    assert not any("v1 API only" in n for n in r_mig.notes)
    assert r_mig.util_pct is None
    assert r_plain.mig_mode is False
    # a GPU without MIG answers NOT_SUPPORTED: MIG is off, and no note on every record says so
    assert r_consumer.mig_mode is False and not any("mig" in n for n in r_consumer.notes)


def test_one_mig_instance_that_refuses_leaves_the_others_read():
    gpu = FakeGpu(mig_current=1, migs=[
        FakeMig(gpu_instance_id=1, mem_total=20 * GiB, mem_used=5 * GiB, fail={"nvmlDeviceGetMemoryInfo": "NOT_SUPPORTED"}),
        FakeMig(gpu_instance_id=2, mem_total=40 * GiB, mem_used=10 * GiB),
    ], fail={"nvmlDeviceGetMemoryInfo": "NO_PERMISSION"})
    src = GpuSource(nvml=FakeNvml([gpu]))
    for t in (1.0, 2.0):
        r, = src.poll(t)
        assert "mig gi 2: 10.0 of 40.0 GiB used" in r.notes, r.notes
        assert (r.mem_used_bytes, r.mem_total_bytes) == (10 * GiB, 40 * GiB)


# -- engine process memory ---------------------------------------------------------------------------

def test_engine_process_memory_sums_matching_pids_only():
    gpus = two_gpus()
    gpus[0].procs = [FakeProc(100, 30 * GiB), FakeProc(101, 2 * GiB), FakeProc(200, 5 * GiB)]
    gpus[0].mps_procs = [FakeProc(102, GiB)]
    gpus[1].procs = [FakeProc(200, 7 * GiB)]
    src = GpuSource(nvml=FakeNvml(gpus), engine_pids=lambda: {100, 101, 102, 999}, pid_exists=lambda pid: True)
    r0, r1 = src.poll(1.0)
    assert r0.engine_proc_mem_bytes == 33 * GiB  # 30 + 2 + 1 (MPS); pid 200 is not the engine
    assert r1.engine_proc_mem_bytes == 0  # the engine does not use GPU 1


def test_engine_memory_is_unknown_not_zero_where_its_processes_cannot_be_matched():
    # a container without --pid=host: NVML names host PIDs that kvtop's /proc does not have
    gpus = two_gpus()
    gpus[0].procs = [FakeProc(812345, 70 * GiB)]
    r0, r1 = GpuSource(nvml=FakeNvml(gpus), engine_pids=lambda: {17, 42}, pid_exists=lambda pid: pid < 1000).poll(1.0)
    assert r0.engine_proc_mem_bytes is None and any("--pid=host" in n for n in r0.notes)
    # the engine's processes found, but none on any GPU while others hold 70 GiB (TGI's shards are
    # the launcher's children, not the router's on the port): unknown, not "the engine uses 0 B"
    r0, r1 = GpuSource(nvml=FakeNvml(gpus), engine_pids=lambda: {17, 42}, pid_exists=lambda pid: True).poll(1.0)
    assert r0.engine_proc_mem_bytes is None and r1.engine_proc_mem_bytes is None
    assert any("none of NVML's GPU processes is the engine's" in n for n in r0.notes)
    # no GPU process at all: the engine really holds nothing
    r0, r1 = GpuSource(nvml=FakeNvml(two_gpus()), engine_pids=lambda: {17}, pid_exists=lambda pid: True).poll(1.0)
    assert r0.engine_proc_mem_bytes == 0 and r1.engine_proc_mem_bytes == 0


def test_engine_memory_unknown_cases():
    gpus = two_gpus()
    gpus[0].procs = [FakeProc(100, None)]  # MIG / WDDM: no per-process figure
    r0, r1 = GpuSource(nvml=FakeNvml(gpus), engine_pids=lambda: {100}).poll(1.0)
    assert r0.engine_proc_mem_bytes is None
    assert any("per-process memory n/a" in n for n in r0.notes)
    # No engine process found locally: unknown, not zero.
    r0, _ = GpuSource(nvml=FakeNvml(two_gpus()), engine_pids=set).poll(1.0)
    assert r0.engine_proc_mem_bytes is None

    def boom() -> set[int]:
        raise PermissionError("hidepid")

    r0, _ = GpuSource(nvml=FakeNvml(two_gpus()), engine_pids=boom).poll(1.0)
    assert r0.engine_proc_mem_bytes is None and any("engine processes unknown" in n for n in r0.notes)


def test_process_query_probes_older_versions():
    gpus = two_gpus()
    gpus[0].procs = [FakeProc(100, 3 * GiB)]
    for g in gpus:  # 535.98 shipped without the _v3 symbols
        g.fail = {"nvmlDeviceGetComputeRunningProcesses_v3": "FUNCTION_NOT_FOUND"}
    nv = FakeNvml(gpus)
    src = GpuSource(nvml=nv, engine_pids=lambda: {100})
    r0, _ = src.poll(1.0)
    assert r0.engine_proc_mem_bytes == 3 * GiB
    src.poll(2.0)
    # The working version is remembered: _v3 was tried once only.
    assert nv.calls.count("nvmlDeviceGetComputeRunningProcesses_v3") == 1
    assert nv.calls.count("nvmlDeviceGetComputeRunningProcesses_v2") == 4


def test_process_query_no_permission():
    gpus = [FakeGpu(procs=[FakeProc(100, GiB)], fail={"nvmlDeviceGetComputeRunningProcesses_v3": "NO_PERMISSION"})]
    r, = GpuSource(nvml=FakeNvml(gpus), engine_pids=lambda: {100}).poll(1.0)
    assert r.engine_proc_mem_bytes is None
    assert "compute processes: no permission (run as root to read it)" in r.notes


# -- the fake itself -------------------------------------------------------------------------------

def test_fake_matches_real_binding():
    pynvml = pytest.importorskip("pynvml")
    for name, val in ERROR_CODES.items():
        assert getattr(pynvml, "NVML_ERROR_" + name) == val, name
    for cname in ERROR_CLASSES:
        assert hasattr(pynvml, cname), cname
        assert getattr(pynvml, cname)().value == ERROR_CLASSES[cname]().value
    for name, val in CONSTANTS.items():
        assert getattr(pynvml, name) == val, name
    nv = FakeNvml()
    for fn in (f for f in dir(nv) if f.startswith("nvml") and callable(getattr(nv, f))):
        assert hasattr(pynvml, fn), fn


async def test_a_gpu_reading_is_stamped_when_taken_not_when_asked():
    import asyncio
    import time
    from types import SimpleNamespace

    from kvtop.feeds.sources import GpuPoll

    src = GpuPoll()
    src._gpu = GpuSource(nvml=FakeNvml([FakeGpu()]))
    got: list = []
    t0 = time.monotonic()
    src._ctx = SimpleNamespace(now=lambda: time.monotonic() - t0, emit=got.append,
                               core=SimpleNamespace(set_gpu_status=lambda s: None))
    with src._lock:  # the previous poll still reading (a slow driver call)
        task = asyncio.create_task(src.poll(0.0))
        await asyncio.sleep(0.3)
    await task
    [rec] = got
    assert rec.t >= 0.3  # it was stamped 0.0, the time it was asked
