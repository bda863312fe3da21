"""`kvtop compare A B`: figures of two runs of the same traffic and the one-line outcome."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
from conftest import REPO, run_kvtop

from kvtop.analysis.compare import compare

SCHEMA = json.loads((REPO / "kvtop" / "schemas" / "compare.schema.json").read_text())
HEAD = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-01-01T00:00:00.000Z",
        "host": "h", "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "kv": {}}


def _trace(path: Path, n: int = 40, stalled: int = 0, stall_s: float = 0.5, preempts: int = 0,
           errors: int = 0, every_s: float = 0.5, tokens: int = 30, gap_s: float = 0.02) -> Path:
    """``n`` requests every ``every_s``, ``tokens`` tokens ``gap_s`` apart; the first ``stalled`` stall
    ``stall_s`` once mid-stream (the engine counts ``preempts`` preemptions over the run); the last
    ``errors`` are answered with an error instead."""
    recs: list[dict[str, Any]] = []
    for i in range(n):
        rid, t0 = f"r{i}", i * every_s
        recs.append({"kind": "request", "t": t0, "id": rid, "event": "arrive", "prompt_tokens": 500,
                     "class": "chat" if i % 2 else "batch", "source": "proxy"})
        if i >= n - errors:
            recs.append({"kind": "request", "t": t0 + 0.01, "id": rid, "event": "error", "status": 503,
                         "error": "http_503"})
            continue
        t = t0 + 0.05
        for k in range(tokens):
            recs.append({"kind": "request", "t": round(t, 6), "id": rid,
                         "event": "first_token" if k == 0 else "token", "n": 1})
            t += stall_s if (i < stalled and k == tokens // 2) else gap_s
        recs.append({"kind": "request", "t": round(t, 6), "id": rid, "event": "finish", "finish_reason": "length",
                     "completion_tokens": tokens})
    end = n * every_s + 2
    for s in range(int(end) + 1):
        recs.append({"kind": "engine", "t": float(s), "adapter": "vllm", "url": "http://127.0.0.1:8000", "up": True,
                     "preemptions_total": round(preempts * s / end), "running": 3, "waiting": 0})
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
    for args, msg in ((["nope.jsonl", str(b)], "no such trace"), ([str(a), str(b), "--itl-target-ms", "-1"], "between")):
        r = run_kvtop("compare", *args)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1
