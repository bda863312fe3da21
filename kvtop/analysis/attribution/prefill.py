"""Prefill interference: nobody streamed through the stall, and a prefill ended it.

Signals: another request's first token at the stall's end, or a prompt-token counter jump around it.
"""

from __future__ import annotations

from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.evidence import Evidence


def signals(ev: Evidence) -> list[str]:
    out = []
    ft = ev.first_token
    if ft is not None:
        out.append(f"request {ft.request_id} got its first token at the end of the stall"
                   + (f" ({ft.prompt_tokens} prompt tokens)" if ft.prompt_tokens else ""))
    if ev.prompt_jump:
        out.append(f"prompt tokens rose by {ev.window.prompt_delta:.0f} around the stall")
    return out


def lone(ev: Evidence) -> Finding | None:
    """The only running stream stalled, with a prefill signal (nobody else to compare with)."""
    sig = signals(ev)
    if not sig or ev.flowing is not None:
        return None
    return Finding(Cause.PREFILL, 0.5, sig)


def shared(ev: Evidence) -> Finding | None:
    """Every stream stalled together and a prefill signal ends the stall."""
    sig = signals(ev)
    if not sig:
        return None
    conf = min(0.95, 0.55 + 0.25 * (ev.first_token is not None) + 0.15 * ev.prompt_jump)
    return Finding(Cause.PREFILL, conf, sig)
