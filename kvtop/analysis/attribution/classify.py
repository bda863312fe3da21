"""The order in which the rules are asked about one spike."""

from __future__ import annotations

from kvtop.analysis.attribution import host, preemption, prefill, slow_decode
from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.evidence import Evidence


def classify(ev: Evidence) -> Finding:
    f = preemption.reported(ev) or slow_decode.judge(ev)
    if f is not None:
        return f
    head = ev.context_lines()
    # While any other stream still received tokens the engine kept stepping: this stream alone was
    # left out. In a preemption storm most streams sit silent (preempted earlier, still waiting), so
    # a share of silent streams says nothing; an engine-wide stall (a prefill step, a host hiccup)
    # is one that nobody streamed through.
    flowing = ev.flowing
    if flowing is None or flowing > 0:
        f, signs = preemption.lone(ev)
        head += signs
        f = f or prefill.lone(ev)
        if f is not None:
            f.lines = head + f.lines
            return f
        lines = head
        if host.scrapes_stalled(ev):
            lines.append(host.line(ev))
        if flowing is None:
            lines.append("the only active stream stalled, so nothing tells the engine apart from the host"
                         + ("" if ev.preempts else " (this engine never preempts)"))
        else:
            lines.append("a lone stall without preemption evidence (no counter step, KV not near full, "
                         "no running/waiting change)" if ev.preempts else "a lone stall (this engine never preempts)")
        return Finding(Cause.UNKNOWN, 0.3, lines)
    # (nearly) every stream stalled together
    sig = prefill.signals(ev)
    f = preemption.longer_than_company(ev) or preemption.mass(ev, bool(sig)) or prefill.shared(ev)
    if f is not None:
        f.lines = head + f.lines
        return f
    return Finding(Cause.UNKNOWN, 0.35, head + ["all streams stalled together without a prefill or preemption signal"])
