"""Slow decode: the spike is no outlier for its stream's pace.

Judged against the stream's recent gaps, with a look-ahead at the gaps that follow it (see
``gaps.LOOKAHEAD``): a spike much longer than the gaps after it stood out, whatever came before.
A spike the following gaps are about as long as is (the onset of) a slower pace, not a stall
(asked after the prefill and preemption rules: a run of prefill steps lifts a few gaps in a row).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.evidence import Evidence
from kvtop.analysis.attribution.thresholds import REL_SLOW


def _median(v: Sequence[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2]


def lifted(ev: Evidence) -> Finding | None:
    """The gap is less than REL_SLOW x the stream's decode-only pace (its fastest recent gap: the
    median would count a run of prefill steps as the pace), and the gaps after it do not show it
    standing out."""
    g = ev.gap
    pace = ev.decode_pace
    if not pace or g.gap >= REL_SLOW * pace:
        return None
    rel = g.gap / pace
    if g.after and g.gap >= REL_SLOW * _median(g.after):
        return None  # the pace after it is much faster: this gap stood out
    return ev.found(Cause.SLOW_DECODE, "slow/lifted" if ev.baseline_is_stream else "slow/lifted-run",
                    [f"gap {g.gap * 1e3:.0f} ms is only {rel:.1f}x this stream's recent gaps: all gaps lifted"],
                    "lifted", weighed=False)


def onset(ev: Evidence) -> Finding | None:
    """The gaps after the spike are about as long: a new, slower pace (asked after the prefill rules:
    a run of prefill steps lifts a few gaps in a row too)."""
    g = ev.gap
    after = g.after
    p = ev.prev_spike
    if len(after) < 2 and p is not None and p.cause is Cause.SLOW_DECODE and g.t_start - p.t_end <= REL_SLOW * g.gap \
            and g.gap < REL_SLOW * p.candidate.gap and not (after and g.gap >= REL_SLOW * after[0]):
        # too few gaps after it (the stream ended): it continues the slow pace of the spike just before
        return ev.found(Cause.SLOW_DECODE, "slow/continued", ["the stream's previous spike, just before, was slow "
                        f"decode at {p.candidate.gap * 1e3:.0f} ms: the same slower pace"], "continued", weighed=False)
    if len(after) < 2:
        return None
    ahead = _median(after)
    if g.gap < REL_SLOW * ahead:
        base = g.calm_baseline or ev.baseline
        return ev.found(Cause.SLOW_DECODE, "slow/onset", [
            f"the {len(after)} gaps after it are about as long ({ahead * 1e3:.0f} ms"
            + (f", {ahead / base:.1f}x the stall-free pace before" if base else "")
            + "): a slower decode pace, not a stall"], "onset", weighed=False)
    return None


def pace_missed(ev: Evidence) -> Finding | None:
    """Nothing else explains a spike of a stream whose own pace already missed the target: its
    decode is slow, and this gap is a longer one of the same (asked last)."""
    if not (ev.target and ev.baseline_is_stream and ev.baseline and ev.baseline >= ev.target):
        return None
    return ev.found(Cause.SLOW_DECODE, "slow/pace", [
        f"this stream's pace ({ev.baseline * 1e3:.0f} ms per token) already misses the target: its decode is slow"],
        "pace", weighed=False)
