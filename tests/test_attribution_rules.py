"""The attribution rules of issue 12 on hand-built traces: what a stall really leaves behind."""

from __future__ import annotations

import pytest

from kvtop.analysis.analyzer import Analyzer
from kvtop.model.trace import TraceWriter, make_header
from tests.test_attribution import STEP, engine_records, run, stream_records


def _one(an: Analyzer, rid: str):
    (g,) = [g for g in an.spikes if g.request_id == rid]
    return g


def test_vllm_counts_at_resume_a_step_from_an_interval_after_the_stall_is_not_its_own():
    # r3 silent 4-6 s while 7 others flow, KV 0.97 the whole time (a storm: true of every stream)
    silent = {"r3": (4.0, 6.0)}
    # counter read at 6.5 (interval 5.5-6.5 holds the resume at 6.0): r3's own preemption
    g = _one(run(stream_records(silent=silent) + engine_records(kv=0.97, pre_steps=(6.5,))), "r3")
    assert g.cause == "preemption" and g.kind == "counter"
    # the step read at 8.5 s moved in 7.5-8.5 s, after r3 resumed: somebody else's. KV alone is not
    # evidence about r3 on vLLM, which would have counted r3 at its resume
    g = _one(run(stream_records(silent=silent) + engine_records(kv=0.97, pre_steps=(8.5,))), "r3")
    assert g.cause == "unknown"
    assert any("did not step at its resume" in e for e in g.evidence)
    # the same stall on an engine that does not say when it counts (its records name no adapter kvtop
    # knows): KV pinned while others flow
    unnamed = [{**d, "adapter": None} for d in engine_records(kv=0.97, pre_steps=(8.5,))]
    an = Analyzer()
    for d in sorted(stream_records(silent=silent) + unnamed, key=lambda d: d["t"]):
        an.feed_dict(d)
    an.finish()
    assert _one(an, "r3").cause == "preemption"


def test_sglang_counts_at_retraction():
    silent = {"r3": (4.0, 6.0)}
    recs = stream_records(silent=silent)
    for where, expect in ((4.5, "preemption"), (6.5, "unknown")):  # interval 3.5-4.5 holds the start
        an = Analyzer()
        an.set_header({"engine": {"adapter": "sglang"}})
        for d in sorted(recs + engine_records(kv=0.5, pre_steps=(where,)), key=lambda d: d["t"]):
            an.feed_dict(d)
        an.finish()
        assert an.counted_at == "retract"
        assert _one(an, "r3").cause == expect, where


def test_a_stall_ending_in_a_buffered_burst_is_delivery_not_preemption():
    # r3's client stops reading 4-6 s: the 100 tokens generated meanwhile arrive as one chunk
    recs = [d for d in stream_records(silent={"r3": (4.0, 6.0)})]
    recs.append({"kind": "request", "t": 6.0, "id": "r3", "event": "token", "n": 100})
    recs = [d for d in recs if not (d.get("id") == "r3" and d.get("event") == "token" and d["t"] == pytest.approx(6.01))]
    # KV pinned and a counter step right at its end (another victim's resume): still not r3's
    g = _one(run(recs + engine_records(kv=0.97, pre_steps=(6.5,))), "r3")
    assert g.cause == "unknown" and g.kind == "delivery" and g.candidate.burst_n == 100
    assert any("100 tokens delivered at once" in e for e in g.evidence)
    # many separate reads within a millisecond are the same burst
    recs2 = [d for d in stream_records(silent={"r3": (4.0, 6.0)})]
    recs2 += [{"kind": "request", "t": round(6.0 + k * 1e-5, 6), "id": "r3", "event": "token", "n": 1}
              for k in range(100)]
    g = _one(run(recs2 + engine_records(kv=0.97, pre_steps=(6.5,))), "r3")
    assert g.kind == "delivery" and g.candidate.burst_n == 100
    # too few to cover the stall at the stream's 20 ms pace (20 tokens: 0.4 s of 2 s): not a delivery burst
    recs3 = [d for d in stream_records(silent={"r3": (4.0, 6.0)})]
    recs3 += [{"kind": "request", "t": round(6.0 + k * 1e-5, 6), "id": "r3", "event": "token", "n": 1}
              for k in range(20)]
    assert _one(run(recs3 + engine_records(kv=0.97, pre_steps=(6.5,))), "r3").kind == "counter"


def test_a_short_prompt_does_not_explain_a_long_freeze():
    # every stream stalls 4.0-5.9 s; a 117-token prompt gets its first token at the end. The prefill
    # rate measured from earlier requests (1,000-token prompts, 0.1 s TTFT: 10,000 tokens/s) says
    # that prompt takes ~12 ms: it does not explain 1.9 s
    recs = stream_records(silent={f"r{i}": (4.0, 5.9) for i in range(8)})
    for i in range(6):
        recs += [{"kind": "request", "t": 0.5 + i * 0.3, "id": f"p{i}", "event": "arrive", "prompt_tokens": 1000},
                 {"kind": "request", "t": 0.6 + i * 0.3, "id": f"p{i}", "event": "first_token", "n": 1},
                 {"kind": "request", "t": 0.61 + i * 0.3, "id": f"p{i}", "event": "finish"}]
    recs += [{"kind": "request", "t": 5.8, "id": "s", "event": "arrive", "prompt_tokens": 117},
             {"kind": "request", "t": 5.9, "id": "s", "event": "first_token", "n": 1}]
    an = run(recs + engine_records(kv=0.4))
    assert an.prefill_rate() == pytest.approx(10_000, rel=0.05)
    assert {g.cause for g in an.spikes} == {"unknown"}
    # a 12,000-token prompt at the same rate (1.2 s) does
    recs[-2]["prompt_tokens"] = 12_000
    an = run(recs + engine_records(kv=0.4))
    assert {g.cause for g in an.spikes} == {"prefill_interference"}
    assert all(any("at the measured" in e for e in g.evidence) for g in an.spikes)


def test_look_ahead_separates_a_lone_lift_from_a_slower_pace():
    # r0 alone: gaps of 20 ms, one of 35 ms... then (a) a 150 ms stall back to 20 ms, or (b) 150 ms
    # from then on. Target 100 ms: both first spikes are 7.5x the pace before
    def stream(after_step):
        recs = [{"kind": "request", "t": 0.0, "id": "r0", "event": "first_token", "n": 1}]
        t = 0.0
        while t < 4.0:
            t = round(t + STEP, 6)
            recs.append({"kind": "request", "t": t, "id": "r0", "event": "token", "n": 1})
        t = round(t + 0.15, 6)
        recs.append({"kind": "request", "t": t, "id": "r0", "event": "token", "n": 1})
        while t < 8.0:
            t = round(t + after_step, 6)
            recs.append({"kind": "request", "t": t, "id": "r0", "event": "token", "n": 1})
        return recs

    a = run(stream(STEP), itl_target_s=0.1)
    (g,) = list(a.spikes)
    assert g.cause != "slow_decode" and g.candidate.after == pytest.approx([STEP] * 3)
    b = run(stream(0.15), itl_target_s=0.1)
    first = min(b.spikes, key=lambda g: g.t_start)
    assert first.cause == "slow_decode" and first.kind == "onset"
    assert {g.cause for g in b.spikes} == {"slow_decode"}


def test_confidence_is_lower_on_coarse_scrapes():
    silent = {"r3": (4.0, 6.0)}
    fine = _one(run(stream_records(silent=silent, dur=20.0) + engine_records(dur=20.0, kv=0.5, pre_steps=(6.5,))),
                "r3")
    coarse_eng = [d for d in engine_records(dur=20.0, kv=0.5, pre_steps=(5.5,)) if round(d["t"] - 0.5) % 5 == 0]
    coarse = _one(run(stream_records(silent=silent, dur=20.0) + coarse_eng), "r3")
    assert fine.cause == coarse.cause == "preemption"
    assert coarse.confidence < fine.confidence
    assert any("5.0s scrape interval" in e for e in coarse.evidence)


def _streaming_and_fast(tmp_path, recs, itl_target_s: float, chunk_bytes: int) -> tuple[Analyzer, Analyzer]:
    """The same trace file through the per-record path and through the fast path in small chunks."""
    import json

    from kvtop.analysis import fastscan

    p = tmp_path / "t.jsonl"
    with TraceWriter(p, make_header(engine={"adapter": "vllm"})) as w:
        for d in sorted(recs, key=lambda d: d["t"]):
            w.write(d)
    slow = Analyzer(itl_target_s=itl_target_s)
    slow.set_header({"engine": {"adapter": "vllm"}})
    with open(p) as f:
        next(f)
        for line in f:
            slow.feed_dict(json.loads(line))
    slow.finish()
    fast = Analyzer(itl_target_s=itl_target_s)
    fast.set_header({"engine": {"adapter": "vllm"}})
    fastscan.scan(str(p), fast, chunk_bytes=chunk_bytes)
    fast.finish()
    return slow, fast


def test_fast_path_collects_the_same_look_ahead(tmp_path):
    """Bursts and following gaps that straddle the fast path's chunk boundaries give the same spikes,
    causes and look-ahead as the streaming path."""
    recs = stream_records(n_streams=6, dur=12.0, silent={"r1": (3.0, 5.0), "r2": (6.0, 6.9), "r4": (8.0, 9.5)})
    recs.append({"kind": "request", "t": 5.0, "id": "r1", "event": "token", "n": 90})
    recs += [{"kind": "request", "t": round(6.9 + k * 1e-5, 6), "id": "r2", "event": "token", "n": 1} for k in range(40)]
    recs += engine_records(dur=12.0, kv=0.97, pre_steps=(9.5,))
    # look-ahead starts once the target is known
    slow, fast = _streaming_and_fast(tmp_path, recs, itl_target_s=0.08, chunk_bytes=2048)

    def key(an):
        return [(g.request_id, g.t_end, str(g.cause), g.kind, g.candidate.burst_n,
                 [round(x, 9) for x in g.candidate.after], round(g.candidate.tokens_per_event, 9)) for g in an.spikes]

    assert key(fast) == key(slow)
    kinds = {g.request_id: g.kind for g in slow.spikes}
    assert kinds["r1"] == "delivery" and kinds["r2"] == "delivery" and kinds["r4"] == "counter"


def test_real_vllm_page_gives_the_per_request_histograms():
    from pathlib import Path

    from kvtop_plugins.vllm import VllmAdapter

    page = (Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu-preemption.prom").read_text()
    (rec,) = VllmAdapter().parse(page, 1.0)
    # captured mid-storm: 6 requests had finished, preempted 11 times in all; the counter says 18
    # (the two still running had been preempted too)
    assert rec.extra["request_preemptions"] == {"count": 6.0, "sum": 11.0}
    assert rec.extra["prefill_kv_computed"] == {"count": 6.0, "sum": 390.0}
    assert rec.preemptions_total == 18.0


def test_per_request_histogram_pins_the_count_of_a_lone_finish():
    # r3 is preempted once (4-6 s, counted at its resume) and finishes alone at 7.2 s; r5 finishes
    # alone at 8.2 s and the engine says it was preempted twice, which kvtop never saw
    recs = stream_records(silent={"r3": (4.0, 6.0)}, dur=10.0)
    recs = [d for d in recs if not (d["id"] == "r3" and d["t"] > 7.2) and not (d["id"] == "r5" and d["t"] > 8.2)]
    recs += [{"kind": "request", "t": 7.2, "id": "r3", "event": "finish"},
             {"kind": "request", "t": 8.2, "id": "r5", "event": "finish"}]
    eng = engine_records(dur=10.0, kv=0.97, pre_steps=(6.5,))
    for d in eng:
        fin = (d["t"] > 7.2) + (d["t"] > 8.2)
        d["extra"] = {"request_preemptions": {"count": float(fin), "sum": float((d["t"] > 7.2) + 2 * (d["t"] > 8.2))}}
    from kvtop.analysis.report import build_report, render_report_text

    rep = build_report(run(recs + eng))
    assert rep.request_preemptions is not None
    assert rep.request_preemptions.to_dict() == {"finished_requests": 2.0, "engine_preemptions": 3.0,
                                                 "pinned_requests": 2, "pinned_agree": 1, "pinned_kvtop_more": 0,
                                                 "pinned_kvtop_fewer": 1, "pinned_engine_preemptions": 3,
                                                 "pinned_kvtop_found": 1, "pinned_kvtop_extra": 0}
    text = render_report_text(rep)
    assert "of the 3 preemptions the engine counted on them kvtop found 1, and called 0 more" in text


def test_a_scrape_late_by_the_stall_makes_it_a_host_stall_before_any_engine_cause():
    # every stream stalls 4.55-5.0 s and a 4,000-token prompt jump is read around it, but kvtop's
    # own scrape due at 4.5 s came at 4.9 s: the host (or the API server) paused, not the engine
    recs = stream_records(silent={f"r{i}": (4.55, 5.0) for i in range(8)})
    eng = engine_records(kv=0.4, prompt_steps=((5.5, 4000),))
    for d in eng:
        if d["t"] == 4.5:
            d["t"] = 4.9
    spikes = list(run(recs + eng).spikes)
    assert spikes and {(str(g.cause), g.kind) for g in spikes} == {("unknown", "host")}
    assert all(any("came 0.40s late" in e for e in g.evidence) for g in spikes)
    # on time, the same stall is the prefill's
    spikes = list(run(recs + engine_records(kv=0.4, prompt_steps=((5.5, 4000),))).spikes)
    assert {str(g.cause) for g in spikes} == {"prefill_interference"}


def test_report_weighs_each_cause_by_the_time_over_target():
    from kvtop.analysis.report import build_report

    # one 2 s preemption stall (counter at its resume) and r5's lone 0.5 s stall without evidence
    recs = stream_records(silent={"r3": (4.0, 6.0), "r5": (7.0, 7.5)}) + engine_records(kv=0.5, pre_steps=(6.5,))
    rep = build_report(run(recs, itl_target_s=0.1))
    assert rep.causes["preemption"].count == rep.causes["unknown"].count == 1
    assert rep.over_target_s["preemption"] == pytest.approx(2.0 + STEP - 0.1, abs=0.01)
    assert rep.over_target_s["unknown"] == pytest.approx(0.5 + STEP - 0.1, abs=0.01)
    assert rep.over_target_s["slow_decode"] == 0.0


def test_a_counter_step_is_no_evidence_about_the_only_observed_stream():
    # one observed stream of an engine running 8 (sparse observation): its 2 s stall ends in the
    # interval where the counter stepped, but nobody observed kept decoding, so whose preemption it
    # was (or whether an unobserved prompt stalled the engine) cannot be told
    recs = stream_records(n_streams=1, silent={"r0": (4.0, 6.0)}) + engine_records(kv=0.97, pre_steps=(6.5,))
    g = _one(run(recs), "r0")
    assert g.cause == "unknown" and g.confidence <= 0.35
    assert any("stream kvtop does not see" in e for e in g.evidence)
    # with a second observed stream flowing through the stall, the same step is r0's own
    recs = stream_records(n_streams=2, silent={"r0": (4.0, 6.0)}) + engine_records(kv=0.97, pre_steps=(6.5,))
    assert _one(run(recs), "r0").kind == "counter"


def test_a_stall_most_streams_share_is_no_lone_preemption():
    # 6 of 8 streams fall silent together 4.0-4.25 s (2 keep flowing: their tokens were buffered
    # elsewhere), a counter step read in the interval that holds the end: judged as a shared stall,
    # where one counter unit does not make six preemptions
    silent = {f"r{i}": (4.0, 4.25) for i in range(6)}
    an = run(stream_records(silent=silent) + engine_records(kv=0.97, pre_steps=(4.5,)))
    causes = [g.cause for g in an.spikes if g.request_id in silent]
    assert len(causes) == 6 and causes.count("preemption") <= 1
    # one stream alone with the same step stays a preemption
    g = _one(run(stream_records(silent={"r3": (4.0, 4.25)}) + engine_records(kv=0.97, pre_steps=(4.5,))), "r3")
    assert g.cause == "preemption"


def test_a_stall_after_the_last_scrape_reads_kv_and_queue_instead_of_the_resume_counter():
    # r3 silent 8.7-9.8 s; scrapes stop at 8.5 s (the run ended), KV pinned and the queue rising:
    # the resume counter cannot show it, so the state evidence speaks, at lower confidence
    recs = stream_records(silent={"r3": (8.7, 9.8)}) + engine_records(dur=8.6, kv=0.97, wait_rise=((8.4, 8.6),))
    g = _one(run(recs), "r3")
    assert g.cause == "preemption" and g.kind == "unread"
    assert g.confidence < 0.9
    assert any("no scrape was read after its end" in e for e in g.evidence)
    # the same stall with a scrape after it and no counter step: vLLM would have counted it
    recs = stream_records(silent={"r3": (8.7, 9.8)}) + engine_records(dur=10.6, kv=0.97, wait_rise=((8.4, 10.6),))
    assert _one(run(recs), "r3").cause == "unknown"


def test_confidence_comes_from_the_rule_table_times_its_discounts():
    from kvtop.analysis.attribution.thresholds import CONFIDENCE, DISCOUNT

    g = _one(run(stream_records(silent={"r3": (4.0, 6.0)}) + engine_records(kv=0.97, pre_steps=(6.5,))), "r3")
    assert g.rule_key == "preemption/counter" and g.discounts == ()
    assert g.confidence == pytest.approx(CONFIDENCE["preemption/counter"])
    assert all(0.01 <= v <= 0.99 for v in list(CONFIDENCE.values()) + list(DISCOUNT.values()))


def test_a_first_token_ending_a_gap_that_dwarfs_the_pace_on_both_sides_is_prefill():
    # six streams step every 20 ms; all stall 4.0-4.5 s and come back at 40 ms (the engine now runs
    # 2x slower: a flood of short requests, throttled clocks). Request q's first token ends the stall
    def recs(prompt: int | None) -> list[dict]:
        out = []
        for i in range(6):
            rid = f"r{i}"
            out.append({"kind": "request", "t": 0.0, "id": rid, "event": "arrive", "prompt_tokens": 500})
            out.append({"kind": "request", "t": 0.05, "id": rid, "event": "first_token", "n": 1})
            t = 0.05
            while t < 8.0:
                t = round(4.5 if 3.99 < t < 4.5 else t + (0.02 if t < 4.0 else 0.04), 6)
                out.append({"kind": "request", "t": t, "id": rid, "event": "token", "n": 1})
        if prompt is not None:
            out += [{"kind": "request", "t": 3.9, "id": "q", "event": "arrive", "prompt_tokens": prompt},
                    {"kind": "request", "t": 4.5, "id": "q", "event": "first_token", "n": 1}]
        return out

    def stalls(prompt: int | None) -> set[tuple[str, str | None]]:
        an = run(recs(prompt) + engine_records(dur=8.0), itl_target_s=0.1)
        return {(str(g.cause), g.kind) for g in an.spikes if 3.9 <= g.t_start <= 4.1}

    # 1,000 prompt tokens at the measured 10,000 tokens/s are 0.1 s: too little for the stall at the
    # calm pace (shared), enough at the 2x slower pace the engine now runs at
    assert stalls(1000) == {("prefill_interference", "dominant")}
    # 300 tokens explain it at neither pace; no first token at all: not prefill
    assert all(c != "prefill_interference" for c, _ in stalls(300))
    assert all(c != "prefill_interference" for c, _ in stalls(None))


def test_victims_resumed_together_are_preemptions_when_the_counter_stepped_for_each():
    # r0-r4 fall silent at 4 s and come back together at 6 s (vLLM resumes waiting victims as one
    # batch once KV frees) while r5-r7 keep flowing; the counter read at 6.5 s rose by 5: one per victim
    silent = {f"r{i}": (4.0, 6.0) for i in range(5)}
    an = run(stream_records(silent=silent) + engine_records(kv=0.97, pre_steps=(6.5,) * 5))
    assert sorted(str(g.cause) for g in an.spikes if g.request_id in silent) == ["preemption"] * 5
    # one step for five streams that stalled and resumed as one: not five preemptions
    an = run(stream_records(silent=silent) + engine_records(kv=0.97, pre_steps=(6.5,)))
    assert sum(g.cause == "preemption" for g in an.spikes if g.request_id in silent) <= 1


def _prefill_run_records() -> list[dict]:
    """Six streams step every 20 ms; from 4 s on, three of every four steps also prefill a new
    1,200-token prompt (150 ms), whose first token ends the step: the median of each stream's last
    8 gaps is a prefill step (150 ms, over the 100 ms target), the fastest is still 20 ms."""
    out = []
    for i in range(6):
        rid = f"r{i}"
        out.append({"kind": "request", "t": 0.0, "id": rid, "event": "arrive", "prompt_tokens": 500})
        out.append({"kind": "request", "t": 0.05, "id": rid, "event": "first_token", "n": 1})
    t, k = 0.05, 0
    while t < 9.0:
        prefill = 4.0 <= t < 7.0 and k % 4 != 3
        nt = round(t + (0.15 if prefill else STEP), 6)
        if prefill:
            q = f"q{k}"
            out += [{"kind": "request", "t": t, "id": q, "event": "arrive", "prompt_tokens": 1200},
                    {"kind": "request", "t": nt, "id": q, "event": "first_token", "n": 1}]
        if 4.0 <= t < 7.0:
            k += 1
        out += [{"kind": "request", "t": nt, "id": f"r{i}", "event": "token", "n": 1} for i in range(6)]
        t = nt
    return out


def test_prefill_steps_that_lift_a_streams_median_over_the_target_are_still_prefill():
    an = run(_prefill_run_records() + engine_records(dur=9.0), itl_target_s=0.1)
    late = [g for g in an.spikes if g.request_id == "r0" and g.t_start > 5.0]
    assert len(late) >= 10
    assert late[-1].candidate.stream_baseline >= 0.1  # the median a run of prefill steps lifted
    # judged against the stream's decode-only pace (its fastest recent gap), each step is a prefill
    assert all(g.cause == "prefill_interference" for g in late), {(str(g.cause), g.kind) for g in late}


def test_a_scrape_due_in_a_stall_and_answered_as_the_streams_resume_is_a_host_hang():
    # every stream silent 3.9-4.9 s; the scrape due at 4.5 s is answered at 4.9 s, as they resume
    # (0.4 s late: less than half the stall, so lateness alone does not say the host hung)
    recs = stream_records(silent={f"r{i}": (3.9, 4.9) for i in range(8)})
    eng = engine_records(dur=10.0, kv=0.97, pre_steps=(5.5,))
    for d in eng:
        if d["t"] == pytest.approx(4.5):
            d["t"] = 4.9
    g = _one(run(recs + eng), "r3")
    assert g.cause == "unknown" and g.kind == "host"
    assert any("answered 0.40s late as the streams resumed" in e for e in g.evidence)
    # the same stall with the scrape answered on time: no host evidence
    g = _one(run(recs + engine_records(dur=10.0, kv=0.97, pre_steps=(5.5,))), "r3")
    assert g.kind != "host"


def test_a_victim_already_silent_before_the_host_hung_is_still_the_engines_preemption():
    # r3 is preempted at 4.0 s and resumes at 6.0 s (the counter steps at its resume, read at 6.5 s);
    # from 5.5 s the API server hangs: the scrape due then is answered at 6.0 s and every other stream
    # stalls with it. r3 missed its target long before the hang began, so the hang is not its cause
    silent = {f"r{i}": (5.5, 6.0) for i in range(8)} | {"r3": (4.0, 6.0)}
    eng = engine_records(kv=0.97, pre_steps=(6.5,))
    for d in eng:
        if d["t"] == pytest.approx(5.5):
            d["t"] = 6.0
    an = run(stream_records(silent=silent) + eng)
    g = _one(an, "r3")
    assert (str(g.cause), g.kind) == ("preemption", "counter"), g.evidence
    others = [g for g in an.spikes if g.request_id != "r3"]
    assert len(others) == 7 and {(str(g.cause), g.kind) for g in others} == {("unknown", "host")}
    # the same victim silent only from where the hang began is the host's
    silent["r3"] = (5.5, 6.0)
    assert _one(run(stream_records(silent=silent) + eng), "r3").kind == "host"


def test_a_prompt_counted_where_an_engine_wide_stall_ended_explains_it_without_a_first_token():
    # all eight streams stall 4.30-4.45 s; the request being prefilled is not observed (no first
    # token), and with 1,000 prompt tokens a second usual the 3.5-4.5 s interval's extra 1,000 is no
    # jump over the stall's whole evidence window, but at the measured 10,000 tokens/s it covers it
    recs = stream_records(silent={f"r{i}": (4.3, 4.45) for i in range(8)})
    usual = tuple((t + 0.5, 800) for t in range(10))

    def spike(extra: int):
        an = run(recs + engine_records(dur=10.0, prompt_steps=usual + ((4.5, extra),)), itl_target_s=0.1)
        return _one(an, "r3")

    g = spike(1000)
    assert g.cause == "prefill_interference"
    assert any("added 1000 prompt tokens more than usual" in e for e in g.evidence)
    # 200 extra tokens are 20 ms of prefill: they do not explain a 150 ms stall
    assert spike(200).cause != "prefill_interference"


def _spec_records(end_n: int) -> list[dict]:
    """8 streams with speculative decoding: every 40 ms each delivers 1-4 tokens (mean 2.5); r3 is
    silent 4.0-4.2 s and the event that ends its silence carries ``end_n`` tokens."""
    sizes = (1, 4, 2, 3, 4, 1, 2, 3)
    out = []
    for i in range(8):
        rid = f"r{i}"
        out += [{"kind": "request", "t": 0.0, "id": rid, "event": "arrive", "prompt_tokens": 500},
                {"kind": "request", "t": 0.05, "id": rid, "event": "first_token", "n": 1}]
    k = 1
    while 0.05 + k * 0.04 <= 10.0:
        t = round(0.05 + k * 0.04, 6)
        for i in range(8):
            if i == 3 and 4.0 < t < 4.2:
                continue
            n = end_n if i == 3 and t == pytest.approx(4.21) else sizes[(k + i) % len(sizes)]
            out.append({"kind": "request", "t": t, "id": f"r{i}", "event": "token", "n": n})
        k += 1
    return out


def test_a_chunk_bigger_than_any_one_step_of_the_stream_ends_a_delivery_stall():
    # With speculative decoding one step carries up to k + 1 = 4 tokens. 6 tokens after a 0.2 s
    # silence were produced during it and held (API-server merging), though 6 is less than 3x the
    # stream's usual 2.5: delivery, even with a counter step at its end (another victim's resume).
    g = _one(run(_spec_records(6) + engine_records(kv=0.97, pre_steps=(4.5,))), "r3")
    assert g.cause == "unknown" and g.kind == "delivery" and g.candidate.step_n_max == 4
    # the same silence ended by one step's worth (3 tokens) is the resumed victim the counter names
    g = _one(run(_spec_records(3) + engine_records(kv=0.97, pre_steps=(4.5,))), "r3")
    assert g.cause == "preemption"


def test_fast_path_knows_each_streams_largest_step_across_chunk_boundaries(tmp_path):
    recs = _spec_records(6) + engine_records(kv=0.97, pre_steps=(4.5,))
    # many chunks: the window straddles their boundaries
    slow, fast = _streaming_and_fast(tmp_path, recs, itl_target_s=0.1, chunk_bytes=1500)

    def key(an):
        return [(g.request_id, g.t_end, str(g.cause), g.kind, g.candidate.step_n_max) for g in an.spikes]

    assert key(fast) == key(slow)
    assert ("r3", 4.21, "unknown", "delivery", 4) in key(slow)


def test_a_victim_that_resumed_before_a_later_hang_began_is_no_host_stall():
    # r3 is preempted at 4.45 s and resumes at 4.90 s while the others flow (the counter steps at its
    # resume); from 5.0 s the API server hangs and every stream waits until 6.4 s, so the scrape due at
    # 5.5 s is answered then. Most of r3's silence lies in that late scrape interval, and the last
    # on-time reply (4.5 s) leaves only 50 ms of it before the hang could have begun; but the other
    # streams still got tokens until 5.0 s: the hang began after r3 had resumed
    silent = {f"r{i}": (5.0, 6.4) for i in range(8)}
    recs = [d for d in stream_records(silent=silent)
            if not (d["id"] == "r3" and d["event"] == "token" and 4.45 < d["t"] < 4.9)]
    eng = engine_records(kv=0.97, pre_steps=(5.5,))
    for d in eng:
        if d["t"] == pytest.approx(5.5):
            d["t"] = 6.4
    an = run(recs + eng)
    g = [g for g in an.spikes if g.request_id == "r3" and g.t_end < 5.0][0]
    assert (str(g.cause), g.kind) == ("preemption", "counter"), g.evidence
    # the hang's own stalls stay the host's
    hung = [g for g in an.spikes if g.t_start >= 4.95]
    assert len(hung) == 8 and {g.kind for g in hung} == {"host"}


def _held_to_the_end(finish: bool) -> list[dict]:
    """r3 stops reading at 4.0 s (a slow reader) while the engine makes its last 9 tokens; at 7.0 s it
    reads them in three chunks within a millisecond and, with ``finish``, the stream's end; without,
    it goes on at its pace. Another stream's victim resumes meanwhile: the counter steps at 7.5 s."""
    recs = [d for d in stream_records() if not (d["id"] == "r3" and d["t"] > 4.0)]
    recs += [{"kind": "request", "t": 7.0 + 0.0003 * i, "id": "r3", "event": "token", "n": 3} for i in range(3)]
    if finish:
        recs.append({"kind": "request", "t": 7.0008, "id": "r3", "event": "finish", "completion_tokens": 210})
    else:
        recs += [{"kind": "request", "t": round(7.0 + 0.02 * k, 6), "id": "r3", "event": "token", "n": 1}
                 for k in range(1, 100)]
    return recs + engine_records(kv=0.97, pre_steps=(7.5,))


def test_a_held_burst_that_ends_the_stream_is_a_delivery_stall_however_short():
    # the 9 tokens are 180 ms of the stream's pace, under a quarter of the 3 s silence: a burst that
    # explains so little is no delivery stall while the stream goes on (the engine was not making its
    # tokens then), but one that came with the stream's end held everything the engine made before it
    # finished: the silence was the reader's
    g = _one(run(_held_to_the_end(finish=True)), "r3")
    assert (str(g.cause), g.kind) == ("unknown", "delivery"), g.evidence
    assert g.candidate.finished
    g = _one(run(_held_to_the_end(finish=False)), "r3")
    assert g.kind != "delivery" and not g.candidate.finished
