"""kvtop's inference judged by a real engine, without the engine: the witnessed vLLM rounds shipped in
eval/witness_rounds/ (real vLLM 0.32 whose scheduler logged every step, see that folder's README) are
analysed with their step records left out and each spike's cause is scored against the log, at
100 ms and at 2.5x each trace's median decode step.

The floors are a guard against regressions, a few points under what the final code of the change
that shipped the rounds measured (docs/real-engines.md section 7 has the figures and says which rounds
were read while rules were chosen); they are not where a threshold was tuned."""

from __future__ import annotations

from typing import Any

import pytest

from eval import witnessed
from eval.witness_matrix import matrix, pool


@pytest.fixture(scope="module")
def by_round() -> dict[str, list[dict[str, Any]]]:
    """Every shipped round's matrix rows, scored once for the whole module."""
    out = {}
    for r in witnessed.names():
        with witnessed.traces([r]) as paths:
            out[r] = matrix(paths)
    return out


def _pooled(by_round: dict[str, list[dict[str, Any]]], rounds: list[str]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["trace"], r["target"]): r for r in pool([row for x in rounds for row in by_round[x]])}


@pytest.fixture(scope="module")
def pooled(by_round: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, str], dict[str, Any]]:
    return _pooled(by_round, witnessed.names())


LOOSE, TIGHT = "100 ms", "2.5x decode step"


@pytest.mark.parametrize(("target", "p", "r"), [(LOOSE, 0.97, 0.93), (TIGHT, 0.96, 0.93)])
def test_preemptions_the_engine_logged_are_found_and_few_stalls_are_wrongly_called_one(pooled, target, p, r):
    got = pooled[("all", target)]["preemption"]
    assert got["actual"] >= 1100  # every round's storms and mixed runs were read
    assert got["precision"] >= p and got["recall"] >= r, got


@pytest.mark.parametrize(("target", "p", "r"), [(LOOSE, 0.88, 0.9), (TIGHT, 0.86, 0.92)])
def test_prefill_stalls_the_engine_logged_are_found(pooled, target, p, r):
    # measured 0.93 / 0.95 at 100 ms and 0.91 / 0.96 at the tight target (docs/real-engines.md 7.6);
    # round P's prefill run, on an engine whose decode steps alone took about the 100 ms target, still
    # has 72 and 78 of the false calls (stalls that its chunk steps and slow decode steps shared);
    # rounds AI and AJ's chat-sized prompts (below): the tight target's precision over all 36 rounds is
    # 0.90 (7.10)
    got = pooled[("all", target)]["prefill_interference"]
    assert got["precision"] >= p and got["recall"] >= r, got
    # where prompts are long and chunked, the prefill stalls are all found at both targets
    chunked = pooled[("prefill", target)]["prefill_interference"]
    assert chunked["precision"] >= 0.8 and chunked["recall"] >= 0.95, chunked


@pytest.mark.parametrize("target", [LOOSE, TIGHT])
def test_ordinary_slow_steps_are_rarely_blamed_on_an_engine_cause(pooled, target):
    # the issue's bound is 5 %: decode steps and time outside the engine called preemption or prefill
    got = pooled[("all", target)]
    assert got["neither"] > 9000 and got["neither_called_engine"] <= 0.025 * got["neither"], got


def test_the_rounds_recorded_after_the_preemption_rules_were_final_score_as_well(by_round):
    # rounds O-T were recorded after the last preemption change; no preemption rule was read on them
    rows = _pooled(by_round, witnessed.select("O-T"))
    for target in (LOOSE, TIGHT):
        pre = rows[("all", target)]["preemption"]
        assert pre["actual"] >= 250 and pre["precision"] >= 0.95 and pre["recall"] >= 0.92, (target, pre)


def test_the_rounds_recorded_after_the_gauge_rules_meet_the_issues_targets(by_round):
    # rounds U-AB were recorded after the rules that read the engine's gauges and first-token count
    # (docs/real-engines.md 7.4) and scored once; issue 22's targets: preemption >= 0.95, prefill >=
    # 0.9, other gaps called an engine cause <= 5 % (floors a few points under what they measured)
    _meet_targets(_pooled(by_round, witnessed.select("U-AB")), pre_n=250, pre_r=0.93, pf_n=0, pf_p=0.9,
                  neither_n=0, neither_share=0.05)


def _meet_targets(rows: dict[tuple[str, str], dict[str, Any]], pre_n: int, pre_r: float, pf_n: int, pf_p: float,
                  neither_n: int, neither_share: float) -> None:
    """Pooled rows at issue 22's targets, at both ITL targets: preemption precision >= 0.95 and recall
    ``pre_r``, prefill precision ``pf_p`` and recall >= 0.95 (with at least ``pre_n`` and ``pf_n`` of
    them logged), other gaps called an engine cause at most ``neither_share`` at the tight target."""
    for target in (LOOSE, TIGHT):
        pre = rows[("all", target)]["preemption"]
        assert pre["actual"] >= pre_n and pre["precision"] >= 0.95 and pre["recall"] >= pre_r, (target, pre)
        pf = rows[("all", target)]["prefill_interference"]
        assert pf["actual"] >= pf_n and pf["precision"] >= pf_p and pf["recall"] >= 0.95, (target, pf)
    tight = rows[("all", TIGHT)]
    assert tight["neither"] >= neither_n and tight["neither_called_engine"] <= neither_share * tight["neither"], tight


def test_an_engine_slowed_by_its_host_is_slow_decode_not_an_engine_cause(by_round):
    # round Z's two prefill runs on a host with spinning processes ahead of vLLM: half or more of its
    # decode-only steps, nearly all of the runs' time, took 120-150 ms (5 ms idle), and at the 100 ms
    # target 2,402 stalls were the engine's own slow steps (docs/real-engines.md 7.5); kvtop called 4
    # of them preemption or prefill
    busy = _pooled(by_round, ["Z-271"])[("prefill-busyhost", LOOSE)]
    # (the recall floor guards against a regression only: these runs' prefill labels split each chunk
    # step by a decode-only step from before the load, so they do not say kvtop is right there)
    assert busy["neither"] >= 2000 and busy["neither_called_engine"] <= 0.01 * busy["neither"], busy
    assert busy["prefill_interference"]["recall"] >= 0.95, busy


def _spikes(rnd: str, workload: str) -> tuple[float, dict[tuple[str, float], tuple[str, str, str | None, str]]]:
    """A round's trace analysed without its step records at its tight target: (target, spikes by
    stream and end as (cause, rule, the engine log's cause, the evidence))."""
    import tempfile

    from eval.witness_matrix import spike_key, targets, truth, without_witness
    from kvtop.analysis.scan import analyze_trace

    with witnessed.traces(witnessed.select(rnd)) as paths, tempfile.TemporaryDirectory() as tmp:
        (trace,) = [p for p in paths if workload in p]
        tight = targets(trace)[1][1]
        logged, _, _ = truth(trace, tight)
        rep = analyze_trace(without_witness(trace, tmp), itl_target_s=tight, fast=False)
    return tight, {(s.request_id[:8], round(s.t_end, 3)): (str(s.cause), s.rule, logged.get(spike_key(s)),
                                                         " / ".join(s.evidence)) for s in rep.spikes}


def test_a_victims_counter_unit_goes_to_the_victim_not_to_a_stream_that_stalled_with_the_others():
    # round G's mixed load at its tight target (8.1 ms, 2.5x a 3.2 ms step): stream 8c64390d stalled with
    # every other stream and stayed silent 5x its recent gaps, to 3.617 s; stream 98202577 stayed silent
    # 6x its gaps while the others kept flowing, to 3.650 s, in the same 0.5 s scrape interval, which read
    # one preemption-counter step. The engine's log: 98202577 was preempted, 8c64390d waited for another
    # request's prefill. The unit is the longer turn's; the shorter shared silence was called preemption
    # (rule `longer`) and the victim `unknown` before (docs/real-engines.md 7.5)
    _, got = _spikes("G", "mixed")
    assert got[("98202577", 3.65)][:3] == ("preemption", "counter", "preemption")
    assert got[("8c64390d", 3.617)][:3] == ("prefill_interference", "shared", "prefill_interference")


def test_inside_a_prefill_an_engine_already_slow_with_no_prompt_in_flight_is_slow_decode():
    # round P's prefill run, tight target (9.2 ms, 2.5x a 3.7 ms step): for its first 10 s the engine's
    # decode-only steps took 80-160 ms (the step log), and the streams' gaps while no prompt was in
    # flight said so. Request 87b475d9's prompt was being prefilled when stream 7334b257 stalled 194 ms
    # to 8.657 s: its decode step (150 ms) is most of it. The engine's log: one 194 ms step, 141 ms of
    # it decode and 53 ms the chunk's (docs/real-engines.md 7.6)
    tight, got = _spikes("P", "prefill")
    assert abs(tight - 0.0092) < 0.0002
    cause, rule, logged, why = got[("7334b257", 8.657)]
    assert (cause, logged) == ("slow_decode", "slow_decode")
    assert "87b475d9c3ed43f4bdb58cea78319442's prefill" in why and "no prompt in flight took 151 ms" in why
    # round L's prefill run at its tight target (9.1 ms): decode-only steps took 24 ms before the
    # prompts came, chunk steps 80-110 ms; the prefill is the larger part and stays the cause
    _, got = _spikes("L", "prefill")
    assert got[("2f9a7c31", 4.439)][:3] == ("prefill_interference", "span", "prefill_interference")


def test_a_first_token_a_step_after_the_stall_is_the_next_stalls_prefill_not_this_ones():
    # round F's mixed load at its tight target (7.6 ms, 2.5x a 3.0 ms step): three streams stalled
    # 10-13 ms to 3.023 s (the engine's log: three decode steps, no prompt, each making a token of theirs
    # that reached the clients in one chunk: held outside the steps), then 15-16 ms to 3.040 s,
    # and request 0819243c's first token reached its client 24 ms after the first stall ended, with the
    # second: its prompt was that stall's (the log says so). The first stall was called prefill on that
    # first token before (docs/real-engines.md 7.6)
    _, got = _spikes("F", "mixed")
    for rid in ("b3a688b9", "caaf08ab", "a256aeea"):
        cause, _, logged, why = got[(rid, 3.023)]
        assert logged == "unknown" and cause != "prefill_interference" and "0819243c" not in why, (rid, cause)
    cause, rule, logged, why = got[("b3a688b9", 3.04)]
    assert (cause, rule, logged) == ("prefill_interference", "shared", "prefill_interference")
    assert "request 0819243c746e4539abe8ffe4a7edb025 got its first token at the end of the stall" in why


def test_a_straggler_of_a_burst_whose_first_token_came_late_is_not_the_next_steps_prefill():
    # round B's 8 x 900 storm at its tight target (7.5 ms, 2.5x a 3.0 ms step): eight requests arrived
    # within 3 ms and the engine prefilled seven of them in one step (the log), to 1.816 s; five first
    # tokens reached their clients at 1.821 s, but request 359215d4's, which had arrived before one of
    # those (f4011b4f), only at 1.855 s, with the next decode step's tokens. The streams' 33 ms gaps to
    # then were decode steps; they were called prefill on that first token before (docs/real-engines.md
    # 7.15: vLLM admits its queue in arrival order, so a later arrival's first token dates its prefill)
    _, got = _spikes("B", "storm8x900")
    for rid in ("83b80fb0", "f4011b4f", "364aceb7", "940b5885"):
        cause, _, logged, why = got[(rid, 1.855)]
        assert logged == "slow_decode" and cause != "prefill_interference", (rid, cause)
        # and the answer says why that first token was no signal
        assert "request 359215d4ca1f4cceaa0f2f72a8269699's first token came at its end, but request" in why, why


def test_a_victim_resuming_as_two_decode_steps_end_did_not_hold_them_with_its_re_prefill():
    # round U's 8 x 900 storm at its tight target (7.3 ms, 2.5x a 2.9 ms step): three victims resumed at
    # 12.96 s; the two decoding streams' next gaps, 7-8 ms to 12.967 s (2x their recent gaps), ended as
    # another stream came back, and likewise at 14.903 s. The engine's log: two decode steps each, no
    # recompute token in them (vLLM re-prefills a victim resumed soon from its cached blocks), each
    # making a token that reached the client in one chunk with the other (held outside the steps). They
    # were called prefill/recompute before (docs/real-engines.md 7.17)
    _, got = _spikes("U", "storm8x900")
    for key in (("5440e550", 12.967), ("ccb4feba", 12.967), ("ccb4feba", 14.903)):
        cause, _, logged, _ = got[key]
        assert logged == "unknown" and cause != "prefill_interference", (key, cause)


def test_the_rounds_recorded_after_the_prefill_changes_meet_the_issues_targets(by_round):
    # rounds AC-AD were recorded after the changes of docs/real-engines.md 7.6 and scored once
    # (preemption 1.00 / 0.99 at both targets, prefill 1.00 / 1.00 and 0.97 / 0.99, 16 of 1,358 other gaps
    # called an engine cause at the tight target); floors a few points under, at issue 22's targets
    _meet_targets(_pooled(by_round, witnessed.select("AC-AD")), pre_n=100, pre_r=0.95, pf_n=290, pf_p=0.92,
                  neither_n=1000, neither_share=0.03)


def test_a_chat_sized_prompt_prefilled_in_a_step_is_no_cause_of_a_gap_that_misses_the_target_without_it():
    # round AN's chat-sized prompts at the tight target (21.9 ms, 2.5x an 8.8 ms step): a gap of 25.3 ms
    # ending at 6.401 s, two engine steps, in one of which an 8-token prompt ran; vLLM timed its prefill
    # at 13 ms, 11 ms of which was a decode step of the stream's own, so the prompt's part is at most
    # 2 ms and the gap misses the target without it (the engine's log: two steps at pace, whose tokens
    # reached the client in one chunk: held outside the steps). It was
    # called `prefill-span` before (docs/real-engines.md 7.19)
    _, got = _spikes("AN", "shortprompts-621")
    cause, rule, logged, evidence = got[("213c0805", 6.401)]
    assert logged == "unknown" and cause != "prefill_interference", (cause, rule, evidence)
    assert "prompt (8 tokens) was prefilled inside the stall, but in 13 ms of it" in evidence, evidence


def test_a_victim_resuming_steps_after_a_short_stall_is_not_its_recompute():
    # round G's mixed load at its tight target (8.1 ms): streams 45261003 and 07a4f70b stalled 8-10 ms
    # to 3.000 s (the engine's log: one decode step); victim c1e4473a, silent since 2.938 s, resumed at
    # 3.041 s, 41 ms later, with 07a4f70b's next stall. Its re-prefill was called the first stall's
    # cause (rule `recompute`) before (docs/real-engines.md 7.6)
    _, got = _spikes("G", "mixed")
    for rid in ("45261003", "07a4f70b"):
        cause, rule, logged, why = got[(rid, 3.0)]
        assert logged == "slow_decode" and cause != "prefill_interference" and "c1e4473a" not in why, (rid, rule)


def test_with_half_the_traffic_past_kvtop_preemptions_are_found_and_prefill_at_100_ms(by_round):
    # rounds AE-AG: the mixed load with every other client going to vLLM past kvtop's proxy (kvtop sees
    # half the streams, the witness all of them); AE-AF were read while trying two changes (both dropped,
    # docs/real-engines.md 7.7), AG was recorded after them and scored once. Measured on AE-AG: preemption
    # 1.00 / 0.97 (86) at 100 ms and 0.97 / 0.97 (88) at the tight target; prefill 0.95 / 1.00 (57) at
    # 100 ms, and at the tight target 0.86 / 0.60 (256): the unseen clients' 50-70-token prompts stall
    # every stream one 13-90 ms step, and before kvtop has measured a prefill rate (its first five
    # prompts) nothing sizes them. Floors a few points under
    rows = _pooled(by_round, witnessed.select("AE-AG"))
    for target, pre_p in ((LOOSE, 0.95), (TIGHT, 0.92)):
        pre = rows[("mixedhalf", target)]["preemption"]
        assert pre["actual"] >= 80 and pre["precision"] >= pre_p and pre["recall"] >= 0.92, (target, pre)
    pf = rows[("mixedhalf", LOOSE)]["prefill_interference"]
    assert pf["actual"] >= 50 and pf["precision"] >= 0.9 and pf["recall"] >= 0.95, pf
    pf = rows[("mixedhalf", TIGHT)]["prefill_interference"]
    assert pf["precision"] >= 0.8 and pf["recall"] >= 0.5, pf
    tight = rows[("mixedhalf", TIGHT)]
    assert tight["neither_called_engine"] <= 0.05 * tight["neither"], tight


def test_the_round_recorded_after_every_change_of_the_third_stop_meets_the_issues_targets(by_round):
    # round AH (all five workloads, mixedhalf included) was recorded after the changes and the refit of
    # docs/real-engines.md 7.7 and scored once: preemption 1.00 / 0.97 at both targets (60, 63), prefill
    # 0.98 / 1.00 (99) and 0.95 / 0.98 (282), 14 of 730 other gaps called an engine cause at the tight
    # target; floors a few points under
    rows = _pooled(by_round, witnessed.select("AH"))
    for target, pf_p in ((LOOSE, 0.93), (TIGHT, 0.9)):
        pre = rows[("all", target)]["preemption"]
        assert pre["actual"] >= 55 and pre["precision"] >= 0.95 and pre["recall"] >= 0.93, (target, pre)
        pf = rows[("all", target)]["prefill_interference"]
        assert pf["actual"] >= 90 and pf["precision"] >= pf_p and pf["recall"] >= 0.95, (target, pf)
    tight = rows[("all", TIGHT)]
    assert tight["neither"] >= 600 and tight["neither_called_engine"] <= 0.03 * tight["neither"], tight


def test_chat_sized_prompts_on_a_growing_batch_are_found_and_rarely_overcalled(by_round):
    # rounds AI and AJ (docs/real-engines.md 7.9-7.10): prompts of about ten tokens, each adding 0-4 ms
    # to a 5-9 ms step, seldom decide whether a gap misses a target of 2.5x the step. The measured
    # prefill rate (a low estimate) let such a prompt explain a gap of two steps (precision 0.60 on AI,
    # 0.63 on AJ); the engine's own times for the prompt now bound its part (0.81 on AI, where it was
    # chosen; 0.75 on AJ, recorded after it; 0.82 on AK, recorded later). Floors against regression,
    # short of issue 22's 0.9. Since 7.13 such a prompt no longer counts in the interval's rise either:
    # AI 0.81 / 0.95 -> 0.83 / 0.92, AK (held out) 0.82 / 0.96 -> 0.85 / 0.96
    # AL (recorded after 7.15, held out): 0.79 / 0.96, 82 of 1,452 others; AM (after 7.17): 0.80 / 0.93, 102
    # of 1,682; AN (after 7.18): 0.75 / 0.96, 105 of 1,568 (0.78, 91, since 7.19); AO (after 7.19): 0.78 / 0.97,
    # 84 of 1,439; AP (after 7.20): 0.86 / 0.97, 61 of 1,476
    for rounds, precision, others in (("AI", 0.8, 0.07), ("AJ", 0.7, 0.11), ("AK", 0.8, 0.08), ("AL", 0.75, 0.08),
                                      ("AM", 0.75, 0.08), ("AN", 0.7, 0.08), ("AO", 0.75, 0.08), ("AP", 0.8, 0.08)):
        rows = _pooled(by_round, witnessed.select(rounds))
        got = rows[("shortprompts", TIGHT)]
        pf = got["prefill_interference"]
        assert pf["actual"] >= 300 and pf["recall"] >= 0.9 and pf["precision"] >= precision, (rounds, pf)
        assert got["neither_called_engine"] <= others * got["neither"], (rounds, got)
        loose = rows[("shortprompts", LOOSE)]
        assert loose["neither_called_engine"] <= 3, (rounds, loose)  # at 100 ms a prompt is rarely blamed


@pytest.mark.parametrize(("last", "prefills", "tight_recall"), [("AK", 150, 0.95), ("AL", 150, 0.95), ("AM", 120, 0.95),
                                                           ("AN", 200, 0.9), ("AO", 200, 0.95), ("AP", 200, 0.95)])
def test_the_round_recorded_last_meets_the_issues_targets_at_100_ms(by_round, last, prefills, tight_recall):
    # rounds AK (docs/real-engines.md 7.12), AL (7.15), AM (7.17), AN (7.18), AO (7.19) and AP (7.20) were
    # each recorded after every rule of their stop and scored once (AP with both lead settings tried, 2 and
    # the 1.75 chosen on other data: the same calls): at 100 ms preemption 48 of 48, 49 of 49,
    # 54 of 54, 63 of 65, 67 of 68, 49 of 49, none wrongly called, prefill 202 of 202, 172 of 172, 142 of
    # 144, 232 of 232, 223 of 223, 217 of 217; at the tight target preemption 54 of 54, 52 of 54, 55 of 57,
    # 64 of 68 (AN: 0.94, short of the issue's 0.95: two victims read as a co-victim's recompute, two in a
    # storm of five), 67 of 69, 51 of 52 (one wrong), prefill 0.86 / 0.95, 0.85 / 0.95, 0.85 / 0.94, 0.84 /
    # 0.96, 0.86 / 0.98, 0.90 / 0.96 (their chat-sized prompts, above)
    rows = _pooled(by_round, witnessed.select(last))
    for target in (LOOSE, TIGHT):
        pre = rows[("all", target)]["preemption"]
        floor = 0.95 if target == LOOSE else tight_recall
        assert pre["actual"] >= 40 and pre["precision"] >= 0.95 and pre["recall"] >= floor, (target, pre)
    pf = rows[("all", LOOSE)]["prefill_interference"]
    assert pf["actual"] >= prefills and pf["precision"] >= 0.95 and pf["recall"] >= 0.95, pf
    tight = rows[("all", TIGHT)]
    assert tight["prefill_interference"]["recall"] >= 0.92 and tight["prefill_interference"]["precision"] >= 0.8, tight
    assert tight["neither_called_engine"] <= 0.06 * tight["neither"], tight


def test_a_victim_back_within_the_target_inside_an_api_server_stall_is_the_stalls():
    # round E's mixed load at 100 ms: four streams got nothing from 3.07 s to 3.38 s, then 63-93 tokens
    # each in one chunk that the engine had made meanwhile, never more than 60 ms apart: the API server
    # held them. One of them (6ad4f0ea) was also preempted in that time and back within 60 ms; the
    # engine's log called its gap a preemption before, which kvtop, reading the held burst, missed.
    # Its preemption cost it less than the target and the gap misses the target without it: the log
    # now gives it the stall's cause, as the other three's (docs/real-engines.md 7.24)
    import tempfile

    from eval.witness_matrix import spike_key, truth, without_witness
    from kvtop.analysis.scan import analyze_trace

    with witnessed.traces(witnessed.select("E")) as paths, tempfile.TemporaryDirectory() as tmp:
        (trace,) = [p for p in paths if "mixed-51" in p]
        logged, _, _ = truth(trace, 0.1)
        got = {(s.request_id[:8], round(s.t_end, 2)): (str(s.cause), s.rule, logged.get(spike_key(s)))
               for s in analyze_trace(without_witness(trace, tmp), itl_target_s=0.1, fast=False).spikes}
    for rid in ("69bb70b1", "acd85eeb", "781755d0", "6ad4f0ea"):
        assert got[(rid, 3.38)] == ("unknown", "delivery", "unknown"), (rid, got[(rid, 3.38)])


def test_without_the_witness_the_report_bounds_the_held_chunks_and_warns_at_the_tight_target(by_round):
    # docs/real-engines.md 7.25: the report without the engine's log counts the tokens the engine's usage
    # numbered beyond the chunks and bounds the spikes that can be merged chunks. At the tight target
    # (2.5x the step, under 3x the median gap) that bound holds, on every trace, the spikes the witness
    # read as tokens held outside its steps, and the report warns on every trace. At 100 ms one trace of
    # 197 has a held spike outside it (round R's mixed: four streams held by an API-server stall, one of
    # them cancelled later, whose count the engine never reported); pooled the bound holds it there too
    rows = [row for x in witnessed.names() for row in by_round[x]]
    tight = [r["merged"] for r in rows if r["target_s"] != 0.1]
    loose = [r["merged"] for r in rows if r["target_s"] == 0.1]
    for m in tight:
        assert m["spikes_max"] >= m["held"] and m["warned"] == 1, m
    assert sum(m["held"] for m in tight) >= 20_000  # 22,743: a third of the spikes, not a corner case
    assert sum(m["spikes_max"] < m["held"] for m in loose) <= 1
    assert sum(m["spikes_max"] for m in loose) >= sum(m["held"] for m in loose)
