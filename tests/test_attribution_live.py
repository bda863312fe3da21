"""LiveAnalyzer: same answers as the batch analysis, fed record by record through the Core."""

from __future__ import annotations

import pytest

from kvtop.analysis.live import LiveAnalyzer
from kvtop.core import Core
from kvtop.model.records import from_dict
from tests.test_attribution import engine_records, run, stream_records


def _records():
    recs = stream_records(silent={"r3": (4.0, 6.0)}) + engine_records(
        kv=0.97, pre_steps=(6.5,), run_drop=((4.4, 6.1),), wait_rise=((4.4, 6.1),))
    return sorted(recs, key=lambda d: d["t"])


def test_live_matches_batch_through_core():
    live = LiveAnalyzer(adapter="vllm", model="meta-llama/Llama-3.1-8B-Instruct")
    core = Core(analysis=live)
    seen_before_settle = None
    for d in _records():
        core.ingest(from_dict(d))
        if d["t"] >= 6.5 and seen_before_settle is None:
            seen_before_settle = live.request_info("r3")
    # the stall ended at 6.0 but its evidence window (counter at resume) was still open at 6.5
    assert seen_before_settle == (0, 0, None)
    snap = core.snapshot(now=10.0)
    rep = snap.analysis
    assert [(s.request_id, s.cause) for s in rep.spikes] == [("r3", "preemption")]
    row = next(r for r in snap.requests if r.id == "r3")
    assert (row.spikes, row.preempt_spikes, row.last_cause) == (1, 1, "preemption")
    batch = run(_records())
    assert [(g.request_id, g.cause, round(g.confidence, 3)) for g in batch.spikes] == \
        [(s.request_id, s.cause, s.confidence) for s in rep.spikes]
    assert set(rep.to_dict()) >= {"spikes", "causes", "requests", "verdict"}


def test_live_memory_is_bounded():
    live = LiveAnalyzer(max_requests=50, keep_spikes=20, itl_target_s=0.01)
    t = 0.0
    for i in range(2000):  # 2,000 short requests, each with one long gap
        rid = f"q{i}"
        live.feed(from_dict({"kind": "request", "t": t, "id": rid, "event": "first_token", "n": 1}))
        live.feed(from_dict({"kind": "request", "t": t + 0.5, "id": rid, "event": "token", "n": 1}))
        live.feed(from_dict({"kind": "request", "t": t + 0.5, "id": rid, "event": "finish"}))
        t += 0.5
    rep = live.report(t + 10)
    assert len(live.an.reqs) <= 50
    assert len(rep.spikes) == 20 and rep.spikes_total == 2000
    assert len(live.an.gaps.stalls.long) - live.an.gaps.stalls.long_head < 2000  # old evidence pruned


def test_live_report_is_cached_between_ticks():
    live = LiveAnalyzer(adapter="vllm")
    assert live.report(0.0) is None
    for d in _records()[:200]:
        live.feed(from_dict(d))
    a = live.report(1.0)
    assert live.report(1.5) is a  # same second: no rebuild
    assert live.report(3.0) is not a


def test_live_analysis_lag_is_the_age_of_the_oldest_spike_waiting_for_its_evidence():
    # what `kvtop agent` publishes as kvtop_analysis_lag_seconds
    live = LiveAnalyzer(adapter="vllm", model="meta-llama/Llama-3.1-8B-Instruct")
    core = Core(analysis=live)
    for d in _records():
        if d["t"] > 6.3:
            break
        core.ingest(from_dict(d))
    # r3's stall ended at 6.0; the counter that would confirm it is read at 6.5: it still waits
    assert live.lag(6.3) == pytest.approx(0.3, abs=0.02)
    for d in _records():
        if d["t"] > 6.3:
            core.ingest(from_dict(d))
    core.snapshot(now=10.0)  # judged once its window closed
    assert live.lag(10.0) == 0.0
