"""`kvtop compare A B`: figures of two runs of the same traffic and the one-line outcome."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jsonschema
from conftest import REPO, run_kvtop

from kvtop.analysis.compare import RunFigures, Tolerance, compare, judge

LOOP = REPO / "tests" / "fixtures" / "loop"  # a real vLLM before/after pair: SOURCES.md there
SCHEMA = json.loads((REPO / "kvtop" / "schemas" / "compare.schema.json").read_text())
HEAD = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-01-01T00:00:00.000Z",
        "host": "h", "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "kv": {}}


def _trace(path: Path, n: int = 40, stalled: int = 0, stall_s: float = 0.5, preempts: int = 0,
           errors: int = 0, every_s: float = 0.5, tokens: int = 30, gap_s: float = 0.02,
           ttfts: list[float] | None = None, stalls: list[float] | None = None,
           prefix_hit: float | None = None) -> Path:
    """``n`` requests every ``every_s``, ``tokens`` tokens ``gap_s`` apart; the first ``stalled`` stall
    ``stall_s`` once mid-stream (the engine counts ``preempts`` preemptions over the run); the last
    ``errors`` are answered with an error instead. ``ttfts`` / ``stalls``: request i's time to first
    token (default 50 ms) and mid-stream stall, one each. ``prefix_hit``: the share of the 1,000
    prompt tokens a second the engine's prefix cache counts as hits (no such counters when None)."""
    recs: list[dict[str, Any]] = []
    for i in range(n):
        rid, t0 = f"r{i}", i * every_s
        recs.append({"kind": "request", "t": t0, "id": rid, "event": "arrive", "prompt_tokens": 500,
                     "class": "chat" if i % 2 else "batch", "source": "proxy"})
        if i >= n - errors:
            recs.append({"kind": "request", "t": t0 + 0.01, "id": rid, "event": "error", "status": 503,
                         "error": "http_503"})
            continue
        t = t0 + (ttfts[i] if ttfts else 0.05)
        stall = stalls[i] if stalls else stall_s if i < stalled else gap_s
        for k in range(tokens):
            recs.append({"kind": "request", "t": round(t, 6), "id": rid,
                         "event": "first_token" if k == 0 else "token", "n": 1})
            t += stall if k == tokens // 2 else gap_s
        recs.append({"kind": "request", "t": round(t, 6), "id": rid, "event": "finish", "finish_reason": "length",
                     "completion_tokens": tokens})
    end = math.ceil(max(d["t"] for d in recs)) + 2
    for s in range(int(end) + 1):
        recs.append({"kind": "engine", "t": float(s), "adapter": "vllm", "url": "http://127.0.0.1:8000", "up": True,
                     "preemptions_total": round(preempts * s / end), "running": 3, "waiting": 0})
        if prefix_hit is not None:
            recs[-1].update(prefix_queries_total=1000.0 * s, prefix_hits_total=round(1000.0 * s * prefix_hit))
    recs.sort(key=lambda d: d["t"])
    path.write_text("\n".join(json.dumps(d) for d in [HEAD, *recs]) + "\n")
    return path


def test_fewer_stalls_at_equal_load_is_improved(tmp_path: Path):
    a = _trace(tmp_path / "a.jsonl", stalled=12, preempts=12)
    b = _trace(tmp_path / "b.jsonl", stalled=1, preempts=1)
    c = compare(str(a), str(b), itl_target_s=0.1)
    assert c.outcome == "improved", c.to_dict()
    assert (c.a.offered, c.b.offered, c.a.completed, c.b.completed) == (40, 40, 40, 40)
    assert (c.a.goodput, c.b.goodput) == (28, 39)  # a 0.5 s stall is 0.4 s over the 100 ms target: more than one target
    assert abs(c.a.preemptions_per_completed - 12 / 40) < 1e-9 and abs(c.b.preemptions_per_completed - 1 / 40) < 1e-9
    assert 0.45 < c.a.itl_p99_s < 0.55 and 0.018 < c.b.itl_p99_s < 0.022
    assert any(x.startswith("goodput 28 -> 39") for x in c.better)
    doc = c.to_dict()
    jsonschema.validate(doc, SCHEMA)
    # the same run against itself: nothing moved
    same = compare(str(a), str(a), itl_target_s=0.1)
    assert same.outcome == "no_change" and not same.better and not same.worse


def test_shedding_load_is_worse_even_with_better_latency(tmp_path: Path):
    a = _trace(tmp_path / "a.jsonl", stalled=12, preempts=12)
    b = _trace(tmp_path / "b.jsonl", errors=6)  # no stall left, but 6 of 40 requests refused
    c = compare(str(a), str(b), itl_target_s=0.1)
    assert c.outcome == "worse", c.to_dict()
    assert any(w.startswith("completed 40 -> 34") for w in c.worse)
    assert any(w.startswith("shed") for w in c.worse)
    assert any(x.startswith("p99 ITL") for x in c.better)  # the latency did improve: it does not count
    # the line leads with what decided and names the gain as a gain, not under "worse:"
    assert c.summary.startswith("worse: completed 40 -> 34 of 40 (-15%)") and "p99 ITL" in c.summary.split("; better: ", 1)[1]


def test_different_offered_load_is_not_comparable(tmp_path: Path):
    a = _trace(tmp_path / "a.jsonl")
    b = _trace(tmp_path / "b.jsonl", n=30)
    fast = _trace(tmp_path / "fast.jsonl", every_s=0.25)
    c = compare(str(a), str(b))
    assert c.outcome == "not_comparable" and any("offered requests differ by -25.0%" in r for r in c.reasons)
    c = compare(str(a), str(fast))
    assert c.outcome == "not_comparable" and any("offered rate differs by +100.0%" in r for r in c.reasons)


def test_a_burst_is_compared_by_its_counts_not_a_rate(tmp_path: Path):
    """Eight requests sent at once (a replayed storm) land within tens of ms of each other: the spread
    is the client's jitter, so a 40 ms vs 65 ms span is no "+63 % offered rate"."""
    a = _trace(tmp_path / "a.jsonl", n=8, every_s=0.008, stalled=8, preempts=8)
    b = _trace(tmp_path / "b.jsonl", n=8, every_s=0.005)
    c = compare(str(a), str(b), itl_target_s=0.1)
    assert c.outcome == "improved" and not any("offered rate" in r for r in c.reasons), c.reasons


def test_ttft_contract_counts_in_goodput(tmp_path: Path):
    a = _trace(tmp_path / "a.jsonl")
    c = compare(str(a), str(a), ttft_target_s=0.04, itl_target_s=0.1)
    assert c.a.goodput == 0  # every first token came 50 ms after its arrival
    c = compare(str(a), str(a), ttft_target_s=0.06, itl_target_s=0.1)
    assert c.a.goodput == 40


def test_compare_cli_text_json_and_bad_input(tmp_path: Path):
    a = _trace(tmp_path / "a.jsonl", stalled=12, preempts=12)
    b = _trace(tmp_path / "b.jsonl", stalled=1, preempts=1)
    r = run_kvtop("compare", str(a), str(b), "--itl-target-ms", "100")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("result: improved: goodput 28 -> 39")
    assert any(x.startswith("preemptions / completed") and "0.3" in x and "0.025" in x for x in lines)
    r = run_kvtop("compare", str(a), str(b), "--itl-target-ms", "100", "--format", "json")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["outcome"] == "improved" and doc["a"]["goodput"] == 28 and doc["itl_target_s"] == 0.1
    for args, msg in ((["nope.jsonl", str(b)], "no such trace"), ([str(a), str(b), "--itl-target-ms", "-1"], "must be > 0")):
        r = run_kvtop("compare", *args)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_runs_pooled_keep_one_host_stall_from_deciding(tmp_path: Path):
    """Two runs of each configuration. In B's first, a stall outside the engine held every stream
    0.5 s once (all 40 miss the contract); alone that pair reads "worse: goodput 5 -> 0". Pooled with
    the second pair, the figures are sums and percentiles over all 80 requests: goodput 10 -> 39 of 80."""
    a1 = _trace(tmp_path / "a1.jsonl", stalled=35, preempts=35)
    a2 = _trace(tmp_path / "a2.jsonl", stalled=35, preempts=35)
    b1 = _trace(tmp_path / "b1.jsonl", stalled=40)
    b2 = _trace(tmp_path / "b2.jsonl", stalled=1, preempts=1)
    alone = compare(str(a1), str(b1), itl_target_s=0.1)
    assert alone.outcome == "worse" and alone.summary.startswith("worse: goodput 5 -> 0 of 40"), alone.summary
    c = compare([str(a1), str(a2)], [str(b1), str(b2)], itl_target_s=0.1)
    assert c.outcome == "improved", c.summary
    assert (c.a.offered, c.b.offered, c.a.goodput, c.b.goodput) == (80, 80, 10, 39)
    assert (c.a.preemptions, c.b.preemptions) == (70, 1)
    assert c.a.runs == [str(a1), str(a2)] and c.a.span_s == 2 * 19.5 and c.a.rate_per_s == (80 - 2) / 39  # two runs: n - 1 gaps each
    assert abs(sum(c.b.over_target_s.values()) - 41 * 0.4) < 0.05  # 40 + 1 stalls of 0.5 s, each 0.4 s over
    doc = c.to_dict()
    jsonschema.validate(doc, SCHEMA)
    r = run_kvtop("compare", str(a1), str(b1), "--also", str(a2), str(b2), "--itl-target-ms", "100")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"A: 2 runs pooled: {a1}, {a2}"
    assert r.stdout.splitlines()[-1].startswith("result: improved: goodput 10 -> 39 of 80"), r.stdout
    r = run_kvtop("compare", str(a1), str(b1), "--also", str(a2), str(tmp_path / "nope.jsonl"))
    assert r.returncode == 2 and "no such trace" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _queued_instead_of_stalled(tmp_path: Path) -> tuple[Path, Path]:
    """Eight requests at once on an engine that fits two: A admits all and thrashes (request i stalls
    mid-stream while the pairs before it run, 0.63 s a pair), B admits two at a time (request i waits
    that long for its first token). Every request ends at the same moment in both."""
    waits = [(i // 2) * 0.63 for i in range(8)]
    a = _trace(tmp_path / "a.jsonl", n=8, every_s=0.001, stalls=[w + 0.02 for w in waits], preempts=6)
    b = _trace(tmp_path / "b.jsonl", n=8, every_s=0.001, ttfts=[0.05 + w for w in waits])
    return a, b


def test_a_queue_traded_for_stalls_is_a_trade_off_not_an_improvement(tmp_path: Path):
    a, b = _queued_instead_of_stalled(tmp_path)
    c = compare(str(a), str(b), itl_target_s=0.1)
    doc = c.to_dict()
    jsonschema.validate(doc, SCHEMA)
    # the ITL contract alone: every stall gone, every request meets it...
    assert (c.a.goodput, c.b.goodput) == (2, 8)
    assert any(x.startswith("goodput 2 -> 8 of 8") for x in c.better)
    # ...but the first token now waits up to 1.9 s instead of 50 ms, and nothing ends sooner
    assert c.outcome == "trade_off", doc
    assert c.outside_contract == [w for w in c.worse if w.startswith("p99 TTFT")] and len(c.outside_contract) == 1
    assert c.outside_contract[0].startswith("p99 TTFT 50.1 ms -> 1.95 s")  # 2 % bins
    assert abs(c.a.e2e_p99_s - c.b.e2e_p99_s) < 0.05 * c.a.e2e_p99_s
    assert c.a.output_tokens == c.b.output_tokens == 8 * 30
    assert abs(c.a.makespan_s - c.b.makespan_s) < 1e-3 and abs(c.a.makespan_s - (0.007 + 1.89 + 0.05 + 30 * 0.02)) < 0.001
    assert doc["summary"].startswith("trade-off: better on the ITL contract (goodput 2 -> 8 of 8")
    assert doc["summary"].endswith("set --ttft-target-ms to judge both")
    # with the TTFT contract the operator would set (1 s), goodput judges both: 2 -> 4, improved
    c = compare(str(a), str(b), ttft_target_s=1.0, itl_target_s=0.1)
    assert (c.a.goodput, c.b.goodput) == (2, 4) and c.outcome == "improved" and not c.outside_contract, c.to_dict()
    assert any(w.startswith("p99 TTFT") for w in c.worse)  # still shown, judged by goodput
    # a TTFT contract B meets no better than A: the ITL gain does not carry it
    c = compare(str(a), str(b), ttft_target_s=0.5, itl_target_s=0.1)
    assert (c.a.goodput, c.b.goodput) == (2, 2) and c.outcome == "mixed", c.to_dict()


def test_slower_end_to_end_outside_the_contract_is_a_trade_off(tmp_path: Path):
    """B meets the ITL contract by pacing every token at 60 ms instead of stalling: under the 100 ms
    target, but each 30-token answer takes almost three times as long."""
    a = _trace(tmp_path / "a.jsonl", stalled=12, preempts=12)
    b = _trace(tmp_path / "b.jsonl", gap_s=0.06)
    c = compare(str(a), str(b), itl_target_s=0.1)
    assert c.outcome == "trade_off", c.to_dict()
    assert any(w.startswith("p99 end-to-end latency") for w in c.outside_contract), c.outside_contract
    # 50 ms + 30 gaps of 20 / 60 ms (the finish one gap after the last token; 2 % bins)
    assert abs(c.a.e2e_p50_s / 0.65 - 1) < 0.02 and abs(c.b.e2e_p50_s / 1.85 - 1) < 0.02


def test_completing_the_requests_the_other_run_lost_is_not_a_slower_end_to_end():
    """The simulator's cancel-heavy loop: A's clients gave up on 76 of 191 requests (the longest)
    during preemption stalls; with room for them in the KV cache B completes all 191. B's p99 end to
    end is longer only because it includes the long answers A never finished: that is judged by
    completed and goodput, not counted against B."""
    common = dict(offered=191, span_s=60.0, classes={"chat": 191}, prompt_mean=900.0, itl_p99_s=0.0095,
                  ttft_p99_s=6.9, output_tokens=100_000, makespan_s=90.0)
    a = RunFigures("a", completed=115, cancelled=76, goodput=69, e2e_p99_s=29.5, **common)
    b = RunFigures("b", completed=191, goodput=191, e2e_p99_s=35.2,
                   **{**common, "itl_p99_s": 0.0445, "ttft_p99_s": 1.5, "output_tokens": 154_000})
    c = judge(a, b, Tolerance(), None, 0.1)
    assert c.outcome == "improved", c.to_dict()
    assert not any(x.startswith("p99 end-to-end") for x in c.better + c.worse)
    # the same latencies between runs that completed the same share are compared
    a2 = RunFigures("a", completed=191, goodput=69, e2e_p99_s=29.5, **common)
    c = judge(a2, b, Tolerance(), None, 0.1)
    assert c.outcome == "trade_off" and c.outside_contract == ["p99 end-to-end latency 29.5 s -> 35.2 s (+19%)"], \
        c.to_dict()


def test_the_real_vllm_loop_pair_is_a_trade_off_until_ttft_is_judged():
    """The tier's real run: the advisor's --max-num-seqs 2 took preemptions from 2.6 to 0.6 per request
    and p99 ITL from 30.5 to 19.8 ms by queueing 6 of 8 requests for 4-13 s before their first token;
    end-to-end latency and throughput moved by under 10 %."""
    before, after = str(LOOP / "vllm-storm-before.jsonl.gz"), str(LOOP / "vllm-storm-after.jsonl.gz")
    c = compare(before, after, itl_target_s=0.1)
    jsonschema.validate(c.to_dict(), SCHEMA)
    assert c.outcome == "trade_off", c.to_dict()
    assert (c.a.goodput, c.b.goodput, c.a.completed, c.b.completed) == (0, 5, 8, 8)
    assert c.outside_contract == ["p99 TTFT 249 ms -> 13.3 s (+5253%)"]
    assert c.a.output_tokens == c.b.output_tokens == 8 * 600
    assert abs(c.a.makespan_s - 18.24) < 0.01 and abs(c.b.makespan_s - 16.69) < 0.01
    assert 17.4 < c.a.e2e_p99_s < 18.2 and 16.3 < c.b.e2e_p99_s < 17.0
    assert not any(x.startswith(("output throughput", "p99 end-to-end")) for x in c.better + c.worse)
    # a 2 s TTFT contract: one request of eight meets both (it was none before)
    c = compare(before, after, ttft_target_s=2.0, itl_target_s=0.1)
    assert (c.a.goodput, c.b.goodput) == (0, 1) and c.outcome == "improved", c.to_dict()


def test_compare_cli_says_trade_off_in_its_last_line(tmp_path: Path):
    a, b = _queued_instead_of_stalled(tmp_path)
    r = run_kvtop("compare", str(a), str(b), "--itl-target-ms", "100")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[-1].startswith("result: trade-off: better on the ITL contract") and "worse outside it: p99 TTFT" in out[-1]
    assert any(x.startswith("end-to-end p50 / p99") for x in out) and any(x.startswith("output tokens/s") for x in out)
    assert "TTFT: none (--ttft-target-ms)" in out[2]


def test_a_replay_the_prefix_cache_served_is_named_not_pooled(tmp_path: Path):
    """A trace replay's prompts share no prefix, so a run whose prompts the engine's prefix cache served
    had been sent them before: in a CI run of the real-vLLM prefill loop, the second `before` replay
    on the same engine with the same --seed took 18 ms to first token where the first took 0.3-1.3 s,
    no stream stalled, and the pooled `before` hid the budget's goodput gain (16 -> 16 of 20). Runs of
    one configuration whose cache shares differ by more than 25 points are not comparable; sides that
    differ get a note (the change may be prefix caching itself), printed above the result line."""
    a1 = _trace(tmp_path / "a1.jsonl", stalled=20, preempts=20, prefix_hit=0.0)
    a2 = _trace(tmp_path / "a2.jsonl", prefix_hit=0.97)  # the same prompts again: served from the cache, no stall
    b1 = _trace(tmp_path / "b1.jsonl", stalled=2, prefix_hit=0.0)
    b2 = _trace(tmp_path / "b2.jsonl", stalled=2, prefix_hit=0.02)
    c = compare([str(a1), str(a2)], [str(b1), str(b2)], itl_target_s=0.1)
    assert c.outcome == "not_comparable", c.summary
    assert c.a.prefix_hit_shares == [0.0, 0.97] and c.b.prefix_hit_shares == [0.0, 0.02]
    assert len(c.reasons) == 1 and c.reasons[0].startswith("the engine's prefix cache served 0% / 97% of the prompt "
                                                           "tokens in A's runs"), c.reasons
    jsonschema.validate(c.to_dict(), SCHEMA)
    # runs of one configuration alike: compared, no note
    a3 = _trace(tmp_path / "a3.jsonl", stalled=20, preempts=20, prefix_hit=0.01)
    ok = compare([str(a1), str(a3)], [str(b1), str(b2)], itl_target_s=0.1)
    assert ok.outcome == "improved" and ok.notes == [], ok.summary
    # one side served from the cache: compared, with a note above the result line
    noted = compare(str(a2), str(b1), itl_target_s=0.1)
    assert noted.outcome != "not_comparable" and len(noted.notes) == 1, noted.to_dict()
    assert noted.notes[0].startswith("the engine's prefix cache served 97% of A's prompt tokens and 0% of B's")
    r = run_kvtop("compare", str(a2), str(b1), "--itl-target-ms", "100")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-2].startswith("note: the engine's prefix cache served 97% of A's") and lines[-1].startswith("result: ")
    assert any(ln.startswith("prefix cache served") and "97%" in ln for ln in lines), r.stdout
    # a trace without the counters says nothing of the cache
    plain = compare(str(_trace(tmp_path / "p1.jsonl")), str(_trace(tmp_path / "p2.jsonl")), itl_target_s=0.1)
    assert plain.a.prefix_hit_shares == [None] and not plain.notes and "prefix cache" not in json.dumps(plain.reasons)


def test_numbered_request_ids_are_compared_as_analyze_reads_them(tmp_path: Path):
    # older simulated traces number their requests: compare skipped them all ("offered no request")
    a = _trace(tmp_path / "a.jsonl")
    b = tmp_path / "b.jsonl"
    lines = [json.loads(x) for x in a.read_text().splitlines()]
    for d in lines:
        if d.get("kind") == "request":
            d["id"] = int(d["id"][1:])
    b.write_text("\n".join(json.dumps(d) for d in lines) + "\n")
    r = run_kvtop("compare", str(a), str(b), "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["b"]["offered"] == doc["a"]["offered"] == 40, doc["b"]


def test_tokens_of_a_resync_are_output_tokens(tmp_path: Path):
    # after bytes the capture lost, the next chunk is a "resync": its tokens streamed all the same
    a = _trace(tmp_path / "a.jsonl", n=4, tokens=10)
    lines = [json.loads(x) for x in a.read_text().splitlines()]
    for d in lines:
        if d.get("event") == "finish":
            d.pop("completion_tokens")  # a stream cut off before its usage: tokens are counted from chunks
    seen: set = set()
    for d in lines:
        if d.get("event") == "token" and d["id"] not in seen:
            seen.add(d["id"])
            d["event"], d["n"] = "resync", 3
    b = tmp_path / "b.jsonl"
    b.write_text("\n".join(json.dumps(d) for d in lines) + "\n")
    r = run_kvtop("compare", str(b), str(b), "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["b"]["output_tokens"] == 4 * (10 + 2)  # each resync carried 3, not 0


def test_a_rise_from_zero_smaller_than_the_target_decides_nothing(tmp_path: Path):
    # one gap 10 ms over a 50 ms target in B, where A had none: the same goodput (both 40 of 40, by
    # compare's own contract), and "worse: time over the ITL target 0 -> 10 ms" was its outcome
    a = _trace(tmp_path / "a.jsonl")
    b = _trace(tmp_path / "b.jsonl", stalls=[0.06] + [0.02] * 39)
    c = compare(str(a), str(b), itl_target_s=0.05)
    assert (c.a.goodput, c.b.goodput) == (40, 40)
    assert c.outcome == "no_change" and not c.worse, c.to_dict()
    # a real rise (a quarter second over the target) still counts
    b2 = _trace(tmp_path / "b2.jsonl", stalls=[0.3] + [0.02] * 39)
    assert any(x.startswith("time over the ITL target") for x in compare(str(a), str(b2), itl_target_s=0.05).worse)
    # and so does more than one preemption, where there was none
    p = _trace(tmp_path / "p.jsonl", preempts=1)
    assert compare(str(a), str(p), itl_target_s=0.05).outcome == "no_change"
    assert compare(str(a), str(_trace(tmp_path / "q.jsonl", preempts=6)), itl_target_s=0.05).outcome == "worse"


def test_one_request_of_goodput_in_142_decides_nothing():
    # the storm's 120 s loop: goodput 3 -> 2 of 142 read "-33 %: worse" while p99 TTFT fell 25.6 ->
    # 4.96 s, preemptions went and time over the target fell 88 -> 31 s
    common = dict(offered=142, span_s=120.0, classes={"chat": 142}, prompt_mean=900.0, output_tokens=100_000,
                  makespan_s=150.0, completed=142)
    a = RunFigures("a", goodput=3, itl_p99_s=0.0076, ttft_p99_s=25.6, e2e_p99_s=27.8, **common)
    b = RunFigures("b", goodput=2, itl_p99_s=0.0153, ttft_p99_s=4.96, e2e_p99_s=12.3, **common)
    c = judge(a, b, Tolerance(), None, 0.03)
    assert not any(x.startswith("goodput") for x in c.better + c.worse), c.to_dict()
    # three requests of 142 is more than 2 % of them: it counts
    c = judge(a, dataclasses.replace(b, goodput=6), Tolerance(), None, 0.03)
    assert any(x.startswith("goodput 3 -> 6") for x in c.better), c.to_dict()
