"""Run a situation and write a standard kvtop trace: header, engine records (what the rendered
/metrics pages say, written by the generator itself: ``records``), request records as kvtop's proxy
writes them, and ``truth`` records (``stall`` per stalled gap of an observed stream, ``victim`` per
preemption). Nothing here imports kvtop: the trace format is the only thing the two share.

Deterministic: the same situation, seed, duration and scrape interval give the same bytes.
"""

from __future__ import annotations

import json
import random
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from .delivery import Stream, deliver, windows
from .pages import (
    CREATED,
    VLLM_ITL_BUCKETS,
    VLLM_NUM_PREEMPTIONS_BUCKETS,
    VLLM_TTFT_BUCKETS,
    Cum,
    State,
    sglang_page,
    tgi_page,
    vllm_page,
)
from .records import sglang_record, tgi_record, vllm_record
from .situations import ITL_TARGET_S, SITUATIONS, Situation, requests
from .stepper import Run, Stepper

ADAPTER = {"vllm": "vllm", "sglang": "sglang", "never": "tgi"}
URL = "tracegen://"
BYTES_PER_TOKEN = 131_072  # Llama-3.1-8B, bf16: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes


def trace_time(t: float) -> float:
    """A record time as kvtop's traces hold it: to the microsecond."""
    return round(t, 6)


@dataclass
class Generated:
    sit: Situation
    seed: int
    duration_s: float
    run: Run
    streams: list[Stream]
    host_pauses: list[tuple[float, float]]
    api_stalls: list[tuple[float, float]]


def situation(name: str) -> Situation:
    try:
        return SITUATIONS[name]
    except KeyError:
        raise ValueError(f"unknown situation {name!r} (choose from {', '.join(SITUATIONS)})") from None


def simulate(name: str, seed: int, duration_s: float | None = None, observed_frac: float | None = None) -> Generated:
    """Engine run and delivery for one situation and seed (no scrapes yet: any interval can follow)."""
    sit = situation(name)
    if observed_frac is not None:
        sit = replace(sit, delivery=replace(sit.delivery, observed_frac=observed_frac))
    dur = sit.duration_s if duration_s is None else duration_s
    rng = random.Random(f"{seed}:host:{sit.name}")
    d = sit.delivery
    pauses = windows(rng, d.host_pause_rate_per_s, d.host_pause_len_s, 3.0, dur - 3.0)
    stalls = windows(rng, d.api_stall_rate_per_s, d.api_stall_len_s, 3.0, dur - 3.0)
    # an API stall and a host pause at once would make the truth ambiguous: keep the pause
    stalls = [(a, x) for a, x in stalls if all(a + x < p or a > p + q for p, q in pauses)]
    reqs = requests(sit, seed, dur)
    for r in reqs:  # the proxy is on the paused host too: a request sent meanwhile lands at the end
        for a, x in pauses:
            if a <= r.arrive < a + x:
                r.arrive = round(a + x + 0.0005, 6)
    run = Stepper(sit.engine, reqs, random.Random(f"{seed}:spec:{sit.name}"), pauses, ITL_TARGET_S).simulate(dur)
    streams = deliver(run, d, seed, sit.name, dur, pauses, stalls)
    return Generated(sit, seed, dur, run, streams, pauses, stalls)


def scrape_times(g: Generated, interval_s: float) -> list[float]:
    """kvtop's recorder beat: a fixed interval with a few ms of jitter; a beat that falls in a host
    pause or an API-server stall is answered only when it ends."""
    rng = random.Random(f"{g.seed}:scrape:{g.sit.name}:{interval_s}")
    holds = sorted(g.host_pauses + g.api_stalls)
    out: list[float] = []
    t = rng.uniform(0.0, min(1.0, interval_s))
    while t < g.duration_s:
        ts = t + rng.uniform(-0.003, 0.003)
        for a, d in holds:
            if a <= ts < a + d:
                ts = a + d + rng.uniform(0.002, 0.01)
        ts = round(max(ts, 0.0), 6)
        if not out or ts > out[-1] + 0.05:
            out.append(ts)
        t += interval_s
    return out


@dataclass
class Scrape:
    """What one scrape of the engine's /metrics shows. The histograms are cumulative and shared
    from one scrape to the next: read them before asking for the next scrape."""

    t: float
    state: State
    itl: Cum
    ttft: Cum
    npre: Cum
    prompts: int  # requests whose prompt was counted (TGI's input-length histogram)
    finished: int  # requests observed in TGI's per-request histograms


def scrapes(g: Generated, interval_s: float) -> Iterator[Scrape]:
    """Every scrape in time order, in the engine family's own semantics."""
    run = g.run
    sem = g.sit.engine.semantics
    log_t = [e[0] for e in run.log]
    itl = Cum(VLLM_ITL_BUCKETS)
    ttft = Cum(VLLM_TTFT_BUCKETS)
    npre = Cum(VLLM_NUM_PREEMPTIONS_BUCKETS)
    ended = sorted(run.ended)
    ii = ti = ei = 0
    # TGI: per-request mean time per token, observed when the request finishes
    tpot = sorted((r.end_t, (r.emits[-1][0] - r.emits[0][0]) / (len(r.emits) - 1))
                  for r in run.reqs if r.end_kind == "finish" and r.end_t is not None and len(r.emits) > 1)
    arrivals = sorted((r.arrive, r.prompt) for r in run.reqs)
    ai = prompt_sum = 0
    fin_n = 0
    for ts in scrape_times(g, interval_s):
        k = bisect_right(log_t, ts) - 1
        e = run.log[k] if k >= 0 else (0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        st = State(e[1], e[2], e[3], run.total_blocks, g.sit.engine.block, e[4], e[5], e[6], e[7], e[8], e[9],
                   g.sit.engine.model)
        if sem == "never":
            while fin_n < len(tpot) and tpot[fin_n][0] <= ts:
                itl.add(tpot[fin_n][1])
                fin_n += 1
            while ai < len(arrivals) and arrivals[ai][0] <= ts:
                prompt_sum += arrivals[ai][1]
                ai += 1
            st.prompt = prompt_sum
        else:
            while ii < len(run.itl) and run.itl[ii][0] <= ts:
                _, v, n = run.itl[ii]
                if sem == "sglang":
                    for _ in range(n):
                        itl.add(v / n)
                else:
                    itl.add(v)
                ii += 1
            while ti < len(run.ttft) and run.ttft[ti][0] <= ts:
                ttft.add(run.ttft[ti][1])
                ti += 1
            while ei < len(ended) and ended[ei][0] <= ts:
                npre.add(float(ended[ei][1]))
                ei += 1
        yield Scrape(ts, st, itl, ttft, npre, ai, fin_n)


def pages(g: Generated, interval_s: float) -> Iterator[tuple[float, str]]:
    """(scrape time, /metrics page text) for every scrape, in the engine family's own names."""
    sem = g.sit.engine.semantics
    for sc in scrapes(g, interval_s):
        if sem == "never":
            text = tgi_page(sc.state, sc.itl, sc.ttft, sc.prompts, sc.finished)
        elif sem == "sglang":
            text = sglang_page(sc.state, sc.itl, sc.ttft)
        else:
            text = vllm_page(sc.state, sc.itl, sc.ttft, sc.npre)
        yield sc.t, text


def engine_records(g: Generated, interval_s: float) -> Iterator[dict[str, Any]]:
    """The engine record of every scrape: what the page of ``pages`` says, as a trace line's dict."""
    sem = g.sit.engine.semantics
    for sc in scrapes(g, interval_s):
        if sem == "never":
            yield tgi_record(sc.t, URL, sc.state, sc.itl)
        elif sem == "sglang":
            yield sglang_record(sc.t, URL, sc.state, sc.itl, sc.ttft)
        else:
            yield vllm_record(sc.t, URL, sc.state, sc.itl, sc.ttft, sc.npre, CREATED)


def _engine_lines(g: Generated, interval_s: float) -> list[tuple[float, str]]:
    return [(d["t"], json.dumps(d, separators=(",", ":"))) for d in engine_records(g, interval_s)]


def _request_lines(s: Stream, prompt_on_arrive: bool) -> list[tuple[float, str]]:
    r = s.req
    rid = json.dumps(r.id)
    arrive: dict[str, Any] = {"kind": "request", "t": trace_time(r.arrive), "id": r.id, "event": "arrive"}
    if prompt_on_arrive:
        arrive["prompt_tokens"] = r.prompt
    arrive["class"] = r.cls
    arrive["source"] = "proxy"
    out = [(r.arrive, json.dumps(arrive, separators=(",", ":")))]
    for i, (t, n) in enumerate(s.chunks):
        ev = "first_token" if i == 0 else "token"
        out.append((t, f'{{"kind":"request","t":{t!r},"id":{rid},"event":"{ev}","n":{n}}}'))
    if s.end is not None:
        t, kind = s.end
        if kind == "finish":
            d = {"kind": "request", "t": t, "id": r.id, "event": "finish", "finish_reason": r.finish_reason,
                 "prompt_tokens": r.prompt, "completion_tokens": r.generated}
        else:
            d = {"kind": "request", "t": t, "id": r.id, "event": "cancel"}
        out.append((t, json.dumps(d, separators=(",", ":"))))
    return out


def _dominant(gap_s: float, step_s: float) -> str:
    """Which of an engine step and a delivery hold over the same client-time gap accounts for most
    of its time over the target: the step owns its own excess (its duration without any host pause
    inside it, ``step_s``), the hold everything the client waited beyond that."""
    step_over = max(0.0, step_s - ITL_TARGET_S)
    hold_over = (gap_s - ITL_TARGET_S) - step_over
    return "step" if step_over >= hold_over else "hold"


def stall_spans(g: Generated) -> list[tuple[str, float, float, str, dict[str, Any]]]:
    """Every stall's truth in client time: (request, t_start, t_end, cause, detail).

    One gap gets one cause. A long engine step (prefill interference, slow decode) and a delivery
    hold (slow reader, API-server merge or stall, host pause) can stretch the same gap; the one
    that accounts for most of the gap's time over the target labels it and the other span is
    dropped (a 65 ms step that a slow reader stretched to 2 s is the reader's stall)."""
    by_id = {s.req.id: s for s in g.streams}
    engine: list[tuple[str, float, float, str, dict[str, Any]]] = []
    for sp in g.run.spans:
        s = by_id.get(sp.rid)
        if s is None or sp.i_from < 0 or sp.i_from >= len(s.deliv):
            continue
        a = s.deliv[sp.i_from]
        if sp.i_to is not None:
            if sp.i_to >= len(s.deliv):
                continue
            b = s.deliv[sp.i_to]
        elif sp.t_to is not None:
            b = s.end[0] if s.end is not None else sp.t_to
        else:
            continue  # still silent when the run ended: no gap closes
        if b <= a:
            continue
        engine.append((sp.rid, a, b, sp.cause, sp.detail))
    holds = [(s.req.id, a, b, cause, detail) for s in g.streams for a, b, cause, detail in s.spans]
    hold_at: dict[str, list[int]] = {}
    for i, h in enumerate(holds):
        hold_at.setdefault(h[0], []).append(i)
    dropped: set[int] = set()
    out = []
    for rid, a, b, cause, detail in engine:
        step_s = detail.get("step_s")
        if step_s is not None:  # one step's stall (not a preemption): does a hold stretch the same gap?
            over = [i for i in hold_at.get(rid, ()) if min(b, holds[i][2]) - max(a, holds[i][1]) > 0]
            if over:
                if _dominant(b - a, float(step_s)) == "hold":
                    continue
                dropped.update(over)
        out.append((rid, a, b, cause, detail))
    out += [h for i, h in enumerate(holds) if i not in dropped]
    return out


def _truth_lines(g: Generated) -> list[tuple[float, str]]:
    out = []

    def add(t: float, event: str, rid: str | None, data: dict[str, Any]) -> None:
        t = trace_time(t)
        rec = {"kind": "truth", "t": t, "event": event, "request_id": rid, "data": data}
        out.append((t, json.dumps(rec, separators=(",", ":"))))

    for rid, a, b, cause, detail in stall_spans(g):
        add(b, "stall", rid, {"t_start": a, "t_end": b, "cause": cause, **detail})
    for v in g.run.victims:
        add(v.t, "victim", v.rid, {"t_preempt": trace_time(v.t), "outcome": v.outcome,
                                   "t_end": None if v.t_end is None else trace_time(v.t_end), "times": v.times,
                                   "counted": v.counted, "counted_at": v.counted_at, "observed": v.observed})
    return out


def header(g: Generated, interval_s: float) -> dict[str, Any]:
    e = g.sit.engine
    return {
        "kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-01-01T00:00:00.000Z",
        "host": "tracegen",
        "engine": {"adapter": ADAPTER[e.semantics], "url": URL, "model": e.model, "version": "tracegen"},
        "kv": {"bytes_per_token": BYTES_PER_TOKEN, "block_size": e.block, "capacity_tokens": e.kv_tokens // e.block * e.block},
        # the recorder name traces carried before the generator moved to eval/: same bytes as before
        "recorder": "bench/tracegen", "interval_s": interval_s, "itl_target_s": ITL_TARGET_S,
        "tracegen": {"situation": g.sit.name, "about": g.sit.about, "seed": g.seed, "duration_s": g.duration_s,
                     "semantics": e.semantics, "scheduler": e.scheduler, "chunked_prefill": e.chunked,
                     "spec_k": e.spec_k, "observed_frac": g.sit.delivery.observed_frac,
                     "host_pauses": g.host_pauses, "api_stalls": g.api_stalls},
    }


def write(g: Generated, path: str, interval_s: float = 1.0) -> dict[str, Any]:
    """Write the trace for one scrape interval; returns a summary (records, stalls by cause)."""
    lines = _engine_lines(g, interval_s)
    for s in g.streams:
        lines.extend(_request_lines(s, g.sit.delivery.prompt_on_arrive))
    truth = _truth_lines(g)
    lines.extend(truth)
    lines.sort(key=lambda x: x[0])  # stable: each request's own records stay in order
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header(g, interval_s), separators=(",", ":")) + "\n")
        f.write("\n".join(x[1] for x in lines) + "\n")
    causes: dict[str, int] = {}
    for _, ln in truth:
        d = json.loads(ln)
        if d["event"] == "stall":
            causes[d["data"]["cause"]] = causes.get(d["data"]["cause"], 0) + 1
    return {"records": len(lines), "stalls": causes, "victims": len(g.run.victims),
            "preemptions_counted": g.run.log[-1][4] if g.run.log else 0, "streams": len(g.streams)}


def generate(name: str, seed: int, path: str, interval_s: float = 1.0, duration_s: float | None = None,
             observed_frac: float | None = None) -> dict[str, Any]:
    return write(simulate(name, seed, duration_s, observed_frac), path, interval_s)
