"""Truth records, read back from a trace with exact ground truth (evaluation only).

The simulator (``kvtop simulate``) and the independent generator (``eval.tracegen``) write ``truth``
lines beside what kvtop observes; kvtop itself never reads them. This module turns them into, per
request, the stalls that really happened, and labels a spike with the one it overlaps most.
A preemption is a ``resume`` with t_start/t_end, or a ``preempt`` followed by a ``cancel``; a
prefill stall lists the request among the ``affected`` streams; a ``stall`` record is one stalled
gap of one stream with its ``cause`` (engine causes, or delivery causes such as a slow reader or a
host pause, as eval/tracegen writes them); a ``victim`` record (eval/tracegen) is the engine's own
window from preempting a request to resuming it (to its end, if it never resumed). With
``engine_wide``, a ``slow_step`` run (no stream list: every decoding stream waited) labels every
stream's overlapping gaps ``slow_decode`` (and wins a tie with a prefill stall: the decode part alone
missed the target).

A spike of a request the engine preempted between its two tokens is a preemption, whatever else
overlapped it: the rule of the witness that judges kvtop on the real vLLM (docs/witness.md), which
also leaves out (given the ITL target) a preemption the victim waited out within the target in a gap
that would miss the target without that wait (a victim resumed soon, inside a hold of its stream).
The wait here runs from the preemption to the resume's token; the witness reads it from the token
before, up to one decode step longer. A slow
reader's hold that hid a victim's wait is then the preemption's, as the engine's log would call it.
"Between its two tokens" is in the engine's time, as the witness maps each chunk to the step that
produced it: the spike's closing token was made after the victim resumed (its start was read before
the resume, its end after it). A token made before the preemption that a hold delivered late closes
a gap the engine never preempted inside, however much of the victim's wait the hold overlapped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvtop.model.trace import TraceReader

TRUTH_CAUSES = ("preemption", "prefill_interference")
PREEMPTED = "preempted"  # a victim's window in the engine (a ``victim`` record): read by ``label_span`` only
RESUMED = "resumed"  # ... of a victim that resumed: it ends with the token the resume made
# a preempted window overlapping a spike by less than this (a resume this close to its ends) is the
# clocks' offset between the engine and the client (delivery latency), not a preemption between its
# tokens
PREEMPTED_MIN_S = 0.002
# stalls that happen between the engine and the client: never the engine's doing
NON_ENGINE_CAUSES = ("slow_reader", "api_merge", "api_stall", "host_pause")
ANY_STREAM = "*"  # key of intervals that apply to every stream


class Stall(NamedTuple):
    """One stall that really happened, in trace time."""

    t_start: float
    t_end: float
    cause: str


Truth = dict[str, list[Stall]]  # request id (or ANY_STREAM) -> its stalls


def truth_intervals(path: str, engine_wide: bool = False) -> Truth:
    out: Truth = defaultdict(list)
    open_pre: dict[str, float] = {}
    for d in TraceReader(path).dicts():
        if d.get("kind") != "truth":
            continue
        ev, rid, data = d.get("event"), d.get("request_id"), d.get("data") or {}
        if ev == "preempt" and rid:
            open_pre[rid] = d["t"]
        elif ev == "resume" and rid:
            out[rid].append(Stall(data.get("t_start", open_pre.get(rid, d["t"])), data.get("t_end", d["t"]), "preemption"))
            open_pre.pop(rid, None)
        elif ev == "cancel" and rid and rid in open_pre:
            out[rid].append(Stall(open_pre.pop(rid), d["t"], "preemption"))
        elif ev == "prefill_stall":
            for a in data.get("affected", []):
                out[a].append(Stall(data["t_start"], data["t_end"], "prefill_interference"))
        elif ev == "victim" and rid:
            end = data.get("t_end")
            resumed = data.get("outcome") == "resumed" and end is not None
            out[rid].append(Stall(data.get("t_preempt", d["t"]), float("inf") if end is None else end,
                                  RESUMED if resumed else PREEMPTED))
        elif ev == "stall" and rid:
            out[rid].append(Stall(data["t_start"], data["t_end"], data["cause"]))
        elif ev == "slow_step" and engine_wide:
            out[ANY_STREAM].append(Stall(data["t_start"], data["t_end"], "slow_decode"))
    return out


def label(spike: Mapping[str, Any], truth: Truth, target: float | None = None) -> str | None:
    """The true cause of a spike given as ``{"request_id", "t_start", "t_end"}``."""
    return label_span(spike["request_id"], spike["t_start"], spike["t_end"], truth, target)


def label_span(request_id: str, t_start: float, t_end: float,
               truth: Truth, target: float | None = None) -> str | None:
    """The truth stall that overlaps [t_start, t_end] most: of the request itself, else engine-wide;
    a preemption wherever the request was preempted inside it, unless the victim's wait (preempt to
    resume) met the ITL ``target`` and the gap less that wait still misses it."""
    own = truth.get(request_id, ())
    gap = t_end - t_start

    def counts(wait: float) -> bool:
        return target is None or wait > target or gap - wait <= target

    waited_out = set()  # preemptions inside the spike that broke no target: never its cause
    for i, (a, b, cause) in enumerate(own):
        if cause == RESUMED:
            # the resume's token (made at b) came after the spike's first token and by its last
            if t_start + PREEMPTED_MIN_S < b <= t_end + PREEMPTED_MIN_S:
                if counts(b - a):
                    return "preemption"
                waited_out.add(i)
        elif cause in ("preemption", PREEMPTED) and min(b, t_end) - max(a, t_start) >= PREEMPTED_MIN_S:
            if counts(min(b, t_end) - a):
                return "preemption"
            waited_out.add(i)
    best, best_ov = None, 0.0
    for i, (a, b, cause) in enumerate(own):
        ov = min(b, t_end) - max(a, t_start)
        if ov > best_ov and cause not in (PREEMPTED, RESUMED) and i not in waited_out:
            best, best_ov = cause, ov
    for a, b, cause in truth.get(ANY_STREAM, ()):
        ov = min(b, t_end) - max(a, t_start)
        # a prefill step inside a run of steps whose decode part alone misses the target: the
        # stall would have happened without the prefill
        if ov > best_ov or (ov > 0 and ov >= best_ov and best == "prefill_interference"):
            best, best_ov = cause, ov
    return best


