"""A first token that a later request overtook is no prefill at the stall's end, on an engine that admits
prompts in arrival order: a burst of arrivals is prefilled together, and a straggler whose first token the
API server delivered a step after the others' ends the next decode step's gap without any prefill in it
(real vLLM's own step log, the recompute storms' first seconds: docs/real-engines.md 7.15)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtop.analysis.scan import analyze_trace
from tests.trace_files import decoding_streams, write_trace

STEP = 0.005
TARGET = 0.012
STALL = (2.000, 2.030)  # the decode step after the burst's prefill: 30 ms, no prompt in it
BURST = 1.9  # when the two prompts arrived: the straggler first, then the one that overtook it


def _write(path: Path, adapter: str, classes: tuple[str | None, str | None] = (None, None)) -> None:
    recs: list[dict] = []
    times = [1.0 + STEP * k for k in range(201)] + [STALL[1] + STEP * k for k in range(200)]
    decoding_streams(recs, times, 0.5, 3.1)
    # the straggler's first token came out of the step that ended at 1.995, with the overtaker's, but
    # reached the client only with the next step's tokens, at the stall's end
    for rid, arrive, first, cls in (("late", BURST, STALL[1] + 0.0008, classes[0]),
                                    ("early", BURST + 0.0005, 1.9952, classes[1])):
        rec = {"kind": "request", "t": arrive, "id": rid, "event": "arrive", "source": "proxy"}
        if cls:
            rec["class"] = cls
        recs.append(rec)
        recs.append({"kind": "request", "t": first, "id": rid, "event": "first_token", "n": 1})
        recs += [{"kind": "request", "t": first + STEP * k, "id": rid, "event": "token", "n": 1} for k in range(1, 100)]
        recs.append({"kind": "request", "t": 3.1, "id": rid, "event": "finish", "completion_tokens": 100})
    for k in range(7):
        t = 0.25 + 0.5 * k
        recs.append({"kind": "engine", "t": t, "adapter": adapter, "url": "http://127.0.0.1:8000", "engine": "0",
                     "up": True, "kv_usage": 0.2, "running": 3 if t < BURST else 5, "waiting": 0,
                     "preemptions_total": 0})
    header = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-04T00:00:00Z",
              "engine": {"adapter": adapter, "url": "http://127.0.0.1:8000"}, "interval_s": 0.5}
    write_trace(path, header, recs)


def _spikes(tmp_path: Path, adapter: str, classes: tuple[str | None, str | None] = (None, None)) -> list:
    _write(tmp_path / "t.jsonl", adapter, classes)
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=TARGET)
    got = [s for s in rep.spikes if s.request_id in ("a", "b", "c") and abs(s.t_end - STALL[1]) < 0.002]
    assert got, "the stall must be a spike of the decoding streams"
    return got


def _calls(tmp_path: Path, adapter: str, classes: tuple[str | None, str | None] = (None, None)) -> set[str]:
    return {s.cause for s in _spikes(tmp_path, adapter, classes)}


def test_a_straggler_that_a_later_arrival_overtook_is_no_prefill_on_vllm(tmp_path):
    # vLLM admits its waiting queue in arrival order: the straggler was prefilled with the overtaker
    spikes = _spikes(tmp_path, "vllm")
    assert {s.cause for s in spikes} == {"unknown"}
    # the answer says which first token it did not count, and why
    for s in spikes:
        assert any(line.startswith("request late's first token came at its end, but request early, which arrived "
                                   "after it, had its first token before the stall began") for line in s.evidence), s.evidence


def test_an_engine_that_may_reorder_keeps_the_first_token_as_the_stalls_prefill(tmp_path):
    # SGLang's longest-prefix-match policy may admit a later prompt first: the straggler's prefill may
    # have been in the stall
    assert _calls(tmp_path, "sglang") == {"prefill_interference"}


@pytest.mark.parametrize("classes", [("batch", "interactive"), ("batch", None)])
def test_an_overtaker_of_another_class_proves_nothing(tmp_path, classes):
    # a priority policy admits the interactive class first, whenever it came
    assert _calls(tmp_path, "vllm", classes) == {"prefill_interference"}
