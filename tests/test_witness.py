"""The engine's witness: step accounting, the witness file and its reader, and exact causes in the analysis.

The vLLM glue itself (kvtop.witness.vllm) runs inside a real vLLM in tests/integration/test_real_vllm_witness.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtop.analysis.scan import analyze_trace
from kvtop.analysis.witness import StepIndex
from kvtop.sources.witness import WitnessError, WitnessReader, client_id
from kvtop.witness.steplog import StepBook, StepLog


def test_step_book_splits_prompt_decode_and_recompute():
    book = StepBook()
    # a 100-token prompt in two chunks, then decode
    # (id, scheduled, prefill, recompute)
    assert book.plan("a", 0, 64, 100) == ("a", 64, 64, 0)
    assert book.plan("a", 64, 36, 100) == ("a", 36, 36, 0)
    assert book.plan("a", 100, 1, 100) == ("a", 1, 0, 0)
    book.plan("a", 101, 1, 100)  # high-water 102
    # preempted: vLLM resets computed tokens to 0 and schedules everything known again
    assert book.plan("a", 0, 103, 100) == ("a", 103, 0, 102)
    # resumed after a prefix-cache hit of 64 tokens: only the rest is recomputed
    book2 = StepBook()
    book2.plan("b", 0, 200, 200)
    assert book2.plan("b", 64, 137, 200) == ("b", 137, 0, 136)
    # preempted in the middle of its prompt: what was never computed is still prefill
    book3 = StepBook()
    book3.plan("c", 0, 50, 300)
    assert book3.plan("c", 0, 120, 300) == ("c", 120, 70, 50)


def test_rejected_drafts_rolled_back_are_no_recompute_but_a_resume_is():
    book = StepBook()
    book.plan("a", 0, 100, 100)
    # a decode step with 4 speculative tokens: positions 100-104; 2 rejected, vLLM rolls back to 102
    assert book.plan("a", 100, 5, 100, drafts=4) == ("a", 5, 0, 0)
    assert book.plan("a", 103, 5, 100, drafts=4) == ("a", 5, 0, 0)  # was recompute 2: read as a preemption
    # a request preempted and back from its prefix cache 3 positions short is recompute, drafts or not
    assert book.plan("a", 105, 3, 100, resumed=True) == ("a", 3, 0, 3)


class _FakeScheduler:
    """The vLLM scheduler methods the witness wraps, with its bookkeeping reduced to a dict."""

    def __init__(self) -> None:
        self.requests: dict[str, object] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []

    def _update_after_schedule(self, so: object) -> None:
        for rid, n in so.num_scheduled_tokens.items():  # type: ignore[attr-defined]
            self.requests[rid].num_computed_tokens += n  # type: ignore[attr-defined]

    def update_from_output(self, so: object, mro: object) -> dict:
        return mro  # type: ignore[return-value]

    def finish_requests(self, ids: list[str], status: object) -> list[object]:
        return [self.requests.pop(r) for r in ids if r in self.requests]

    def shutdown(self) -> None:
        pass


def _glue(tmp_path):
    from types import SimpleNamespace as NS

    from kvtop.witness.vllm import _Witness

    class W(_Witness, _FakeScheduler):
        pass

    w = W()
    w._kvw_init(str(tmp_path / "w.jsonl"), "0.32.0", 16)
    return w, NS


def test_a_request_async_scheduling_planned_after_it_finished_takes_no_number(tmp_path):
    # async scheduling plans step N+1 before step N's output: a request that N ends on a stop token
    # is in N+1's plan and vLLM skips it; the witness gave it a new number, never given back, and the
    # once-a-second map grew by one such number per stop-finished request, for ever
    w, NS = _glue(tmp_path)
    for i in range(50):
        rid = f"r{i}"
        w.requests[rid] = NS(num_computed_tokens=0, num_prompt_tokens=4, num_preemptions=0)
        empty = NS(resumed_req_ids=())
        s1 = NS(num_scheduled_tokens={rid: 4}, scheduled_cached_reqs=empty, preempted_req_ids=(), scheduled_new_reqs=())
        s2 = NS(num_scheduled_tokens={rid: 1}, scheduled_cached_reqs=empty, preempted_req_ids=(), scheduled_new_reqs=())
        w._update_after_schedule(s1)
        w._update_after_schedule(s2)  # planned before s1's output is in
        out = NS(request_id=rid, new_token_ids=[7], finish_reason="stop")
        w.update_from_output(s1, {0: NS(outputs=[out])})
        del w.requests[rid]  # vLLM frees the finished request
        w.update_from_output(s2, {0: NS(outputs=[])})
    assert w._kvw is not None and w._kvw._handles == {} and w._kvw_book.high == {}
    w.shutdown()


def test_an_error_finish_is_no_client_abort(tmp_path):
    w, NS = _glue(tmp_path)
    w.requests["e"] = NS(request_id="e")
    w.requests["c"] = NS(request_id="c")
    w.finish_requests(["e"], NS(name="FINISHED_ERROR"))
    w.finish_requests(["c"], NS(name="FINISHED_ABORTED"))
    assert w._kvw_aborted == ["c"]
    w.shutdown()


def test_a_resumed_request_model_runner_v2_schedules_as_new_is_still_resumed(tmp_path):
    w, NS = _glue(tmp_path)
    w.requests["v"] = NS(num_computed_tokens=64, num_prompt_tokens=100, num_preemptions=1)
    so = NS(num_scheduled_tokens={"v": 40}, scheduled_cached_reqs=NS(resumed_req_ids=()), preempted_req_ids=(),
            scheduled_new_reqs=[NS(req_id="v")])
    w._kvw_book.high["v"] = 104  # it had 104 positions before its preemption
    w._update_after_schedule(so)
    _t, plans, _pre, resumed, restored = w._kvw_plans[id(so)]
    assert resumed == ["v"] and restored == [("v", 64)] and plans == [("v", 40, 0, 40)]
    w.shutdown()


def _write_steps(path: Path, t0: float, steps: list[dict]) -> None:
    log = StepLog(str(path), "vllm", "0.32.0")
    for s in steps:
        log.step(t0 + s["t0"], t0 + s["t1"], s["r"], s.get("pre", []), s.get("res", []), [], [])
    log.close()


def test_a_step_line_is_json_with_requests_by_number_and_odd_ids_escaped(tmp_path):
    p = tmp_path / "w.jsonl"
    log = StepLog(str(p), "vllm", "0.32.0")
    log.step(10.0, 10.25, [('we"ird\\id', 1, 0, 0, 1), ("b", 64, 64, 0, 1), ("c", 1, 0, 0, 0)], ["x"], [],
             [("b", "length")], [])
    log.step(10.25, 10.5, [('we"ird\\id', 1, 0, 0, 1), ("c", 1, 0, 0, 1)], [], [], [], [])
    log.step(11.5, 11.6, [("c", 1, 0, 0, 1)], [], [], [], [])
    log.close()
    first, second, third = (json.loads(x) for x in p.read_text().splitlines()[1:])
    names = {1: 'we"ird\\id', 2: "b", 3: "c", 4: "x"}
    assert {int(k): v for k, v in first["n"].items()} == names
    assert first["d"] == [1] and first["r"] == [[2, 64, 64, 0, 1], [3, 1, 0, 0, 0]]
    assert first["pre"] == [4] and first["fin"] == [[2, "length"]]
    assert second == {"t0": 10.25, "t1": 10.5, "d": [1, 3]}  # known requests: numbers only
    # a second later the map of the running requests is repeated (b finished and left it)
    assert {int(k): v for k, v in third["m"].items()} == {1: 'we"ird\\id', 3: "c", 4: "x"}
    recs = WitnessReader(str(p), 0.0, from_start=True).read()
    assert recs[0].reqs == [['we"ird\\id', 1, 0, 0, 1], ["b", 64, 64, 0, 1], ["c", 1, 0, 0, 0]]
    assert recs[0].preempted == ["x"] and recs[0].finished == [["b", "length"]]
    # a reader that starts after the first line learns the numbers from the repeated map
    late = WitnessReader(str(p), 0.0, from_start=True)
    got = [late.parse(x.encode()) for x in p.read_text().splitlines()[2:]]
    assert got[0] is not None and got[0].reqs == [] and late.unnamed == 2
    assert got[1] is not None and got[1].reqs == [["c", 1, 0, 0, 1]]


def test_reader_maps_ids_and_clock_and_follows_rollover(tmp_path):
    p = tmp_path / "w.jsonl"
    log = StepLog(str(p), "vllm", "0.32.0", max_bytes=700)
    for i in range(8):
        rid = f"cmpl-abc{i}-0-0123abcd"
        log.step(1000.0 + i, 1000.5 + i, [(rid, 1, 0, 0, 1)], [], [], [(rid, "stop")], [])
    log.close()
    assert (tmp_path / "w.jsonl.1").exists()  # rolled over at 700 bytes
    r = WitnessReader(str(p), wall_zero=990.0, engine="http://127.0.0.1:8000", from_start=True)
    recs = r.read()
    assert recs and all(rec.reqs[0][0].startswith("abc") for rec in recs)
    assert recs[0].t == pytest.approx(recs[0].end - 0.5)
    assert recs[-1].end == pytest.approx(17.5)
    assert client_id("chatcmpl-9f8e-0123abcd") == "9f8e"
    assert client_id("not-a-vllm-id") == "not-a-vllm-id"


def test_a_rolled_over_file_is_read_on_at_once_even_on_an_idle_engine(tmp_path):
    p = tmp_path / "w.jsonl"
    log = StepLog(str(p), "vllm", "0.32.0", max_bytes=400)
    r = WitnessReader(str(p), 0.0)
    assert r.read() == []
    for i in range(6):  # rolls over; the last step leaves the engine idle
        log.step(100.0 + i, 100.1 + i, [(f"q{i}", 1, 0, 0, 1)], [], [], [], [], idle=True)
    # the new file's header is on disk at once (it waited for the next flush, and the reader that met
    # the empty file gave up on the witness for the rest of the run)
    assert p.read_bytes().startswith(b'{"format":"kvtop-witness"')
    assert r.read() is not None and r.header is not None
    log.step(200.0, 200.1, [("z", 1, 0, 0, 1)], [], [], [], [], idle=True)
    assert [rec.reqs for rec in r.read()][-1] == [["z", 1, 0, 0, 1]]
    log.close()
    # a file just created, its header not yet written: not yet a witness, not "not a witness"
    empty = tmp_path / "e.jsonl"
    empty.write_bytes(b"")
    assert WitnessReader(str(empty), 0.0).read() == []


def test_an_engine_restarted_on_the_same_file_gives_its_own_limits(tmp_path):
    p = tmp_path / "w.jsonl"
    StepLog(str(p), "vllm", "0.32.0", extra={"limits": {"max_num_seqs": 256}}).close()
    log = StepLog(str(p), "vllm", "0.32.0", extra={"limits": {"max_num_seqs": 9}})  # restarted, appended
    r = WitnessReader(str(p), 0.0)
    assert r.read() == []
    log.step(10.0, 10.1, [("a", 1, 0, 0, 1)], [], [], [("a", "stop")], [], idle=True)
    [rec] = r.read()
    assert rec.limits == {"max_num_seqs": 9}  # the advice was applied: not the old engine's 256
    assert r.names == {}  # a finished request's number is dropped (the map grew for days)
    log.close()


def test_reader_tails_new_lines_and_skips_torn_ones(tmp_path):
    p = tmp_path / "w.jsonl"
    _write_steps(p, 100.0, [{"t0": 0, "t1": 0.01, "r": [["x", 1, 0, 0, 1]]}])
    r = WitnessReader(str(p), wall_zero=100.0)
    assert r.read() == []  # steps from before the run are not the run's
    with open(p, "a") as f:
        f.write('{"t0": 100.5, "t1": 100.6, "r": [["x", 1, 0, 0, 1]]}\n{"t0": 1')
    got = r.read()
    assert [g.t for g in got] == [0.5]
    with open(p, "a") as f:
        f.write('01.0, "t1": 101.1, "r": [["x", 1, 0, 0, 1]]}\nnot json\n')
    got = r.read()
    assert [g.t for g in got] == [1.0] and r.skipped == 1


def test_a_file_that_is_not_a_witness_is_refused(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_text('{"kind": "header", "format": "kvtop-trace"}\n')
    with pytest.raises(WitnessError):
        WitnessReader(str(p), 0.0).read()
    r = subprocess.run([sys.executable, "-m", "kvtop", "record", "-o", str(tmp_path / "o.jsonl"), "--url",
                        "http://127.0.0.1:9", "--witness", str(p), "--duration", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a kvtop witness file" in r.stderr and "Traceback" not in r.stderr


def test_a_witness_file_not_there_yet_is_waited_for_and_said(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvtop", "snapshot", "--url", "http://127.0.0.1:9", "--witness",
                        str(tmp_path / "w.jsonl"), "--duration", "0.2", "--no-gpu", "--no-host"],
                       capture_output=True, text=True, timeout=60)
    # the dead engine fails the run, but first the missing file is said (a typo went unnoticed)
    assert f"kvtop: warning: --witness {tmp_path / 'w.jsonl'} does not exist yet" in r.stderr, r.stderr


def test_record_never_overwrites_the_witness_file_it_reads(tmp_path):
    p = tmp_path / "w.jsonl"
    _write_steps(p, 100.0, [{"t0": 0, "t1": 0.01, "r": [["x", 1, 0, 0, 1]]}])
    before = p.read_bytes()
    r = subprocess.run([sys.executable, "-m", "kvtop", "record", "-o", str(p), "--force", "--url",
                        "http://127.0.0.1:9", "--witness", str(p), "--duration", "1", "--no-gpu", "--no-host"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is the --witness file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert p.read_bytes() == before  # --force deleted the engine's witness and wrote the trace there


HEADER = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-02T00:00:00Z",
          "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "interval_s": 1.0}


def _trace(path: Path, steps: list[dict], extra: list[dict]) -> None:
    """Two streams, a and b, decoding at 20 ms a token from t=1; ``steps`` are the engine's steps."""
    recs: list[dict] = []
    for rid in ("a", "b"):
        recs.append({"kind": "request", "t": 0.5, "id": rid, "event": "arrive", "source": "proxy"})
    recs += extra
    recs += [{"kind": "step", "engine": "http://127.0.0.1:8000", **s} for s in steps]
    recs.sort(key=lambda d: d["t"])
    with open(path, "w") as f:
        f.write(json.dumps(HEADER) + "\n")
        for d in recs:
            f.write(json.dumps(d) + "\n")


def _decode(rid: str, times: list[float]) -> list[dict]:
    out = [{"kind": "request", "t": times[0], "id": rid, "event": "first_token", "n": 1}]
    out += [{"kind": "request", "t": t, "id": rid, "event": "token", "n": 1} for t in times[1:]]
    return out


def _steps(ts: list[float], reqs_at, dur: float = 0.018) -> list[dict]:
    return [{"t": round(t - dur, 6), "end": round(t - 0.001, 6), "reqs": reqs_at(t)} for t in ts]


def test_witness_gives_each_spike_its_logged_cause_with_confidence_one(tmp_path):
    """Four stalls of 300 ms on stream a, each with a different story in the engine's log."""
    base = [1.0 + 0.02 * i for i in range(50)]  # 1.00 .. 1.98
    a_times = base + [2.3] + [2.3 + 0.02 * i for i in range(1, 20)]  # stall 1 ends at 2.30 (prefill by c)
    a_times += [a_times[-1] + 0.3] + [a_times[-1] + 0.3 + 0.02 * i for i in range(1, 20)]  # stall 2: preempted
    a_times += [a_times[-1] + 0.3] + [a_times[-1] + 0.3 + 0.02 * i for i in range(1, 20)]  # stall 3: outside
    a_times += [a_times[-1] + 0.3] + [a_times[-1] + 0.3 + 0.02 * i for i in range(1, 20)]  # stall 4: slow steps
    stalls = [(a_times[i - 1], a_times[i]) for i in range(1, len(a_times)) if a_times[i] - a_times[i - 1] > 0.2]
    assert len(stalls) == 4
    (s1a, s1b), (s2a, s2b), (s3a, s3b), (s4a, s4b) = stalls
    steps = _steps(a_times, lambda t: [["a", 1, 0, 0, 1]])
    # stall 1: one 280 ms step in which c's 2,000-token prompt ran beside a's decode
    big = [s for s in steps if s["end"] == round(s1b - 0.001, 6)][0]
    big["t"] = round(s1a + 0.001, 6)
    big["reqs"] = [["a", 1, 0, 0, 1], ["c", 2000, 2000, 0, 1]]
    # stall 2: a preempted in the first step after its token, recomputed in the step that ends the stall
    pre_t = s2a + 0.02
    steps.append({"t": round(pre_t - 0.018, 6), "end": round(pre_t, 6), "reqs": [["b", 1, 0, 0, 1]], "preempted": ["a"]})
    # stall 3: the engine made a's next token 20 ms after the last one; the client got it 300 ms later
    late = [s for s in steps if s["end"] == round(s3b - 0.001, 6)][0]
    late["t"], late["end"] = round(s3a + 0.002, 6), round(s3a + 0.019, 6)
    # stall 4: the engine's own decode: one 300 ms step with decode tokens only
    slow = [s for s in steps if s["end"] == round(s4b - 0.001, 6)][0]
    slow["t"] = round(s4a + 0.001, 6)
    steps.sort(key=lambda s: s["t"])
    b_times = [1.01 + 0.02 * i for i in range(int((a_times[-1] - 1.0) / 0.02))]
    _trace(tmp_path / "t.jsonl", steps, _decode("a", a_times) + _decode("b", b_times))
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    got = {(round(s.t_end, 3)): (s.cause, s.rule, s.confidence) for s in rep.spikes if s.request_id == "a"}
    assert got[round(s1b, 3)] == ("prefill_interference", "witness", 1.0)
    assert got[round(s2b, 3)] == ("preemption", "witness", 1.0)
    assert got[round(s3b, 3)] == ("unknown", "witness", 1.0)
    assert got[round(s4b, 3)] == ("slow_decode", "witness", 1.0)
    # the same trace without the engine's log: inferred, and never at confidence 1.0
    lines = [ln for ln in (tmp_path / "t.jsonl").read_text().splitlines() if '"kind": "step"' not in ln]
    (tmp_path / "n.jsonl").write_text("\n".join(lines) + "\n")
    rep2 = analyze_trace(str(tmp_path / "n.jsonl"), itl_target_s=0.1)
    assert rep2.spikes and all(s.rule != "witness" and (s.confidence or 0) < 1.0 for s in rep2.spikes)


def test_the_report_says_how_many_spikes_were_tokens_held_outside_the_engine(tmp_path):
    """Stream a at 20 ms a token: once the engine made three of its tokens on pace and the client got
    them in one chunk 60 ms after the one before (held), once one 300 ms step made its token (slow
    decode). At a 50 ms target the report says which of its unknowns the engine's log put outside its
    steps, in text and JSON; without the log it says nothing of the kind."""
    a_times = [1.0 + 0.02 * i for i in range(50)]  # 1.00 .. 1.98
    made = a_times + [a_times[-1] + 0.02 * i for i in (1, 2, 3)]  # the engine's: 2.00, 2.02, 2.04
    a_times += [made[-1] + 0.001] + [made[-1] + 0.001 + 0.02 * i for i in range(1, 20)]  # client: one chunk
    made += a_times[-19:]
    made += [made[-1] + 0.3] + [made[-1] + 0.3 + 0.02 * i for i in range(1, 10)]  # one 300 ms step
    a_times += made[-10:]
    steps = _steps(made, lambda t: [["a", 1, 0, 0, 1]])
    slow = [st for st in steps if st["end"] == round(made[-10] - 0.001, 6)][0]
    slow["t"] = round(made[-11] + 0.001, 6)
    _trace(tmp_path / "t.jsonl", steps, _decode("a", a_times))
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.05)
    assert sorted(str(s.cause) for s in rep.spikes) == ["slow_decode", "unknown"]
    assert rep.held_spikes == 1 and rep.to_dict()["held_spikes"] == 1
    out = subprocess.run([sys.executable, "-m", "kvtop", "analyze", str(tmp_path / "t.jsonl"), "--itl-target-ms", "50"],
                         capture_output=True, text=True, timeout=60).stdout
    assert ("engine step log (witness): 1 of the 2 spikes were tokens the engine made on pace that reached the "
            "client in one chunk") in out
    lines = [ln for ln in (tmp_path / "t.jsonl").read_text().splitlines() if '"kind": "step"' not in ln]
    (tmp_path / "n.jsonl").write_text("\n".join(lines) + "\n")
    rep2 = analyze_trace(str(tmp_path / "n.jsonl"), itl_target_s=0.05)
    assert rep2.spikes and rep2.held_spikes is None and rep2.to_dict()["held_spikes"] is None

def test_the_request_detail_shows_the_engines_steps_and_its_preemption():
    from kvtop.core import Core
    from kvtop.model.records import RequestRecord, StepRecord
    from kvtop.views.tui import render

    core = Core(itl_target_s=0.1)
    core.ingest(RequestRecord(t=0.0, id="r1", event="arrive"))
    core.ingest(StepRecord(0.0, 0.1, None, [["r1", 40, 40, 0, 1]]))
    core.ingest(RequestRecord(t=0.1, id="r1", event="first_token", n=1))
    for i in range(1, 10):
        core.ingest(StepRecord(0.1 + 0.02 * i, 0.12 + 0.02 * i, None, [["r1", 1, 0, 0, 1]]))
        core.ingest(RequestRecord(t=0.12 + 0.02 * i, id="r1", event="token", n=1))
    core.ingest(StepRecord(0.31, 0.33, None, [["other", 1, 0, 0, 1]], preempted=["r1"]))
    core.ingest(StepRecord(0.9, 1.0, None, [["r1", 50, 0, 49, 1]], resumed=["r1"]))
    core.ingest(RequestRecord(t=1.0, id="r1", event="token", n=1))
    tl = core.request_timeline("r1")
    assert tl is not None
    assert tl.marks == ((0.31, "preempt"), (0.9, "resume"))
    assert [k for _a, _b, k in tl.steps] == ["p"] + ["d"] * 9 + ["r"]
    snap = core.snapshot()
    text = render.detail(snap.requests[0], tl, [], 0.1, snap.t, 100)
    steps_row = next(ln for ln in text.splitlines() if ln.startswith("steps  │"))
    assert "R" in steps_row and "p" in steps_row


def _index(durs: list[tuple[float, list[list]]]) -> tuple[StepIndex, list[float]]:
    """Steps back to back from t=1, each (duration, reqs); returns the index and the steps' ends."""
    idx, t, ends = StepIndex(), 1.0, []
    for d, reqs in durs:
        idx.add({"t": t, "end": t + d, "reqs": reqs})
        t += d
        ends.append(t)
    return idx, ends


def test_a_steps_prefill_cost_is_its_time_beyond_a_decode_step_of_that_moment():
    """A host that slows the whole engine makes every step long: a prompt riding in one of them is
    not why that step was long when the decode-only steps beside it took as long."""
    dec = [["a", 1, 0, 0, 1]]
    with_prompt = [["a", 1, 0, 0, 1], ["c", 53, 53, 0, 1]]
    # 30 fast decode steps (8 ms), then the engine slows: 8 decode steps of 130 ms, and then the
    # step that also runs c's 53-token prompt takes 135 ms
    idx, ends = _index([(0.008, dec)] * 30 + [(0.130, dec)] * 8 + [(0.135, with_prompt), (0.130, dec)])
    acct = idx.account("a", ends[-3] + 0.001, ends[-2] + 0.001, target=0.1)
    assert acct is not None and acct.cause.value == "slow_decode"
    assert acct.prefill_s == pytest.approx(0.005, abs=1e-6) and acct.decode_step_s == pytest.approx(0.130)
    # the same 135 ms step on an engine that decodes in 8 ms: 127 ms of it were the prompt's
    idx, ends = _index([(0.008, dec)] * 30 + [(0.135, with_prompt), (0.008, dec)])
    acct = idx.account("a", ends[-3] + 0.001, ends[-2] + 0.001, target=0.1)
    assert acct is not None and acct.cause.value == "prefill_interference"
    assert acct.prefill_s == pytest.approx(0.127, abs=1e-6) and acct.decode_step_s == pytest.approx(0.008)


def test_tokens_the_engine_made_on_pace_and_the_client_got_in_one_chunk_are_no_slow_decode():
    """Real vLLM on round AB's mixed load (13.2 ms target, 6 ms decode steps): the engine made three
    tokens of a stream 6-7 ms apart and its client got them in one chunk 20 ms after the one before (the
    API server holds back a token whose text is incomplete). The engine never left the stream waiting
    past the target: the gap was the tokens' wait outside its steps, not its decode (before: slow_decode,
    at confidence 1.0, which points an operator at the batch size)."""
    dec = [["a", 1, 0, 0, 1]]
    idx, ends = _index([(0.006, dec)] * 20 + [(0.0065, dec)] * 3)
    acct = idx.account("a", ends[-4] + 0.001, ends[-1] + 0.0012, target=0.0132)
    assert acct is not None and acct.cause.value == "unknown" and acct.kind == "held"
    assert (acct.made, round(acct.longest_s * 1e3, 1)) == (3, 6.5)
    f = acct.finding()
    assert f.kind == "witness" and f.confidence == 1.0
    assert f.lines[1].startswith("the engine made 3 of this request's tokens in the gap, never more than 6 ms apart")
    # one step that took as long, making one token: the engine's own decode
    idx, ends = _index([(0.006, dec)] * 20 + [(0.0195, dec)])
    acct = idx.account("a", ends[-2] + 0.001, ends[-1] + 0.0012, target=0.0132)
    assert acct is not None and acct.cause.value == "slow_decode"
    # three tokens, but the engine left the stream 14 ms without one (over the target) between them
    idx, ends = _index([(0.006, dec)] * 20 + [(0.003, dec), (0.014, dec), (0.003, dec)])
    acct = idx.account("a", ends[-4] + 0.001, ends[-1] + 0.0012, target=0.0132)
    assert acct is not None and acct.cause.value == "slow_decode"


def test_a_victim_back_within_the_target_in_a_gap_held_outside_the_engine_is_no_preemption():
    """Real vLLM on round E's mixed load at 100 ms: a stream preempted and back within 60 ms of a
    305 ms gap whose 77 tokens reached the client in one chunk. Its preemption cost it less than the
    target and the gap would have missed the target without it: the hold outside the engine's steps
    is the cause (before: preemption, whatever else held the stream)."""
    dec = [["a", 1, 0, 0, 1]]
    idx, ends = _index([(0.01, dec)] * 20)
    # a step that preempted it, one that recomputed its 29 positions and made a token, 20 more tokens
    idx.add({"t": ends[-1], "end": ends[-1] + 0.01, "reqs": [["b", 1, 0, 0, 1]], "preempted": ["a"]})
    ends.append(ends[-1] + 0.01)
    for d, reqs in [(0.02, [["a", 30, 0, 29, 1]])] + [(0.01, dec)] * 20:
        idx.add({"t": ends[-1], "end": ends[-1] + d, "reqs": reqs})
        ends.append(ends[-1] + d)
    acct = idx.account("a", ends[19] + 0.001, ends[-1] + 0.001, target=0.1)
    assert acct is not None and acct.cause.value == "unknown" and acct.kind == "held"
    assert acct.made == 21 and acct.longest_s == pytest.approx(0.03)
    # the same preemption at a 20 ms target: its 30 ms wait missed it alone
    acct = idx.account("a", ends[19] + 0.001, ends[-1] + 0.001, target=0.02)
    assert acct is not None and acct.cause.value == "preemption" and acct.kind == "preempted"
    # and a gap that ends with the resumed token: without the wait it would have met the target
    acct = idx.account("a", ends[19] + 0.001, ends[21] + 0.001, target=0.025)
    assert acct is not None and acct.cause.value == "preemption"

def test_a_prompt_step_where_the_engine_changed_pace_is_no_cause_the_log_can_tell():
    """Real vLLM on a contended host (round B's mixed): 8 ms decode steps, then two of 101 and 112 ms,
    the step that also ran a 68-token prompt (139 ms), and decode steps of 128-143 ms after it. Read
    against the decode steps before it (mostly fast) the prompt took 129 ms of the step; against those
    after it, 11 ms: prefill at 100 ms one way, slow decode the other, so the log says it cannot tell
    (before: "prefill_interference", at confidence 1.0)."""
    dec = [["a", 1, 0, 0, 1]]
    with_prompt = [["a", 1, 0, 0, 1], ["c", 68, 68, 0, 1]]
    slow = [(0.128, dec), (0.135, dec), (0.143, dec), (0.136, dec)]
    idx, ends = _index([(0.008, dec)] * 30 + [(0.101, dec), (0.112, dec), (0.139, with_prompt)] + slow)
    acct = idx.account("a", ends[-6] + 0.001, ends[-5] + 0.001, target=0.1)
    assert acct is not None and acct.cause.value == "unknown" and acct.kind == "ambiguous"
    f = acct.finding()
    assert f.kind == "witness-ambiguous" and f.confidence == 1.0
    assert ("a decode-only step took 8.0 ms just before and 135.5 ms just after, so the prompts took 3-131 ms "
            "beyond decode steps") in f.lines[1]
    # the engine sped up instead (132 ms decode steps, then 10 ms): against those before it the 102 ms
    # prompt step held no prefill, against those after it 92 ms of it: the log cannot tell either
    idx, ends = _index([(0.132, dec)] * 10 + [(0.102, with_prompt)] + [(0.010, dec)] * 10)
    acct = idx.account("a", ends[-12] + 0.001, ends[-11] + 0.001, target=0.1)
    assert acct is not None and acct.kind == "ambiguous"
    # where the cause is the same read either way, it stands: a 300 ms prompt step between 8 ms and
    # 20 ms decode steps is prefill whichever (280-292 ms of it)
    idx, ends = _index([(0.008, dec)] * 30 + [(0.300, with_prompt)] + [(0.020, dec)] * 10)
    acct = idx.account("a", ends[-12] + 0.001, ends[-11] + 0.001, target=0.1)
    assert acct is not None and acct.cause.value == "prefill_interference"
    assert acct.prefill_s == pytest.approx(0.292, abs=1e-6)


def test_resumed_requests_restored_positions_reach_the_analysis(tmp_path):
    """A victim resumed with 64 of its 130 positions still in the engine's prefix cache (two full
    32-token blocks) recomputes the other 66; a second victim found nothing. The witness writes both
    resumes (0 included), the reader keeps them, and analyze reports 64 restored of 64 + 66 + 90."""
    p = tmp_path / "w.jsonl"
    log = StepLog(str(p), "vllm", "0.32.0")
    log.step(10.0, 10.02, [("a", 1, 0, 0, 1), ("b", 1, 0, 0, 1)], ["c"], [], [], [])
    log.step(10.5, 10.6, [("a", 67, 0, 66, 1)], [], ["a"], [], [], restored=[("a", 64)])
    log.step(11.0, 11.1, [("b", 91, 0, 90, 1)], [], ["b"], [], [], restored=[("b", 0)])
    log.close()
    lines = [json.loads(x) for x in p.read_text().splitlines()[1:]]
    assert lines[1]["rst"] == [[1, 64]] and lines[2]["rst"] == [[2, 0]] and "rst" not in lines[0]
    recs = WitnessReader(str(p), 10.0 - 1.0, engine="http://127.0.0.1:8000", from_start=True).read()
    assert [r.restored for r in recs] == [[], [["a", 64]], [["b", 0]]]
    # the same steps in a trace: the run's resume costs, in JSON and in the text report
    from kvtop.model.records import to_dict
    steps = [to_dict(r) for r in recs]
    assert "restored" not in steps[0] and steps[1]["restored"] == [["a", 64]]
    _trace(tmp_path / "t.jsonl", [{k: v for k, v in s.items() if k != "kind"} for s in steps],
           _decode("a", [1.0 + 0.02 * i for i in range(20)]))
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    assert rep.resume_costs is not None
    assert rep.resume_costs.to_dict() == {"resumes": 2, "restored_tokens": 64, "recomputed_tokens": 156,
                                          "restored_share": round(64 / 220, 4)}
    # the cost model's h_res: what a resume finds again instead of recomputing, now measured
    assert rep.verdict is not None
    hit = rep.verdict.numbers["resume_hit_tokens"]
    assert (hit.value, hit.source) == (32.0, "measured") and "mean of 2 resumes by the engine's witness" in hit.note
    r = subprocess.run([sys.executable, "-m", "kvtop", "analyze", str(tmp_path / "t.jsonl"), "--itl-target-ms", "100"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("engine step log (witness): 2 resume(s) after preemption; positions had again without compute "
            "(prefix cache or KV connector) 64, recomputed 156 (29% restored)") in r.stdout
    # a witness file too old to say (resumes without `restored`) reports nothing rather than 0 %
    old = [{k: v for k, v in s.items() if k not in ("kind", "restored")} for s in steps]
    _trace(tmp_path / "o.jsonl", old, _decode("a", [1.0 + 0.02 * i for i in range(20)]))
    assert analyze_trace(str(tmp_path / "o.jsonl"), itl_target_s=0.1).resume_costs is None


def test_the_prefill_rate_is_the_engines_marginal_rate_where_its_witness_logged_the_steps(tmp_path):
    """Six 64-token prompts whose engine TTFTs (300 ms) are mostly other work, and one resume that
    recomputes 1,000 positions, on an engine that computes 2,000 prompt tokens/s beside 18 ms decode
    steps. Prompt tokens / TTFT reads 213 tokens/s and would price each recompute ~9x too high; the
    witness's steps say 1,384 tokens took 0.692 s beyond a decode-only step: 2,000 tokens/s."""
    dec = 0.018
    steps: list[dict] = []
    extra: list[dict] = []
    a_times: list[float] = []
    t = 1.0
    plan: list[tuple[float, list[list]]] = [(dec, [])] * 10
    for i in range(6):
        plan += [(dec + 64 / 2000, [[f"r{i}", 64, 64, 0, 1]])] + [(dec, [])] * 10
    plan += [(dec + 1000 / 2000, [["v", 1000, 0, 1000, 1]])] + [(dec, [])] * 10
    for d, more in plan:
        steps.append({"t": round(t, 6), "end": round(t + d, 6), "reqs": [["a", 1, 0, 0, 1], *more]})
        t += d
        a_times.append(round(t + 0.001, 6))
        for r in more:
            if r[0].startswith("r"):
                extra += [{"kind": "request", "t": round(t - 0.3, 6), "id": r[0], "event": "arrive", "source": "proxy"},
                          {"kind": "request", "t": round(t + 0.001, 6), "id": r[0], "event": "first_token", "n": 1},
                          {"kind": "request", "t": round(t + 0.002, 6), "id": r[0], "event": "finish",
                           "prompt_tokens": 64, "completion_tokens": 1, "finish_reason": "length",
                           "engine_queue_s": 0.0, "engine_ttft_s": 0.3, "engine_decode_s": 0.0}]
    _trace(tmp_path / "t.jsonl", steps, _decode("a", a_times) + extra)
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    assert rep.prefill_compute is not None
    assert rep.prefill_compute.to_dict() == {"steps": 7, "tokens": 1384, "seconds": 0.692, "tokens_per_s": 2000.0}
    assert rep.verdict is not None
    rate = rep.verdict.numbers["prefill_rate"]
    assert rate.source == "measured" and rate.value == pytest.approx(2000.0)
    assert "engine's witness: 1384 prompt and recompute tokens in 7 steps" in rate.note
    # without the engine's log the rate falls back to the engine's per-request figure, 64 / 0.3 s (to
    # its median's histogram bin)
    lines = [ln for ln in (tmp_path / "t.jsonl").read_text().splitlines() if '"kind": "step"' not in ln]
    (tmp_path / "n.jsonl").write_text("\n".join(lines) + "\n")
    rep2 = analyze_trace(str(tmp_path / "n.jsonl"), itl_target_s=0.1)
    assert rep2.prefill_compute is None and rep2.verdict is not None
    assert rep2.verdict.numbers["prefill_rate"].value == pytest.approx(64 / 0.3, rel=0.01)
    # that figure is a lower bound, said in the report and in a saved scenario; the witness's is not
    from kvtop.analysis.advice.scenario import from_report
    assert rep2.verdict.numbers["prefill_rate"].low and not rate.low
    kv = 131072.0  # bytes per token: a saved scenario needs the KV size
    saved = [from_report(analyze_trace(str(tmp_path / f), itl_target_s=0.1, kv_bytes=kv), f)["prefill"]
             for f in ("n.jsonl", "t.jsonl")]
    assert saved[0]["tokens_per_s_low"] is True and "tokens_per_s_low" not in saved[1]
    r = subprocess.run([sys.executable, "-m", "kvtop", "analyze", str(tmp_path / "t.jsonl"), "--itl-target-ms", "100"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("engine step log (witness): 7 step(s) computed 1384 prompt and recompute tokens in 0.692 s beyond a "
            "decode-only step (2,000 tokens/s)") in r.stdout


def test_a_step_of_no_request_is_no_compute_step():
    # an engine waiting on a remote KV transfer steps with nothing scheduled (about 1 kHz): each was
    # counted a "compute step" of 0 tokens, its time beyond a decode step added to the prefill time
    dec = [["a", 1, 0, 0, 1]]
    idx, _ = _index([(0.008, dec)] * 10 + [(0.050, [])] * 20 + [(0.108, [["a", 1, 0, 0, 1], ["p", 100, 100, 0, 1]])])
    assert idx.compute_steps == 1 and idx.compute_tokens == 100
    assert idx.compute_s == pytest.approx(0.100, abs=1e-9)


def test_lines_written_to_the_old_file_just_before_a_roll_are_read(tmp_path, monkeypatch):
    import kvtop.sources.witness as ws

    p = tmp_path / "w.jsonl"
    log = StepLog(str(p), "vllm", "0.32.0")
    r = WitnessReader(str(p), 0.0)
    assert r.read() == []
    real_stat = ws.os.stat

    def engine_between(path, *a, **kw):  # the engine writes and rolls between the read and the check
        if not getattr(engine_between, "done", False):
            engine_between.done = True  # type: ignore[attr-defined]
            log.step(10.0, 10.1, [("a", 1, 0, 0, 1)], [], [], [], [], idle=True)
            log._roll()
            log.step(11.0, 11.1, [("b", 1, 0, 0, 1)], [], [], [], [], idle=True)
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(ws.os, "stat", engine_between)
    got = [rec.reqs[0][0] for rec in r.read()]
    assert got == ["a", "b"]  # "a" was lost with the old file
    log.close()


async def test_a_wall_clock_step_during_a_run_does_not_shift_the_engines_steps(tmp_path, monkeypatch):
    # the engine writes wall-clock times; one offset taken at start put every step after an NTP step
    # of the host's clock 2 s away from the client chunks it produced (steps are 10-30 ms wide)
    from types import SimpleNamespace

    import kvtop.feeds.sources as fs
    from kvtop.feeds.sources import WitnessTail

    p = tmp_path / "w.jsonl"
    log = StepLog(str(p), "vllm", "0.32.0")
    wall = {"now": 1000.0}
    run = {"now": 0.0}
    monkeypatch.setattr(fs.time, "time", lambda: wall["now"])
    got: list = []
    ctx = SimpleNamespace(now=lambda: run["now"], emit=got.append, core=SimpleNamespace(event=lambda *a: None))
    tail = WitnessTail(str(p), None)
    await tail.start(ctx)
    await tail.poll(0.0)
    # 10 s later the host's clock is stepped back 2 s; the engine's next step, at run time 10.0,
    # is written at wall 1008.0
    run["now"], wall["now"] = 10.0, 1008.0
    log.step(1008.0, 1008.02, [("a", 1, 0, 0, 1)], [], [], [], [], idle=True)
    await tail.poll(10.0)
    [rec] = got
    assert rec.t == pytest.approx(10.0)  # was 8.0
    await tail.stop()
    log.close()
