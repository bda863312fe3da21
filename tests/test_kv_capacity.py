"""More KV capacity instead of a queue (issue 24): where the KV cache holds fewer sequences of the
traffic than were in flight and an admission limit would make requests wait longer than they are
served (or than the TTFT target), the advisor sizes the cache for the peak and prescribes it as the
engine's own flag, only where the device has the room, and keeps the limit as a safety bound."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import flags, judge, small_kv_storm

from kvtop.sim.flags import apply_engine_flags
from kvtop.sim.workload import WorkloadError, load_preset

MIB = 1 << 20

# 20 requests in flight on a 22,880-token cache of llama-3.1-8b (131,072 B per token, 16-token blocks):
# p90 sequence 2,400 tokens, so the cache holds 9.5 of them; a 1,400-token answer at a 20 ms step lives 28 s.
_base = small_kv_storm()
STORM = {
    **_base,
    "name": "20 in flight on a small KV cache",
    "engine_version": "0.32.0",
    "traffic": {**_base["traffic"], "inflight_peak": 20},
    "observed": {"decode_step_ms": 20},
    "capacity": {"kv_capacity_tokens": 22880, "block_size": 16, "device_free_bytes": 20e9},
    "engine_settings": {"kv_cache_memory_bytes": 22880 * 131072, "max_num_seqs": 64},
}


def test_kv_for_the_peak_in_flight_with_its_arithmetic():
    v = judge(STORM)
    f = flags(v)
    # 20 sequences x 2,400 tokens (150 whole blocks) x 131,072 B = 6,291,456,000 B = 6,000 MiB exactly
    assert f["--kv-cache-memory-bytes"] == 20 * 2400 * 131072 == 6000 * MIB
    # the limit is recomputed on the larger cache: 48,000 / 2,400 = 20 floor, 48,000 / 1,700 = 28.2
    # ceiling -> a power of two between them is not >= 20, so the floor: 20 (not the 9 that queues)
    assert f["--max-num-seqs"] == 20
    why = next(s["why"] for s in v["settings"] if s["flag"] == "--kv-cache-memory-bytes")
    assert "20 requests in flight at the peak × 2,400 tokens per sequence" in why
    assert "× 131,072 B per token" in why and "2.1x the 2,998,927,360 B" in why
    assert "3.29 GB more fits in the 20 GB GPU memory free" in why
    line = next(r for r in v["reasons"] if r.startswith("more KV capacity instead of a queue"))
    # (20/9 - 1) x 1,400 tokens x 20 ms = 34.2 s of queue vs a 28 s request
    assert "the limit's queue (34.2 s) exceeds one request's own lifetime (28.0 s)" in line
    assert v["numbers"]["kv_capacity_needed"]["value"] == 6000 * MIB
    assert v["action"] == "admission" and not v["tentative"]


def test_no_kv_flag_where_the_device_lacks_the_room():
    doc = copy.deepcopy(STORM)
    doc["capacity"]["device_free_bytes"] = 3e9  # 3.29 GB more needed, 90 % of 3 GB = 2.7 GB may be used
    v = judge(doc)
    f = flags(v)
    assert "--kv-cache-memory-bytes" not in f and "--gpu-memory-utilization" not in f
    assert f["--max-num-seqs"] == 9  # the admission limit from the small cache stays
    assert any("it needs 3.29 GB more but only 3 GB is GPU memory free" in r and "not prescribed" in r
               for r in v["reasons"])


def test_unknown_headroom_is_prescribed_to_confirm():
    doc = copy.deepcopy(STORM)
    del doc["capacity"]["device_free_bytes"]
    v = judge(doc)
    assert flags(v)["--kv-cache-memory-bytes"] == 6000 * MIB
    assert v["reasons"][0] == ("to confirm before applying: the device's free memory is unknown (no NVML record): "
                               "confirm 3.29 GB more per GPU is free before applying")


def test_a_cpu_engine_is_judged_by_the_hosts_available_memory():
    doc = copy.deepcopy(STORM)
    del doc["capacity"]["device_free_bytes"]
    doc["host"]["mem_available_bytes"] = 2e9
    v = judge(doc)
    assert "--kv-cache-memory-bytes" not in flags(v)
    assert any("only 2 GB is host memory available" in r for r in v["reasons"])
    doc["host"]["mem_available_bytes"] = 64e9
    assert flags(judge(doc))["--kv-cache-memory-bytes"] == 6000 * MIB


def test_no_kv_flag_when_the_cache_already_holds_the_peak():
    doc = copy.deepcopy(STORM)
    doc["capacity"]["kv_capacity_tokens"] = 48000  # 20 sequences of 2,400: the floor is the peak
    doc["engine_settings"]["kv_cache_memory_bytes"] = 6000 * MIB
    v = judge(doc)
    assert "--kv-cache-memory-bytes" not in flags(v)
    assert not any(r.startswith("more KV capacity") for r in v["reasons"])


def test_without_a_ttft_target_the_itl_target_sets_the_budget():
    doc = copy.deepcopy(STORM)
    doc["traffic"]["inflight_peak"] = 12  # (12/9 - 1) x 28 s = 9.3 s of queue: less than one 28 s request
    assert "--kv-cache-memory-bytes" not in flags(judge(doc))
    doc["slo"] = {"itl_ms": 100}  # 10 x 100 ms = 1 s to first token: the 9.3 s queue is material
    v = judge(doc)
    assert flags(v)["--kv-cache-memory-bytes"] == 12 * 2400 * 131072 == 3600 * MIB
    assert any("the limit's queue (9.3 s) exceeds a 1000 ms time to first token (10x the 100 ms ITL target"
               in r for r in v["reasons"])
    doc["slo"] = {"itl_ms": 1000}  # 10 s to first token: the 9.3 s queue is within it
    assert "--kv-cache-memory-bytes" not in flags(judge(doc))


def test_a_queue_within_the_ttft_target_keeps_the_limit():
    doc = copy.deepcopy(STORM)
    doc["slo"] = {"ttft_ms": 60000}  # the 34.2 s queue is within a 60 s TTFT target
    f = flags(judge(doc))
    assert "--kv-cache-memory-bytes" not in f and f["--max-num-seqs"] == 9
    doc["slo"] = {"ttft_ms": 2000}
    v = judge(doc)
    assert flags(v)["--kv-cache-memory-bytes"] == 6000 * MIB
    assert any("the limit's queue (34.2 s) exceeds the 2000 ms TTFT target" in r for r in v["reasons"])


def test_an_engine_sized_by_its_memory_share_gets_the_share_raised():
    doc = copy.deepcopy(STORM)
    del doc["engine_settings"]["kv_cache_memory_bytes"]
    doc["engine_settings"]["gpu_memory_utilization"] = 0.9
    doc["capacity"]["device_total_bytes"] = 80e9
    v = judge(doc)
    f = flags(v)
    # the cache now: 22,880 x 131,072 B; 3,292,528,640 B more of 80 GB = 0.0412 -> 0.9412, rounded up
    assert f["--gpu-memory-utilization"] == 0.95 and "--kv-cache-memory-bytes" not in f
    # a share that would pass 1.0 is not prescribed
    doc["engine_settings"]["gpu_memory_utilization"] = 0.98
    doc["capacity"]["device_free_bytes"] = 40e9
    v = judge(doc)
    assert "--gpu-memory-utilization" not in flags(v)
    assert any("the memory share would exceed 1.0 (1.03)" in r for r in v["reasons"])


def test_the_real_vllm_storm_gets_a_kv_cache_for_its_eight_requests():
    """The tier's real vLLM 0.32 storm (tests/fixtures/loop): 8 requests of 679 tokens on 1,056 slots
    (1,081,344 B: 1,024 B per token, 32-token blocks), recorded on a CPU engine with 22 GB available."""
    from kvtop.analysis.scan import analyze_trace

    v = analyze_trace("tests/fixtures/loop/vllm-storm-before.jsonl.gz").verdict
    assert v is not None
    f = {s.flag: s.value for s in v.settings}
    # 8 x 704 tokens (22 blocks of 32 for 679) x 1,024 B = 5,767,168 B, rounded up to 6 MiB
    assert f["--kv-cache-memory-bytes"] == 6 * MIB
    # 6,144 tokens / 679 = 9.05 without preemption: 9 admitted, more than the 8 in flight
    assert f["--max-num-seqs"] == 9
    why = next(s.why for s in v.settings if s.flag == "--kv-cache-memory-bytes")
    assert "8 requests in flight at the peak × 704 tokens per sequence" in why
    assert "× 1,024 B per token (the engine's KV bytes / its KV tokens)" in why
    assert "host memory available (kvtop saw no GPU: a CPU engine's KV)" in why


def test_saved_scenario_carries_what_the_kv_rule_read(tmp_path, kvtop_cli):
    saved = tmp_path / "s.json"
    # a scenario needs the KV size; the tiny model is in no table: 1,081,344 B / 1,056 tokens
    r = kvtop_cli("analyze", "tests/fixtures/loop/vllm-storm-before.jsonl.gz", "--format", "json",
                  "--kv-bytes-per-token", "1024", "--save-scenario", str(saved))
    assert r.returncode == 0, r.stderr
    a = json.loads(r.stdout)["verdict"]
    doc = json.loads(saved.read_text())
    assert doc["engine_settings"]["kv_cache_memory_bytes"] == 1081344 and doc["capacity"]["block_size"] == 32
    r = kvtop_cli("advise", "--scenario", str(saved), "--format", "json")
    assert r.returncode == 0, r.stderr
    b = json.loads(r.stdout)["verdict"]
    assert flags(b) == flags(a) and flags(a)["--kv-cache-memory-bytes"] == 6291456
    assert (b["action"], b["confidence"]) == (a["action"], a["confidence"])


def test_the_simulator_sizes_its_cache_as_vllm_does():
    wl = load_preset("preemption-storm")
    block = wl.engine.block_bytes  # 16 tokens x 131,072 B
    e = apply_engine_flags(wl, f"--kv-cache-memory-bytes {6000 * MIB}").engine
    assert e.num_gpu_blocks == 6000 * MIB // block == 3000 and e.capacity_tokens == 48000
    # an explicit KV size wins over the memory share, whichever comes first
    for fl in (f"--gpu-memory-utilization 0.45 --kv-cache-memory-bytes {6000 * MIB}",
               f"--kv-cache-memory-bytes={6000 * MIB} --gpu-memory-utilization 0.45"):
        assert apply_engine_flags(wl, fl).engine.num_gpu_blocks == 3000
    with pytest.raises(WorkloadError, match="holds fewer than 2 KV blocks"):
        apply_engine_flags(wl, f"--kv-cache-memory-bytes {block}")


@pytest.mark.parametrize("free, fires", [(8 << 30, True), (4 << 20, False)])
def test_nvml_free_memory_decides_on_a_gpu_host(tmp_path, free, fires):
    """The same real storm with NVML records of one 80 GiB GPU: its least free memory over the run is
    the room (5,210,112 B more are needed: 90 % of 4 MiB is not enough, 8 GiB is)."""
    import gzip

    from kvtop.analysis.scan import analyze_trace
    from kvtop.model.records import GpuRecord, to_dict

    total = 80 << 30
    lines = gzip.open("tests/fixtures/loop/vllm-storm-before.jsonl.gz", "rt").read().splitlines()
    gpu = [json.dumps(to_dict(GpuRecord(t=float(t), index=0, mem_used_bytes=total - free + (t % 2) * MIB,
                                        mem_total_bytes=total))) for t in range(1, 10)]
    path = tmp_path / "gpu.jsonl"
    path.write_text("\n".join(lines[:3] + gpu + lines[3:]) + "\n")
    v = analyze_trace(str(path)).verdict
    assert v is not None
    assert v.numbers["device_free_bytes"].value == pytest.approx(free - MIB, rel=1e-5)  # the least seen
    f = {s.flag: s.value for s in v.settings}
    if fires:
        assert f["--kv-cache-memory-bytes"] == 6 * MIB
        why = next(s.why for s in v.settings if s.flag == "--kv-cache-memory-bytes")
        assert "5.21 MB more fits in the 8.59 GB GPU memory free (NVML, least over the run)" in why
    else:
        assert "--kv-cache-memory-bytes" not in f and f["--max-num-seqs"] == 2
        assert any("it needs 5.21 MB more but only 3.15 MB is GPU memory free" in r for r in v.reasons)


def test_sglang_gets_its_static_memory_share_raised_and_no_bytes_flag():
    doc = copy.deepcopy(STORM)
    doc["engine"] = "sglang"
    del doc["engine_version"]
    del doc["engine_settings"]["kv_cache_memory_bytes"]
    doc["engine_settings"]["gpu_memory_utilization"] = 0.88
    doc["capacity"]["device_total_bytes"] = 80e9
    f = flags(judge(doc))
    # 0.88 + 3,292,528,640 B / 80 GB = 0.9212 -> 0.93 of SGLang's --mem-fraction-static (weights + KV pool)
    assert f["--mem-fraction-static"] == 0.93
    del doc["engine_settings"]["gpu_memory_utilization"]  # its share unknown: no value to give
    v = judge(doc)
    assert "--mem-fraction-static" not in flags(v)
    assert any("raise --mem-fraction-static by 3.29 GB / the GPU's memory: its current value is not known"
               in r for r in v["reasons"])


def test_the_simulated_engine_is_never_judged_by_this_machines_memory():
    # `kvtop demo` models an 8B GPU engine; the host row beside it is the laptop's: "(kvtop saw no
    # GPU: a CPU engine's KV)" sized its cache against the laptop's 2 GB
    doc = copy.deepcopy(STORM)
    del doc["capacity"]["device_free_bytes"]
    doc["host"]["mem_available_bytes"] = 2e9
    doc["engine_version"] = "kvtop-sim"
    v = judge(doc)
    assert flags(v)["--kv-cache-memory-bytes"] == 6000 * MIB
    assert v["reasons"][0].startswith("to confirm before applying: the device's free memory is unknown")
    assert not any("host memory available" in r for r in v["reasons"])
