"""vLLM's per-request metrics object (``--enable-per-request-metrics``): read as numbers onto the
finish record, never text, and used as evidence (issue 12, deliverable 3)."""

from __future__ import annotations

import json

import pytest

from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.report import build_report
from kvtop.model.records import RequestRecord, to_dict
from kvtop.model.validate import record_ok
from kvtop.sources.sse import StreamRecorder, engine_metrics

SECRET = "PROMPT-OR-COMPLETION-TEXT"


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def vllm_stream(metrics: dict | None) -> list[bytes]:
    """A /v1/completions stream as vLLM 0.32 writes it with include_usage: text chunks, a finish
    chunk, then the usage chunk (empty choices) that carries ``metrics``."""
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    out = [sse({**base, "choices": [{"index": 0, "text": SECRET, "logprobs": None, "finish_reason": None}]})
           for _ in range(3)]
    out.append(sse({**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]}))
    last = {**base, "choices": [], "usage": {"prompt_tokens": 900, "total_tokens": 903, "completion_tokens": 3}}
    if metrics is not None:
        last["metrics"] = metrics
    out.append(sse(last))
    out.append(b"data: [DONE]\n\n")
    return out


def record(chunks: list[bytes], sse_stream: bool = True, status: int = 200) -> list[RequestRecord]:
    out: list[RequestRecord] = []
    sr = StreamRecorder("r1", out.append, status, sse_stream)
    for i, c in enumerate(chunks):
        sr.feed(c, 1.0 + 0.1 * i)
    sr.finish(2.0)
    return out


METRICS = {"time_to_first_token_ms": 412.5, "generation_time_ms": 1830.25, "queue_time_ms": 2500.0,
           "mean_itl_ms": 915.125, "tokens_per_second": 1.33}


def test_final_usage_chunk_metrics_land_on_the_finish_record_as_seconds():
    out = record(vllm_stream(METRICS))
    fin = out[-1]
    assert fin.event == "finish" and fin.completion_tokens == 3 and fin.prompt_tokens == 900
    assert (fin.engine_queue_s, fin.engine_ttft_s, fin.engine_decode_s) == (2.5, 0.4125, 1.83025)
    assert sum(r.n or 0 for r in out if r.event in ("first_token", "token")) == 3  # counting unchanged
    d = to_dict(fin)
    assert record_ok(d) and SECRET not in json.dumps([to_dict(r) for r in out])


def test_non_streamed_body_metrics_and_absent_metrics():
    body = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": SECRET,
                                                                        "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7}, "metrics": {"queue_time_ms": 12.0}}
    (fin,) = record([json.dumps(body).encode()], sse_stream=False)
    assert fin.completion_tokens == 7 and fin.engine_queue_s == 0.012 and fin.engine_ttft_s is None
    plain = record(vllm_stream(None))[-1]
    assert (plain.engine_queue_s, plain.engine_ttft_s, plain.engine_decode_s) == (None, None, None)
    assert "engine_queue_s" not in to_dict(plain)  # old-shape finish records stay as they were


@pytest.mark.parametrize("bad", [{"queue_time_ms": "12"}, {"queue_time_ms": -1}, {"queue_time_ms": True},
                                 {"queue_time_ms": float("inf")}, {"queue_time_ms": 1e300}, [1, 2], "x", None])
def test_malformed_metrics_are_ignored(bad):
    assert engine_metrics(bad) is None


def _requests(an: Analyzer, n: int, times: bool) -> None:
    """n requests of 1,000 prompt tokens: 1.5 s queued in the engine and 0.5 s of prefill, so the
    observed TTFT is 2 s; then 10 tokens 20 ms apart."""
    for i in range(n):
        t0 = 10.0 * i
        rid = f"q{i}"
        an.feed_dict({"kind": "request", "t": t0, "id": rid, "event": "arrive", "prompt_tokens": 1000})
        an.feed_dict({"kind": "request", "t": t0 + 2.0, "id": rid, "event": "first_token", "n": 1})
        for k in range(1, 10):
            an.feed_dict({"kind": "request", "t": round(t0 + 2.0 + 0.02 * k, 6), "id": rid, "event": "token", "n": 1})
        fin = {"kind": "request", "t": t0 + 2.25, "id": rid, "event": "finish", "completion_tokens": 10}
        if times:
            fin.update(engine_queue_s=1.5, engine_ttft_s=0.5, engine_decode_s=0.18)
        an.feed_dict(fin)


def test_engine_times_measure_prefill_without_the_queue():
    """Prompt / observed TTFT says 500 tokens/s (queueing included); the engine's own TTFT says
    2,000: a prefill of 1,000 tokens takes 0.5 s, not 2 s, and can explain only a stall that long."""
    plain = Analyzer(itl_target_s=0.1)
    _requests(plain, 8, times=False)
    timed = Analyzer(itl_target_s=0.1)
    _requests(timed, 8, times=True)
    assert plain.prefill_rate() == pytest.approx(500, rel=0.03)
    assert timed.prefill_rate() == pytest.approx(2000, rel=0.03)
    full = build_report(timed)
    rep = full.engine_request_times
    assert rep is not None and rep.requests == 8 and rep.queued_requests == 8
    assert rep.queue_s_median == 1.5 and rep.engine_prefill_tokens_per_s == pytest.approx(2000, rel=0.03)
    # observed TTFT 2 s = 1.5 queued + 0.5 prefill: nothing outside the engine; the decode spans agree
    assert rep.outside_engine_ttft_s_median == pytest.approx(0.0, abs=1e-6)
    assert rep.tail_delivery_s_median == pytest.approx(0.0, abs=1e-6)
    assert build_report(plain).engine_request_times is None
    # the JSON report carries it and reads back into the same value
    d = full.to_dict()
    assert d["engine_request_times"]["queue_s_median"] == 1.5
    assert type(full).from_dict(d).engine_request_times == rep


def _llama_stream(name: str) -> list[bytes]:
    """The real llama-server's SSE body (tests/fixtures/engines), cut into its events."""
    from conftest import fixture_text

    raw = fixture_text(name).encode()
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def test_llamacpp_timings_are_the_engines_own_times_and_its_cache():
    """llama.cpp's final chunk carries ``timings``: the prompt's processing (slot start to first
    token) and the generation, in ms, and ``cache_n``, the prompt tokens its slot's cache served."""
    cold = record(_llama_stream("llamacpp-11434-v1-completions-stream.txt"))[-1]
    assert cold.event == "finish" and (cold.prompt_tokens, cold.completion_tokens) == (202, 4)
    assert (cold.engine_queue_s, cold.engine_ttft_s, cold.engine_decode_s) == (None, 0.545521, 0.050397)
    assert cold.cached_tokens == 0 and record_ok(to_dict(cold))
    warm = record(_llama_stream("llamacpp-11434-v1-completions-stream-cached.txt"))[-1]
    assert (warm.engine_ttft_s, warm.cached_tokens) == (0.038294, 197)
    assert to_dict(warm)["cached_tokens"] == 197 and record_ok(to_dict(warm))


def test_prompt_tokens_the_cache_served_are_not_counted_as_prefilled():
    """8 prompts of 1,000 tokens whose engine TTFT is 0.5 s: 2,000 tokens/s; where the engine says
    its prefix cache served 900 of each, it computed 100 in that time: 200 tokens/s."""
    def rate(cached: int | None) -> float | None:
        """The prefill rate the engine's own times give."""
        an = Analyzer(itl_target_s=0.1)
        for i in range(8):
            t0 = 10.0 * i
            an.feed_dict({"kind": "request", "t": t0, "id": f"c{i}", "event": "arrive", "prompt_tokens": 1000})
            an.feed_dict({"kind": "request", "t": t0 + 0.5, "id": f"c{i}", "event": "first_token", "n": 1})
            fin = {"kind": "request", "t": t0 + 0.6, "id": f"c{i}", "event": "finish", "completion_tokens": 1,
                   "prompt_tokens": 1000, "engine_ttft_s": 0.5}
            if cached is not None:
                fin["cached_tokens"] = cached
            an.feed_dict(fin)
        rep = build_report(an).engine_request_times
        assert rep is not None and rep.requests == 8
        return rep.engine_prefill_tokens_per_s

    assert rate(None) == pytest.approx(2000, rel=0.03) and rate(0) == pytest.approx(2000, rel=0.03)
    assert rate(900) == pytest.approx(200, rel=0.03)
    assert rate(1000) is None  # nothing computed: no prefill to time
