"""Stalls outside the engine, checked before any engine cause.

* The host or the engine's API server hung: kvtop's own scrapes paused across the stall too (the
  recorder scrapes on a fixed beat; /metrics is answered by the same API server that streams tokens).
* A delivery stall (slow reader, API-server merging, network): the stall ends with everything
  buffered at once — one big chunk or many events within a couple of milliseconds — while a
  resumed preemption victim emits one step's worth of tokens and then its usual pace.
"""

from __future__ import annotations

from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.evidence import Evidence
from kvtop.analysis.gaps import BURST_S

# a late reply this close to the stall's end was held by the same hang (one decode step after it)
HELD_REPLY_S = 0.1
HOST_LATE_MIN_S = 0.25  # a scrape this late (beyond its interval) is no scheduling jitter

# A delivery stall (slow reader, API-server merging, network) ends with what was buffered: one big
# chunk, or many events within a couple of milliseconds. A resumed victim emits one step's worth.
BURST_MIN_TOKENS = 4
BURST_REL = 3.0  # ... and this many times the stream's usual tokens per event
BURST_EXPLAINS = 0.25  # the buffered tokens, at the stream's own pace, cover this share of the stall


def scrapes_stalled(ev: Evidence) -> bool:
    """A scrape beat missed (>= 2 intervals covering half the stall), or one late by at least half
    the stall (and >= HOST_LATE_MIN_S, and a quarter of the interval): kvtop waited as the stream did."""
    lag, si = ev.scrape_lag, ev.scrape_interval
    if lag >= 0.5 * ev.gap.gap and lag >= 2.0 * si:
        return True
    wait = ev.scrape_wait
    late = wait - si
    if late >= 0.5 * ev.gap.gap and late >= HOST_LATE_MIN_S and wait >= 1.25 * si:
        return True
    # a beat due inside the stall answered only when the streams resumed: however little of the
    # stall was left when the beat fell due, kvtop's reply waited on the same host / API server
    held = ev.held_reply
    return held is not None and held[0] >= HOST_LATE_MIN_S and abs(held[1] - ev.gap.t_end) <= HELD_REPLY_S


def calm_outside(ev: Evidence) -> float:
    """How long the stream was silent while kvtop's scrapes were answered on time: before the hang
    could have begun (the last reply before the first late one, or later: the last token another
    stream released with the late reply received before it fell silent) and after its late reply
    (beyond the skew of one release)."""
    span = ev.timeline.hang_span(ev.gap.t_start, ev.gap.t_end, ev.scrape_interval + HOST_LATE_MIN_S)
    if span is None:
        return 0.0
    # streams come back within HELD_REPLY_S of the late reply when the same hang held both; one that
    # still got tokens after the last on-time reply shows the hang had not begun
    began = span[0]
    other = ev.stalls.last_silent_from(ev.gap, span[1], HELD_REPLY_S, ev.cut)
    if other is not None:
        began = max(began, other)
    return max(0.0, began - ev.gap.t_start) + max(0.0, ev.gap.t_end - span[1] - HELD_REPLY_S)


def line(ev: Evidence) -> str:
    held = ev.held_reply
    if held is not None and held[0] >= HOST_LATE_MIN_S and abs(held[1] - ev.gap.t_end) <= HELD_REPLY_S:
        return (f"kvtop's own scrape, due during the stall, was answered {held[0]:.2f}s late as the streams resumed: "
                "the host or the engine's API server hung")
    if ev.scrape_lag >= 2.0 * ev.scrape_interval:
        return f"kvtop's own scrapes stalled {ev.scrape_lag:.1f}s across it: the host or the engine's API server hung"
    return (f"kvtop's own scrape came {ev.scrape_wait - ev.scrape_interval:.2f}s late across it: the host or the "
            "engine's API server hung")


def hung(ev: Evidence) -> Finding | None:
    """The host or the engine's API server hung: kvtop's own scrapes stalled with the stream."""
    if not scrapes_stalled(ev):
        return None
    # the stream silent for the target outside the hang (before it began, after kvtop's scrapes were
    # answered again): without the hang it would still have missed the target, so the hang is not
    # what made it (a preemption victim waiting through a hang of the API server)
    if ev.target is not None and calm_outside(ev) >= ev.target:
        return None
    return ev.found(Cause.UNKNOWN, "unknown/host", [line(ev), "not an engine cause: no engine setting fixes it"],
                    "host", weighed=False)


def continued(ev: Evidence) -> Finding | None:
    """A spike starting where the stream's delivery stall ended is the same disruption, unless it
    outlasts that stall: what held the stream back then was released by the burst that ended it, and a
    longer silence after it is a stall of its own (a preemption victim's tokens flushed just before
    it was preempted). Nor when it ended with a single token: a hold buffers what the engine made
    meanwhile, so nothing was held (scored against real vLLM's step log, such spikes were the engine's
    decode steps, or that victim's wait)."""
    g = ev.gap
    p = ev.prev_spike
    if p is None or p.kind != "delivery" or g.t_start - p.t_end > BURST_S or g.gap > p.candidate.gap:
        return None
    if g.ended_by == "token" and g.burst_n <= 1:
        return None  # it buffered nothing: the engine made no token for the stream meanwhile
    return ev.found(Cause.UNKNOWN, "unknown/delivery-continued",
                    ["it began where the stream's delivery stall ended: the same disruption"], "delivery", weighed=False)


def delivery(ev: Evidence) -> Finding | None:
    """The stall ended with what was buffered during it: a delivery stall, not the engine."""
    g = ev.gap
    usual = max(1.0, g.tokens_per_event)
    # more tokens than any one event of the stream carried so far is more than one engine step's
    # worth (a resumed victim emits one step, up to k + 1 tokens with speculative decoding): they
    # were produced during the stall and held back, as is a chunk several times the usual size
    if g.ended_by != "token" or g.burst_n < BURST_MIN_TOKENS or (
            g.burst_n < BURST_REL * usual and g.burst_n <= g.step_n_max):
        return None
    # the buffered tokens at the stream's own pace (baseline per event / tokens per event) cover a
    # share of the stall, unless the stream finished with them: the engine had made its last token
    pace = (ev.baseline or 0.0) / usual
    if pace and g.burst_n * pace < BURST_EXPLAINS * g.gap and not g.finished:
        return None
    return ev.found(Cause.UNKNOWN, "unknown/delivery", [
        f"the stall ended with {g.burst_n} tokens delivered at once (the stream usually gets {usual:.1f} per event,"
        f" at most {g.step_n_max} so far):"
        " a delivery stall (slow reader, API-server merging or network), not the engine"], "delivery", weighed=False)
