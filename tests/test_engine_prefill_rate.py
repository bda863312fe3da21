"""Where kvtop has measured no prefill rate of its own (it sees none of the long prompts: they come
from clients it does not observe), the engine's counters give one: its prompt tokens over the sum of
its TTFT histogram, read only where its prompts average 256 tokens or more (shorter ones' TTFT is
the step they rode in, as for kvtop's own sample). The generator's `mixed` situation (half its
streams unobserved) left stalls at the start of a run unchecked or unexplained for want of it."""

from __future__ import annotations

from pathlib import Path

from kvtop.analysis.scan import analyze_trace
from tests.trace_files import decoding_streams, write_trace

HEADER = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-04T00:00:00Z",
          "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "interval_s": 1.0}
STALL = (6.0, 6.3)  # every observed stream waits 300 ms while an unobserved prompt is prefilled


def _write(path: Path, prompt: int) -> None:
    """Three observed streams stepping 20 ms from 1 s to 10 s; the engine had prefilled five
    unobserved ``prompt``-token prompts before them (0.2 s of TTFT each) and one of ``3 * prompt / 2``
    (0.3 s) in the scrape interval in which the stall ends."""
    recs: list[dict] = []
    times = [1.0 + 0.02 * k for k in range(251)]  # 1.00 .. 6.00
    times += [STALL[1] + 0.02 * k for k in range(186)]  # 6.30 .. 10.00
    decoding_streams(recs, times, 0.95, 10.1)
    for k in range(11):
        t = 0.5 + k
        n, tokens, ttft = 5, 5 * prompt, 1.0  # the unobserved prompts before the streams began
        if t > 1.0:
            n, ttft = n + 3, ttft + 3 * 0.05  # the observed streams' own first tokens (prompt lengths unknown)
        if t > STALL[1]:
            n, tokens, ttft = n + 1, tokens + 3 * prompt // 2, ttft + 0.3
        recs.append({"kind": "engine", "t": t, "adapter": "vllm", "url": "http://127.0.0.1:8000", "engine": "0",
                     "up": True, "kv_usage": 0.3, "running": 3, "waiting": 0, "preemptions_total": 0,
                     "prompt_tokens_total": tokens, "ttft": {"count": n, "sum": ttft, "buckets": []}})
    write_trace(path, HEADER, recs)


def _stall(tmp_path: Path, prompt: int) -> set[tuple[str, bool]]:
    """The stall's causes, and whether a measured rate checked them."""
    _write(tmp_path / "t.jsonl", prompt)
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    got = {(s.cause, any("at the measured" in e for e in s.evidence))
           for s in rep.spikes if abs(s.t_end - STALL[1]) < 0.002}
    assert got, [(s.request_id, s.t_start, s.t_end) for s in rep.spikes]
    return got


def test_the_engines_own_rate_checks_a_prompt_kvtop_did_not_see(tmp_path):
    # 2,000-token prompts: the engine's rate (about 9,000 tokens/s) puts the unseen 3,000-token prompt
    # at 0.33 s, over the stall's excess: a checked call (before, with no rate of its own, kvtop took
    # the prompt-counter jump unchecked: `prefill/shared`, a lower confidence)
    assert _stall(tmp_path, 2000) == {("prefill_interference", True)}


def test_short_prompts_give_no_rate(tmp_path):
    # 200-token prompts: their TTFT is the step they rode in, not a prefill rate (read as one, about
    # 900 tokens/s, the unseen 300-token prompt would have covered the stall); with no rate, a rise
    # this small explains nothing
    assert _stall(tmp_path, 200) == {("unknown", False)}
