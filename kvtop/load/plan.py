"""What `kvtop load` sends: one ``LoadRequest`` per request of a recorded trace or a workload.

A trace stores lengths and times, never text, so every prompt is synthetic: token ids (or filler
words) of the recorded length. What a plan reproduces from a trace, request by request:

* the arrival time (the run clock of the trace, from its first arrival);
* the prompt length: ``prompt_tokens`` of the ``arrive`` record (a token-id request), else of the
  ``finish`` record (the usage block); a request whose prompt length the trace never learnt is left
  out and counted (``skipped_no_prompt``);
* the output length: ``completion_tokens`` of its ``finish`` (else the tokens it received) as
  ``max_tokens`` with ``ignore_eos``;
* a client cancel at the same point of the stream: after the same number of tokens, or, when it
  gave up before its first token, after the same wait. Streams kvtop itself cut off
  (``proxy_stopped``, ``probe_stopped``) or left open at the end of the trace were not cancelled
  by their client: they are replayed to the median output length of their class;
* a slow reader: where the stream ended a silence with a buffered burst (one chunk of at least
  ``BURST_TOKENS`` tokens after a gap of at least ``BURST_GAP_X`` times the stream's mean gap),
  the client stops reading at that token for that long.

kvtop's own probe canaries are not user traffic and are left out. Shared prefixes are not in the
trace format; a workload's classes with a ``prefix_id`` share their prefix tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtop.model.trace import TraceError, TraceReader
from kvtop.sim.workload import Workload

BURST_TOKENS = 4  # tokens in one chunk that a stream delivering one token per event did not produce in one step
BURST_GAP_X = 4.0  # the silence before such a burst, against the stream's mean gap, that reads as a stalled reader
KVTOP_STOPPED = frozenset({"proxy_stopped", "probe_stopped"})  # cancels kvtop made, not the client
DEFAULT_OUTPUT = 128
CANCEL_MARGIN = 16  # output length when a trace has no finished request to take a median from


class PlanError(ValueError):
    """The source cannot give a plan (one line for the user)."""


@dataclass(slots=True)
class LoadRequest:
    id: str
    t: float  # seconds after the first arrival
    prompt_tokens: int
    max_tokens: int
    cls: str | None = None
    cancel_after_tokens: int | None = None  # hang up once this many tokens arrived
    cancel_after_s: float | None = None  # hang up this long after sending if no token came
    patience_s: float | None = None  # hang up after this long without a token (workload classes)
    pauses: tuple[tuple[int, float], ...] = ()  # (after token k, stop reading for s seconds)
    prefix_id: str | None = None
    prefix_tokens: int = 0

    @property
    def shared_prefix(self) -> int:
        """Leading prompt tokens this request shares with the others of its prefix group (0: none)."""
        return self.prefix_tokens if self.prefix_id and 0 < self.prefix_tokens < self.prompt_tokens else 0


@dataclass
class Plan:
    requests: list[LoadRequest]
    source: str  # the trace path or the workload's name
    kind: str  # "trace" or "workload"
    skipped_no_prompt: int = 0
    skipped_probe: int = 0
    notes: list[str] = field(default_factory=list)

    def scaled(self, rate_scale: float) -> Plan:
        """Every time of the plan divided by ``rate_scale`` (arrivals, timed cancels, patience, pauses)."""
        if rate_scale == 1.0:
            return self
        out = []
        for r in self.requests:
            out.append(LoadRequest(
                r.id, r.t / rate_scale, r.prompt_tokens, r.max_tokens, r.cls, r.cancel_after_tokens,
                None if r.cancel_after_s is None else r.cancel_after_s / rate_scale,
                None if r.patience_s is None else r.patience_s / rate_scale,
                tuple((k, s / rate_scale) for k, s in r.pauses), r.prefix_id, r.prefix_tokens))
        return Plan(out, self.source, self.kind, self.skipped_no_prompt, self.skipped_probe, list(self.notes))

    def shared_share(self) -> float:
        """The share of the plan's prompt tokens that repeat an earlier request's shared prefix: the
        most a prefix cache that had seen none of the plan can serve of it."""
        seen: set[str] = set()
        shared = total = 0
        for r in sorted(self.requests, key=lambda r: r.t):
            total += r.prompt_tokens
            if r.shared_prefix and r.prefix_id is not None:
                if r.prefix_id in seen:
                    shared += r.shared_prefix
                seen.add(r.prefix_id)
        return shared / total if total else 0.0

    def limited(self, max_requests: int | None) -> Plan:
        if max_requests is None or max_requests >= len(self.requests):
            return self
        return Plan(self.requests[:max_requests], self.source, self.kind, self.skipped_no_prompt,
                    self.skipped_probe, list(self.notes))


@dataclass(slots=True)
class _Seen:
    t: float
    prompt: int | None
    cls: str | None
    tokens: int = 0
    last_t: float | None = None
    first_t: float | None = None
    gap_sum: float = 0.0
    gaps: int = 0
    bursts: list[tuple[int, float]] = field(default_factory=list)
    end: str | None = None  # finish, cancel, error
    end_t: float | None = None
    completion: int | None = None
    kvtop_stopped: bool = False


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def plan_from_trace(path: str) -> Plan:
    try:
        reader = TraceReader(path)
    except TraceError as e:
        raise PlanError(str(e)) from None
    return plan_from_records(reader.dicts(), path)


def plan_from_records(records: Iterable[Mapping[str, Any]], source: str) -> Plan:
    seen: dict[str, _Seen] = {}
    probes = 0
    for d in records:
        if d.get("kind") != "request":
            continue
        rid, ev, t = d.get("id"), d.get("event"), d.get("t")
        if not isinstance(rid, str) or not isinstance(t, (int, float)):
            continue
        if ev == "arrive":
            if d.get("source") == "probe" or d.get("class") == "probe" or rid.startswith("probe-"):
                probes += 1
                continue
            cls = d.get("class")
            seen.setdefault(rid, _Seen(float(t), _int(d.get("prompt_tokens")), cls if isinstance(cls, str) else None))
            continue
        r = seen.get(rid)
        if r is None or r.end is not None:
            continue
        if ev in ("first_token", "token", "resync"):
            n = _int(d.get("n")) or 1
            if r.last_t is not None and ev != "resync":
                g = float(t) - r.last_t
                if n >= BURST_TOKENS and r.gaps and g >= BURST_GAP_X * (r.gap_sum / r.gaps):
                    r.bursts.append((r.tokens, g))
                r.gap_sum += g
                r.gaps += 1
            if r.first_t is None:
                r.first_t = float(t)
            r.tokens += n
            r.last_t = float(t)
        elif ev in ("finish", "cancel", "error"):
            r.end, r.end_t = ev, float(t)
            r.completion = _int(d.get("completion_tokens"))
            r.prompt = r.prompt or _int(d.get("prompt_tokens"))
            r.kvtop_stopped = ev == "cancel" and d.get("error") in KVTOP_STOPPED
    if not seen:
        raise PlanError(f"{source}: no request arrivals in this trace (record one through the proxy: "
                        "kvtop record --proxy-listen, or kvtop proxy --record)")
    # the output length of requests the trace never saw finish: their class's median, else everyone's
    by_cls: dict[str | None, list[int]] = {}
    for r in seen.values():
        if r.end == "finish":
            by_cls.setdefault(r.cls, []).append(r.completion or max(1, r.tokens))
    every = [x for v in by_cls.values() for x in v]
    median_all = int(statistics.median(every)) if every else DEFAULT_OUTPUT
    medians = {c: int(statistics.median(v)) for c, v in by_cls.items()}

    reqs: list[LoadRequest] = []
    skipped = 0
    t0: float | None = None
    for rid, r in sorted(seen.items(), key=lambda kv: kv[1].t):
        if r.prompt is None:
            skipped += 1
            continue
        if t0 is None:
            t0 = r.t
        typical = medians.get(r.cls, median_all)
        cancel_tokens = cancel_s = None
        if r.end == "finish":
            out = r.completion or max(1, r.tokens)
        elif r.end == "cancel" and not r.kvtop_stopped:
            if r.tokens > 0:
                cancel_tokens = r.tokens
            else:
                cancel_s = max(0.0, (r.end_t or r.t) - r.t)
            # the client left before the end, so the stream must outlast the cancel point by more than
            # the tokens one read can bring: a stream that ends first would record a finish instead
            out = max(2 * r.tokens + CANCEL_MARGIN, typical)
        else:  # error, cut off by kvtop, or still open when the trace ended
            out = max(r.tokens + 1, typical)
        pauses = tuple(r.bursts) if r.end != "error" else ()
        reqs.append(LoadRequest(rid, round(r.t - t0, 6), r.prompt, out, r.cls, cancel_tokens, cancel_s,
                                pauses=pauses))
    if not reqs:
        raise PlanError(f"{source}: no request in this trace has a known prompt length (send token-id prompts, "
                        "or ask for usage: stream_options.include_usage)")
    notes = []
    if skipped:
        notes.append(f"{skipped} request(s) left out: the trace does not know their prompt length")
    return Plan(reqs, source, "trace", skipped, probes, notes)


def plan_from_workload(workload: Workload, seed: int, duration_s: float) -> Plan:
    """The workload's arrivals for ``duration_s`` (the same draws ``kvtop simulate`` makes for the seed)."""
    reqs = []
    for spec in workload.requests(seed, duration_s):
        # the simulated server stops a request at its drawn output length; a real engine needs it as max_tokens
        reqs.append(LoadRequest(spec.id, spec.t, spec.prompt_tokens, spec.output_tokens, spec.cls,
                                patience_s=spec.patience_s, prefix_id=spec.prefix_id,
                                prefix_tokens=spec.prefix_tokens))
    if not reqs:
        raise PlanError(f"workload {workload.name}: no arrivals in {duration_s:g} s")
    return Plan(reqs, workload.name, "workload")
