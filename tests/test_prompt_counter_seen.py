"""A prompt-counter rise is prefill evidence only for prompts kvtop did not see: where the engine's own
first-token count (its TTFT histogram) says kvtop saw every prefill of the interval, the rise points at
no prefill that a first token does not already place (scored against real vLLM's step log at tight
targets, such calls were almost never right), unless a request kvtop sees was waiting for its first
token all through the stall beyond what the engine's queue held (a long prompt's chunk steps)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtop.analysis.scan import analyze_trace

HEADER = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-03T00:00:00Z",
          "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "interval_s": 1.0}
STALL = (3.2, 3.45)  # every decoder waits 250 ms: a slow step, no prefill in it


def _dump(path: Path, recs: list[dict]) -> None:
    recs.sort(key=lambda d: d["t"])
    with open(path, "w") as f:
        f.write(json.dumps(HEADER) + "\n")
        for d in recs:
            f.write(json.dumps(d) + "\n")


def _write(path: Path, *, unseen: int, counts: bool = True, long_arrives: float = 3.5, waiting: int = 0) -> None:
    """Three decoders at 20 ms a token from t=1 with a 250 ms stall at 3.2-3.45; an observed 600-token
    request arrives at ``long_arrives`` and gets its first token at 3.55; ``unseen`` prompts of 600
    tokens that kvtop never saw complete in the same scrape interval (3-4 s)."""
    recs: list[dict] = []
    for i, rid in enumerate(("a", "b", "c")):
        recs.append({"kind": "request", "t": 0.9, "id": rid, "event": "arrive", "source": "proxy", "prompt_tokens": 50})
        times = [1.0 + 0.02 * k + 0.001 * i for k in range(111)]  # 1.00 .. 3.20
        times += [STALL[1] + 0.02 * k + 0.001 * i for k in range(150)]
        recs.append({"kind": "request", "t": times[0], "id": rid, "event": "first_token", "n": 1})
        recs += [{"kind": "request", "t": t, "id": rid, "event": "token", "n": 1} for t in times[1:]]
        recs.append({"kind": "request", "t": times[-1] + 0.01, "id": rid, "event": "finish", "prompt_tokens": 50,
                     "completion_tokens": len(times)})
    recs.append({"kind": "request", "t": long_arrives, "id": "x", "event": "arrive", "source": "proxy",
                 "prompt_tokens": 600})
    recs.append({"kind": "request", "t": 3.55, "id": "x", "event": "first_token", "n": 1})
    recs.append({"kind": "request", "t": 3.7, "id": "x", "event": "finish", "prompt_tokens": 600,
                 "completion_tokens": 4})
    for k in range(8):
        t = 0.5 + k
        firsts = 3 + (1 + unseen if t > 3.55 else 0)
        d = {"kind": "engine", "t": t, "adapter": "vllm", "url": "http://127.0.0.1:8000", "engine": "0", "up": True,
             "kv_usage": 0.2, "running": 3, "waiting": waiting if 2.0 < t < 4.0 else 0, "preemptions_total": 0,
             "prompt_tokens_total": 150 + (600 * (1 + unseen) if t > 3.55 else 0)}
        if counts:
            d["ttft"] = {"buckets": [[0.1, firsts], ["+Inf", firsts]], "count": firsts, "sum": 0.05 * firsts}
        recs.append(d)
    _dump(path, recs)


def _stall(path: Path) -> list[tuple[str, str | None]]:
    rep = analyze_trace(str(path), itl_target_s=0.1)
    return sorted({(str(s.cause), s.rule) for s in rep.spikes if abs(s.t_end - STALL[1]) < 0.01})


def test_a_rise_of_prompts_kvtop_saw_elsewhere_explains_no_stall(tmp_path):
    _write(tmp_path / "t.jsonl", unseen=0)
    assert _stall(tmp_path / "t.jsonl") == [("unknown", "shared")]


def test_a_rise_with_prompts_kvtop_did_not_see_still_does(tmp_path):
    _write(tmp_path / "t.jsonl", unseen=1)
    assert _stall(tmp_path / "t.jsonl") == [("prefill_interference", "shared")]


def test_an_engine_without_a_first_token_count_keeps_the_rise(tmp_path):
    _write(tmp_path / "t.jsonl", unseen=0, counts=False)
    assert _stall(tmp_path / "t.jsonl") == [("prefill_interference", "shared")]


def test_a_request_waiting_through_the_stall_beyond_the_queue_keeps_the_rise(tmp_path):
    """``x`` arrived before the stall and got its first token after it: with nothing queued in the
    engine it was in prefill all through it (its chunks); with one request queued at the scrapes
    before and after the stall it may have been that one, waiting, and the rise is no evidence again."""
    _write(tmp_path / "t.jsonl", unseen=0, long_arrives=2.4)
    assert _stall(tmp_path / "t.jsonl") == [("prefill_interference", "shared")]
    _write(tmp_path / "q.jsonl", unseen=0, long_arrives=2.4, waiting=1)
    assert _stall(tmp_path / "q.jsonl") == [("unknown", "shared")]


def test_both_paths_agree(tmp_path):
    _write(tmp_path / "t.jsonl", unseen=0)
    fast = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1, fast=True)
    slow = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1, fast=False)
    assert [(s.request_id, s.t_end, s.cause, s.rule) for s in fast.spikes] == \
        [(s.request_id, s.t_end, s.cause, s.rule) for s in slow.spikes]


def _write_steady(path: Path) -> None:
    """Decoders a, b, c (2,000-token prompts) at 20 ms a token from t=1; an observed 2,000-token request
    admitted in every scrape interval but the one in which every decoder stalls 250 ms (4.2-4.45), where
    a 2,000-token prompt kvtop never saw completes: that interval adds no more than the usual one."""
    recs: list[dict] = []
    for i, rid in enumerate(("a", "b", "c")):
        recs.append({"kind": "request", "t": 0.9, "id": rid, "event": "arrive", "source": "proxy",
                     "prompt_tokens": 2000})
        times = [1.0 + 0.02 * k + 0.001 * i for k in range(161)]  # 1.00 .. 4.20
        times += [4.45 + 0.02 * k + 0.001 * i for k in range(200)]
        recs.append({"kind": "request", "t": times[0], "id": rid, "event": "first_token", "n": 1})
        recs += [{"kind": "request", "t": t, "id": rid, "event": "token", "n": 1} for t in times[1:]]
        recs.append({"kind": "request", "t": times[-1] + 0.01, "id": rid, "event": "finish", "prompt_tokens": 2000,
                     "completion_tokens": len(times)})
    observed = [k for k in range(1, 8) if k != 3]
    for k in observed:
        rid = f"o{k}"
        recs.append({"kind": "request", "t": k + 0.6, "id": rid, "event": "arrive", "source": "proxy",
                     "prompt_tokens": 2000})
        recs.append({"kind": "request", "t": k + 0.8, "id": rid, "event": "first_token", "n": 1})
        recs.append({"kind": "request", "t": k + 0.9, "id": rid, "event": "finish", "prompt_tokens": 2000,
                     "completion_tokens": 3})
    for j in range(9):
        t = 0.5 + j
        firsts = 3 + sum(k + 0.8 < t for k in observed) + (t > 4.45)
        prompt = 6000 + 2000 * sum(k + 0.8 < t for k in observed) + 2000 * (t > 4.45)
        recs.append({"kind": "engine", "t": t, "adapter": "vllm", "url": "http://127.0.0.1:8000", "engine": "0",
                     "up": True, "kv_usage": 0.2, "running": 3, "waiting": 0, "preemptions_total": 0,
                     "prompt_tokens_total": prompt,
                     "ttft": {"buckets": [[0.5, firsts], ["+Inf", firsts]], "count": firsts, "sum": 0.2 * firsts}})
    _dump(path, recs)


def test_an_unseen_prompt_in_a_quiet_interval_is_measured_against_the_prompts_kvtop_saw(tmp_path):
    """Beyond the usual rise, the stall's interval added nothing (2,000 tokens, as usual); against the
    prompts kvtop saw complete there (none), its 2,000 tokens are an unseen prefill of 100 ms at the
    measured 20,000 tokens/s (a, b, c: 2,000 tokens in 0.1 s): enough for the 230 ms stall's excess
    over the decoders' pace."""
    _write_steady(tmp_path / "t.jsonl")
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    stalls = [s for s in rep.spikes if abs(s.t_end - 4.45) < 0.01]
    assert len(stalls) == 3
    assert {(str(s.cause), s.rule) for s in stalls} == {("prefill_interference", "shared")}
    assert all("added 2000 prompt tokens more than usual" in " ".join(s.evidence) for s in stalls)
