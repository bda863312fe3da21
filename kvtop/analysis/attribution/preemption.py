"""Preemption: one stream left out while the engine kept stepping, or a victim of a mass preemption.

Signatures: the preemption counter steps at the end of the stall or shortly after (vLLM V1 counts
a preemption when the victim *resumes*; SGLang when it is retracted); KV near full; running drops
or waiting rises. A victim cancelled while preempted may never be counted. A lone stall with none
of this evidence is not a preemption.
"""

from __future__ import annotations

from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.evidence import Evidence
from kvtop.analysis.attribution.thresholds import KV_FULL, LONGER


def reported(ev: Evidence) -> Finding | None:
    """The engine (or simulator) itself reported a preempt event for this request inside the gap."""
    if not (ev.engine_reported_preempt and ev.preempts):
        return None
    return Finding(Cause.PREEMPTION, 0.98, ["engine reported a preempt event for this request inside the gap"])


def lone(ev: Evidence) -> tuple[Finding | None, list[str]]:
    """A stall of this stream alone (others streamed through it, or it is the only one).

    Returns the finding when the evidence is strong enough, else None and the weaker signs seen
    (they belong in whatever answer the stall gets instead)."""
    if not ev.preempts:
        return None, []
    w = ev.window
    pev = []
    score = 0.0
    t_c = ev.claim_counter()
    if t_c is not None:
        score += 0.45
        pev.append(f"preemption counter stepped at t={t_c:.2f}s ({t_c - ev.gap.t_end:+.2f}s from the stall's end)")
    if ev.kv_high:
        score += 0.2
        pev.append(f"KV usage {w.kv_max:.2f}")
    if ev.running_drop or w.waiting_rise:
        score += 0.2
        pev.append("running dropped / waiting rose" if ev.running_drop and w.waiting_rise else
                   ("running dropped" if ev.running_drop else "waiting rose"))
    if ev.gap.ended_by == "cancel":
        pev.append("the client cancelled while the stream was silent (an uncounted victim?)")
    flowing = ev.flowing
    # KV pinned at full while every other stream keeps flowing is itself the signature, e.g. for
    # victims the counter never counts (cancelled while preempted)
    kv_full_flowing = flowing is not None and w.kv_max is not None and w.kv_max >= KV_FULL
    strong = t_c is not None or (ev.kv_high and (ev.running_drop or w.waiting_rise)) or kv_full_flowing
    if not strong:
        return None, pev
    lines = []
    if flowing is not None:
        score += 0.15
        lines.append("the other streams kept flowing")
    return Finding(Cause.PREEMPTION, min(0.97, 0.3 + score), lines + pev), []


def longer_than_company(ev: Evidence) -> Finding | None:
    """Every stream stalled (a prefill step, say) but this one stayed silent longer: a victim — only
    with a counter step to claim. KV sits near full through a whole storm, so "longer and KV high"
    alone turned host hiccups that stall every stream into preemptions on a real vLLM."""
    if not (ev.preempts and ev.co_gap_median and ev.gap.gap > LONGER * ev.co_gap_median):
        return None
    t_c = ev.claim_counter()
    if t_c is None:
        return None
    return Finding(Cause.PREEMPTION, 0.8,
                   [f"silent {ev.gap.gap / ev.co_gap_median:.1f}x longer than the other stalled streams",
                    f"preemption counter stepped at t={t_c:.2f}s"]
                   + ([f"KV usage {ev.window.kv_max:.2f}"] if ev.kv_high else []))


def mass(ev: Evidence, prefill_signals: bool) -> Finding | None:
    """Streams stalled together while the counter rose by about their number."""
    if not ev.preempts or prefill_signals:
        return None
    d = ev.counter_delta()
    if d < max(2.0, 0.5 * (ev.co_fresh + 1)):
        return None
    return Finding(Cause.PREEMPTION, 0.6, [f"the preemption counter rose by {d:.0f}: a mass preemption"])
