"""Replaying a trace through the core: speed, pause/step/seek, and the `kvtop replay` command."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from conftest import run_kvtop

from kvtop.core import Core
from kvtop.feeds.replay import ReplayFeed, last_record_time
from kvtop.model.records import EngineRecord, RequestRecord
from kvtop.model.trace import TraceError, TraceWriter, make_header

URL = "http://127.0.0.1:8000"


def _write_trace(path: Path) -> None:
    """Engine every 0.5 s for 4 s (kv_usage = t / 10, preemptions +1 at t=2.0), and one request
    with tokens at 1.0, 1.1, 1.2 then a 0.8 s gap to 2.0, finishing at 2.1."""
    with TraceWriter(path, make_header(engine={"adapter": "vllm", "url": URL, "model": "m"})) as w:
        reqs = [RequestRecord(0.9, "r1", "arrive", source="proxy"), RequestRecord(1.0, "r1", "first_token", n=1),
                RequestRecord(1.1, "r1", "token", n=1), RequestRecord(1.2, "r1", "token", n=2),
                RequestRecord(2.0, "r1", "token", n=1), RequestRecord(2.1, "r1", "finish", finish_reason="stop")]
        for i in range(9):
            t = i * 0.5
            while reqs and reqs[0].t <= t:
                w.write(reqs.pop(0))
            w.write(EngineRecord(t, "vllm", url=URL, engine="0", model="m", kv_usage=t / 10,
                                 running=1, waiting=0, preemptions_total=3.0 if t >= 2.0 else 2.0,
                                 generation_tokens_total=100 + 10 * i))


def _engine(core: Core):
    (e,) = core.snapshot().engines
    return e


def _core() -> Core:
    return Core(window_s=10, source_label="replay")


def test_feed_as_fast_as_possible_then_seek_back_and_step(tmp_path: Path):
    p = tmp_path / "t.jsonl"
    _write_trace(p)
    assert last_record_time(p) == 4.0
    feed = ReplayFeed(p, _core(), speed=0, core_factory=_core)
    assert feed.duration == 4.0 and feed.header["engine"]["model"] == "m"
    asyncio.run(feed.run())
    assert feed.done and feed.t == 4.0 and feed.fed == 9 + 6
    e = _engine(feed.core)
    assert e.kv_usage == pytest.approx(0.4) and e.preemptions_total == 3.0
    (r,) = feed.core.snapshot().requests
    assert r.state == "finished" and r.tokens == 5 and r.max_gap_s == pytest.approx(0.8)

    old = feed.core
    resets = []
    feed.on_reset = resets.append
    feed.seek(1.1)  # backwards: a fresh core, re-fed from the start up to t=1.1
    assert feed.core is not old and resets == [feed.core]
    assert feed.t == 1.1
    assert _engine(feed.core).kv_usage == pytest.approx(0.1)
    (r,) = feed.core.snapshot(now=feed.t).requests
    assert r.state == "running" and r.tokens == 2
    feed.step(1.0)  # to t=2.1: the gap and the finish are in
    assert feed.t == pytest.approx(2.1)
    assert _engine(feed.core).kv_usage == pytest.approx(0.2) and _engine(feed.core).preemptions_total == 3.0
    (r,) = feed.core.snapshot(now=feed.t).requests
    assert r.state == "finished" and r.max_gap_s == pytest.approx(0.8)
    feed.step(100)
    assert feed.done and feed.t == 4.0


def test_backward_seek_without_factory_resets_the_same_core(tmp_path: Path):
    p = tmp_path / "t.jsonl"
    _write_trace(p)
    core = Core(window_s=7, itl_target_s=0.05, source_label="replay x")
    feed = ReplayFeed(core, p)  # either argument order
    feed.seek(4.0)
    assert feed.done and _engine(core).kv_usage == pytest.approx(0.4)
    feed.seek(0.6)
    # a view holding `core` sees the rewound state, with its settings kept
    assert feed.core is core and not feed.done
    assert _engine(core).kv_usage == pytest.approx(0.05)
    assert core.snapshot(now=feed.t).requests == ()  # r1 arrives at 0.9
    assert (core.window_s, core.itl_target_s, core.source_label) == (7, 0.05, "replay x")
    feed.step(0.5)
    (r,) = core.snapshot(now=feed.t).requests
    assert r.tokens == 2 and feed.t == pytest.approx(1.1)


async def test_recorded_speed_pause_and_resume(tmp_path: Path):
    p = tmp_path / "t.jsonl"
    _write_trace(p)
    feed = ReplayFeed(p, _core(), speed=4.0)  # 4 s of trace in ~1 s
    stop = asyncio.Event()
    t0 = time.monotonic()
    task = asyncio.create_task(feed.run(stop))
    await asyncio.sleep(0.3)
    # at least 1.2 s of trace time has passed (more if the machine was busy): the t=1.0 record is in
    assert feed.t >= 0.8
    feed.pause()
    frozen = feed.t
    fed = feed.fed
    await asyncio.sleep(0.3)
    assert feed.t == frozen and feed.fed == fed  # paused: nothing moves
    feed.resume()
    await asyncio.wait_for(task, 30)
    wall = time.monotonic() - t0
    # 4 s of trace at 4x, plus the 0.3 s pause: never sooner (later only as a busy machine makes it)
    assert wall >= 1.2
    assert feed.done and _engine(feed.core).kv_usage == pytest.approx(0.4)


def test_replay_command_headless(tmp_path: Path):
    p = tmp_path / "t.jsonl"
    _write_trace(p)
    r = run_kvtop("replay", str(p), "--headless", "--format", "json")
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["requests"][0]["tokens"] == 5 and snap["requests"][0]["state"] == "finished"
    assert snap["engines"][0]["kv_usage"] == pytest.approx(0.4)
    r = run_kvtop("replay", str(p), "--headless", "--until", "1.2", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["engines"][0]["kv_usage"] == pytest.approx(0.1)
    r = run_kvtop("replay", str(p), "--headless")
    assert r.returncode == 0 and "vllm" in r.stdout and "40" in r.stdout  # text report, KV 40 %


def test_replay_bad_files_exit_2(tmp_path: Path):
    notrace = tmp_path / "x.jsonl"
    notrace.write_text('{"hello": 1}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    future = tmp_path / "v9.jsonl"
    future.write_text('{"kind":"header","format":"kvtop-trace","version":9}\n')
    for path in (tmp_path / "missing.jsonl", tmp_path, notrace, empty, binary, future):
        r = run_kvtop("replay", str(path), "--headless")
        assert r.returncode == 2, (path, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    r = run_kvtop("replay", str(notrace), "--speed", "-1")
    assert r.returncode == 2
    with pytest.raises(TraceError):
        ReplayFeed(notrace, _core())


def test_headless_replay_reports_the_same_analysis_as_analyze(tmp_path: Path):
    """`kvtop replay --headless` runs the live analysis through the same pipeline as the console:
    on a simulated preemption storm it finds the spikes and the verdict `kvtop analyze` finds."""
    trace = tmp_path / "storm.jsonl"
    r = run_kvtop("simulate", "--preset", "preemption-storm", "--seed", "1", "--duration", "40", "-o", str(trace))
    assert r.returncode == 0, r.stderr
    r = run_kvtop("analyze", str(trace), "--format", "json")
    assert r.returncode == 0, r.stderr
    batch = json.loads(r.stdout)
    r = run_kvtop("replay", str(trace), "--headless", "--format", "json")
    assert r.returncode == 0, r.stderr
    live = json.loads(r.stdout)["analysis"]
    assert live["itl_target_s"] == pytest.approx(0.1)  # the target the trace was simulated against
    pre = live["causes"]["preemption"]["count"]
    assert pre >= 5 and pre == batch["causes"]["preemption"]["count"]
    assert live["spikes_total"] == batch["spikes_total"]
    assert live["verdict"]["action"] == batch["verdict"]["action"]
    # the settings too: the console read none of the header's limits and told the operator to set
    # --max-num-seqs to the 64 the engine already ran with
    flags = [(s["flag"], s["value"]) for s in live["verdict"]["settings"]]
    assert flags == [(s["flag"], s["value"]) for s in batch["verdict"]["settings"]]
    assert ("--max-num-seqs", 64) not in flags
    for key in ("itl_target", "max_seqs_current"):
        assert live["verdict"]["numbers"][key]["source"] == batch["verdict"]["numbers"][key]["source"], key


def test_a_replay_never_calls_the_gpu_fine_when_the_trace_has_no_gpu_record(tmp_path: Path):
    # recorded without NVML: live said why, the replay said "ok" beside no GPU at all
    from kvtop.model.records import GpuRecord

    path = tmp_path / "t.jsonl"
    _write_trace(path)
    r = run_kvtop("replay", str(path), "--headless", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gpu_status"].startswith("no GPU record in this trace")
    with TraceWriter(path, {}) as w:  # appended: the same run, with one GPU reading
        w.write(GpuRecord(t=2.0, index=0, uuid="GPU-0", mem_used_bytes=1, mem_total_bytes=2))
    r = run_kvtop("replay", str(path), "--headless", "--format", "json")
    doc = json.loads(r.stdout)
    assert doc["gpu_status"] == "ok" and [g["uuid"] for g in doc["gpus"]] == ["GPU-0"]


def test_the_console_judges_the_last_spikes_when_the_trace_ends(tmp_path: Path):
    # the spikes still waiting for evidence at the trace's end stayed pending for ever in the console
    # (360 shown where analyze counted 363)
    from kvtop.analysis.scan import analyze_trace
    from kvtop.pipeline import replay_feed

    trace = tmp_path / "storm.jsonl"
    assert run_kvtop("simulate", "--preset", "preemption-storm", "--seed", "1", "--duration", "120",
                     "-o", str(trace)).returncode == 0
    feed = replay_feed(str(trace))
    feed.seek(feed.duration + 1.0)
    rep = feed.core.analysis.report(feed.t)  # the console asks at the trace clock, which stops at the end
    assert rep is not None and rep.pending_spikes == 0
    assert rep.spikes_total == analyze_trace(str(trace)).spikes_total


def test_an_as_fast_as_possible_replay_moves_its_clock_with_the_records_it_fed(tmp_path: Path):
    # --speed 0 in the console: the trace clock stayed at 0 while the whole trace was fed in batches
    # ("replay 0ms/300s", rates over 0 s, a staleness of -211 s) until the very end
    from kvtop.feeds import replay as replay_mod

    p = tmp_path / "t.jsonl"
    _write_trace(p)
    feed = ReplayFeed(p, _core(), speed=0)
    clocks: list[float] = []
    fed = feed._feed_until

    def watch(t: float, limit: int | None = None) -> int:
        n = fed(t, limit)
        clocks.append(feed.t)
        return n

    feed._feed_until = watch  # type: ignore[method-assign]
    old = replay_mod._BATCH
    replay_mod._BATCH = 4
    try:
        asyncio.run(feed.run())
    finally:
        replay_mod._BATCH = old
    assert feed.done and feed.t == 4.0
    assert len(clocks) >= 3 and 0.0 < clocks[0] < clocks[1] < 4.0 and clocks == sorted(clocks)
