"""Preemption: one stream left out while the engine kept stepping, or a victim among stalled streams.

What a preemption leaves behind depends on the engine (its adapter's ``preempt_counted_at``):
* vLLM V1 counts a preemption when the victim *resumes*: a stall that ends in a token is a
  preemption only if the counter stepped in the scrape interval around its end (the re-prefill
  before the token included). KV pinned near full and a rising queue hold for every stream in a
  storm, so they are evidence only for a silence that ended in a cancel (a victim cancelled while
  waiting is never counted).
* SGLang counts at retraction: the step belongs to the interval around the stall's start.
* Unknown engines: a step near the end, or KV near full with running dropping / waiting rising.
Each counter unit is claimed by one spike. Engines whose adapter says ``preempts = False`` never
get this cause.
"""

from __future__ import annotations

from kvtop.analysis.attribution.causes import Cause, Finding, Signs
from kvtop.analysis.attribution.evidence import Evidence
from kvtop.analysis.attribution.thresholds import REL_PREEMPT

# KV usage this close to full while every other stream keeps flowing: a victim the counter never
# counts (cancelled while preempted) pins it there.
KV_FULL = 0.95
# a co-stalled stream silent this much longer than the others: it was preempted too
LONGER = 1.2
# ... or fell silent this many of its decode steps before them and came back with them
LEAD_STEPS = 1.75


def reported(ev: Evidence) -> Finding | None:
    """The engine (or simulator) itself reported a preempt event for this request inside the gap."""
    if not (ev.engine_reported_preempt and ev.preempts):
        return None
    return ev.found(Cause.PREEMPTION, "preemption/reported",
                    ["engine reported a preempt event for this request inside the gap"], "reported", weighed=False)


def _step_line(ev: Evidence, t_c: float) -> str:
    return f"preemption counter stepped at t={t_c:.2f}s ({t_c - ev.gap.t_end:+.2f}s from the stall's end)"


def _brief(ev: Evidence) -> bool:
    """The stream resumed after a silence too brief for a victim's turn (``REL_PREEMPT``)."""
    rel = ev.rel
    return ev.resumed and rel is not None and rel < REL_PREEMPT


def _brief_line(ev: Evidence) -> str:
    return (f"the counter stepped, but a silence of {ev.rel:.1f}x the stream's recent gaps is no victim's wait and "
            "re-prefill")


def _state_signs(ev: Evidence) -> list[str]:
    w = ev.window
    out = []
    if ev.kv_high:
        out.append(f"KV usage {w.kv_max:.2f}")
    if ev.running_drop or w.waiting_rise:
        out.append("running dropped / waiting rose" if ev.running_drop and w.waiting_rise else
                   ("running dropped" if ev.running_drop else "waiting rose"))
    return out


def lone(ev: Evidence) -> Finding | Signs | None:
    """A stall of this stream alone (others streamed through it, or none was decoding).

    Returns the finding when the evidence is strong enough, else the weaker signs seen (they belong
    in whatever answer the stall gets instead)."""
    if not ev.preempts:
        return None
    w = ev.window
    # state evidence (KV, running, waiting) is about the engine, not this stream: it counts where
    # the counter cannot (a victim cancelled while waiting) or where the engine's semantics are unknown
    # (or where no scrape after the stall was read: the run ended before the counter could show it)
    unread = ev.counter_unread and not ev.alone
    state_ok = ev.counted_at is None or not ev.resumed or not ev.has_counter or unread
    pev = []
    # nobody else observed was decoding: a counter step says the engine preempted *someone*, and the
    # unobserved streams (or an engine-wide stall that only this stream shows) cannot be told apart
    # from this one (a prefill of an unobserved request looks the same): the honest answer is unknown.
    blind = ev.alone and ev.resumed
    brief = _brief(ev)
    claim = ev.claim_counter() if ev.has_counter and not blind and not brief else None
    if brief and ev.has_counter and not blind and ev.counter_delta() > 0:
        pev.append(_brief_line(ev))
    if blind and ev.has_counter and ev.counter_delta() > 0:
        pev.append("the counter stepped, but no other observed stream was decoding: the step may belong to "
                   "a stream kvtop does not see")
    if claim is not None:
        pev.append(_step_line(ev, claim[0]))
    signs = _state_signs(ev)
    pev += signs
    if unread:
        pev.append("no scrape was read after its end (the run ended): the counter cannot confirm it")
    if ev.gap.ended_by == "cancel":
        pev.append("the client cancelled while the stream was silent (an uncounted victim?)")
    flowing = ev.flowing
    # KV pinned at full while every other stream keeps flowing is itself the signature of a victim
    # the counter never counts (cancelled while preempted)
    kv_full_flowing = state_ok and flowing is not None and flowing > 0 and w.kv_max is not None and w.kv_max >= KV_FULL
    strong = claim is not None or (state_ok and ev.kv_high and (ev.running_drop or w.waiting_rise)) or kv_full_flowing
    if not strong:
        if ev.counted_at == "resume" and ev.resumed and ev.has_counter and signs and not brief:
            if ev.counter_delta() <= 0:
                pev.append("the stream resumed but the counter did not step at its resume (this engine counts there)")
            elif not blind:
                pev.append("the counter stepped at its resume, but each step there is another stall's (claimed by, "
                           "or left to, streams that resumed in the same scrape interval)")
        return Signs(pev)
    lines = []
    if flowing is not None and flowing > 0:
        lines.append("the other streams kept flowing")
    if claim is not None:
        kind = "counter"
    else:
        # state evidence alone (KV, running/waiting, others flowing)
        kind = "cancelled" if ev.gap.ended_by == "cancel" else ("unread" if unread else "state")
    return ev.found(Cause.PREEMPTION, "preemption/" + kind, lines + pev, kind, claim[1] if claim else None)


def queued(ev: Evidence) -> Finding | None:
    """The engine's own gauges, read while the stream was silent, leave it no place in the running
    batch: no more requests were running than the streams kvtop saw flowing then, and the queue held
    at least every silent stream (beyond the requests still waiting for a first token). A stream
    mid-way through its output that sits in the queue was preempted; on vLLM V1, whose counter steps
    only at the resume, this needs no counter step."""
    if not ev.preempts:
        return None
    q = ev.queued_at
    if q is None:
        return None
    t, running, waiting, silent = q
    claim = ev.claim_counter() if ev.has_counter else None
    return ev.found(Cause.PREEMPTION, "preemption/queued", [
        f"at t={t:.2f}s the engine ran {running:.0f} request(s) and queued {waiting:.0f}, while {silent} stream(s) "
        "kvtop sees mid-output, this one among them, were silent: no room in the running batch for it (it was "
        "queued: preempted)"] + ([_step_line(ev, claim[0])] if claim else []), "queued", claim[1] if claim else None)


def _silent_first(ev: Evidence) -> float | None:
    """The stream fell silent ``LEAD_STEPS`` decode steps or more before its company and came back
    with it (within half a step): the victim of a re-prefill. A victim misses the steps from its
    preemption to its re-prefill; the others stall only in the re-prefill, whose thousands of tokens
    can make it so long that the missed steps are well under ``LONGER`` of it. The step is the
    slower of the stream's pace and its company's: a stream whose recent gaps were merged chunks
    has a pace that makes any lead many steps."""
    a, b, co = ev.co_start, ev.co_end, ev.co_gap_median
    pace = ev.decode_pace
    if a is None or b is None or co is None or not pace:
        return None
    pace = max(pace, ev.stalls.company_pace(ev.gap, 0) or 0.0)
    g = ev.gap
    lead = a - g.t_start
    if lead >= LEAD_STEPS * pace and g.gap - co >= LEAD_STEPS * pace and abs(g.t_end - b) <= 0.5 * pace:
        return lead
    return None


def longer_than_company(ev: Evidence) -> Finding | None:
    """Every stream stalled (a prefill step, say) but this one stayed silent longer, or fell silent
    steps before them (``_silent_first``): a victim — only with a counter step to claim. KV sits
    near full through a whole storm, so "longer and KV high" alone turned host hiccups that stall
    every stream into preemptions on a real vLLM."""
    co = ev.co_gap_median
    if not (ev.preempts and ev.has_counter and co):
        return None
    first = None  # how long before the company it fell silent, where that and not its length tells
    if ev.gap.gap <= LONGER * co:
        first = _silent_first(ev)
        if first is None:
            return None
    if _brief(ev):
        return None
    # a victim misses at least the step it was preempted in: a silence longer than the company's by
    # less than one of the stream's decode steps is a busy step's jitter, not a turn spent waiting
    pace = ev.decode_pace
    if pace and ev.gap.gap - co < pace:
        return None
    # a silence a little longer than its company's is the weakest claim on a unit: a longer one that
    # ends later in the same scrape interval, a victim's turn, owns it first (its spike is judged later)
    claim = ev.claim_counter(yield_to_turns=REL_PREEMPT)
    if claim is None:
        return None
    return ev.found(Cause.PREEMPTION, "preemption/longer",
                    [f"silent {ev.gap.gap / co:.1f}x longer than the other stalled streams" if first is None else
                     f"silent {first * 1000:.0f} ms before the other stalled streams, and back with them",
                     f"preemption counter stepped at t={claim[0]:.2f}s"]
                    + ([f"KV usage {ev.window.kv_max:.2f}"] if ev.kv_high else []), "longer", claim[1])


def mass(ev: Evidence, prefill_signals: bool) -> Finding | None:
    """Streams fell silent together while the counter rose by about their number. Not for engines
    that count at resume: there each victim's step comes at its own resume (``lone``)."""
    if not ev.preempts or prefill_signals or ev.counted_at == "resume" or ev.co_fresh < 1:
        return None
    d = ev.counter_delta()
    if d < max(2.0, 0.5 * (ev.co_fresh + 1)):
        return None
    return ev.found(Cause.PREEMPTION, "preemption/mass", [f"the preemption counter rose by {d:.0f}: a mass preemption"],
                    "mass")
