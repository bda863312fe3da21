"""Rule prefill-span: vLLM's own per-request times (``--enable-per-request-metrics``) place another
request's prefill in time, and the stalls inside it are that prefill's, whatever pace they leave behind."""

from __future__ import annotations

from pathlib import Path

from kvtop.analysis.scan import analyze_trace
from tests.trace_files import write_trace

HEADER = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-02T00:00:00Z",
          "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "interval_s": 1.0}


def _write(path: Path, engine_times: bool) -> None:
    """Three decoders at 20 ms a token; a 1,500-token prompt prefilled in six 400 ms chunk steps from
    t=5.0 (every decoder's token waits for each chunk step); its first token at 7.4, finish at 7.6."""
    recs: list[dict] = []
    chunk_ends = [5.4, 5.8, 6.2, 6.6, 7.0, 7.4]
    for i, rid in enumerate(("a", "b", "c")):
        recs.append({"kind": "request", "t": 0.1, "id": rid, "event": "arrive", "source": "proxy"})
        times = [1.0 + 0.02 * k + 0.001 * i for k in range(200)]  # 1.00 .. 4.98
        times += [t + 0.001 * i for t in chunk_ends]
        times += [7.42 + 0.02 * k + 0.001 * i for k in range(100)]
        recs.append({"kind": "request", "t": times[0], "id": rid, "event": "first_token", "n": 1})
        recs += [{"kind": "request", "t": t, "id": rid, "event": "token", "n": 1} for t in times[1:]]
        recs.append({"kind": "request", "t": 9.5, "id": rid, "event": "finish", "prompt_tokens": 60,
                     "completion_tokens": len(times)})
    recs.append({"kind": "request", "t": 4.9, "id": "long", "event": "arrive", "source": "proxy"})
    recs.append({"kind": "request", "t": 7.41, "id": "long", "event": "first_token", "n": 1})
    fin = {"kind": "request", "t": 7.6, "id": "long", "event": "finish", "prompt_tokens": 1500,
           "completion_tokens": 4}
    if engine_times:
        fin.update(engine_queue_s=0.05, engine_ttft_s=2.4, engine_decode_s=0.19)
    recs.append(fin)
    prompt_total = 0
    for k in range(12):  # scrapes; vLLM counts a prompt's tokens when its prefill completes
        t = 0.5 + k
        if t > 7.41:
            prompt_total = 1680
        elif t > 1.0:
            prompt_total = 180
        recs.append({"kind": "engine", "t": t, "adapter": "vllm", "url": "http://127.0.0.1:8000", "engine": "0",
                     "up": True, "kv_usage": 0.2, "running": 3, "waiting": 0, "preemptions_total": 0,
                     "prompt_tokens_total": prompt_total})
    write_trace(path, HEADER, recs)


def test_stalls_inside_an_engine_timed_prefill_are_that_prefills(tmp_path):
    _write(tmp_path / "t.jsonl", engine_times=True)
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    chunked = [s for s in rep.spikes if 5.0 < s.t_end <= 7.41]
    assert len(chunked) == 18  # six chunk steps x three streams
    assert {(s.cause, s.rule) for s in chunked} == {("prefill_interference", "span")}
    assert any("request long's prompt (1500 tokens)" in " ".join(s.evidence) for s in chunked)


def test_without_the_engines_times_the_same_stalls_are_not_called_span(tmp_path):
    _write(tmp_path / "t.jsonl", engine_times=False)
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    chunked = [s for s in rep.spikes if 5.0 < s.t_end <= 7.41]
    assert chunked and all(s.rule != "span" for s in chunked)


def test_live_and_file_analysis_agree_while_spikes_wait_for_the_report(tmp_path):
    _write(tmp_path / "t.jsonl", engine_times=True)
    fast = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1, fast=True)
    slow = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1, fast=False)
    key = [(s.request_id, s.t_end, s.cause, s.rule) for s in fast.spikes]
    assert key == [(s.request_id, s.t_end, s.cause, s.rule) for s in slow.spikes]


def test_an_intervals_prompt_tokens_explain_a_finite_amount_of_stall():
    """The prompt tokens one scrape interval added are so much prefill time: a stall they explain
    spends its whole span of it (streams stalled in the same step once), and once it is spent a later
    stall in the same interval gets no prefill signal from it."""
    from kvtop.analysis.attribution.timeline import EngineTimeline

    tl = EngineTimeline()
    for k, prompt in enumerate((0, 0, 2000, 2000)):
        tl.add(float(k), ("u", "0"), 3, 0, 0.3, 0, prompt)
    budget = 0.2  # seconds of prefill those tokens take at the measured rate
    # three streams stalled 1.2-1.7 in the same chunk step: one span, 0.3 x 0.5 s <= 0.2 s; it spends all of it
    for _ in range(3):
        assert tl.prefill_room(1.7, (1.2, 1.7), budget, 0.3)
        tl.claim_prefill(1.7, (1.2, 1.7))
    # a later stall in the same interval: nothing is left to cover 0.3 of its new 0.25 s
    assert not tl.prefill_room(1.95, (1.65, 1.95), budget, 0.3)
    # the next interval's tokens are its own
    assert tl.prefill_room(2.5, (2.2, 2.5), budget, 0.3)
    # at a tight target: 20 ms of prefill and stalls of 6 ms excess at different moments of the
    # interval explain three of them and a sliver, not the eleven that 0.3 of each would fit
    n = 0
    for k in range(12):
        span = (2.1 + 0.05 * k, 2.106 + 0.05 * k)
        if tl.prefill_room(2.9, span, 0.02, 0.3):
            tl.claim_prefill(2.9, span)
            n += 1
    assert n == 4  # 20 ms - 3 x 6 ms leaves 2 ms >= 0.3 x 6 ms; then nothing


def test_a_crowded_target_is_said_and_the_witness_lifts_it(tmp_path):
    """At 100 ms with 1 s scrapes the chunk steps put six stalls in each scrape interval that holds any:
    the report says the scrapes cannot separate their causes; at a looser target it does not."""
    _write(tmp_path / "t.jsonl", engine_times=True)
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    crowded = [w for w in rep.warnings if "stalls fall in each 1 s scrape interval" in w]
    assert len(crowded) == 1 and "docs/witness.md" in crowded[0]
    loose = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.3)
    assert not any("stalls fall in each" in w for w in loose.warnings)
