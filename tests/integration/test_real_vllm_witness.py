"""The witness inside a real vLLM: its steps reach the trace, the analysis reads each stall's cause from
them, and kvtop's inference (the same trace without the steps) is scored against them.

One vLLM (the tiny model, 1,056 KV token slots) started with ``--scheduler-cls
kvtop.witness.vllm.WitnessScheduler``; a preemption storm recorded through ``kvtop record
--proxy-listen --witness``. The floors asserted here are below what the bench measures
(``python -m bench.witness_runs``, figures in docs/real-engines.md): they catch a broken join or a
collapse, not a point of precision.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from eval.witness_matrix import decode_step_s, score
from testkit.engines import servers, witness_workloads
from testkit.engines.kvtop_run import Recorder, analyze, read_trace

pytestmark = pytest.mark.real_engine

FLOOR = 0.7  # inference vs witness, preemption precision and recall at 100 ms, pooled over two storms
# ... and at 2.5x the decode step, where one storm's figures range 0.6-1.0 between runs of the same
# code (docs/real-engines.md §7.1): a floor against collapse, not the 0.95 goal
FLOOR_TIGHT = 0.5
# gaps the engine logged as neither preemption nor prefill that inference called one of them: at a
# tight target on an idle CI box kvtop called 30 of 173 (17 %) `prefill/recompute` (every shared
# stall of a scrape interval whose counter stepped, issue 22): a floor against collapse, not the goal
NEITHER_CALLED_ENGINE = 0.25


@pytest.fixture(scope="module")
def witnessed(vllm_install, trace_dir):
    py, model = vllm_install
    wfile = trace_dir / "witness.jsonl"
    srv = servers.vllm_server(py, model, witness=wfile)
    try:
        srv.start()
        yield srv, wfile
    finally:
        servers.cleanup(srv)


def _preemptions(srv: servers.Server) -> float:
    m = re.search(r"^vllm:num_preemptions_total\{[^}]*\} ([0-9.e+]+)$", srv.metrics(), re.M)
    assert m
    return float(m.group(1))


@pytest.fixture(scope="module")
def storm(witnessed, trace_dir) -> dict:
    srv, wfile = witnessed
    trace = trace_dir / "vllm-witness-storm.jsonl"
    before = _preemptions(srv)
    with Recorder(trace, srv.url, extra=("--witness", str(wfile))) as rec:
        time.sleep(1.0)
        witness_workloads.storm(rec.proxy_url, servers.VLLM_MODEL_NAME)
        time.sleep(2.5)  # the last steps reach the trace at the next poll
        rc = rec.stop()
    assert rc == 0, rec.stderr()
    return {"trace": trace, "records": read_trace(trace), "delta": _preemptions(srv) - before, "wfile": wfile}


def test_the_engine_logs_under_vllms_own_warning_and_writes_its_header(witnessed):
    srv, wfile = witnessed
    head = json.loads(wfile.read_text().splitlines()[0])
    assert head["format"] == "kvtop-witness" and head["engine_version"].startswith("0.32.")
    # the limits its scheduler runs under, vLLM's defaults applied (the budget: its CPU default)
    lim = head["limits"]
    assert lim["max_num_seqs"] == servers.VLLM_MAX_NUM_SEQS and lim["max_num_batched_tokens"] >= lim["max_num_seqs"]
    assert "kvtop witness: writing engine steps to" in srv.log_tail(400) or "Using custom scheduler class" in srv.log_tail(400)


def test_steps_reach_the_trace_joined_to_every_proxied_stream(storm):
    recs = storm["records"]
    steps = [r for r in recs if r.get("kind") == "step"]
    streams = {r["id"] for r in recs if r.get("kind") == "request" and r.get("event") == "arrive"}
    logged = {q[0] for s in steps for q in s["reqs"]}
    assert len(streams) == 8 and streams <= logged
    # tokens: what the engine produced for each stream is what the client asked for (600 each)
    made = {sid: sum(q[4] for s in steps for q in s["reqs"] if q[0] == sid) for sid in streams}
    assert set(made.values()) == {600}, made
    # every preemption the engine counted is in the log, and each victim recomputed on resuming
    preempted = [rid for s in steps for rid in s.get("preempted", [])]
    assert preempted and abs(len(preempted) - storm["delta"]) <= 1, (len(preempted), storm["delta"])
    recomputed = {q[0] for s in steps for q in s["reqs"] if q[3] > 0}
    assert set(preempted) <= recomputed
    assert all(0 <= s["end"] - s["t"] < 60 for s in steps)
    # the first step the recorder read carries the engine's limits: the advisor's current settings
    assert steps[0]["limits"]["max_num_seqs"] == servers.VLLM_MAX_NUM_SEQS
    assert not any("limits" in s for s in steps[1:])


def test_each_resume_says_what_the_engine_had_again_without_recompute(storm):
    """vLLM hands a resumed request the full blocks its prefix cache still holds of it (a KV connector
    such as the offloading one would add what it loads back); the witness writes that for every resume
    and analyze sums it against the positions recomputed (issue 24: recompute vs reloaded tokens)."""
    steps = [r for r in storm["records"] if r.get("kind") == "step"]
    resumed = sorted(rid for s in steps for rid in s.get("resumed", []))
    restored = [x for s in steps for x in s.get("restored", [])]
    assert resumed and sorted(r[0] for r in restored) == resumed
    assert all(n % servers.VLLM_BLOCK_SIZE == 0 for _, n in restored), restored  # whole blocks only
    rc = analyze(storm["trace"], "--itl-target-ms", "100")["resume_costs"]
    print(f"\n[real-engines] resumes: {rc}")
    assert rc["resumes"] == len(resumed) and rc["restored_tokens"] == sum(n for _, n in restored)
    assert rc["recomputed_tokens"] == sum(q[3] for s in steps for q in s["reqs"]) > 0


def test_the_verdict_prices_a_recompute_at_the_engines_own_prefill_rate(storm):
    """Short prompts' TTFTs are mostly a step's fixed cost and other prompts' tokens, so prompt
    tokens / TTFT reads the engine's prefill rate far too low (3-21x on the shipped witness rounds);
    with the witness the verdict's rate is the steps' tokens over their time beyond a decode step."""
    rep = analyze(storm["trace"], "--itl-target-ms", "100")
    pc, ert = rep["prefill_compute"], rep["engine_request_times"]
    print(f"\n[real-engines] prefill compute: {pc}; per-request rate {ert and ert['engine_prefill_tokens_per_s']}")
    assert pc is not None and pc["steps"] >= 3 and pc["tokens"] >= 1000
    # the engine's own limits, from its witness, are the verdict's current settings
    seqs = rep["verdict"]["numbers"]["max_seqs_current"]
    assert (seqs["value"], seqs["note"]) == (servers.VLLM_MAX_NUM_SEQS, "the engine's witness")
    rate = rep["verdict"]["numbers"]["prefill_rate"]
    assert rate["source"] == "measured" and rate["value"] == pytest.approx(pc["tokens_per_s"], rel=1e-3)
    assert ert is not None and pc["tokens_per_s"] > 2 * ert["engine_prefill_tokens_per_s"]


def test_with_the_witness_every_stall_is_read_not_inferred(storm):
    rep = analyze(storm["trace"], "--itl-target-ms", "100")
    spikes = rep["spikes"]
    assert spikes
    read = [s for s in spikes if s["rule"] == "witness"]
    # A stall inside a hang of the host (kvtop's own scrapes paused: rule host) has no engine step
    # to read when the engine hung with it: a local CI run on a loaded box had 2 of 24 stalls in one
    # 2.8 s hang (one called host, one a 227-token burst when it ended), the other 22 all read
    hangs = [(s["t_start"], s["t_end"]) for s in spikes if s["rule"] == "host"]
    loggable = [s for s in spikes if s["rule"] == "witness"
                or not any(s["t_start"] < b and s["t_end"] > a for a, b in hangs)]
    assert len(loggable) >= 0.9 * len(spikes), (len(loggable), len(spikes))
    assert len(read) >= 0.95 * len(loggable) and all(s["confidence"] == 1.0 for s in read)
    assert any(s["cause"] == "preemption" for s in read)
    assert any("engine step log (witness)" in " ".join(s["evidence"]) for s in read)


@pytest.fixture(scope="module")
def second_storm(witnessed, trace_dir) -> Path:
    """Another storm (10 streams of 500 tokens), scored with the first: one storm's ~20 preemptions
    make the floor a coin of a few stalls (one loaded CI run read recall 0.65 where quiet ones read 0.8-1.0)."""
    srv, wfile = witnessed
    trace = trace_dir / "vllm-witness-storm2.jsonl"
    with Recorder(trace, srv.url, extra=("--witness", str(wfile))) as rec:
        time.sleep(1.0)
        witness_workloads.storm(rec.proxy_url, servers.VLLM_MODEL_NAME, n=10, tokens=500, seed=12)
        time.sleep(2.5)
        rc = rec.stop()
    assert rc == 0, rec.stderr()
    return trace


def _pooled(rows: list[dict]) -> dict:
    tp = sum(r["preemption"]["tp"] for r in rows)
    pred = sum(r["preemption"]["predicted"] for r in rows)
    actual = sum(r["preemption"]["actual"] for r in rows)
    return {"tp": tp, "predicted": pred, "actual": actual, "precision": tp / pred if pred else None,
            "recall": tp / actual if actual else None, "neither": sum(r["neither"] for r in rows),
            "neither_called_engine": sum(r["neither_called_engine"] for r in rows)}


def test_inference_scored_against_the_witness(storm, second_storm):
    traces = [str(storm["trace"]), str(second_storm)]
    for name in ("100 ms", "tight (2.5x the decode step)"):
        rows = []
        for trace in traces:
            dec = decode_step_s(trace)
            assert dec is not None and dec > 0
            rows.append(score(trace, 0.100 if name == "100 ms" else 2.5 * dec))
        r = _pooled(rows)
        print(f"\n[real-engines] witness storms at {name}: preemption P {r['precision']} R {r['recall']} "
              f"({r['tp']}/{r['predicted']}/{r['actual']}); neither called engine "
              f"{r['neither_called_engine']} of {r['neither']}")
        assert r["actual"] >= 6, r
        floor = FLOOR if name == "100 ms" else FLOOR_TIGHT
        assert r["precision"] is not None and r["precision"] >= floor, (name, r)
        assert r["recall"] is not None and r["recall"] >= floor, (name, r)
        assert r["neither_called_engine"] <= NEITHER_CALLED_ENGINE * max(1, r["neither"]), (name, r)


def test_tail_of_the_witness_file_is_a_valid_json_line(storm):
    last = Path(storm["wfile"]).read_text().splitlines()[-1]
    json.loads(last)
