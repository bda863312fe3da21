"""The diagnosis half of the verdict, shared by ``kvtop analyze`` and ``kvtop advise``.

Both commands fill a ``Situation`` with what was observed (spikes, gaps, streams, time over the
target per cause) or given (a scenario's sections), and ``diagnose`` decides, through a fixed
order of gates, whether the ITL contract is broken and by what. Each gate that decides says so in
``Situation.decided_by`` so the verdict can name it.

Gate order (docs/kv-science.md §11, then the README's "Analysis and verdicts"):
1. ``cause_given`` — the scenario names the cause.
2. ``itl_target_met`` — observed p99 ITL within the target, or at most 1 % of gaps over it: no action
   (only where spikes over known gaps or streams are not counted: counts decide through gate 3).
3. ``spike_pattern`` — >= 3 spikes and (>= 0.05 % of gaps or >= 1 % of streams hit); isolated
   stalls do not break a p99 contract: no action.
4. ``cause_weight`` — causes weighed by the seconds over the target they cost (spike counts only when
   times are unknown); one that explains at least half the lost time decides, else the largest named
   cause with at least 30 %; only when neither holds is the answer ``insufficient_data``.
5. ``premise`` — a what-if scenario without observed spikes: its sections are the premise
   (a preemption class, a decode step at or over the target, a long prompt whose steps cross the
   target often enough to matter), each checked against its own frequency rule.
"""

from __future__ import annotations

from kvtop.analysis.advice import chunking
from kvtop.analysis.advice.situation import Situation

CAUSES = ("preemption", "prefill_interference", "slow_decode", "unknown")
MIN_SPIKES = 3
GAP_SHARE = 0.0005  # 0.05 % of gaps: enough to move p99.9
STREAM_SHARE = 0.01  # 1 % of streams: a visible share of users hit
P99_SHARE = 0.01  # more than 1 % of gaps over the target breaks a p99 contract
MOST = 0.5  # one cause explaining at least this share of the lost time decides
ENOUGH = 0.3  # otherwise the largest named cause needs this share


def spike_pattern(spikes: float, gaps: float | None = None, streams: float | None = None,
                  streams_hit: float | None = None, stream_share: float | None = None) -> tuple[bool, str]:
    """Whether ``spikes`` stalls form an ITL-miss pattern, and the figures that say so."""
    if spikes < MIN_SPIKES:
        return False, f"{spikes:g} spike(s) < {MIN_SPIKES}"
    share = stream_share
    if share is None and streams and streams_hit is not None:
        share = streams_hit / streams
    parts = []
    ok = False
    if gaps:
        ok = ok or spikes >= GAP_SHARE * gaps
        parts.append(f"{spikes / gaps:.3%} of {gaps:.0f} gaps (rule >= {GAP_SHARE:.2%})")
    if share is not None:
        ok = ok or share >= STREAM_SHARE
        parts.append(f"{share:.2%} of streams hit (rule >= {STREAM_SHARE:.0%})")
    if not parts:
        return True, f"{spikes:g} spikes (gaps and streams unknown)"
    return ok, f"{spikes:g} spikes: " + ", ".join(parts)


def _decide(s: Situation, gate: str, detail: str) -> None:
    s.decided_by.append({"gate": gate, "detail": detail})


def diagnose(s: Situation) -> None:
    """Set ``s.cause`` and ``s.itl_miss`` (and record the deciding gate)."""
    if s.cause_given is not None:
        s.cause = None if s.cause_given == "none" else s.cause_given
        s.itl_miss = s.cause is not None
        _decide(s, "cause_given", f"the scenario names the cause: {s.cause_given}")
        return
    slo = s.v("itl_slo")
    # Counted spikes over known gaps or streams decide through the spike-pattern gate (what `kvtop
    # analyze` measures, and what a saved scenario carries): a p99 or miss rate beside them is
    # informational, so the same figures give the same verdict in `analyze` and `advise`. The p99 /
    # miss-rate gate decides a what-if that gives no such counts.
    counted = s.spikes is not None and bool(s.v("gaps") or s.v("streams"))
    p99 = None if counted else s.v("itl_p99")
    miss = None if counted else s.v("miss_rate")
    if slo and p99 is not None and p99 <= slo:
        _no_action(s, "itl_target_met", f"observed p99 ITL {p99 * 1e3:.0f} ms <= target {slo * 1e3:.0f} ms")
        return
    if miss is not None and miss <= P99_SHARE:
        _no_action(s, "itl_target_met", f"{miss:.2%} of gaps over the target (<= {P99_SHARE:.0%}: p99 met)")
        return
    if s.spikes is not None:
        if s.spikes == 0:
            _no_action(s, "spike_pattern", "no token-gap spikes above the ITL target")
            return
        ok, why = spike_pattern(s.spikes, s.v("gaps"), s.v("streams"), s.v("streams_hit"))
        if not ok:
            _no_action(s, "spike_pattern", f"not an ITL-miss pattern: {why}")
            return
        if s.basis == "given" and not s.cause_counts and not s.cause_lost_s:
            # a scenario that counts spikes without splitting them by cause: its sections say which
            _decide(s, "spike_pattern", f"an ITL-miss pattern: {why}; causes not split, the sections decide")
            _premise(s)
            return
        s.itl_miss = True
        _weigh(s, why)
        return
    if s.basis != "given":
        # a trace without a usable target or timings: nothing to weigh
        s.cause = None
        s.itl_miss = None
        return
    _premise(s)


def _no_action(s: Situation, gate: str, detail: str) -> None:
    s.cause = None
    s.itl_miss = False
    _decide(s, gate, detail)


def _weigh(s: Situation, pattern: str) -> None:
    lost = {c: float(v) for c, v in s.cause_lost_s.items() if v}
    counts = {c: float(v) for c, v in s.cause_counts.items() if v}
    by_time = sum(lost.values()) > 0
    weight = lost if by_time else counts
    total = sum(weight.values())
    if total <= 0:
        s.cause = "unknown"
        _decide(s, "cause_weight", f"{pattern}; no cause weights")
        return
    shares = {c: weight.get(c, 0.0) / total for c in CAUSES}
    s.cause_shares = {c: v for c, v in shares.items() if c != "unknown"}
    unit = "of the time over target" if by_time else "of spikes"
    named = {c: shares[c] for c in CAUSES if c != "unknown"}
    best = max(named, key=lambda c: named[c])
    if named[best] >= MOST:
        s.cause = best
        why = f"{best.replace('_', ' ')} explains {named[best]:.0%} {unit}"
    elif named[best] >= ENOUGH:
        s.cause = best
        why = f"largest named cause {best.replace('_', ' ')}: {named[best]:.0%} {unit}"
    else:
        s.cause = "unknown"
        why = f"no named cause reaches {ENOUGH:.0%} {unit} (unknown {shares['unknown']:.0%})"
    if by_time:
        why += f" ({total:.3g} s over target in all)"
    streams = s.cause_streams.get(s.cause or "")
    if streams:
        why += f", {streams} stream(s) hit"
    _decide(s, "cause_weight", f"{pattern}; {why}")


def _premise(s: Situation) -> None:
    """A scenario with no observed spikes: its sections are the premise, each with its own rule."""
    if s.has_preemption_section and s.v("preemptions") != 0:
        count = s.v("preemptions")
        per_completed = s.v("preemptions_per_completed")
        streams = s.v("streams")
        if count is not None:
            # each preemption stalls one stream; per completed request it is (at most) the share hit
            ok, why = spike_pattern(float(count), s.v("gaps"), streams,
                                    min(float(count), float(streams)) if streams else None,
                                    None if streams else per_completed)
        elif per_completed is not None:
            ok = per_completed >= STREAM_SHARE
            why = f"{per_completed:.3g} preemptions per completed request (rule >= {STREAM_SHARE:g})"
        else:
            ok, why = True, "the scenario describes a preemption class (no observed counts to test it)"
        if not ok:
            _no_action(s, "spike_pattern", f"preemptions too rare to break the ITL target: {why}")
            return
        s.cause = "preemption"
        s.itl_miss = True
        _decide(s, "premise", f"preemption: {why}")
        return
    slo, t_dec, P = s.v("itl_slo"), s.v("decode_step"), s.v("long_prompt_tokens")
    if slo and t_dec and t_dec >= slo:
        s.cause = "slow_decode"
        s.itl_miss = True
        _decide(s, "premise", f"decode step {t_dec * 1e3:.0f} ms >= target {slo * 1e3:.0f} ms")
        return
    if slo and t_dec and P:
        a = 1.0 / (s.v("prefill_rate") or 25_000.0)
        k = s.v("k_att") or 0.0
        budget = s.v("batched_tokens_current")
        steps = chunking.chunk_steps(int(P), int(budget), t_dec, a, k) if budget else [chunking.t_step(0, P, t_dec, a, k)]
        over = [t for t in steps if t > slo]
        if over:
            rate = s.v("long_prompt_rate")
            if rate is not None:
                share = chunking.spike_share_steps(rate, steps, slo, t_dec)
                if share <= P99_SHARE:
                    _no_action(s, "spike_pattern", f"{len(over)} step(s) per {int(P)}-token prompt exceed the target "
                               f"but only {share:.2%} of each stream's gaps land on them (<= {P99_SHARE:.0%})")
                    return
                detail = f"{len(over)} step(s) per prompt over the target, {share:.2%} of each stream's gaps"
            else:
                detail = f"{len(over)} step(s) per prompt over the target (prompt rate unknown)"
            s.cause = "prefill_interference"
            s.itl_miss = True
            _decide(s, "premise", f"prefill: {detail}")
            return
    s.cause = None
    s.itl_miss = None
