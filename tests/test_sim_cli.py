"""`kvtop simulate` as a user runs it: trace contents, determinism, bad input."""

from __future__ import annotations

import json

import pytest

from kvtop.model.trace import TraceReader
from tests.conftest import run_kvtop


def _lines_without_start(path) -> list[str]:
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    head.pop("started_at")
    head.pop("host")
    return [json.dumps(head, sort_keys=True), *lines[1:]]


def test_same_seed_gives_an_identical_trace_and_another_seed_does_not(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    for path, seed in ((a, "7"), (b, "7"), (c, "8")):
        r = run_kvtop("simulate", "--preset", "preemption-storm", "--seed", seed, "--duration", "40", "-o", str(path))
        assert r.returncode == 0, r.stderr
    assert _lines_without_start(a) == _lines_without_start(b)
    assert _lines_without_start(a) != _lines_without_start(c)


def test_trace_has_header_engine_request_and_truth_records(tmp_path):
    out = tmp_path / "t.jsonl"
    r = run_kvtop("simulate", "--preset", "preemption-storm", "--duration", "90", "-o", str(out),
                  "--scrape-interval", "0.5")
    assert r.returncode == 0, r.stderr
    assert "preemptions" in r.stdout
    tr = TraceReader(out)
    h = tr.header
    assert h["engine"] == {"adapter": "vllm", "url": "sim://", "model": "sim-llama-3.1-8b", "version": "kvtop-sim"}
    assert h["kv"] == {"bytes_per_token": 131072, "block_size": 16, "capacity_tokens": 1430 * 16}
    recs = list(tr.records())
    assert tr.skipped == 0
    ts = [x.t for x in recs]
    assert ts == sorted(ts)  # time order
    engines = [x for x in recs if x.kind == "engine"]
    assert len(engines) == 181  # t = 0, 0.5, ..., 90
    assert engines[-1].kv_capacity_tokens == 22880 and engines[-1].kv_usage > 0.8
    events = {x.event for x in recs if x.kind == "request"}
    assert {"arrive", "first_token", "token", "finish"} <= events
    arrivals = [x for x in recs if x.kind == "request" and x.event == "arrive"]
    assert all(x.prompt_tokens and x.cls in ("interactive", "batch") and x.source == "sim" for x in arrivals)
    assert sum(x.cls == "batch" for x in arrivals) == 6  # the burst of long jobs at t = 0.5 ... 3 s
    truth = [x for x in recs if x.kind == "truth"]
    pre = [x for x in truth if x.event == "preempt"]
    assert pre and all(x.request_id for x in pre)
    # the scraped counter never runs ahead of the resumes that have happened (vLLM V1 semantics)
    for e in engines:
        counted = sum(x.data["counted"] for x in truth if x.event == "resume" and x.t <= e.t)
        assert e.preemptions_total == counted


def test_policy_swap_writes_offload_counters(tmp_path):
    out = tmp_path / "s.jsonl"
    r = run_kvtop("simulate", "--preset", "swap-vs-recompute", "--policy", "swap", "--duration", "120", "-o", str(out))
    assert r.returncode == 0, r.stderr
    tr = TraceReader(out)
    assert tr.header["sim"]["preemption_mode"] == "swap"
    engines = [x for x in tr.records() if x.kind == "engine"]
    last = engines[-1]
    assert last.offload_capacity_bytes == int(200e9)
    assert last.offload_out_bytes_total > 0 and last.offload_out_seconds_total > 0
    # effective bandwidth from the counters: BW_eff = g/(g/BW + alpha) with g = one 1.25 MiB block,
    # BW = 40 GB/s, alpha = 6 us (docs/kv-science.md §2.2) = 33.81 GB/s
    bw = last.offload_out_bytes_total / last.offload_out_seconds_total
    g = 16 * 81920
    assert abs(bw - g / (g / 40e9 + 6e-6)) < 0.002 * bw


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"classes": [{"prompt": 10}]}')
    cases = [
        ("--preset", "nope", "--duration", "5", "-o", str(tmp_path / "x.jsonl")),
        ("--workload", str(bad), "--duration", "5", "-o", str(tmp_path / "x.jsonl")),
        ("--workload", str(tmp_path / "missing.json"), "--duration", "5", "-o", str(tmp_path / "x.jsonl")),
        ("--preset", "healthy", "--policy", "teleport", "--duration", "5", "-o", str(tmp_path / "x.jsonl")),
        ("--preset", "healthy", "--duration", "-1", "-o", str(tmp_path / "x.jsonl")),
    ]
    for args in cases:
        r = run_kvtop("simulate", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_fast_token_lines_equal_the_trace_writers_lines(tmp_path):
    from types import SimpleNamespace

    from kvtop.model.records import RequestRecord
    from kvtop.model.trace import TraceWriter
    from kvtop.sim.simulate import _token_lines

    seqs = [SimpleNamespace(id="sim-3", generated=1), SimpleNamespace(id='odd"id\\', generated=7)]
    for i, t in enumerate((1.0, 0.1 + 0.2, 12345.678901234, 3e-7, 2.5e-6)):
        path = tmp_path / f"{i}.jsonl"
        with TraceWriter(path, {"kind": "header"}) as w:
            for s in seqs:
                w.write(RequestRecord(t, s.id, "first_token" if s.generated == 1 else "token", n=1, source="sim"))
        want = path.read_text().splitlines()[1:]
        assert _token_lines(t, seqs).splitlines() == want
        # to the microsecond, as every trace line
        assert json.loads(want[0])["t"] == round(t, 6)


def test_what_if_replays_a_traces_arrivals_exactly_then_under_another_policy(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    r = run_kvtop("simulate", "--preset", "swap-vs-recompute", "--duration", "240", "-o", str(a))
    assert r.returncode == 0, r.stderr
    for path, policy in ((b, "recompute"), (c, "swap-slow-link")):
        r = run_kvtop("simulate", "--preset", "swap-vs-recompute", "--policy", policy, "--arrivals-from", str(a),
                      "--duration", "240", "-o", str(path))
        assert r.returncode == 0, r.stderr

    def timeline(path):
        return [(d["t"], d.get("id") or d.get("request_id"), d["event"]) for d in TraceReader(path)
                if d["kind"] in ("request", "truth")]

    ta, tb, tc = timeline(a), timeline(b), timeline(c)
    arrivals = [x for x in ta if x[2] == "arrive"]
    assert len(arrivals) >= 40
    # same engine and policy: the recorded run comes back record for record
    assert ta == tb
    # a slow fragmented swap link on the same arrivals: same requests, a different (worse) timeline
    assert [x for x in tc if x[2] == "arrive"] == arrivals
    assert tc != ta
    pre_a = sum(1 for x in ta if x[2] == "preempt")
    pre_c = sum(1 for x in tc if x[2] == "preempt")
    assert pre_c > pre_a


@pytest.mark.parametrize(("where", "field", "value", "said"), [
    ("class", "start_s", "x", "start_s: expected a number"),
    ("class", "start_s", -5, "start_s: must be >= 0"),
    ("class", "max_tokens", "a", "max_tokens: expected a whole number"),
    ("class", "max_tokens", 0, "max_tokens: must be >= 1"),
    ("class", "reserved_kv_frac", "a", "reserved_kv_frac: expected a number"),
    ("class", "priority", "a", "priority: expected a whole number"),
    ("class", "name", 5, "name must be a name"),
    ("class", "rate_per_s", 1e7, "rate_per_s must be at most"),
    ("engine", "model", 5, "engine.model must be a name"),
    ("engine", "chunked_prefill", "no", "engine.chunked_prefill must be true or false"),
    ("engine", "max_model_len", 8, "does not fit engine.max_model_len"),
])
def test_a_workload_field_of_the_wrong_kind_is_one_line(tmp_path, where, field, value, said):
    # each was a traceback (exit 1), a MemoryError, or read wrongly without a word ("no" as true)
    doc = {"engine": {"max_model_len": 8192},
           "classes": [{"name": "a", "rate_per_s": 1, "prompt": {"median": 100, "min": 10}, "output": 50}]}
    (doc["engine"] if where == "engine" else doc["classes"][0])[field] = value
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps(doc))
    r = run_kvtop("simulate", "--workload", str(wl), "--duration", "5", "-o", str(tmp_path / "x.jsonl"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and said in r.stderr, r.stderr


def test_arrivals_from_a_recording_of_text_prompts_take_the_length_from_the_finish(tmp_path):
    # clients that send text: the proxy knows a prompt's length only from the usage block at the
    # finish; `load --from` read it there, `simulate --arrivals-from` refused the whole recording
    from kvtop.model.trace import TraceWriter, make_header
    from kvtop.sim.workload import load_preset, requests_from_trace

    p = tmp_path / "text.jsonl"
    with TraceWriter(p, make_header()) as w:
        for i in range(3):
            w.write({"kind": "request", "t": 1.0 + i, "id": f"r{i}", "event": "arrive"})
            w.write({"kind": "request", "t": 1.5 + i, "id": f"r{i}", "event": "first_token", "n": 1})
            w.write({"kind": "request", "t": 1.9 + i, "id": f"r{i}", "event": "finish", "completion_tokens": 20,
                     "prompt_tokens": 300 + i})
        w.write({"kind": "request", "t": 9.0, "id": "cut", "event": "arrive"})
        w.write({"kind": "request", "t": 9.5, "id": "cut", "event": "cancel"})
    specs = requests_from_trace(p, load_preset("healthy"))
    assert [(s.id, s.t, s.prompt_tokens, s.output_tokens) for s in specs] == [
        ("r0", 1.0, 300, 20), ("r1", 2.0, 301, 20), ("r2", 3.0, 302, 20)]
