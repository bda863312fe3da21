"""A stream too young to have shown a decode-only step takes its pace from the older streams stalled
with it: its only gap so far was another request's prefill step, and read as its pace that step made
the next prefill stall look like the stream's own slow decode. Not below its own look-ahead, though:
an engine that just slowed shows it only in the gaps ahead."""

from __future__ import annotations

from pathlib import Path

from kvtop.analysis.scan import analyze_trace
from tests.trace_files import write_trace

HEADER = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-04T00:00:00Z",
          "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "interval_s": 1.0}
STEP = 0.02  # the engine's decode step (s)
FIRST = (2.9, 3.2)  # a 3,000-token prompt's step: every decoder waits 300 ms
SECOND = (3.2, 3.45)  # then a 2,500-token prompt's: 250 ms
RATE = 10_000  # prompt tokens/s, as five observed requests' prompts / TTFT measure it


def _tokens(rid: str, times: list[float]) -> list[dict]:
    return [{"kind": "request", "t": t, "id": rid, "event": "first_token" if k == 0 else "token", "n": 1}
            for k, t in enumerate(times)]


def _after(t0: float, step: float, until: float = 6.0) -> list[float]:
    return [t0 + step * k for k in range(1, int((until - t0) / step))]


def _trace(path: Path, step_after: float) -> None:
    """Decoders a, b and c stream from 0.3 s at the engine's step; request y's first token comes as
    the 3,000-token prompt's step begins, so its first gap is that step. Both prompts' requests (p1,
    p2) are observed, and so are five earlier ones that measure the prefill rate. After the second
    step every stream's gaps are ``step_after`` long."""
    recs: list[dict] = []
    for rid in "abc":
        times = [0.3 + STEP * k for k in range(int((FIRST[0] - 0.3) / STEP) + 1)]
        times += [FIRST[1], SECOND[1]] + [SECOND[1] + t for t in _after(0.0, step_after, 6.0 - SECOND[1])]
        recs += [{"kind": "request", "t": 0.1, "id": rid, "event": "arrive", "source": "proxy", "prompt_tokens": 500}]
        recs += _tokens(rid, times)
    recs += [{"kind": "request", "t": 2.5, "id": "y", "event": "arrive", "source": "proxy", "prompt_tokens": 400}]
    recs += _tokens("y", [FIRST[0], FIRST[1], SECOND[1]] + [SECOND[1] + t for t in _after(0.0, step_after, 6.0 - SECOND[1])])
    for k, (t0, prompt) in enumerate([(0.4, 2000), (0.8, 2000), (1.2, 2000), (1.6, 2000), (2.0, 2000),
                                      (FIRST[1] - 0.3, 3000), (SECOND[1] - 0.25, 2500)]):
        rid = f"p{k}"
        recs += [{"kind": "request", "t": t0, "id": rid, "event": "arrive", "source": "proxy", "prompt_tokens": prompt},
                 {"kind": "request", "t": t0 + prompt / RATE, "id": rid, "event": "first_token", "n": 1},
                 {"kind": "request", "t": t0 + prompt / RATE + 0.001, "id": rid, "event": "finish",
                  "prompt_tokens": prompt, "completion_tokens": 1}]
    prompts = 1500.0
    for k in range(7):
        t = 0.5 + k
        prompts += sum(d["prompt_tokens"] for d in recs if d.get("event") == "finish" and t - 1 < d["t"] <= t)
        recs.append({"kind": "engine", "t": t, "adapter": "vllm", "url": "http://127.0.0.1:8000", "engine": "0",
                     "up": True, "kv_usage": 0.3, "running": 4, "waiting": 0, "preemptions_total": 0,
                     "prompt_tokens_total": prompts})
    write_trace(path, HEADER, recs)


def _second_stall(path: Path) -> dict[str, tuple[str, str, list[str]]]:
    rep = analyze_trace(str(path), itl_target_s=0.1)
    return {s.request_id: (str(s.cause), s.rule, s.evidence) for s in rep.spikes if abs(s.t_end - SECOND[1]) < 0.005}


def test_a_young_stream_shares_the_prefill_stall_of_its_company(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    _trace(p, STEP)
    got = _second_stall(p)
    assert set(got) == {"a", "b", "c", "y"}
    # the older decoders: p6's 2,500 tokens at the measured rate cover the 230 ms beyond their 20 ms step
    assert {got[r][0] for r in "abc"} == {"prefill_interference"}
    # y's one gap before it (300 ms, the first prompt's step) is no pace of its own: the same call,
    # where its fastest gap read as its decode step called it slow decode
    cause, rule, lines = got["y"]
    assert (cause, rule) == ("prefill_interference", "shared")
    assert any("p6 got its first token at the end of the stall (2500 prompt tokens)" in x for x in lines)
    assert any("prompt tokens/s that prefill covers the stall" in x for x in lines)


def test_an_engine_that_slowed_keeps_the_young_streams_slow_pace(tmp_path: Path) -> None:
    # after the second prompt's step every gap is 240 ms: the engine slowed (throttled clocks, a
    # flood of requests) and the stall's 250 ms is about one of its new steps; the older streams'
    # 20 ms pace before it says nothing of that, and y's own look-ahead does
    p = tmp_path / "t.jsonl"
    _trace(p, 0.24)
    cause, rule, _ = _second_stall(p)["y"]
    assert cause == "slow_decode", (cause, rule)
