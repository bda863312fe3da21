"""The generator's truth labels a spike as the witness does on the real vLLM: a request the engine
preempted between the spike's two tokens stalled for its preemption, whatever else overlapped."""

from __future__ import annotations

import json

from eval.truth import label_span, truth_intervals


def _trace(tmp_path, victim_end: float | None) -> str:
    """One stream, held 11.77-14.66 s by a slow reader; the engine preempted it at 12.0 s."""
    recs = [{"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-04T00:00:00Z"},
            {"kind": "truth", "t": 12.0, "event": "victim", "request_id": "r",
             "data": {"t_preempt": 12.0, "t_end": victim_end, "outcome": "resumed" if victim_end else "cancelled"}},
            {"kind": "truth", "t": 14.66, "event": "stall", "request_id": "r",
             "data": {"t_start": 11.77, "t_end": 14.66, "cause": "slow_reader", "hold_s": 2.89}}]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(p)


def test_a_hold_that_hid_a_victims_wait_is_the_preemptions(tmp_path):
    truth = truth_intervals(_trace(tmp_path, 12.4))
    # 0.4 s of the 2.9 s silence were the engine's preemption: the hold overlaps more, the log says preempted
    assert label_span("r", 11.77, 14.66, truth) == "preemption"
    # a gap of the same hold after the victim resumed is the reader's
    assert label_span("r", 12.5, 14.66, truth) == "slow_reader"
    # a victim window that reaches 1 ms into the gap is the clocks' offset, not a preemption inside it
    assert label_span("r", 12.399, 14.66, truth) == "slow_reader"


def test_a_victim_never_resumed_is_preempted_to_the_end(tmp_path):
    truth = truth_intervals(_trace(tmp_path, None))
    assert label_span("r", 13.0, 14.66, truth) == "preemption"


def test_a_token_made_before_the_preemption_and_held_back_closes_no_preemption(tmp_path):
    """The API server held the stream 4.65-5.70 s; the engine preempted it at 5.10 s and resumed it at
    20.74 s. The burst at 5.70 s carried tokens made before 5.10 s: the witness maps that chunk to the
    step that made its last token, before the preemption, so the gap 4.65-5.70 s is the hold's (it
    overlaps 0.6 s of the victim's wait), and the preemption is the gap that ends with the resume's token."""
    recs = [{"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-04T00:00:00Z"},
            {"kind": "truth", "t": 5.097, "event": "victim", "request_id": "r",
             "data": {"t_preempt": 5.097, "t_end": 20.7359, "outcome": "resumed"}},
            {"kind": "truth", "t": 5.7023, "event": "stall", "request_id": "r",
             "data": {"t_start": 4.6488, "t_end": 5.7023, "cause": "api_stall", "hold_s": 1.041}}]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    truth = truth_intervals(str(p))
    assert label_span("r", 4.6488, 5.7023, truth) == "api_stall"
    assert label_span("r", 5.7023, 20.7363, truth) == "preemption"


def test_a_victim_resumed_within_the_target_inside_a_hold_did_not_break_it(tmp_path):
    """The witness's rule, given the ITL target: a preemption the victim waited out within the target,
    in a gap that misses the target without that wait, broke no target (real vLLM's round E: a
    stream preempted and back within 60 ms of a 305 ms gap whose 77 tokens reached the client in one
    chunk)."""
    truth = truth_intervals(_trace(tmp_path, 12.06))  # preempted 12.00-12.06 s inside the 2.9 s hold
    assert label_span("r", 11.77, 14.66, truth) == "preemption"  # no target given: as before
    assert label_span("r", 11.77, 14.66, truth, target=0.1) == "slow_reader"
    # a wait over the target is the preemption's whatever held the stream too
    assert label_span("r", 11.77, 14.66, truth, target=0.05) == "preemption"
    # ... as is one without which the gap would have met the target
    assert label_span("r", 11.99, 12.1, truth, target=0.1) == "preemption"


def test_a_preemption_waited_out_within_the_target_does_not_come_back_as_the_longest_overlap(tmp_path):
    """kvtop's simulator writes a preemption as a ``resume`` with its span: one the victim waited out
    within the target, alone in the gap, leaves the gap no cause (it is not the overlap's winner)."""
    p = tmp_path / "t.jsonl"
    recs = [{"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-04T00:00:00Z"},
            {"kind": "truth", "t": 12.06, "event": "resume", "request_id": "r", "data": {"t_start": 12.0, "t_end": 12.06}}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    truth = truth_intervals(str(p))
    assert label_span("r", 11.77, 14.66, truth) == "preemption"
    assert label_span("r", 11.77, 14.66, truth, target=0.1) is None
