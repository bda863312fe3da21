"""The order in which the rules are asked about one spike.

1. the engine reported a preempt for this request;
2. outside the engine: kvtop's own scrapes stalled (host / API server), or the stall ended with a
   buffered burst (delivery);
3. slow decode: the gap is no outlier for the stream's pace;
4. a stall of this stream alone (others streamed through it, or none was decoding): preemption
   evidence, else (none decoding) a prefill that explains it, else the onset of a slower pace;
5. a stall every decoding stream shared: a victim that stayed silent longer (counter step), a
   prefill that explains it, a first token ending a gap that dwarfs the pace on both sides of it
   (a mostly-prefill step on a slower engine), the onset of a slower pace, a resumed victim's re-prefill
   (recompute), a mass preemption, a stream whose own pace already missed the target;
6. otherwise unknown.
"""

from __future__ import annotations

from kvtop.analysis.attribution import host, preemption, prefill, slow_decode
from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.evidence import Evidence


def _with(head: list[str], f: Finding) -> Finding:
    f.lines = head + f.lines
    return f


def classify(ev: Evidence) -> Finding:
    f = preemption.reported(ev)
    if f is not None:
        return f
    head = ev.context_lines()
    f = host.judge(ev)
    if f is not None:
        return _with(head, f)
    f = slow_decode.lifted(ev)
    if f is not None:
        return f
    # While any other stream still received tokens the engine kept stepping: this stream alone was
    # left out. In a preemption storm most streams sit silent (preempted earlier, still waiting), so
    # a share of silent streams says nothing; an engine-wide stall (a prefill step, a host hiccup)
    # is one that nobody streamed through.
    if ev.others_flowed or ev.alone:
        # with nobody else decoding, a prefill that the measured rate confirms comes first: in a
        # storm some counter step is near almost any stall of the only observed stream
        found = prefill.lone(ev, checked_only=True) if ev.alone else None
        if found is not None:
            return _with(head, found)
        found, signs = preemption.lone(ev)
        head += signs
        if found is None and ev.alone:
            found = prefill.lone(ev)
        found = found or slow_decode.onset(ev) or slow_decode.pace_missed(ev)
        if found is not None:
            return _with(head, found)
        if ev.flowing is None:
            head.append("the only active stream stalled, so nothing tells the engine apart from the host"
                        + ("" if ev.preempts else " (this engine never preempts)"))
        elif ev.alone:
            head.append("the other streams were silent since before it: nothing tells the engine apart from the host")
        else:
            head.append("a lone stall without preemption evidence (no counter step, KV not near full, "
                        "no running/waiting change)" if ev.preempts else "a lone stall (this engine never preempts)")
        return Finding(Cause.UNKNOWN, 0.3, head, "lone")
    # every decoding stream stalled together
    sig, _ = prefill.signals(ev)
    found = (preemption.longer_than_company(ev) or prefill.shared(ev) or prefill.dominant(ev) or slow_decode.onset(ev)
             or prefill.recompute(ev) or preemption.mass(ev, bool(sig)) or slow_decode.pace_missed(ev))
    if found is not None:
        return _with(head, found)
    return Finding(Cause.UNKNOWN, 0.35, head + ["all streams stalled together without a prefill or preemption signal"],
                   "shared")
