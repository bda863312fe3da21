"""The independent trace generator (eval/tracegen): engine semantics, delivery, determinism.

Facts are checked against the generator's own engine log (what really happened) and read back
from the trace file the way kvtop reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eval.tracegen.generate import Generated, simulate, write
from tests.conftest import REPO, run_kvtop


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _engine(recs: list[dict]) -> list[dict]:
    return [d for d in recs if d.get("kind") == "engine"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Generated, list[dict]]:
    g = simulate("base", 3, 60.0)
    p = tmp_path_factory.mktemp("tg") / "base.jsonl"
    write(g, str(p), 1.0)
    return g, _lines(p)


def test_vllm_counter_steps_when_the_victim_resumes_never_for_a_cancelled_one(base):
    g, recs = base
    victims = g.run.victims
    resumed = [v for v in victims if v.outcome == "resumed"]
    cancelled = [v for v in victims if v.outcome == "cancelled"]
    assert resumed and cancelled, "the seed must produce both resumed and cancelled victims"
    eng = _engine(recs)
    # every rise of the counter between two scrapes is exactly the victims that resumed in between
    for prev, cur in zip(eng, eng[1:], strict=False):
        rise = cur["preemptions_total"] - prev["preemptions_total"]
        resumed_between = sum(v.counted for v in resumed if prev["t"] < v.t_end <= cur["t"])
        assert rise == resumed_between, (prev["t"], cur["t"])
    assert all(v.counted == 0 for v in cancelled)
    # a victim preempted again while waiting is counted once per preemption, at its resume
    assert sum(v.counted for v in resumed) == sum(v.times for v in resumed)
    assert eng[-1]["preemptions_total"] < sum(v.times for v in victims)


def test_recomputed_prompt_tokens_are_in_no_counter(base):
    g, recs = base
    assert any(v.recompute_tokens > 0 for v in g.run.victims)
    last = _engine(recs)[-1]
    fresh = sum(r.prompt for r in g.run.reqs if r.emits and r.emits[0][0] <= last["t"])
    assert last["prompt_tokens_total"] == fresh


def test_sglang_counts_at_retraction_cancelled_or_not(tmp_path):
    g = simulate("sglang", 1, 60.0)
    p = tmp_path / "sg.jsonl"
    write(g, str(p), 1.0)
    recs = _lines(p)
    assert recs[0]["engine"]["adapter"] == "sglang"
    eng = _engine(recs)
    assert all(d["adapter"] == "sglang" for d in eng)
    cancelled = [v for v in g.run.victims if v.outcome == "cancelled"]
    assert cancelled and all(v.counted == v.times for v in cancelled)
    # the counter stepped when each victim was retracted: by the first retraction of every victim
    # preempted before the last scrape, it had already counted it
    last = eng[-1]
    assert last["preemptions_total"] >= sum(1 for v in g.run.victims if v.t <= last["t"])
    assert last["preemptions_total"] == sum(v.counted for v in g.run.victims)


def test_never_preempting_engine_reads_as_tgi(tmp_path):
    g = simulate("nopreempt", 1, 40.0)
    p = tmp_path / "tgi.jsonl"
    write(g, str(p), 1.0)
    recs = _lines(p)
    assert not g.run.victims
    eng = _engine(recs)
    assert eng and all(d["adapter"] == "tgi" and d["preemptions_total"] is None for d in eng)
    assert max(d["waiting"] for d in eng) > 0  # KV pressure shows as queueing


def test_merged_chunks_carry_n_above_one_or_arrive_within_a_millisecond(tmp_path):
    g = simulate("multitoken", 2, 60.0)
    p = tmp_path / "mt.jsonl"
    write(g, str(p), 1.0)
    recs = _lines(p)
    toks: dict[str, list[tuple[float, int]]] = {}
    for d in recs:
        if d.get("kind") == "request" and d["event"] in ("first_token", "token"):
            toks.setdefault(d["id"], []).append((d["t"], d["n"]))
    merges = [d for d in recs if d.get("kind") == "truth" and d["event"] == "stall"
              and d["data"]["cause"] == "api_merge"]
    assert len(merges) >= 5
    one_record = several_reads = 0
    for m in merges:
        ts = toks[m["request_id"]]
        i = [t for t, _ in ts].index(m["data"]["t_end"])
        burst = [n for t, n in ts[i:] if t <= m["data"]["t_end"] + 0.001]
        assert sum(burst) > 1
        if len(burst) > 1:
            several_reads += 1
        else:
            one_record += 1
    assert one_record and several_reads


def test_host_pause_silences_streams_and_leaves_a_scrape_gap(tmp_path):
    g = simulate("delivery", 1, 90.0)
    assert g.host_pauses
    p = tmp_path / "dl.jsonl"
    write(g, str(p), 1.0)
    recs = _lines(p)
    eng_t = [d["t"] for d in _engine(recs)]
    tok_t = [d["t"] for d in recs if d.get("kind") == "request" and d["event"] in ("first_token", "token")]
    missed = 0
    for a, dur in g.host_pauses:
        assert not [t for t in eng_t if a < t < a + dur]
        assert not [t for t in tok_t if a + 0.001 < t < a + dur]
        before = max(t for t in eng_t if t <= a)
        after = min(t for t in eng_t if t >= a + dur)
        assert after - before > dur
        missed += after - before > 1.2  # a beat fell in the pause and was answered only after it
    assert missed >= 2
    stalls = [d for d in recs if d.get("kind") == "truth" and d["event"] == "stall"
              and d["data"]["cause"] == "host_pause"]
    assert len(stalls) >= len(g.host_pauses)


def test_sparse_observation_records_only_some_streams(tmp_path):
    g = simulate("sparse", 1, 40.0)
    p = tmp_path / "sp.jsonl"
    write(g, str(p), 5.0)
    recs = _lines(p)
    seen = {d["id"] for d in recs if d.get("kind") == "request"}
    assert 0.1 < len(seen) / len(g.run.reqs) < 0.35
    eng_t = [d["t"] for d in _engine(recs)]
    assert all(4.9 < b - a < 5.1 for a, b in zip(eng_t, eng_t[1:], strict=False))


def test_same_seed_same_bytes_other_seed_other_trace(tmp_path):
    out = []
    for i, seed in enumerate((4, 4, 5)):
        p = tmp_path / f"{i}.jsonl"
        write(simulate("mixed", seed, 30.0), str(p), 5.0)
        out.append(p.read_bytes())
    assert out[0] == out[1]
    assert out[0] != out[2]


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m eval.tracegen.cli ARGS`` as the docs say, from any folder (the checkout on the path)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "eval.tracegen.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_kvtop_analyze_reads_the_trace_unchanged(tmp_path):
    p = tmp_path / "t.jsonl"
    r = _cli("--situation", "priority", "--seed", "1", "--duration", "45", "-o", str(p))
    assert r.returncode == 0, r.stderr
    res = run_kvtop("analyze", str(p), "--format", "json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["itl_target_s"] == pytest.approx(0.1)
    assert rep["spikes_total"] > 0 and rep["causes"]["preemption"]["count"] > 0


@pytest.mark.parametrize("args", [["--situation", "nope", "-o", "x.jsonl"], ["--situation", "base"],
                                  ["--situation", "base", "-o", "x", "--scrape-interval", "0"]])
def test_cli_bad_input_is_one_line_exit_2(args, tmp_path):
    r = _cli(*args, cwd=tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def _synthetic(path: Path) -> None:
    """Three streams at a 20 ms pace; A stalls alone (counter steps after), everyone stalls until
    D's first token, C stalls alone without a counter step; B slows down evenly at the end."""
    recs: list[dict] = [{"kind": "header", "format": "kvtop-trace", "version": 1,
                         "engine": {"adapter": "vllm"}, "kv": {}}]
    for k in range(9):
        t = 0.5 + k
        recs.append({"kind": "engine", "t": t, "adapter": "vllm", "url": "u", "engine": "0",
                     "preemptions_total": 0.0 if t < 3.0 else 1.0, "prompt_tokens_total": 1000.0})
    silent = {"A": [(2.0, 3.2), (5.0, 5.5)], "B": [(5.0, 5.5)], "C": [(4.0, 4.6), (5.0, 5.5)]}
    for rid in ("A", "B", "C"):
        recs.append({"kind": "request", "t": 0.05, "id": rid, "event": "arrive"})
        t, first = 0.1, True
        while t < 8.0:
            if not any(a < t < b for a, b in silent[rid]):
                recs.append({"kind": "request", "t": round(t, 6), "id": rid,
                             "event": "first_token" if first else "token", "n": 1})
                first = False
            t += 0.1 if rid == "B" and t > 6.5 else 0.02
        recs.append({"kind": "request", "t": 8.0, "id": rid, "event": "finish"})
    recs.append({"kind": "request", "t": 5.5, "id": "D", "event": "first_token", "n": 1})
    recs.append({"kind": "request", "t": 9.0, "id": "D", "event": "finish"})
    recs.sort(key=lambda d: d.get("t", -1))
    path.write_text("\n".join(json.dumps(d) for d in recs) + "\n")


def test_rule_baseline_follows_the_readme_signal_table(tmp_path):
    from eval.tracegen import baseline

    p = tmp_path / "syn.jsonl"
    _synthetic(p)
    idx = baseline.TraceIndex(str(p))
    lone_a = {"request_id": "A", "t_start": 1.98, "t_end": 3.22}
    lone_c = {"request_id": "C", "t_start": 3.98, "t_end": 4.62}
    shared = [{"request_id": r, "t_start": 4.98, "t_end": 5.5} for r in ("A", "B", "C")]
    slow = {"request_id": "B", "t_start": 7.3, "t_end": 7.45}
    got = baseline.classify([lone_c, lone_a, *shared, slow], idx)
    # the one counter step goes to the stall it ends (A), not to C's stall a second later
    assert got == ["unknown", "preemption", "prefill_interference", "prefill_interference",
                   "prefill_interference", "slow_decode"]


def test_truth_labels_a_spike_by_its_own_stalls_overlap(tmp_path):
    from eval.truth import label, truth_intervals

    g = simulate("delivery", 2, 60.0)
    p = tmp_path / "d.jsonl"
    write(g, str(p), 1.0)
    truth = truth_intervals(str(p))
    stalls = [d for d in _lines(p) if d.get("kind") == "truth" and d["event"] == "stall"]
    causes = {d["data"]["cause"] for d in stalls}
    assert {"preemption", "slow_reader", "host_pause", "api_stall"} <= causes
    for d in stalls[:200]:
        spike = {"request_id": d["request_id"], "t_start": d["data"]["t_start"], "t_end": d["data"]["t_end"]}
        own = [c for a, b, c in truth[d["request_id"]] if a <= spike["t_start"] and b >= spike["t_end"]]
        assert label(spike, truth) in own
        assert label({**spike, "request_id": "nobody"}, truth) is None


@pytest.mark.parametrize("name", ["mixed", "sglang", "nopreempt"])
def test_every_line_validates_against_the_trace_schema(name, tmp_path):
    import jsonschema

    schema = json.loads((REPO / "kvtop" / "schemas" / "trace.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    p = tmp_path / "t.jsonl"
    write(simulate(name, 1, 20.0), str(p), 1.0)
    recs = _lines(p)
    kinds = {d["kind"] for d in recs}
    assert {"header", "engine", "request", "truth"} <= kinds
    tokens = 0
    for d in recs:
        if d.get("event") == "token":
            tokens += 1
            if tokens > 500:  # token lines all look alike; validating thousands only costs time
                continue
        errs = list(validator.iter_errors(d))
        assert not errs, (d, errs[0].message)
    ts = [d["t"] for d in recs[1:]]
    assert ts == sorted(ts)


def test_vllm_page_request_num_preemptions_sums_to_the_counter_of_ended_requests(base):
    from eval.tracegen.generate import pages
    from kvtop.sources.prom import parse_page

    g, _ = base
    ts, text = list(pages(g, 1.0))[-1]
    page = parse_page(text)
    counter = page.value("vllm:num_preemptions_total")
    hist_sum = page.value("vllm:request_num_preemptions_sum")
    hist_n = page.value("vllm:request_num_preemptions_count")
    ended = [r for r in g.run.reqs if r.end_t is not None and r.end_t <= ts]
    live_counted = sum(r.counted for r in g.run.reqs if r.end_t is None or r.end_t > ts)
    assert hist_n == len(ended)
    assert counter is not None and hist_sum is not None
    assert hist_sum == counter - live_counted
    assert hist_sum > 0


@pytest.mark.parametrize("name", ["base", "sglang", "nopreempt"])
def test_kvtop_adapters_read_the_generators_own_engine_records_from_its_pages(name):
    """The generator writes each scrape's engine record itself (eval/tracegen/records.py), never
    through kvtop; kvtop's adapter for the engine family (vllm, sglang, tgi), reading the page the
    same scrape renders, gets the same line, byte for byte."""
    from eval.tracegen.generate import ADAPTER, URL, engine_records, pages
    from kvtop.model.records import to_dict
    from kvtop.plugin import load_adapter

    g = simulate(name, 1, 20.0)
    adapter = load_adapter(ADAPTER[g.sit.engine.semantics])()
    ours = [json.dumps(d, separators=(",", ":")) for d in engine_records(g, 1.0)]
    read = []
    for ts, text in pages(g, 1.0):
        (rec,) = adapter.parse(text, ts)
        rec.url = URL
        read.append(json.dumps(to_dict(rec), separators=(",", ":")))
    assert len(ours) == len(read) >= 19  # one scrape a second for 20 s
    assert ours == read
    last = json.loads(ours[-1])
    assert last["running"] > 0 and last["generation_tokens_total"] > 0 and last["itl"]["count"] > 0
    if name != "nopreempt":
        assert last["preemptions_total"] > 0


def test_nothing_arrives_during_a_host_pause(tmp_path):
    g = simulate("delivery", 1, 90.0)
    p = tmp_path / "dl.jsonl"
    write(g, str(p), 1.0)
    recs = [d for d in _lines(p)[1:] if d["kind"] in ("request", "engine")]
    assert recs
    for a, dur in g.host_pauses:
        assert not [d for d in recs if a + 0.001 < d["t"] < a + dur]


def test_a_gap_stretched_by_a_hold_is_labelled_by_the_hold_not_the_short_step_under_it(tmp_path: Path) -> None:
    """One gap, one cause: the one that accounts for most of its time over the target. The stepper
    writes a prefill span for every step of at least half the target (65 ms at 100 ms); when a slow
    reader or an API-server stall held that step's token for a second, the gap's time over the
    target is the hold's, and kvtop's "delivery" answer is the right one."""
    from eval.tracegen.generate import _dominant
    from eval.tracegen.situations import ITL_TARGET_S
    from eval.truth import label_span, truth_intervals

    assert _dominant(2.0, 0.065) == "hold"  # a 65 ms step under a 2 s gap
    assert _dominant(1.0, 0.9) == "step"  # a 900 ms prefill step that a reader delayed by 100 ms
    g = simulate("delivery", 1, 90.0)
    p = tmp_path / "dl.jsonl"
    write(g, str(p), 1.0)
    truth = truth_intervals(str(p))
    by_id = {s.req.id: s for s in g.streams}
    pairs = []  # (request, gap start, gap end, hold cause, the engine step's own seconds)
    for sp in g.run.spans:
        s = by_id.get(sp.rid)
        if s is None or sp.cause != "prefill_interference" or sp.i_to is None or sp.i_to >= len(s.deliv):
            continue
        a, b = s.deliv[sp.i_from], s.deliv[sp.i_to]
        for ha, hb, cause, _ in s.spans:
            if (ha, hb) == (a, b):
                pairs.append((sp.rid, a, b, cause, sp.detail["step_s"]))
    assert len(pairs) >= 3  # before: each of these gaps carried a prefill span too, and scoring gave it the tie
    for rid, a, b, cause, step_s in pairs:
        assert step_s < ITL_TARGET_S < b - a
        assert label_span(rid, a, b, truth) == cause
        assert not [x for x in truth[rid] if x[2] == "prefill_interference" and min(b, x[1]) - max(a, x[0]) > 0]


def test_the_step_cause_is_chosen_on_its_duration_without_a_host_pause_inside_it() -> None:
    """A 4,000-token prompt admitted next to one decoding stream: a 0.24 s prefill step. A 0.4 s
    host pause inside that step stretches the stream's gap to 0.64 s but changes neither the step's
    cause nor its recorded duration (the pause gets its own truth span in the delivery model)."""
    import random

    from eval.tracegen.stepper import EngineSpec, Req, Stepper

    def run(pauses: list[tuple[float, float]]) -> list[tuple[str, dict[str, Any], float]]:
        reqs = [Req("a", "x", 0.0, 100, 200, need=100), Req("b", "x", 0.5, 4000, 10, need=4000)]
        r = Stepper(EngineSpec(chunked=False), reqs, random.Random(1), pauses, 0.1).simulate(3.0)
        em = reqs[0].emits
        return [(sp.cause, sp.detail, em[sp.i_to][0] - em[sp.i_from][0]) for sp in r.spans if sp.i_to is not None]

    plain, paused = run([]), run([(0.6, 0.4)])
    assert [(c, d) for c, d, _ in plain] == [(c, d) for c, d, _ in paused] != []
    (cause, detail, gap), (_, _, gap_paused) = plain[0], paused[0]
    assert cause == "prefill_interference" and 0.2 < detail["step_s"] < 0.3
    assert gap_paused - gap == pytest.approx(0.4, abs=1e-6)
