"""Rule ``queued``: the engine's own gauges, read while a stream mid-way through its output was silent,
leave it no place in the running batch. Such a stream sat in the queue: it was preempted, whatever the
counter shows (vLLM V1 counts a preemption only when the victim resumes, and a storm steps the counter
near almost any stall). Scored against real vLLM's own step log (eval/witness_rounds), every one of these
calls was right."""

from __future__ import annotations

import json
from pathlib import Path

from kvtop.analysis.scan import analyze_trace

HEADER = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-03T00:00:00Z",
          "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "interval_s": 0.5}
SILENT = (3.0, 3.8)  # stream c hears nothing for 800 ms while a and b keep streaming at 20 ms a token


def _write(path: Path, *, running: int, waiting: int, pending_arrival: float | None = None,
           everyone_silent: bool = False) -> None:
    recs: list[dict] = []
    for i, rid in enumerate(("a", "b", "c")):
        recs.append({"kind": "request", "t": 0.9, "id": rid, "event": "arrive", "source": "proxy", "prompt_tokens": 50})
        silent = rid == "c" or everyone_silent
        times = [1.0 + 0.02 * k + 0.001 * i for k in range(301)]  # 1.00 .. 7.00
        if silent:
            times = [t for t in times if not (SILENT[0] < t < SILENT[1])] + [SILENT[1] + 0.001 * i]
            times.sort()
        recs.append({"kind": "request", "t": times[0], "id": rid, "event": "first_token", "n": 1})
        recs += [{"kind": "request", "t": t, "id": rid, "event": "token", "n": 1} for t in times[1:]]
        recs.append({"kind": "request", "t": 7.1, "id": rid, "event": "finish", "prompt_tokens": 50,
                     "completion_tokens": len(times)})
    if pending_arrival is not None:
        recs.append({"kind": "request", "t": pending_arrival, "id": "d", "event": "arrive", "source": "proxy"})
        recs.append({"kind": "request", "t": 5.0, "id": "d", "event": "first_token", "n": 1})
        recs.append({"kind": "request", "t": 5.2, "id": "d", "event": "finish", "completion_tokens": 3})
    for k in range(16):
        t = 0.25 + 0.5 * k
        inside = SILENT[0] < t < SILENT[1]
        recs.append({"kind": "engine", "t": t, "adapter": "vllm", "url": "http://127.0.0.1:8000", "engine": "0",
                     "up": True, "kv_usage": 0.9, "running": running if inside else 3,
                     "waiting": waiting if inside else 0, "preemptions_total": 0, "prompt_tokens_total": 150})
    recs.sort(key=lambda d: d["t"])
    with open(path, "w") as f:
        f.write(json.dumps(HEADER) + "\n")
        for d in recs:
            f.write(json.dumps(d) + "\n")


def _stalls(path: Path) -> list[tuple[str, str, str | None]]:
    rep = analyze_trace(str(path), itl_target_s=0.1)
    return sorted((s.request_id, str(s.cause), s.rule) for s in rep.spikes if abs(s.t_end - SILENT[1]) < 0.01)


def test_a_silent_stream_the_running_batch_has_no_room_for_was_preempted(tmp_path):
    _write(tmp_path / "t.jsonl", running=2, waiting=1)
    assert _stalls(tmp_path / "t.jsonl") == [("c", "preemption", "queued")]
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    (c,) = [s for s in rep.spikes if s.request_id == "c"]
    assert "ran 2 request(s) and queued 1" in " ".join(c.evidence)


def test_room_in_the_batch_says_nothing(tmp_path):
    """Three running: c was in the batch (its tokens held somewhere after the engine), not queued."""
    _write(tmp_path / "t.jsonl", running=3, waiting=1)
    assert _stalls(tmp_path / "t.jsonl") == [("c", "unknown", "lone")]


def test_a_queue_of_new_requests_is_no_victim(tmp_path):
    """One waiting, but a request kvtop sees had arrived without its first token: the queue may be it."""
    _write(tmp_path / "t.jsonl", running=2, waiting=1, pending_arrival=3.1)
    assert _stalls(tmp_path / "t.jsonl") == [("c", "unknown", "lone")]


def test_everyone_queued(tmp_path):
    """Every stream silent with nothing running and all three queued: all three were preempted."""
    _write(tmp_path / "t.jsonl", running=0, waiting=3, everyone_silent=True)
    assert _stalls(tmp_path / "t.jsonl") == [(r, "preemption", "queued") for r in ("a", "b", "c")]


def test_both_paths_agree(tmp_path):
    _write(tmp_path / "t.jsonl", running=2, waiting=1)
    fast = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1, fast=True)
    slow = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1, fast=False)
    assert [(s.request_id, s.t_end, s.cause, s.rule) for s in fast.spikes] == \
        [(s.request_id, s.t_end, s.cause, s.rule) for s in slow.spikes]
