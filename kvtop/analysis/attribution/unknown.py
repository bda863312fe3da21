"""Unknown: no rule explained the stall. The answer says which evidence was missing (asked last,
so it always answers)."""

from __future__ import annotations

from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.evidence import Evidence


def lone(ev: Evidence) -> Finding:
    """A stall of this stream alone that neither preemption, prefill nor slow decode explains."""
    if ev.flowing is None:
        why = "the only active stream stalled, so nothing tells the engine apart from the host" + (
            "" if ev.preempts else " (this engine never preempts)")
    elif ev.alone:
        why = "the other streams were silent since before it: nothing tells the engine apart from the host"
    elif not ev.preempts:
        why = "a lone stall (this engine never preempts)"
    else:
        # only what is absent: the signs seen (KV near full, a rising queue) lead the answer already
        missing = [m for m, seen in (("no counter step", ev.has_counter and ev.counter_delta() > 0),
                                     ("KV not near full", ev.kv_high),
                                     ("no running/waiting change", ev.running_drop or ev.window.waiting_rise))
                   if not seen]
        why = (f"a lone stall without enough preemption evidence ({', '.join(missing)})" if missing else
               "a lone stall: the preemption signs above do not tie a victim's turn to it")
    return ev.found(Cause.UNKNOWN, "unknown/lone", [why] + ev.late_first_token_line(), "lone", weighed=False)


def shared(ev: Evidence) -> Finding:
    """Every decoding stream stalled together and no rule explained it."""
    return ev.found(Cause.UNKNOWN, "unknown/shared",
                    ["all streams stalled together without a prefill or preemption signal"]
                    + ev.late_first_token_line(), "shared", weighed=False)
