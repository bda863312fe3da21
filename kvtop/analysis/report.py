"""Analysis reports: building the typed report (kvtop.model.analysis) and its 30-second text rendering."""

from __future__ import annotations

from typing import Any

from kvtop import units
from kvtop.analysis.advice.advisor import advise
from kvtop.analysis.advice.kvbytes import BUILTIN, ModelConfigError, kv_size
from kvtop.analysis.advice.situation import AGGREGATE_CONFIDENCE_SCALE, Num, Situation
from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.attribution import ALL
from kvtop.analysis.attribution.aggregate import aggregate_causes
from kvtop.analysis.attribution.thresholds import TIGHT_TARGET_REL
from kvtop.analysis.gaps import WARMUP_GAPS
from kvtop.analysis.inputs import build_situation, sum_delta
from kvtop.analysis.state import AnalysisState
from kvtop.analysis.streams import ReqState, merged_of
from kvtop.model.analysis import (
    AnalysisReport,
    CauseRow,
    MergedTokens,
    RequestRow,
    SpikeView,
    Verdict,
)

_KEY_NUMBERS = ("kv_bytes_per_token_rank", "bw_eff", "prefill_rate", "cancel_prob", "seq_tokens", "bytes_moved",
                "t_out", "t_in", "swap_gpu_s", "recompute_gpu_s", "p_star", "break_even_tokens", "n_floor",
                "n_ceiling", "chunk_budget", "unchunked_step", "chunk_worst_step", "spike_share",
                "preemptions_per_completed", "itl_target")


def render_verdict_text(v: Verdict) -> str:
    lines = []
    head = v.action.replace("_", " ").upper()
    if v.mechanism and v.mechanism != v.action:
        head += f"  (eviction mechanism: {v.mechanism})"
    if v.also:
        head += "  also: " + ", ".join(a.replace("_", " ") for a in v.also)
    lines.append(f"verdict: {head}   confidence {v.confidence:.2f}" + ("   TENTATIVE" if v.tentative else "")
                 + ("   MARGINAL" if v.marginal else ""))
    for d in v.decided_by:
        lines.append(f"  decided by: {d.gate} — {d.detail}")
    for r in v.reasons:
        lines.append(f"  - {r}")
    if v.settings:
        lines.append("settings: " + "  ".join(f.shown() for f in v.settings))
        for f in v.settings:
            if f.why:
                lines.append(f"  {f.shown()}: {f.why}")
    nums = v.numbers
    shown = [k for k in _KEY_NUMBERS if k in nums and nums[k].value is not None]
    if shown:
        lines.append("numbers:")
        for k in shown:
            n = nums[k]
            lines.append(f"  {k:<26} {units.quantity(n.value, n.unit, k):>14}  [{n.source}]")
    return "\n".join(lines)


# ---- building the analyze report -------------------------------------------------------------

EVIDENCE_HINT = ("per-request evidence: run with --probe RATE, --capture or --proxy-listen to time every stream's "
                 "tokens; each stall then gets its own cause and the victims' length, cancel rate and prefill "
                 "rate are measured instead of assumed")


def _lost_time(st: AnalysisState, counts: dict[str, int]) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds over the target per cause (every spike) and streams hit per cause (the listed spikes)."""
    # the analyzer sums every spike's time over the target as it attributes it, dropped ones included
    lost: dict[str, float] = {c.value: st.cause_over[c] for c in ALL if c.value in counts}
    streams: dict[str, set[str]] = {c: set() for c in counts}
    for g in st.spikes:
        c = str(g.cause) if str(g.cause) in streams else "unknown"
        streams[c].add(g.request_id)
    return lost, {c: len(v) for c, v in streams.items()}


def _size_link_host(st: AnalysisState, s: Situation, model_config: dict[str, Any] | None, dtype: str, tp: int) -> None:
    """What the advisor needs beyond inputs.py's figures: the KV-size function, per-direction link
    rates from the engine's offload counters, and host-memory bounds for a recommended pool."""
    geo_cfg = model_config
    if geo_cfg is None and s.v("model_key") in BUILTIN:
        geo_cfg = BUILTIN[s.v("model_key")]
    rank = s.n.get("kv_bytes_per_token_rank")
    override = rank.value if rank is not None and rank.source != "config" else None
    try:
        if geo_cfg is not None or override is not None:
            s.size = kv_size(geo_cfg, dtype, tp, 1, override)
    except ModelConfigError:
        s.size = None
    for d, key, what in (("out", "bw_d2h", "GPU->host"), ("in", "bw_h2d", "host->GPU")):
        b = sum_delta(st, f"offload_{d}_bytes_total")
        sec = sum_delta(st, f"offload_{d}_seconds_total")
        if b and sec and sec > 0:
            s.n[key] = Num(b / sec, "B/s", "measured", f"engine offload {what} bytes / seconds")
    host = st.tally.host or {}
    if host.get("mem_available_bytes"):
        s.n["host_available_bytes"] = Num(float(host["mem_available_bytes"]), "B", "measured", "MemAvailable")
    if host.get("cgroup_mem_max_bytes"):
        used = float(host.get("cgroup_shmem_bytes") or 0.0)
        s.n["cgroup_free_bytes"] = Num(max(0.0, float(host["cgroup_mem_max_bytes"]) - used), "B", "measured",
                                       "cgroup memory.max - shmem (upper bound)")


def _last_sum(st: AnalysisState, key: str) -> float | None:
    vals: list[float] = [d[key] for d in st.tally.engine_last.values() if d.get(key) is not None]
    return float(sum(vals)) if vals else None


def build_report(an: Analyzer, model_config: dict[str, Any] | None = None, kv_bytes: float | None = None,
                 dtype: str = "bf16", tp: int = 1, settings_names: dict[str, str] | None = None,
                 engine: str | None = None, warnings: list[str] | None = None) -> AnalysisReport:
    st = an.state()
    s = build_situation(st, model_config, kv_bytes, dtype, tp)
    _size_link_host(st, s, model_config, dtype, tp)
    s.engine = engine
    s.settings_names = dict(settings_names or {})
    if an.semantics is not None:
        s.use_engine(an.semantics)
    basis = "requests" if st.token_records else "aggregate"
    if basis == "requests":
        by_cause = dict(st.cause_counts)
        total = st.n_spikes
        conf = {c.value: (st.cause_conf[c] / by_cause[c] if by_cause[c] else None) for c in ALL}
    else:
        by_cause, tgt, src = aggregate_causes(list(st.scrapes), st.itl_target_s, st.k, st.preempts,
                                              st.target_source)
        total = sum(by_cause.values())
        conf = {c.value: (0.35 if by_cause[c] else None) for c in ALL}
        if tgt is not None and "itl_target" not in s.n:
            s.n["itl_target"] = Num(tgt, "s", "measured", src)
            s.n["itl_slo"] = Num(tgt, "s", "measured", src)
        if st.scrapes:
            s.notes.append("no per-request token timings (no stream observed): causes come from the engine's ITL "
                           "histogram deltas vs preemption and prompt-token counters (lower confidence)")
        else:  # a live run whose engine has not answered yet (or no longer): no method to speak of
            s.notes.append("no per-request token timings and no engine scrape that answered: nothing to judge yet")
    counts: dict[str, int] = {c.value: by_cause[c] for c in ALL}
    # seconds above the target per cause (per-spike attribution only: the aggregate path has no gaps)
    over = {c.value: st.cause_over[c] for c in ALL} if basis == "requests" else {}
    shares = {c: (counts[c] / total if total else 0.0) for c in counts}
    s.cause_counts = {c: float(v) for c, v in counts.items()}
    s.basis = basis
    gaps = st.gaps
    if basis == "requests":
        # the spike-pattern and cause-weight gates (kvtop.analysis.advice.diagnosis) decide; they need the
        # counts, the time over target each cause cost and the streams it hit
        # before a target is set (given, or derived once WARMUP_GAPS gaps are seen) no gap was judged:
        # "no spikes" would claim a met target
        s.spikes = total if st.itl_target_s is not None else None
        if st.itl_target_s is None:
            s.n["target_warmup_gaps"] = Num(float(WARMUP_GAPS), "", "config", "gaps a derived ITL target waits for")
        s.n["gaps"] = Num(float(gaps), "", "measured", "inter-token gaps")
        streams = sum(1 for r in st.streams if r.first_t is not None)
        hit = sum(1 for r in st.streams if r.spikes)
        s.n["streams"] = Num(float(streams), "", "measured")
        s.n["streams_hit"] = Num(float(hit), "", "measured", "streams with at least one spike")
        lost, hit_by = _lost_time(st, counts)
        s.cause_lost_s = lost
        s.cause_streams = hit_by
        for c, v in lost.items():
            if v:
                s.n[f"lost_s_{c}"] = Num(v, "s", "measured", "time over the target")
                s.n[f"streams_{c}"] = Num(hit_by[c], "", "measured", "streams hit by this cause")
        if st.t0 is not None and st.now > st.t0:
            s.n["window"] = Num(st.now - st.t0, "s", "measured", "trace span")
    else:
        s.spikes = total if s.v("itl_target") is not None else None
        s.evidence_hint = EVIDENCE_HINT
        waiting = _last_sum(st, "waiting")
        if waiting is not None:
            s.n["waiting"] = Num(waiting, "requests", "measured", "last scrape, all engines")
    if basis == "requests" and total:
        s.n["spike_share"] = Num(total / max(1, gaps), "", "measured", "spikes / inter-token gaps")
    if basis == "requests" and gaps and st.itl_target_s is not None:
        # the same itl_target_met gate `kvtop advise` applies: at most 1 % of gaps over the target is a met p99
        s.n["miss_rate"] = Num(total / gaps, "", "measured", "gaps over the target / inter-token gaps")
    # advise() runs the diagnosis; the verdict's confidence is the chosen cause's mean attribution
    # confidence, lowered when only aggregates were seen
    s.cause_confidence = {c: v for c, v in conf.items() if v is not None}
    s.confidence_scale = 1.0 if basis == "requests" else AGGREGATE_CONFIDENCE_SCALE
    verdict = advise(s)
    spikes = tuple(SpikeView(g.request_id, round(g.t_start, 6), round(g.t_end, 6), round(g.candidate.gap, 6),
                             str(g.cause), g.kind, round(g.confidence, 3), g.ended_by, tuple(g.evidence))
                   for g in st.spikes)
    requests = tuple(RequestRow(r.id, r.spikes, r.preempt_spikes, round(r.longest_silence(), 6), r.tokens, r.last_cause,
                                r.ended_by) for r in st.streams if r.first_t is not None)
    warnings = list(warnings or ())
    crowded = _crowded_target(st, total) if basis == "requests" else None
    if crowded:
        warnings.append(crowded)
    merged = _merged_tokens(st.streams) if basis == "requests" else None
    note = _merged_chunks(st, total, merged)
    if note:
        warnings.append(note)
    return AnalysisReport(
        basis=basis,
        itl_target_s=s.v("itl_target"),
        itl_target_source=s.n["itl_target"].note if "itl_target" in s.n else None,
        median_gap_s=st.median_gap,
        records=st.records,
        gaps=gaps,
        spikes=spikes,
        spikes_total=total,
        causes={c: CauseRow(counts[c], round(shares[c], 4), _round(conf[c], 3)) for c in counts},
        over_target_s={c: round(v, 3) for c, v in over.items()} or None,
        requests=requests,
        request_preemptions=st.request_preemptions,
        engine_request_times=st.engine_request_times,
        resume_costs=st.resume_costs,
        prefill_compute=st.prefill_compute,
        held_spikes=st.held_spikes if st.witnessed_spikes else None,
        merged_tokens=merged,
        verdict=verdict,
        warnings=tuple(warnings),
    )


# a target this far below the scrape interval puts several stalls in each interval
CROWDED_TARGET_REL = 0.25


def _crowded_target(st: AnalysisState, spikes: int) -> str | None:
    """At a tight target many stalls share each scrape interval, and an interval's counters cannot say
    which stall a prompt or a preemption caused: say so where it happens (without a witness)."""
    si, tgt = st.scrape_interval, st.itl_target_s
    if not spikes or si is None or tgt is None or st.t0 is None or st.now <= st.t0 or st.witnessed_spikes:
        return None
    if tgt >= CROWDED_TARGET_REL * si or not st.spikes:
        return None
    # the intervals that hold stalls (a quiet hour does not thin out a crowded minute)
    t0 = st.t0
    intervals = len({int((g.t_end - t0) // si) for g in st.spikes})
    per_interval = len(st.spikes) / max(1, intervals)
    if per_interval < 2:
        return None
    return (f"at a {tgt * 1e3:.0f} ms target {per_interval:.0f} stalls fall in each {si:.3g} s scrape interval that "
            "holds any, on average: the scrapes cannot tell which of them a prompt or a preemption caused, so those causes rest on "
            "first tokens, the engine's own per-request times and the streams' pace (less certain than at a looser "
            "target); kvtop's witness inside vLLM reads every stall exactly (docs/witness.md)")


def _merged_tokens(streams: tuple[ReqState, ...]) -> MergedTokens | None:
    """What the streams held say of merged chunks (``MergedTokens``); None where no finished stream
    carried usage and no spike closed on a record larger than its stream's usual."""
    n = usage = merged = bound = 0
    for r in streams:
        bound += r.multi_spikes
        m = merged_of(r)
        if m is None:
            continue
        n += 1
        usage += r.usage or 0
        merged += m
        bound += min(m, r.spikes - r.multi_spikes)
    return MergedTokens(n, usage, merged, bound) if n or bound else None


# fewer spikes than this share that can be merged chunks move no cause's share by much: no warning
MERGED_SPIKES_NOTE = 0.05
MERGED_WARNING = "spikes can be such chunks, whatever cause they were given"  # how the warning is known


def _merged_chunks(st: AnalysisState, spikes: int, m: MergedTokens | None) -> str | None:
    """At a target of a few decode steps a chunk that carries several tokens closes a gap that misses
    it, whatever the engine did, and the client's chunks do not say which carried several: say how
    many spikes can be such chunks (without a witness, which reads them)."""
    tgt, med = st.itl_target_s, st.median_gap
    if m is None or not spikes or tgt is None or not med or st.witnessed_spikes:
        return None
    if tgt >= TIGHT_TARGET_REL * med or m.spikes_max < MERGED_SPIKES_NOTE * spikes:
        return None
    told = (f"the engine counted {m.tokens:,} tokens more than the chunks of its {m.streams:,} finished streams "
            f"carried ({m.tokens / max(1, m.usage_tokens):.1%} of {m.usage_tokens:,}): they reached the client merged "
            "with others" if m.tokens else "chunks that carried several tokens reached the client")
    return (told + " (the API server merging outputs, or holding back text until a character, a stop string, a "
            "tool call or a reasoning block completes; speculative decoding's extra tokens count the same), and a "
            "merged chunk closes a gap of two or more decode steps, "
            f"which can miss a {tgt * 1e3:.0f} ms target ({tgt / med:.1f}x the median gap) however fast the engine "
            f"stepped: up to {m.spikes_max:,} of the {spikes:,} {MERGED_WARNING}; the client cannot tell which, "
            "nor how many a stream cancelled before its end had (kvtop's witness inside vLLM reads them: "
            "docs/witness.md)")


def _round(v: float | None, nd: int) -> float | None:
    return None if v is None else round(v, nd)


def render_report_text(rep: AnalysisReport) -> str:
    lines = []
    tgt = rep.itl_target_s
    med = rep.median_gap_s
    lines.append(f"ITL target {tgt * 1e3:.0f} ms ({rep.itl_target_source})" if tgt else "ITL target: unknown")
    # the run's median from a sample of its gaps (2 % bins): not the first gaps' median a derived target names
    lines.append(f"{rep.gaps} inter-token gaps, median of the run ≈{med * 1e3:.1f} ms" if med else f"{rep.gaps} inter-token gaps")
    if rep.basis == "aggregate":
        lines.append("basis: engine aggregates only (no per-request timings) — lower confidence")
    tot = rep.spikes_total
    lines.append(f"{tot} spikes above target")
    for c, v in rep.causes.items():
        if v.count:
            mc = v.mean_confidence
            lines.append(f"  {c.replace('_', ' '):<22} {v.count:>6}  {v.share:6.1%}"
                         + (f"  (confidence {mc:.2f})" if mc is not None else ""))
    worst = sorted(rep.requests, key=lambda r: -r.max_gap_s)[:5]
    worst = [r for r in worst if r.spikes]
    if worst:
        lines.append("worst streams:")
        for r in worst:
            lines.append(f"  {r.request_id:<24} max gap {r.max_gap_s * 1e3:8.0f} ms  spikes {r.spikes}"
                         f"  preemption {r.preemption_spikes}  last cause {r.last_cause}")
    rp = rep.request_preemptions
    if rp and rp.finished_requests:
        lines.append(f"engine per-request histogram: {rp.finished_requests:.0f} finished requests preempted "
                     f"{rp.engine_preemptions:.0f} times; of {rp.pinned_requests} pinned to one observed finish, "
                     f"kvtop agrees on {rp.pinned_agree} (more on {rp.pinned_kvtop_more}, "
                     f"fewer on {rp.pinned_kvtop_fewer}); of the {rp.pinned_engine_preemptions} preemptions the "
                     f"engine counted on them kvtop found {rp.pinned_kvtop_found}, and called "
                     f"{rp.pinned_kvtop_extra} more")
    rc = rep.resume_costs
    if rc is not None:
        share = rc.restored_share
        lines.append(f"engine step log (witness): {rc.resumes} resume(s) after preemption; positions had again "
                     f"without compute (prefix cache or KV connector) {rc.restored_tokens}, recomputed "
                     f"{rc.recomputed_tokens}" + (f" ({share:.0%} restored)" if share is not None else ""))
    pc = rep.prefill_compute
    if pc is not None and pc.tokens_per_s is not None:
        lines.append(f"engine step log (witness): {pc.steps} step(s) computed {pc.tokens} prompt and recompute "
                     f"tokens in {pc.seconds:.3g} s beyond a decode-only step ({pc.tokens_per_s:,.0f} tokens/s)")
    if rep.held_spikes:
        lines.append(f"engine step log (witness): {rep.held_spikes} of the {rep.spikes_total} spikes were tokens the "
                     "engine made on pace that reached the client in one chunk (held outside its steps: the API "
                     "server's output merging or detokenizer hold-back, the network, the reader), not the "
                     "engine's pace")
    lines.append("")
    if rep.verdict is not None:
        lines.append(render_verdict_text(rep.verdict))
    for w in rep.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
