"""Hand-made ``Evidence`` for one spike, for the per-rule tests (tests/test_rule_table.py).

The defaults describe an ordinary lone stall on vLLM V1: stream r3 decoding at 20 ms a token falls
silent from 4.0 s to 6.0 s (100x its pace) while the 7 other observed streams keep flowing; the
engine is scraped every second (0.5, 1.5, ...) with KV at 0.5, 8 running, none waiting, the
preemption counter flat and 200 prompt tokens a scrape; the ITL target is 100 ms; no prefill rate
measured yet. No rule explains that stall: it is the lone unknown. Each test overrides what its
rule looks at.
"""

from __future__ import annotations

import math
from typing import Any

from kvtop.analysis.asof import Cutoff
from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.evidence import Evidence, FirstToken
from kvtop.analysis.attribution.spike import Spike
from kvtop.analysis.attribution.timeline import EngineTimeline
from kvtop.analysis.gaps import Gap
from kvtop.analysis.stalls import StallIndex

PACE = 0.02  # the stream's decode step (s)
TARGET = 0.1


def engine(dur: float = 10.0, kv: float = 0.5, running: float = 8, pre_steps: dict[float, int] | None = None,
           prompt_steps: dict[float, float] | None = None, waiting_rise: tuple[float, float] | None = None,
           no_scrapes: tuple[float, float] | None = None, late: dict[float, float] | None = None) -> EngineTimeline:
    """Scrapes every second from 0.5 s to ``dur``: ``pre_steps`` {scrape time: counter units added
    there}, ``prompt_steps`` {scrape time: prompt tokens added beyond the usual 200}, one waiting
    request within ``waiting_rise``, none at all within ``no_scrapes`` (kvtop itself stalled), and
    ``late`` {scrape time: seconds its reply came late}."""
    tl = EngineTimeline()
    pre, prompt = 0.0, 4000.0
    t = 0.5
    while t <= dur + 1e-9:
        pre += (pre_steps or {}).get(t, 0)
        prompt += 200 + (prompt_steps or {}).get(t, 0.0)
        if not (no_scrapes and no_scrapes[0] < t < no_scrapes[1]):
            waiting = 1 if waiting_rise and waiting_rise[0] <= t <= waiting_rise[1] else 0
            tl.add(t + (late or {}).get(t, 0.0), ("http://x", "0"), running, waiting, kv, pre, prompt)
        t += 1.0
    return tl


def gap(t_start: float = 4.0, length: float = 2.0, **kw: Any) -> Gap:
    """Stream r3's gap from ``t_start``; its pace before and after is PACE unless ``kw`` says otherwise."""
    fields: dict[str, Any] = {"stream_baseline": PACE, "fast_baseline": PACE, "calm_baseline": PACE, "gaps_before": 8,
                              "after": (PACE,) * 3, "tokens_before": 200, "step_n_max": 1, "burst_n": 1,
                              "ended_by": "token", "chunk_n": 1, "tokens_per_event": 1.0, "engine": None}
    rid = kw.pop("request_id", "r3")
    fields.update(kw)
    fields["after"] = tuple(fields["after"])
    return Gap(request_id=rid, t_start=t_start, t_end=t_start + length, gap=length, **fields)


def victim_resumed(g: Gap, since: float = 1.0) -> StallIndex:
    """Other streams as seen around ``g``: stream v, silent from ``since``, resumed as ``g`` ended."""
    st = StallIndex()
    st.add_long(gap(since, g.t_end - since, request_id="v"))
    return st


def judged(g: Gap, cause: Cause, kind: str) -> Spike:
    """``g`` as an earlier spike of the stream that was judged ``cause`` (``kind``)."""
    return Spike(g, Finding(cause, 0.9, [], kind))


def first_token(prompt: int = 3000, requests: int = 1) -> FirstToken:
    """Request q's first token at the stall's end (the one prompt of ``requests`` admitted together)."""
    return FirstToken("q", prompt, prompt * requests, requests)


def evidence(g: Gap | None = None, tl: EngineTimeline | None = None, **kw: Any) -> Evidence:
    """The default stall (see the module's doc), with ``kw`` overriding any ``Evidence`` field."""
    g = g if g is not None else gap()
    tl = tl if tl is not None else engine()
    si = tl.scrape_interval
    fields: dict[str, Any] = {
        "preempts": True, "counted_at": "resume", "baseline": g.stream_baseline,
        "baseline_is_stream": g.stream_baseline is not None, "engine_reported_preempt": False,
        "active_others": 7, "co_stalled": 0, "co_fresh": 0, "co_together": 0, "co_gap_median": None,
        "prev_spike": None, "first_token": None, "typical_prompt_delta": tl.typical_prompt_delta(),
        "prefill_rate": None, "scrape_interval": si, "target": TARGET, "has_counter": tl.has_counter,
        "tol": 1.5 * si + 0.25, "stalls": StallIndex(), "cut": Cutoff(math.inf, math.inf),  # knows it all
    }
    fields.update(kw)
    return Evidence(gap=g, timeline=tl, **fields)


def shared(n: int = 7, **kw: Any) -> dict[str, Any]:
    """``Evidence`` fields of a stall all ``n`` other streams shared (fell silent and came back with it)."""
    return {"active_others": n, "co_stalled": n, "co_fresh": n, "co_together": n, "co_gap_median": 2.0} | kw


def alone(**kw: Any) -> dict[str, Any]:
    """``Evidence`` fields of a stall with no other observed stream decoding."""
    return {"active_others": 0} | kw
