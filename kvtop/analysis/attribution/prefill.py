"""Prefill interference: nobody streamed through the stall, and a prefill explains it.

Signals: another request's first token at the stall's end, or a prompt-token counter jump around
it. A signal counts only when its prompt tokens, at the prefill rate kvtop measured (a low estimate:
the median of prompt tokens / TTFT, which includes queueing), cover at least ``PREFILL_SHARE`` of the stall's excess
over the stream's pace: a 117-token prompt does not explain a 1.9 s freeze. Nor does a prefill
explain a spike of a stream whose own pace already missed the target (that is slow decode). A stall that every
stream shares, with the preemption counter stepping at its end and no new prompt, is a resumed
victim's re-prefill: a recompute stall (prefill work caused by preemption).
"""

from __future__ import annotations

from typing import NamedTuple

from kvtop.analysis.attribution.causes import Cause, Finding, Signs
from kvtop.analysis.attribution.evidence import Evidence
from kvtop.analysis.attribution.thresholds import REL_RECOMPUTE, REL_SLOW
from kvtop.analysis.gaps import BURST_S

# A prefill explains a stall only when its tokens at the measured prefill rate cover this share of
# the stall's excess over the stream's pace.
PREFILL_SHARE = 0.3
# A prompt the engine prefilled in under this many of the stream's decode steps ran beside its decode
# in a step or two (a chat-sized prompt): its part of a stall is bounded by the engine's own times
# (``span``; the bound of ``_timed_part_short``, chosen on round AI, docs/real-engines.md 7.10 and 7.19).
# Over a longer prefill a stall spans chunk steps whose decode part one decode step does not bound.
SHORT_PREFILL_STEPS = 3.0
# A gap this many times the decode-only pace after it, ended by another request's first token: the
# step was mostly prefill (its decode part alone would have kept the pace).
PREFILL_DOMINANT = 2.0

# A decode-only pace this close to the target misses it on its own as soon as the engine slows a
# little more (the estimate, the stream's fastest recent gap, lags a pace that keeps rising): the
# spike is slow decode, not prefill
PACE_NEAR = 0.95

# A resumed victim's re-prefill holds the batch for one engine step: a shared stall longer than this
# with a counter step at its end is as often a host or API-server hang that fell between kvtop's
# scrape beats, so it gets its own, lower, confidence ("prefill/recompute-long").
RECOMPUTE_STEP_S = 0.3
# A waiting stream that resumes is a preemption victim only where the engine preempted (its counter
# stepped) within this long before the stall ended: the span the engine timeline keeps at the least.
RESUMED_AFTER_S = 60.0


def _outlier(ev: Evidence, rel_min: float = REL_SLOW) -> bool:
    """The stall stands out from the stream's own recent gaps (``rel_min`` of them: ``REL_SLOW``, or
    ``REL_RECOMPUTE`` for a victim's re-prefill, which a shorter stall held none of: a victim resumed
    that soon came from the prefix cache). A gap about as long as them is the engine's pace (all gaps
    lifted) unless a prompt that the measured rate checks explains it: scored against real vLLM's own
    step log, such gaps called prefill on an unchecked signal (a first token of unknown prompt length,
    a victim resuming) were mostly decode steps of an engine that had slowed (a fast delivery burst had
    kept the stream's fastest gap, its decode-only pace, short)."""
    rel = ev.rel
    return not (ev.baseline_is_stream and rel is not None and rel < rel_min)


def _pace_misses(ev: Evidence) -> bool:
    """The stream's own decode pace already misses the target (``PACE_NEAR``): its spike would have
    been one without any prefill (slow decode)."""
    pace = ev.decode_pace
    return bool(ev.target and ev.pace_known and pace and pace >= PACE_NEAR * ev.target)


def _slower(ev: Evidence, pace: float | None = None) -> float:
    """How many times slower the engine steps now than it usually did (its decode-only pace now,
    by default the stream's, over the run's median gap so far): the measured rate was read mostly at
    the usual pace, and an engine stepping k times slower (throttled, or its host busy) prefills k
    times slower too. A stream's own calm gaps would not tell: one that began after the engine slowed
    has only slow ones."""
    pace = pace or ev.decode_pace
    usual = ev.run_median
    return max(1.0, pace / usual) if pace and usual else 1.0


def _prefill_s(ev: Evidence, tokens: float, pace: float | None = None) -> float:
    """The prefill time of ``tokens`` at the measured rate, slowed as the engine is (``_slower``)."""
    return tokens * _slower(ev, pace) / ev.prefill_rate if ev.prefill_rate else 0.0


def _explains(ev: Evidence, tokens: float) -> bool | None:
    """Whether ``tokens`` of prefill explain the stall (None: no measured rate to tell)."""
    if not ev.prefill_rate or not tokens:
        return None
    excess = ev.gap.gap - (ev.decode_pace or 0.0)
    t = _prefill_s(ev, tokens)
    return t >= PREFILL_SHARE * excess and not _priced_part_short(ev, t)


def _all_seen(ev: Evidence, unseen: float | None, judged: int = 0) -> bool:
    """kvtop saw the first token of every prompt the engine counted (``Evidence.unseen_prompts``),
    and none of those requests could have been in prefill all through the stall: a prompt-counter
    rise then points at no prefill that a first-token signal does not already place elsewhere.
    ``judged``: requests whose first token ends the stall and whose part of it the engine's own
    times already bounded (``_timed_part_short``): their prefill is no unseen one."""
    return unseen is not None and unseen <= 0 and not ev.prefill_observed_through(judged)


def _timed_part_short(ev: Evidence, engine_prefill_s: float | None, step: float | None = None) -> bool:
    """The witness's test, with the engine's own times for the prompts: the engine spent
    ``engine_prefill_s`` of the stall on steps that prefilled them (vLLM's per-request metrics), each
    of which also ran the stream's decode, so their part of the stall is at most that less one
    decode-only step (the stream's pace). Where the stall less even that part still misses the target,
    the prompts are not why it missed: a gap of two engine steps in one of which a ten-token prompt
    ran is the engine's own steps (or time outside it), whatever the prompt at the measured rate
    (a low estimate) would cover. ``step``: the decode step to take off, where not the stream's pace."""
    tgt, pace = ev.target, step or ev.decode_pace
    if engine_prefill_s is None or not tgt or not pace:
        return False
    return ev.gap.gap - max(0.0, engine_prefill_s - pace) > tgt


def _priced_part_short(ev: Evidence, priced_s: float) -> bool:
    """``_timed_part_short`` with the prompts' time at the measured rate (``priced_s``) where the engine
    gave none, for a chat-sized prompt (priced under ``SHORT_PREFILL_STEPS`` decode steps): the rate is a
    low one (a short prompt's TTFT is mostly the decode work of its step), so its price is a high one,
    and where even that, less the decode step the prompt rode in, leaves the stall missing the target,
    the prompt is not why it missed. Not for longer prompts: a cold engine's first prefills ran far
    slower than the rate says (docs/real-engines.md 7.18)."""
    pace = ev.decode_pace
    return bool(pace) and priced_s < SHORT_PREFILL_STEPS * (pace or 0.0) and _timed_part_short(ev, priced_s)


class Signals(NamedTuple):
    lines: list[str]  # the signals, in words
    checked: bool  # one was checked against the measured prefill rate
    claim: tuple[float, float] | None  # the stall span an interval's prompt tokens would explain


def _budget(ev: Evidence, tokens: float) -> tuple[float, float] | None:
    """The span of the stall that ``tokens`` of the scrape interval it ended in would explain, where
    they can still explain it: an interval's prompt tokens are a finite prefill time (tokens /
    measured rate), which the stalls it explains share, each claiming its excess over the stream's
    pace (streams stalled in the same step claim the same span once). None: spent on other stalls."""
    if not ev.prefill_rate:
        return (0.0, 0.0)  # unchecked signals stay unchecked: no rate, no budget to spend
    g = ev.gap
    excess = max(0.0, g.gap - (ev.decode_pace or 0.0))
    span = (g.t_end - excess, g.t_end)
    if ev.timeline.prefill_room(g.t_end, span, _prefill_s(ev, tokens), PREFILL_SHARE, BURST_S):
        return span
    return None


def _unexplained_rise(ev: Evidence) -> float | None:
    """Prompt tokens of the window's rise that the prompts kvtop saw finish before the stall began
    (this stream's own too) leave unexplained, where no request kvtop sees was in prefill during the
    stall (None: the rise stands as it is). At a tight target every gap of the scrape interval after
    a burst of admissions read as their prefill (real vLLM's own log: decode steps). A prompt of
    unknown length (a text prompt whose usage count kvtop has not seen) may account for the rise
    whole. A request that arrived by the stall's end and had no first token by its start keeps the
    rise (llama.cpp counts a long prompt's tokens batch by batch, before its first token)."""
    done, done_tokens, unsized = ev.prompts_done_before
    if not done or ev.prefill_observed_in:
        return None
    return 0.0 if unsized else max(0.0, ev.window.prompt_delta - done_tokens)


def signals(ev: Evidence) -> Signals:
    """The prefill signals that can explain the stall, in words, whether one was checked against
    the measured prefill rate, and the span a finding on an interval's prompt tokens claims. None
    where the stream's own pace already missed the target: that spike would have been one without
    the prefill (slow decode)."""
    out: list[str] = []
    checked = False
    claim: tuple[float, float] | None = None
    if _pace_misses(ev):
        return Signals(out, checked, None)
    ft = ev.first_token
    ft_short = 0  # a first token at its end whose prompt alone is too short to explain it
    # no signal where the engine's own times leave the stall missing the target without them; nor
    # do those prompts then count in the interval's rise (the engine placed them)
    timed_short = ft is not None and _timed_part_short(ev, ft.engine_prefill_s)
    judged = ft.requests if ft is not None and timed_short else 0
    if ft is not None and not timed_short:
        ok = _explains(ev, ft.total_prompt_tokens)
        if ok is False and ev.end_excess_unseen:
            # prompts kvtop did not see may have finished in the same step: they add to it
            ft_short = ft.total_prompt_tokens
        if ok is not False:
            checked |= ok is True
            out.append(f"request {ft.request_id} got its first token at the end of the stall"
                       + (f" ({ft.prompt_tokens} prompt tokens)" if ft.prompt_tokens else "")
                       + (f", with {ft.requests - 1} more ({ft.total_prompt_tokens} prompt tokens in all)"
                          if ft.requests > 1 else ""))
    # what of the window's prompt rise prompts kvtop saw finish can leave to another prefill
    unexplained = _unexplained_rise(ev) if not out else None
    if ev.prompt_jump and (out or not _all_seen(ev, ev.unseen_prompts)):
        excess = ev.prompt_excess if unexplained is None else min(ev.prompt_excess, unexplained)
        ok = _explains(ev, excess) if excess else False
        span = _budget(ev, excess) if ok is not False else None
        if span is not None:
            checked |= ok is True
            claim = claim if out else span  # a first token at its end needs no interval's budget
            out.append(f"prompt tokens rose by {ev.window.prompt_delta:.0f} around the stall")
    if not out and ev.prefill_rate and not _all_seen(ev, ev.unseen_prompts_at_end, judged):
        # no first token seen (its request may be unobserved) and no jump over the whole window:
        # the interval in which the stall ended still added more prompt tokens than usual, enough
        # at the measured rate to explain it
        extra = ev.end_prompt_excess if unexplained is None else min(ev.end_prompt_excess, unexplained)
        if judged and ft is not None and not ev.end_excess_unseen:  # (else they are already out of it)
            extra = max(0.0, extra - ft.total_prompt_tokens)
        span = _budget(ev, extra + ft_short) if extra and _explains(ev, extra + ft_short) else None
        if span is not None:
            checked = True
            claim = span
            out.append(f"the scrape interval in which it ended added {extra:.0f} prompt tokens more than usual"
                       + (f" (beyond the prompts kvtop saw), besides request {ft.request_id}'s {ft_short} with its "
                          "first token at the stall's end" if ft is not None and ft_short else ""))
    if checked and ev.prefill_rate:
        k = _slower(ev)
        out.append(f"at the measured {ev.prefill_rate:.0f} prompt tokens/s"
                   + (f", {k:.1f}x slower as the engine now steps," if k > 1.05 else "")
                   + " that prefill covers the stall")
    elif out and not _outlier(ev):
        return Signals([], False, None)  # a signal no rate could check, on a gap like the stream's others
    return Signals(out, checked, claim)


def _found(ev: Evidence, sig: Signals, key: str, kind: str) -> Finding:
    if sig.claim is not None and sig.claim[1] > sig.claim[0]:
        ev.timeline.claim_prefill(ev.gap.t_end, sig.claim)
    return ev.found(Cause.PREFILL, key, sig.lines, kind, sparse_matters=False)


def lone(ev: Evidence, checked_only: bool = False) -> Finding | None:
    """The only decoding stream stalled, with a prefill signal (nobody else to compare with);
    ``checked_only``: only a signal the measured prefill rate confirms."""
    sig = signals(ev)
    if not sig.lines or (checked_only and not sig.checked):
        return None
    return _found(ev, sig, "prefill/lone-checked" if sig.checked else "prefill/lone", "lone")


def shared(ev: Evidence) -> Finding | None:
    """Every stream stalled together and a prefill signal ends the stall."""
    sig = signals(ev)
    if not sig.lines:
        return None
    return _found(ev, sig, "prefill/shared-checked" if sig.checked else "prefill/shared", "shared")


def span(ev: Evidence) -> Finding | Signs | None:
    """The stall lies inside another request's prefill as the engine itself timed it (vLLM's
    per-request metrics: from first scheduled to first token), and no preemption was counted around
    it. A chunked prefill slows every step it shares, so the stream's recent pace is no alibi here;
    its decode steps as last seen with no prompt in flight are: where they already missed the target
    and make up most of the stall, its cause is the engine's slow decode."""
    sp = ev.prefill_span
    if sp is None or (ev.has_counter and ev.counter_delta() > 0):
        return None
    a, b, prompt, rid = sp
    tgt = ev.target or 0.0

    def most(step: float) -> bool:  # a decode step that misses the target and is over half the stall
        return tgt > 0 and step >= PACE_NEAR * tgt and ev.gap.gap < 2 * step

    # no decode-only step is longer than a gap it made (the fastest recent one): asked first, it
    # spares reading the clean steps
    pace = ev.decode_pace
    if tgt and (not pace or most(pace)) and (clean := ev.clean_pace) and most(clean):
        step = min(clean, pace) if pace else clean
        return Signs([f"inside request {rid}'s prefill, but this stream's decode steps with no prompt in flight "
                      f"took {step * 1e3:.0f} ms (target {tgt * 1e3:.0f} ms): most of the stall"])
    excess = ev.gap.gap - (ev.decode_pace or 0.0)
    if ev.prefill_rate and _prefill_s(ev, prompt) < PREFILL_SHARE * excess:
        return None  # too short a prompt for this stall
    # a prompt the engine prefilled within a few of the stream's decode steps ran in a step beside the
    # stream's own decode: its part of the stall is at most the prefill's time inside the stall less
    # one decode step (the shorter of the stream's fastest recent gap and its decode-only step with no
    # prompt in flight); where the stall less even that misses the target, the prompt is not why
    if tgt and pace and b - a < SHORT_PREFILL_STEPS * pace and (clean := ev.clean_pace):
        step = min(pace, clean)
        inside = min(b, ev.gap.t_end) - max(a, ev.gap.t_start)
        if _timed_part_short(ev, inside, step):
            return Signs([f"request {rid}'s prompt ({prompt} tokens) was prefilled inside the stall, but in "
                          f"{max(0.0, inside) * 1e3:.0f} ms of it (the engine's own times), one decode step "
                          f"({step * 1e3:.0f} ms) of which was the stream's own: without it the stall still misses "
                          "the target"])
    return ev.found(Cause.PREFILL, "prefill/span", [
        f"request {rid}'s prompt ({prompt} tokens) was being prefilled from t={a:.2f}s to {b:.2f}s (the engine's "
        "own times for it): the stall lies inside that prefill"], "span", sparse_matters=False)


def recompute(ev: Evidence) -> Finding | Signs | None:
    """A shared stall ending with a counter step on an engine that counts at resume: a victim resumed
    and re-prefilled (its recompute tokens are in no counter)."""
    if not (ev.preempts and ev.counted_at == "resume" and ev.has_counter) or not _outlier(ev, REL_RECOMPUTE):
        return None
    d = ev.counter_delta()
    if d < 1:
        return None
    # the counter steps all through a storm: only a victim seen resuming as the stall ended ties the
    # step to this stall (its re-prefill is the step every other stream waited for)
    victim = ev.stalls.victim_resumed(ev.gap)
    if victim is None:
        return Signs([f"the preemption counter stepped by {d:.0f} at its end, but no stream kvtop sees resumed "
                      "with it: the step may be an unobserved victim's re-prefill, or another stall's"])
    lines = [f"the preemption counter stepped by {d:.0f} at its end with no new prompt, and request {victim}, "
             "silent since before it, resumed as it ended: that victim's re-prefill (a recompute stall) held "
             "every stream"]
    key = "prefill/recompute"
    if ev.gap.gap > RECOMPUTE_STEP_S:
        # the counter steps all through a storm, so a step at the end of a long silence proves little:
        # a host or API-server hang that fell between kvtop's scrape beats looks the same
        key = "prefill/recompute-long"
        lines.append(f"but the stall ({ev.gap.gap:.2f}s) outlasts one re-prefill step ({RECOMPUTE_STEP_S:g}s) and "
                     "no scrape of kvtop's could tell a host hang between its beats from it")
    return ev.found(Cause.PREFILL, key, lines, "recompute", sparse_matters=False)


def resumed(ev: Evidence) -> Finding | None:
    """The only decoding stream stalled while the others waited, and one of them resumed as the stall
    ended: that waiting stream's re-prefill (a preemption victim's recompute, in no prompt counter)
    held the step the lone decoder waited for. Scored against real vLLM's step log, these were the
    recompute steps of a storm's survivors; the stream's own pace must keep the target."""
    if not ev.preempts or not ev.resumed or not _outlier(ev, REL_RECOMPUTE):
        return None
    if _pace_misses(ev):
        return None
    if ev.has_counter and ev.timeline.counter_delta(ev.gap.t_end - RESUMED_AFTER_S, ev.gap.t_end + ev.tol) < 1:
        return None  # no preemption within the minute: no waiting victim to resume
    victim = ev.stalls.victim_resumed(ev.gap)
    if victim is None:
        return None
    return ev.found(Cause.PREFILL, "prefill/resumed", [
        f"request {victim}, silent since before it (a waiting victim), resumed as it ended: its re-prefill held "
        "the only decoding stream's step"], "recompute", sparse_matters=False)


def dominant(ev: Evidence) -> Finding | None:
    """Another request's first token ends a gap that is the longest around it and at least
    ``PREFILL_DOMINANT`` x the stream's pace before it and its decode-only pace right after it (the
    shortest look-ahead gap), while that pace keeps the target: the step was mostly prefill, even where every gap
    around it is slow (prefill riding on a slower pace). Asked for a shared stall before the
    slow-decode rules that would otherwise take it (``onset``, ``pace``)."""
    g = ev.gap
    if ev.first_token is None or len(g.after) < 2 or not ev.target:
        return None
    own = ev.decode_pace
    if ev.pace_known and own and own >= PACE_NEAR * ev.target:
        return None  # the stream's own decode-only pace before it was at the target: slow decode (as in signals)
    pace = min(g.after)
    before = ev.baseline or 0.0  # the pace before it: a slower pace that just ended is no prefill
    if pace <= 0 or pace >= ev.target or g.gap < PREFILL_DOMINANT * max(pace, before) or g.gap < max(g.after):
        return None
    ft = ev.first_token
    if _timed_part_short(ev, ft.engine_prefill_s):
        return None
    # on an engine that slowed (seen here in the pace after the gap), the prompts at the slowed rate
    # must still cover their share
    if ev.prefill_rate and _prefill_s(ev, ft.total_prompt_tokens, pace) < PREFILL_SHARE * (g.gap - pace):
        return None
    return ev.found(Cause.PREFILL, "prefill/dominant", [
        f"request {ft.request_id} got its first token at the end of the gap"
        + (f" ({ft.total_prompt_tokens} prompt tokens with {ft.requests - 1} more)" if ft.requests > 1 else ""),
        f"the gap is {g.gap / pace:.1f}x the decode-only pace right after it ({pace * 1e3:.0f} ms, within the "
        "target) and the longest around it: the step was mostly prefill"], "dominant", sparse_matters=False)
