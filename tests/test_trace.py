"""Trace format: schema, documentation (docs/trace-format.md), round trip, growth, crash tolerance, streaming."""

from __future__ import annotations

import dataclasses
import json
import time
import tracemalloc
from pathlib import Path

import jsonschema
import pytest
from conftest import REPO

from kvtop.model import records as R
from kvtop.model.trace import TraceReader, TraceWriter, clock_origin_unix, make_header

SCHEMA = json.loads((REPO / "kvtop" / "schemas" / "trace.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
KINDS = (R.GpuRecord, R.HostRecord, R.EngineRecord, R.RequestRecord, R.TruthRecord)


def _wire_names(cls: type) -> list[str]:
    return ["class" if f.name == "cls" else f.name for f in dataclasses.fields(cls)]


def _samples() -> list[R.Record]:
    h = R.Histogram([(0.01, 3.0), (0.1, 9.0), (float("inf"), 10.0)], 10.0, 0.42)
    return [
        R.GpuRecord(0.5, 0, uuid="GPU-1", name="H100", mem_used_bytes=70 << 30, mem_total_bytes=80 << 30,
                    mem_reserved_bytes=1 << 20, pcie_tx_bytes_per_s=1.5e9, pcie_rx_bytes_per_s=2.5e9,
                    pcie_source="field_counters", pcie_link_gen=5, pcie_link_width=16, pcie_link_gen_max=5,
                    pcie_link_width_max=16, pcie_replay_count=0, util_pct=97.0, mig_mode=False,
                    engine_proc_mem_bytes=69 << 30, notes=["x"]),
        R.HostRecord(0.5, mem_total_bytes=1 << 40, mem_available_bytes=1 << 39, swap_total_bytes=0,
                     swap_used_bytes=0, pinned_bytes=1 << 30, pinned_signal="pinned (all GUP)",
                     pinned_signals={"pinned (all GUP)": 1 << 30, "Mlocked": None}, shmem_bytes=1 << 20,
                     cgroup_shmem_bytes=None, cgroup_mem_max_bytes=None),
        R.EngineRecord(1.0, "vllm", url="http://127.0.0.1:8000", engine="0", model="m", kv_usage=0.97,
                       running=64, waiting=3, preemptions_total=12, prompt_tokens_total=1e6,
                       generation_tokens_total=2e6, prefix_hits_total=10, prefix_queries_total=100,
                       requests_finished_total=500, requests_aborted_total=2, kv_capacity_tokens=100000,
                       block_size=16, offload_capacity_bytes=1 << 34, offload_out_bytes_total=1e9,
                       offload_in_bytes_total=2e9, offload_out_seconds_total=0.1, offload_in_seconds_total=0.2,
                       itl=h, ttft=h, restart_token=1.7e9, version="0.11", warnings=["w"], extra={"a": 1}),
        R.EngineRecord(2.0, "vllm", url="http://127.0.0.1:8000", up=False, warnings=["connection refused"]),
        R.RequestRecord(1.5, "r1", "arrive", prompt_tokens=12, cls="interactive", source="proxy"),
        R.RequestRecord(1.6, "r1", "first_token", n=2),
        R.RequestRecord(1.7, "r1", "finish", finish_reason="stop", completion_tokens=2, prompt_tokens=12),
        R.RequestRecord(1.8, "r2", "error", status=502, error="upstream_unreachable"),
        R.TruthRecord(1.6, "preempt", request_id="r1", data={"blocks": 4}),
    ]


def _trace_format_doc() -> str:
    text = (REPO / "docs" / "trace-format.md").read_text(encoding="utf-8")
    assert text.startswith("# Trace format\n"), "docs/trace-format.md is not the trace format"
    return text


def test_schema_and_docs_document_every_field_of_every_kind():
    section = _trace_format_doc()
    for cls in KINDS:
        props = SCHEMA["$defs"][cls.kind]["properties"]
        for name in ["kind", *_wire_names(cls)]:
            assert name in props, f"schema lacks {cls.kind}.{name}"
            assert f"`{name}`" in section, f"docs/trace-format.md lacks {cls.kind}.{name}"
    for name in ("format", "version", "started_at", "host", "engine", "kv", "bytes_per_token",
                 "capacity_tokens"):
        assert f"`{name}`" in section
    for event in sorted(R.REQUEST_EVENTS):
        assert f"`{event}`" in section


def test_every_kind_round_trips_and_validates(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, make_header(engine={"adapter": "vllm", "url": "u", "model": "m"},
                                       kv={"bytes_per_token": 131072, "block_size": 16,
                                           "capacity_tokens": 100000})) as w:
        for rec in _samples():
            w.write(rec)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for d in lines:
        errors = [e.message for e in VALIDATOR.iter_errors(d)]
        assert not errors, (d, errors)
    assert lines[0]["format"] == "kvtop-trace" and lines[0]["version"] == 1
    # request records are compact: empty optional fields are not written; class is "class" on the wire
    assert lines[5] == {"kind": "request", "t": 1.5, "id": "r1", "event": "arrive", "prompt_tokens": 12,
                        "class": "interactive", "source": "proxy"}
    back = list(TraceReader(path).records())
    assert back == _samples()


def test_readers_ignore_unknown_kinds_and_fields_and_skip_torn_lines(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, make_header()) as w:
        w.write({"kind": "request", "t": 1.0, "id": "a", "event": "token", "n": 3, "future_field": [1, 2]})
        w.write({"kind": "kv_event", "t": 1.1, "block": 7})  # a kind from a later version
        w.write(R.EngineRecord(1.2, "sglang", kv_usage=0.5))
    with open(path, "a") as f:
        f.write('{"kind":"request","t":1.3,"id":"a","ev')  # torn by a crash
    reader = TraceReader(path)
    recs = list(reader.records())
    assert recs == [R.RequestRecord(1.0, "a", "token", n=3), R.EngineRecord(1.2, "sglang", kv_usage=0.5)]
    assert reader.unknown_kinds == 1 and reader.skipped == 1
    assert "skipped 1 malformed line" in reader.warning()


def test_reading_streams_in_bounded_memory(tmp_path: Path):
    path = tmp_path / "big.jsonl"
    n = 60_000
    with TraceWriter(path, make_header()) as w:
        for i in range(n):
            w.write(R.RequestRecord(i * 0.001, f"req-{i // 50}", "token", n=1))
    size = path.stat().st_size
    assert size > 3 << 20
    tracemalloc.start()
    count = sum(1 for _ in TraceReader(path).records())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == n
    assert peak < size / 10, (peak, size)


@pytest.mark.parametrize("bad", ["not json\n", '{"kind":"header","format":"other","version":1}\n', ""])
def test_not_a_trace_is_refused(tmp_path: Path, bad: str):
    from kvtop.model.trace import TraceError

    p = tmp_path / "x.jsonl"
    p.write_text(bad)
    with pytest.raises(TraceError):
        TraceReader(p)


def test_fast_request_path_writes_exactly_what_to_dict_gives(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    recs = [r for r in _samples() if isinstance(r, R.RequestRecord)]
    recs.append(R.RequestRecord(3.0, "r9", "token", n=1, cls="batch", source="sim", status=None, error="x",
                                finish_reason="length", completion_tokens=5, prompt_tokens=3))
    with TraceWriter(path, make_header()) as w:
        for r in recs:
            w.write(r)
    lines = path.read_text().splitlines()[1:]
    assert lines == [json.dumps(R.to_dict(r), separators=(",", ":")) for r in recs]


def test_times_are_written_to_the_microsecond(tmp_path: Path):
    """Clock digits past the microsecond are noise; six decimals keep lines short and let the
    analyzer's fast path parse every timestamp exactly (tests/test_attribution.py)."""
    path = tmp_path / "t.jsonl"
    t = 12.345678912345
    with TraceWriter(path, make_header()) as w:
        w.write(R.RequestRecord(t, "r1", "token", n=1))  # the token fast path
        w.write(R.RequestRecord(t, "r1", "finish", finish_reason="stop"))  # the general path
        d = {"kind": "engine", "t": t, "up": True}
        w.write(d)
        assert d["t"] == t  # the caller's dict is not changed
    lines = path.read_text().splitlines()[1:]
    assert [json.loads(x)["t"] for x in lines] == [12.345679] * 3
    assert all('"t":12.345679,' in x for x in lines)


def test_clock_origin_ignores_a_read_that_straddled_a_preemption():
    """A recorder preempted between its clock read and its wall read would date its whole trace
    that much off another recorder's: the origin comes from the tightest bracketed read."""
    calls = [0]

    def clock() -> float:
        calls[0] += 1
        # the first read stands for a process that lost the CPU for 80 ms right after it
        return time.monotonic() - (0.08 if calls[0] == 1 else 0.0)

    origin = clock_origin_unix(clock)
    assert calls[0] >= 4  # the straddled bracket was not kept
    assert abs(origin - clock_origin_unix()) < 0.005
