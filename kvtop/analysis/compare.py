"""Two runs of the same traffic side by side (``kvtop compare A B``): did the change help?

Per run, from one streaming pass over its trace plus the analysis (``scan.analyze_trace``: the
verdict, the ITL target it judged against and the time over target by cause):

* offered: requests that arrived (kvtop's probe canaries left out), over how long, their classes
  and mean prompt length — the load both runs must share for a comparison to mean anything;
* completed (``finish``), client cancels, errors and streams kvtop cut off when it stopped;
* goodput: completed requests that met the contract — time to first token within the TTFT target
  and at most one target's worth of time over the ITL target (the sum of each gap's excess over it):
  one late token is tolerated, a stall (a preemption, a prefill riding along) is not. A per-request
  percentile would not do: one 5 s preemption stall hides under the p99 of a 1,200-token stream;
* p50/p99 of every inter-token gap and of time to first token (2 % log bins, ``LogHistogram``);
* p50/p99 end-to-end latency of the completed requests (arrival to ``finish``) and output throughput:
  tokens streamed over the run's span (first arrival to the last request's end) — what a change
  that only moves waiting around (a stall mid-stream becomes a queue before the first token) leaves
  unchanged;
* preemptions per completed request: the engine's counter increases (request ``preempt`` events
  where no engine was scraped, e.g. a simulated run);
* the share of prompt tokens the engine's prefix cache served, per run (the analysis' figure).

The decision, B against A, in this order: *not comparable* when the offered load or mix differ
beyond ``Tolerance``, or one side's runs differ in what the prefix cache served (an engine sent
prompts it had seen); *worse* when B completes or meets the contract less often, or sheds (cancels,
errors) more — a policy that buys latency by shedding load is not better; *improved* when goodput
rises or a latency/preemption figure falls by the margin (10 %) and nothing worsens by it;
*trade-off* when B is better on the contract but a figure the contract does not judge (p99 TTFT
without a TTFT target, p99 end-to-end latency, output throughput) worsened by the margin — calling
that improved would let an ITL-only contract hide a TTFT collapse. End-to-end latency is a figure of
the completed requests, so it is compared only when both runs completed the same share of the offered
ones (within ``shed_share``): a run that completes the long requests the other lost has a longer p99
for completing more, which ``completed`` and goodput already judge; *mixed* when contract figures
move both ways without a goodput gain; else *no change*.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtop.analysis.gaps import LogHistogram
from kvtop.analysis.scan import analyze_trace
from kvtop.model.trace import TraceError, TraceReader

KVTOP_STOPPED = frozenset({"proxy_stopped", "probe_stopped"})


@dataclass(frozen=True)
class Tolerance:
    """How far two runs' offered load may differ and still be compared, and the smallest change that counts."""

    requests_frac: float = 0.05  # offered requests
    rate_frac: float = 0.10  # offered arrival rate
    prompt_frac: float = 0.05  # mean prompt length
    class_share: float = 0.05  # each class's share of the offered requests (absolute)
    # a figure must move by this fraction to count as better or worse: two runs of one configuration on the
    # simulated server differed by up to 6 % in p99 TTFT
    better_frac: float = 0.10
    shed_share: float = 0.02  # cancels + errors, share of offered, may rise by at most this much
    # goodput and completed requests must move by more than this share of the offered requests: one
    # request of 142 (goodput 3 -> 2) was "-33 %", a worse run, where both runs missed the contract alike
    count_share: float = 0.02
    # the share of prompt tokens the engine's prefix cache served may differ by this much (absolute) between
    # runs of one configuration: a trace replay's prompts share no prefix, so a run served from the cache was
    # sent prompts the engine had seen (the same `kvtop load --seed` twice on one engine: 0 % and ~100 %)
    prefix_share: float = 0.25

    def to_dict(self) -> dict[str, float]:
        return {"requests_frac": self.requests_frac, "rate_frac": self.rate_frac, "prompt_frac": self.prompt_frac,
                "class_share": self.class_share, "better_frac": self.better_frac, "shed_share": self.shed_share,
                "count_share": self.count_share, "prefix_share": self.prefix_share}


@dataclass
class RunFigures:
    path: str
    offered: int = 0
    span_s: float = 0.0  # first to last arrival, summed over the runs pooled
    classes: dict[str, int] = field(default_factory=dict)
    prompt_mean: float | None = None
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    cut_off: int = 0
    goodput: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p99_s: float | None = None
    output_tokens: int = 0
    makespan_s: float = 0.0  # first arrival to the last request's end
    preemptions: int | None = None
    over_target_s: dict[str, float] = field(default_factory=dict)
    itl_target_s: float | None = None
    verdict: dict[str, Any] | None = None
    runs: list[str] = field(default_factory=list)  # every trace pooled into these figures, ``path`` first
    run_span_max_s: float = 0.0  # the longest one run's arrivals took: a burst is judged per run
    # per run: the engine's prefix cache hits / queries over it (the analysis' ``prefix_hit_share``; None
    # where the trace has no such counters)
    prefix_hit_shares: list[float | None] = field(default_factory=list)
    # the analysis' warnings on each run (skipped lines, a cut .gz...), as analyze prints them; for
    # the command to print, not part of the figures (the JSON schema has no place for them)
    warnings: list[str] = field(default_factory=list)

    @property
    def prefix_hit_share(self) -> float | None:
        known = [x for x in self.prefix_hit_shares if x is not None]
        return sum(known) / len(known) if known else None

    @property
    def rate_per_s(self) -> float | None:
        # n arrivals of a run span n - 1 gaps between them (n / span read 14 % high at n = 8)
        gaps = self.offered - max(1, len(self.runs))
        return gaps / self.span_s if self.span_s > 0 and gaps > 0 else None

    @property
    def output_tokens_per_s(self) -> float | None:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else None

    @property
    def shed(self) -> int:
        return self.cancelled + self.errors

    @property
    def preemptions_per_completed(self) -> float | None:
        if self.preemptions is None or not self.completed:
            return None
        return self.preemptions / self.completed

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace": self.path, "runs": list(self.runs or [self.path]), "offered": self.offered, "span_s": _r(self.span_s), "rate_per_s": _r(self.rate_per_s),
            "classes": dict(sorted(self.classes.items())), "prompt_tokens_mean": _r(self.prompt_mean),
            "completed": self.completed, "cancelled": self.cancelled, "errors": self.errors, "cut_off": self.cut_off,
            "goodput": self.goodput, "goodput_share": _r(self.goodput / self.offered if self.offered else None),
            "ttft_p50_s": _r(self.ttft_p50_s), "ttft_p99_s": _r(self.ttft_p99_s),
            "itl_p50_s": _r(self.itl_p50_s), "itl_p99_s": _r(self.itl_p99_s),
            "e2e_p50_s": _r(self.e2e_p50_s), "e2e_p99_s": _r(self.e2e_p99_s),
            "output_tokens": self.output_tokens, "makespan_s": _r(self.makespan_s),
            "output_tokens_per_s": _r(self.output_tokens_per_s),
            "preemptions": self.preemptions, "preemptions_per_completed": _r(self.preemptions_per_completed),
            "over_target_s": {k: _r(v) for k, v in sorted(self.over_target_s.items())},
            "prefix_hit_shares": [_r(x) for x in self.prefix_hit_shares],
            "verdict": self.verdict,
        }


def _r(v: float | None, nd: int = 6) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, nd)


@dataclass(slots=True)
class _Req:
    t: float
    first: float | None = None
    last: float | None = None
    over_s: float = 0.0  # time over the ITL target, summed over its gaps
    tokens: int = 0  # streamed (the chunks' ``n``)


def run_figures(path: str | Sequence[str], ttft_target_s: float | None,
                itl_target_s: float | None) -> RunFigures:
    """One configuration's figures, from one run or from several runs of the same traffic pooled: counts,
    time over the target and tokens summed, percentiles over every run's gaps, the rate over the runs'
    summed spans. The ITL target defaults to the one the analysis judged the first run against; the
    verdict shown is the first run's."""
    paths = [path] if isinstance(path, str) else list(path)
    if not paths:
        raise ValueError("no trace to read")
    first = analyze_trace(paths[0], itl_target_s=itl_target_s)
    itl_t = itl_target_s if itl_target_s is not None else first.itl_target_s
    fig = RunFigures(paths[0], itl_target_s=itl_t, runs=paths)
    pool = _Pool()
    for k, p in enumerate(paths):
        report = first if k == 0 else analyze_trace(p, itl_target_s=itl_t)
        fig.warnings.extend(report.warnings)
        _read_run(fig, p, ttft_target_s, itl_t, pool)
        fin = report.finite()
        for cause, secs in (fin.over_target_s or {}).items():
            fig.over_target_s[cause] = fig.over_target_s.get(cause, 0.0) + secs
        share = fin.verdict.numbers.get("prefix_hit_share") if fin.verdict is not None else None
        fig.prefix_hit_shares.append(float(share.value) if share is not None and isinstance(share.value, (int, float))
                                     else None)
    fig.prompt_mean = pool.prompt_sum / pool.prompt_n if pool.prompt_n else None
    fig.ttft_p50_s, fig.ttft_p99_s = pool.ttft.quantile(0.5), pool.ttft.quantile(0.99)
    fig.itl_p50_s, fig.itl_p99_s = pool.itl.quantile(0.5), pool.itl.quantile(0.99)
    fig.e2e_p50_s, fig.e2e_p99_s = pool.e2e.quantile(0.5), pool.e2e.quantile(0.99)
    fin = first.finite()
    if fin.verdict is not None:
        v = fin.verdict
        fig.verdict = {"action": v.action, "confidence": v.confidence, "tentative": v.tentative,
                       "settings": [s.to_dict() for s in v.settings]}
    return fig


@dataclass(slots=True)
class _Pool:
    """What the runs of one side add up to beyond ``RunFigures``' counts: the gaps and prompt sizes."""

    itl: LogHistogram = field(default_factory=LogHistogram)
    ttft: LogHistogram = field(default_factory=LogHistogram)
    e2e: LogHistogram = field(default_factory=LogHistogram)
    prompt_sum: int = 0
    prompt_n: int = 0


def _read_run(fig: RunFigures, path: str, ttft_target_s: float | None, itl_t: float | None, pool: _Pool) -> None:
    """Adds one trace's requests to ``fig`` (its engine counters and its span are its own)."""
    try:
        reader = TraceReader(path)
    except TraceError as e:
        raise ValueError(str(e)) from None
    open_: dict[str, _Req] = {}
    itl, ttft, e2e = pool.itl, pool.ttft, pool.e2e
    t_first = t_last = None
    t_end: float | None = None  # the last event of an offered request
    counters: dict[tuple[Any, Any], tuple[float, float]] = {}  # engine -> (last value, increases)
    req_preempts = 0
    for d in reader.dicts():
        kind = d.get("kind")
        if kind == "engine":
            v = d.get("preemptions_total")
            if isinstance(v, (int, float)) and d.get("up", True) is not False:
                key = (d.get("url"), d.get("engine"))
                last, inc = counters.get(key, (float(v), 0.0))
                inc += v - last if v >= last else v  # a drop: the engine restarted from zero
                counters[key] = (float(v), inc)
            continue
        if kind != "request":
            continue
        rid, ev, t = d.get("id"), d.get("event"), d.get("t")
        if isinstance(rid, int) and not isinstance(rid, bool):
            rid = str(rid)  # older simulated traces number their requests; analyze reads them so too
        if not isinstance(rid, str) or not isinstance(t, (int, float)):
            continue
        if ev == "arrive":
            if d.get("source") == "probe" or d.get("class") == "probe" or rid.startswith("probe-"):
                continue
            open_[rid] = _Req(float(t))
            fig.offered += 1
            cls = d.get("class")
            name = cls if isinstance(cls, str) else "(none)"
            fig.classes[name] = fig.classes.get(name, 0) + 1
            p = d.get("prompt_tokens")
            if isinstance(p, int) and p > 0:
                pool.prompt_sum += p
                pool.prompt_n += 1
            t_first = t if t_first is None else t_first
            t_last = t
            t_end = float(t) if t_end is None else max(t_end, float(t))
            continue
        if ev == "preempt":
            req_preempts += 1
            continue
        r = open_.get(rid)
        if r is None:
            continue
        t_end = float(t) if t_end is None else max(t_end, float(t))
        if ev in ("first_token", "token", "resync"):
            n = d.get("n")
            if r.tokens == 0 and ev != "resync":
                # (a stream seen first at a resync lost its first token with the bytes: TTFT unknown)
                r.first = float(t)
                ttft.add(max(1e-6, r.first - r.t))
            elif ev != "resync" and r.last is not None:
                g = float(t) - r.last
                if itl_t is not None and g > itl_t:
                    r.over_s += g - itl_t
                itl.add(max(1e-6, g))
            # a resync's tokens streamed too (only its gap is unknown after lost bytes)
            r.tokens += n if isinstance(n, int) and n > 0 else 1
            r.last = float(t)
        elif ev in ("finish", "cancel", "error"):
            del open_[rid]
            ct = d.get("completion_tokens")
            # the server's usage count when it sent one (a chunk may carry several tokens it did not number)
            fig.output_tokens += ct if ev == "finish" and isinstance(ct, int) and ct >= 0 else r.tokens
            if ev == "finish":
                fig.completed += 1
                e2e.add(max(1e-6, float(t) - r.t))
                ok_ttft = ttft_target_s is None or (r.first is not None and r.first - r.t <= ttft_target_s)
                ok_itl = itl_t is None or r.over_s <= itl_t
                if ok_ttft and ok_itl and r.first is not None:
                    fig.goodput += 1
            elif ev == "cancel" and d.get("error") in KVTOP_STOPPED:
                fig.cut_off += 1
            elif ev == "cancel":
                fig.cancelled += 1
            else:
                fig.errors += 1
    fig.cut_off += len(open_)  # still open when the trace ended
    fig.output_tokens += sum(r.tokens for r in open_.values())
    if t_first is not None and t_last is not None:
        span = float(t_last) - float(t_first)
        fig.span_s += span
        fig.run_span_max_s = max(fig.run_span_max_s, span)
    if t_first is not None and t_end is not None:
        fig.makespan_s += max(0.0, t_end - float(t_first))
    run_preempts = int(round(sum(inc for _, inc in counters.values()))) if counters else req_preempts or None
    if run_preempts is not None:
        fig.preemptions = (fig.preemptions or 0) + run_preempts


def _rel(a: float | None, b: float | None) -> float | None:
    """(b - a) / a; None when either is unknown or a is zero."""
    if a is None or b is None or a == 0:
        return None
    return (b - a) / a


BURST_SPAN_S = 1.0  # offered within this: a burst, compared by its counts, not by a rate


def comparability(a: RunFigures, b: RunFigures, tol: Tolerance) -> list[str]:
    """Why the two runs' offered load differs too much to compare (empty: comparable)."""
    why = []
    d = _rel(a.offered, b.offered)
    if a.offered == 0 or b.offered == 0:
        why.append("a run offered no request")
        return why
    if d is not None and abs(d) > tol.requests_frac:
        why.append(f"offered requests differ by {d:+.1%} (tolerance ±{tol.requests_frac:.0%})")
    d = _rel(a.rate_per_s, b.rate_per_s)
    # a burst (every request offered within a second) has no rate to speak of: its span is the
    # client's scheduling jitter (8 requests in 40 ms vs 65 ms is "+63 %"); the counts decide
    burst = max(a.run_span_max_s, b.run_span_max_s) < BURST_SPAN_S
    if d is not None and abs(d) > tol.rate_frac and not burst:
        why.append(f"offered rate differs by {d:+.1%} (tolerance ±{tol.rate_frac:.0%})")
    d = _rel(a.prompt_mean, b.prompt_mean)
    if d is not None and abs(d) > tol.prompt_frac:
        why.append(f"mean prompt length differs by {d:+.1%} (tolerance ±{tol.prompt_frac:.0%})")
    for c in sorted(set(a.classes) | set(b.classes)):
        sa, sb = a.classes.get(c, 0) / a.offered, b.classes.get(c, 0) / b.offered
        if abs(sb - sa) > tol.class_share:
            why.append(f"class {c} is {sa:.0%} of A and {sb:.0%} of B (tolerance ±{tol.class_share * 100:.0f} points)")
    for name, f in (("A", a), ("B", b)):
        # runs of one configuration and one traffic: a run the prefix cache served, beside one it did not,
        # skipped the very prefills the others paid for
        known = [x for x in f.prefix_hit_shares if x is not None]
        if len(known) >= 2 and max(known) - min(known) > tol.prefix_share:
            why.append(f"the engine's prefix cache served {' / '.join(f'{x:.0%}' for x in known)} of the prompt "
                       f"tokens in {name}'s runs (tolerance ±{tol.prefix_share * 100:.0f} points): the engine had "
                       "seen a run's prompts before (`kvtop load` sends the same token ids for the same --seed); "
                       "replay each run with its own --seed")
    return why


def cache_notes(a: RunFigures, b: RunFigures, tol: Tolerance) -> list[str]:
    """What the outcome may owe to the prefix cache rather than the change: a note, not a refusal, as
    the change may be prefix caching itself."""
    sa, sb = a.prefix_hit_share, b.prefix_hit_share
    if sa is None or sb is None or abs(sb - sa) <= tol.prefix_share:
        return []
    return [f"the engine's prefix cache served {sa:.0%} of A's prompt tokens and {sb:.0%} of B's: unless the "
            "change was to prefix caching, one engine had seen these prompts before (replay with a new --seed, "
            "or restart the engine)"]


@dataclass
class Comparison:
    a: RunFigures
    b: RunFigures
    outcome: str  # improved, trade_off, worse, mixed, no_change, not_comparable
    reasons: list[str]
    better: list[str]
    worse: list[str]
    tolerance: Tolerance
    ttft_target_s: float | None
    itl_target_s: float | None
    outside_contract: list[str] = field(default_factory=list)  # the entries of ``worse`` the contract does not judge
    notes: list[str] = field(default_factory=list)  # what the outcome may owe to something other than the change

    @property
    def summary(self) -> str:
        """The one line: the outcome and what decided it."""
        if self.outcome == "not_comparable":
            return "not comparable: " + "; ".join(self.reasons)
        if self.outcome == "trade_off":
            inside = [x for x in self.better if x not in self.outside_better]
            line = (f"trade-off: better on the {self.contract_name} contract ({'; '.join(inside)}); "
                    f"worse outside it: {'; '.join(self.outside_contract)}")
            also = [w for w in self.worse if w not in self.outside_contract]
            if also:
                line += "; also worse: " + "; ".join(also)
            if self.ttft_target_s is None and any(w.startswith("p99 TTFT") for w in self.outside_contract):
                line += " — set --ttft-target-ms to judge both"
            return line
        if not self.better and not self.worse:
            return f"{self.outcome.replace('_', ' ')}: nothing moved by {self.tolerance.better_frac:.0%} or more"
        better, worse = "; ".join(self.better), "; ".join(self.worse)
        if self.outcome == "improved":
            return "improved: " + better + (f"; worse: {'; '.join(self.worse)}" if self.worse else "")
        if self.outcome == "worse":  # what decided first; a figure that did improve is named as such
            return "worse: " + worse + (f"; better: {better}" if better else "")
        return f"{self.outcome.replace('_', ' ')}: better: {better}; worse: {worse}"

    @property
    def contract_name(self) -> str:
        return "ITL" if self.ttft_target_s is None else "TTFT + ITL"

    @property
    def outside_better(self) -> list[str]:
        return [x for x in self.better if x.startswith(_outside_prefixes(self.ttft_target_s))]

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "summary": self.summary, "reasons": self.reasons, "better": self.better,
                "worse": self.worse, "outside_contract": self.outside_contract, "notes": self.notes,
                "ttft_target_s": self.ttft_target_s, "itl_target_s": self.itl_target_s,
                "tolerance": self.tolerance.to_dict(), "a": self.a.to_dict(), "b": self.b.to_dict()}


def _outside_prefixes(ttft_target_s: float | None) -> tuple[str, ...]:
    """The figures goodput does not judge: end-to-end latency, throughput, and TTFT without its target."""
    return ("p99 end-to-end", "output throughput") + (("p99 TTFT",) if ttft_target_s is None else ())


def compare(path_a: str | Sequence[str], path_b: str | Sequence[str], ttft_target_s: float | None = None,
            itl_target_s: float | None = None, tol: Tolerance | None = None) -> Comparison:
    """B against A. Without an ITL target, both runs are judged against A's (the analysis' target).
    Each side may be several runs of the same traffic (as many on each side), pooled (``run_figures``):
    on a shared host one stall outside the engine costs every stream of a run its goodput, and a
    second run of each configuration keeps that from deciding the outcome."""
    runs_a = [path_a] if isinstance(path_a, str) else list(path_a)
    runs_b = [path_b] if isinstance(path_b, str) else list(path_b)
    if len(runs_a) != len(runs_b):
        raise ValueError(f"give as many runs of B as of A ({len(runs_a)} vs {len(runs_b)})")
    tol = tol or Tolerance()
    a = run_figures(runs_a, ttft_target_s, itl_target_s)
    itl_t = itl_target_s if itl_target_s is not None else a.itl_target_s
    b = run_figures(runs_b, ttft_target_s, itl_t)
    return judge(a, b, tol, ttft_target_s, itl_t)


def judge(a: RunFigures, b: RunFigures, tol: Tolerance, ttft_target_s: float | None,
          itl_target_s: float | None) -> Comparison:
    """The outcome of B against A from their figures (see the module note for the order)."""
    why = comparability(a, b, tol)
    if why:
        return Comparison(a, b, "not_comparable", why, [], [], tol, ttft_target_s, itl_target_s)
    better: list[str] = []
    worse: list[str] = []
    m = tol.better_frac

    def more_is_better(name: str, va: float | None, vb: float | None, fmt: Callable[[float], str] = _g,
                       of: str = "", floor: float = 0.0) -> None:
        if va is not None and vb is not None and abs(vb - va) <= floor:
            return
        d = _rel(va, vb)
        if d is None:
            if va == 0 and vb:
                better.append(f"{name} 0 -> {fmt(vb)}{of}")
            return
        assert va is not None and vb is not None
        if d >= m:
            better.append(f"{name} {fmt(va)} -> {fmt(vb)}{of} ({d:+.0%})")
        elif d <= -m:
            worse.append(f"{name} {fmt(va)} -> {fmt(vb)}{of} ({d:+.0%})")

    def less_is_better(name: str, va: float | None, vb: float | None, fmt: Callable[[float], str] = _g3,
                       floor: float = 0.0) -> None:
        """``floor``: the least change that counts, for figures that can be zero (any rise from 0 is
        an infinite relative change: one gap 10 ms over a 50 ms target made a run "worse")."""
        if va is None or vb is None or abs(vb - va) <= floor:
            return
        if va == 0:
            if vb > 0:
                worse.append(f"{name} 0 -> {fmt(vb)}")
            return
        d = (vb - va) / va
        if d <= -m:
            better.append(f"{name} {fmt(va)} -> {fmt(vb)} ({d:+.0%})")
        elif d >= m:
            worse.append(f"{name} {fmt(va)} -> {fmt(vb)} ({d:+.0%})")

    # "of N": 0 -> 1 is a rise, and how far it is from every offered request is the operator's next question
    counts = tol.count_share * max(a.offered, b.offered)
    more_is_better("goodput", a.goodput, b.goodput, of=f" of {b.offered}", floor=counts)
    more_is_better("completed", a.completed, b.completed, of=f" of {b.offered}", floor=counts)
    shed_a, shed_b = a.shed / a.offered, b.shed / b.offered
    if shed_b - shed_a > tol.shed_share:
        worse.append(f"shed (cancelled + errors) {shed_a:.1%} -> {shed_b:.1%} of offered")
    less_is_better("p99 ITL", a.itl_p99_s, b.itl_p99_s, dur)
    less_is_better("p99 TTFT", a.ttft_p99_s, b.ttft_p99_s, dur)
    # a single preemption, or less time over the target than one target's length in the whole run,
    # decides nothing
    less_is_better("preemptions per completed request", a.preemptions_per_completed, b.preemptions_per_completed,
                   floor=1.0 / max(1, a.completed, b.completed))
    less_is_better("time over the ITL target", sum(a.over_target_s.values()), sum(b.over_target_s.values()), dur,
                   floor=itl_target_s or 0.0)
    if abs(b.completed / b.offered - a.completed / a.offered) <= tol.shed_share:
        less_is_better("p99 end-to-end latency", a.e2e_p99_s, b.e2e_p99_s, dur)
    more_is_better("output throughput", a.output_tokens_per_s, b.output_tokens_per_s, _tps)
    outside = _outside_prefixes(ttft_target_s)
    outside_worse = [w for w in worse if w.startswith(outside)]
    contract_better = [x for x in better if not x.startswith(outside)]
    contract_worse = [w for w in worse if not w.startswith(outside)]
    goodput_up = any(x.startswith("goodput") for x in better)
    # what decides: shedding or completing less outweighs any latency gain
    if any(w.startswith(("goodput", "completed", "shed")) for w in worse):
        outcome = "worse"
    elif not better:
        outcome = "worse" if worse else "no_change"
    elif not worse:
        outcome = "improved"
    elif outside_worse and (goodput_up or (contract_better and not contract_worse)):
        outcome = "trade_off"  # the contract got better by making something it does not look at worse
    elif goodput_up:
        outcome = "improved"  # goodput already judges the contract's own figures per request
    else:
        outcome = "mixed"
    return Comparison(a, b, outcome, [], better, worse, tol, ttft_target_s, itl_target_s, outside_worse,
                      cache_notes(a, b, tol))


def _g(v: float) -> str:
    return f"{v:g}"


def _g3(v: float) -> str:
    return f"{v:.3g}"


def _tps(v: float) -> str:
    return f"{v:.0f} tokens/s"


def dur(v: float | None) -> str:
    """Seconds as an operator reads them: 6.92 ms, 249 ms, 13.3 s."""
    if v is None:
        return "n/a"
    return f"{v * 1e3:.3g} ms" if abs(v) < 1 else f"{v:.3g} s"


def render_text(c: Comparison) -> str:
    a, b = c.a, c.b
    rows: list[tuple[str, str, str]] = [
        ("offered requests", str(a.offered), str(b.offered)),
        ("offered rate", f"{a.rate_per_s or 0:.3g}/s", f"{b.rate_per_s or 0:.3g}/s"),
        ("mean prompt tokens", f"{a.prompt_mean or 0:.0f}", f"{b.prompt_mean or 0:.0f}"),
        ("completed", str(a.completed), str(b.completed)),
        ("cancelled / errors", f"{a.cancelled} / {a.errors}", f"{b.cancelled} / {b.errors}"),
        ("goodput", f"{a.goodput} ({a.goodput / a.offered:.0%})" if a.offered else "0",
         f"{b.goodput} ({b.goodput / b.offered:.0%})" if b.offered else "0"),
        ("TTFT p50 / p99", f"{dur(a.ttft_p50_s)} / {dur(a.ttft_p99_s)}", f"{dur(b.ttft_p50_s)} / {dur(b.ttft_p99_s)}"),
        ("ITL p50 / p99", f"{dur(a.itl_p50_s)} / {dur(a.itl_p99_s)}", f"{dur(b.itl_p50_s)} / {dur(b.itl_p99_s)}"),
        ("end-to-end p50 / p99", f"{dur(a.e2e_p50_s)} / {dur(a.e2e_p99_s)}", f"{dur(b.e2e_p50_s)} / {dur(b.e2e_p99_s)}"),
        ("output tokens/s", _rate(a), _rate(b)),
        ("preemptions / completed", _fmt(a.preemptions_per_completed), _fmt(b.preemptions_per_completed)),
        ("time over target", _lost(a.over_target_s), _lost(b.over_target_s)),
        ("verdict", _verdict(a.verdict), _verdict(b.verdict)),
    ]
    if a.prefix_hit_share is not None or b.prefix_hit_share is not None:
        rows.insert(-2, ("prefix cache served", _shares(a), _shares(b)))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [("", "A", "")])
    targets = [f"ITL {c.itl_target_s * 1e3:.0f} ms" if c.itl_target_s is not None else "ITL: none"]
    targets.append(f"TTFT {c.ttft_target_s * 1e3:.0f} ms" if c.ttft_target_s is not None
                   else "TTFT: none (--ttft-target-ms)")
    out = [f"A: {_runs(a)}", f"B: {_runs(b)}",
           f"goodput contract: {', '.join(targets)} (a request's time over the ITL target at most one target)", "",
           f"{'':{w0}}  {'A':<{w1}}  B"]
    out += [f"{k:{w0}}  {x:<{w1}}  {y}" for k, x, y in rows]
    out.append("")
    out += [f"note: {n}" for n in c.notes]
    out.append("result: " + c.summary)
    return "\n".join(out)


def _runs(f: RunFigures) -> str:
    return f.path if len(f.runs) < 2 else f"{len(f.runs)} runs pooled: {', '.join(f.runs)}"


def _rate(f: RunFigures) -> str:
    v = f.output_tokens_per_s
    return "n/a" if v is None else f"{v:.0f} ({f.output_tokens} in {f.makespan_s:.3g} s)"


def _shares(f: RunFigures) -> str:
    """The prefix cache's share of prompt tokens, per run where several are pooled."""
    return " / ".join("n/a" if x is None else f"{x:.0%}" for x in f.prefix_hit_shares) or "n/a"


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def _lost(d: dict[str, float]) -> str:
    tot = sum(d.values())
    if not d:
        return "n/a"
    top = sorted(((v, k) for k, v in d.items() if v > 0), reverse=True)[:3]
    return f"{tot:.3g} s" + (" (" + ", ".join(f"{k} {v:.3g}" for v, k in top) + ")" if top else "")


def _verdict(v: dict[str, Any] | None) -> str:
    if not v:
        return "n/a"
    conf = v.get("confidence")
    return f"{v['action']}" + (f" {conf:.2f}" if isinstance(conf, (int, float)) else "") + \
        (" (tentative)" if v.get("tentative") else "")
