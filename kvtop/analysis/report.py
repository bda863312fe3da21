"""Analysis reports: the JSON dict and the 30-second text rendering."""

from __future__ import annotations

import math
from typing import Any


def _fmt(v: Any, unit: str) -> str:
    if isinstance(v, bool) or v is None or isinstance(v, (str, list, dict)):
        return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return "n/a"
    if unit == "s":
        return f"{v * 1e3:.1f} ms" if abs(v) < 10 else f"{v:.1f} s"
    if unit == "B":
        return f"{v / 1e9:.3g} GB" if abs(v) >= 1e8 else f"{v / 1e6:.3g} MB"
    if unit == "B/s":
        return f"{v / 1e9:.3g} GB/s" if abs(v) >= 1e8 else f"{v / 1e6:.3g} MB/s"
    if isinstance(v, float):
        return f"{v:.4g}{(' ' + unit) if unit else ''}"
    return f"{v}{(' ' + unit) if unit else ''}"


_KEY_NUMBERS = ("kv_bytes_per_token_rank", "bw_eff", "prefill_rate", "cancel_prob", "seq_tokens", "bytes_moved",
                "t_out", "t_in", "swap_gpu_s", "recompute_gpu_s", "p_star", "break_even_tokens", "n_floor",
                "n_ceiling", "chunk_budget", "unchunked_step", "chunk_worst_step", "spike_share",
                "preemptions_per_completed", "itl_target")


def render_verdict_text(v: dict[str, Any]) -> str:
    lines = []
    head = v["action"].replace("_", " ").upper()
    if v.get("mechanism") and v["mechanism"] != v["action"]:
        head += f"  (eviction mechanism: {v['mechanism']})"
    if v.get("also"):
        head += "  also: " + ", ".join(a.replace("_", " ") for a in v["also"])
    lines.append(f"verdict: {head}   confidence {v['confidence']:.2f}" + ("   MARGINAL" if v.get("marginal") else ""))
    for r in v.get("reasons", []):
        lines.append(f"  - {r}")
    if v.get("settings"):
        lines.append("settings: " + "  ".join(f"{k} {val}" for k, val in v["settings"].items()))
    nums = v.get("numbers", {})
    shown = [k for k in _KEY_NUMBERS if k in nums and nums[k]["value"] is not None]
    if shown:
        lines.append("numbers:")
        for k in shown:
            n = nums[k]
            lines.append(f"  {k:<26} {_fmt(n['value'], n['unit']):>14}  [{n['source']}]")
    return "\n".join(lines)


# ---- building the analyze report -------------------------------------------------------------

def _aggregate_causes(an: Any, k: float) -> tuple[dict[str, int], float | None, str | None]:
    """Fallback without per-request timings: ITL histogram deltas per scrape vs counters."""
    from kvtop.analysis.attribution import KV_HIGH

    scrapes = list(an._scrapes)
    counts = {c: 0 for c in ("preemption", "prefill_interference", "slow_decode", "unknown")}
    if len(scrapes) < 2:
        return counts, None, None
    by_key: dict[Any, list[tuple]] = {}
    for s in scrapes:
        by_key.setdefault(s[1], []).append(s)
    target = an.itl_target_s
    src = an.target_source
    if target is None:
        # p50 of the whole run's histogram delta x k
        merged: dict[float, float] = {}
        total = 0.0
        for lst in by_key.values():
            f, last = lst[0][2], lst[-1][2]
            for (le, c1), (_, c0) in zip(last["buckets"], f["buckets"], strict=False):
                merged[float(le)] = merged.get(float(le), 0.0) + (c1 - c0)
            total += last["count"] - f["count"]
        if total <= 0:
            return counts, None, None
        for le in sorted(merged):
            if merged[le] >= 0.5 * total:
                target = k * le
                src = f"derived: {k:g} x engine ITL histogram p50 (bucket bound)"
                break
    if target is None:
        return counts, None, None
    deltas = []
    for lst in by_key.values():
        for prev, cur in zip(lst, lst[1:], strict=False):
            if prev[4] is not None and cur[4] is not None:
                deltas.append(max(0.0, cur[4] - prev[4]))
    typ = sorted(deltas)[len(deltas) // 2] if deltas else 0.0
    for lst in by_key.values():
        for prev, cur in zip(lst, lst[1:], strict=False):
            h0, h1 = prev[2], cur[2]
            dcount = h1["count"] - h0["count"]
            if not math.isfinite(dcount) or dcount <= 0:  # a NaN/Inf count is no observation
                continue
            below = 0.0
            p50_le = None
            for (le, c1), (_, c0) in zip(h1["buckets"], h0["buckets"], strict=False):
                if float(le) <= target:
                    below = c1 - c0
                if p50_le is None and c1 - c0 >= 0.5 * dcount:
                    p50_le = float(le)
            if not math.isfinite(below):
                continue
            above = int(round(dcount - below))
            if above <= 0:
                continue
            dpre = (cur[3] - prev[3]) if cur[3] is not None and prev[3] is not None and cur[3] >= prev[3] else 0
            dprompt = (cur[4] - prev[4]) if cur[4] is not None and prev[4] is not None and cur[4] >= prev[4] else 0
            kv = cur[6]
            if an.preempts and dpre >= 1 and (kv is None or kv >= KV_HIGH) and above <= 3 * dpre:
                counts["preemption"] += above
            elif dprompt >= 512 and dprompt > 1.5 * typ and (cur[5] is None or above >= 0.5 * max(1, cur[5])):
                counts["prefill_interference"] += above
            elif p50_le is not None and p50_le > target:
                counts["slow_decode"] += above
            else:
                counts["unknown"] += above
    return counts, target, src


def build_report(an: Any, model_config: dict[str, Any] | None = None, kv_bytes: float | None = None,
                 dtype: str = "bf16", tp: int = 1, settings_names: dict[str, str] | None = None,
                 engine: str | None = None, warnings: list[str] | None = None) -> dict[str, Any]:
    from kvtop.analysis.advisor import Num, advise
    from kvtop.analysis.inputs import build_situation

    s = build_situation(an, model_config, kv_bytes, dtype, tp)
    s.engine = engine
    s.settings_names = dict(settings_names or {})
    basis = "requests" if an.token_records else "aggregate"
    if basis == "requests":
        counts = dict(an.cause_counts)
        total = an.n_spikes
        conf = {c: (an.cause_conf[c] / counts[c] if counts[c] else None) for c in counts}
    else:
        counts, tgt, src = _aggregate_causes(an, an.k)
        total = sum(counts.values())
        conf = {c: (0.35 if counts[c] else None) for c in counts}
        if tgt is not None and "itl_target" not in s.n:
            s.n["itl_target"] = Num(tgt, "s", "measured", src)
            s.n["itl_slo"] = Num(tgt, "s", "measured", src)
        s.notes.append("no per-request token timings in this trace: causes come from the engine's ITL histogram "
                       "deltas vs preemption and prompt-token counters (lower confidence)")
    shares = {c: (counts[c] / total if total else 0.0) for c in counts}
    s.cause_shares = {c: v for c, v in shares.items() if c != "unknown"}
    s.spikes = total
    s.basis = basis
    gaps = an.n_gaps
    if basis == "requests":
        if not an.token_records:
            s.itl_miss = None
        else:
            # a miss pattern: enough spikes to matter for a p99/p99.9 contract, or a visible share of
            # streams hit (a few multi-second stalls in a long run still break users' streams)
            streams = sum(1 for r in an.reqs.values() if r.first_t is not None)
            hit = sum(1 for r in an.reqs.values() if r.spikes)
            s.itl_miss = total >= 3 and (total >= 0.0005 * gaps or hit >= 0.01 * max(1, streams))
    else:
        s.itl_miss = (total >= 3) if s.v("itl_target") is not None else None
    if s.itl_miss:
        known = {c: counts[c] for c in ("preemption", "prefill_interference", "slow_decode")}
        best = max(known, key=lambda c: known[c])
        s.cause = best if known[best] >= 0.3 * total else "unknown"
        cc = conf.get(s.cause)
        s.attribution_confidence = (cc if cc is not None else 0.3) * (1.0 if basis == "requests" else 0.6)
    elif s.itl_miss is None:
        s.cause = None
        s.spikes = None
    if basis == "requests" and total:
        s.n["spike_share"] = Num(total / max(1, gaps), "", "measured", "spikes / inter-token gaps")
    verdict = advise(s)
    spikes = [{"request_id": g.request_id, "t_start": round(g.t_start, 6), "t_end": round(g.t_end, 6),
               "gap_s": round(g.gap, 6), "cause": g.cause, "confidence": round(g.confidence, 3),
               "ended_by": g.ended_by, "evidence": g.evidence} for g in an.spikes]
    requests = []
    for r in an.reqs.values():
        if r.first_t is None:
            continue
        requests.append({"request_id": r.id, "spikes": r.spikes, "preemption_spikes": r.preempt_spikes,
                         "max_gap_s": round(r.max_gap, 6), "tokens": r.tokens, "last_cause": r.last_cause,
                         "ended_by": r.ended_by})
    out = {
        "basis": basis,
        "itl_target_s": s.v("itl_target"),
        "itl_target_source": s.n["itl_target"].note if "itl_target" in s.n else None,
        "median_gap_s": an.median_gap(),
        "records": an.records,
        "gaps": gaps,
        "spikes": spikes,
        "spikes_listed": len(spikes),
        "spikes_total": total,
        "causes": {c: {"count": counts[c], "share": round(shares[c], 4),
                       "mean_confidence": None if conf[c] is None else round(conf[c], 3)} for c in counts},
        "requests": requests,
        "verdict": verdict,
        "warnings": list(warnings or []),
    }
    return out


def render_report_text(rep: dict[str, Any]) -> str:
    lines = []
    tgt = rep.get("itl_target_s")
    med = rep.get("median_gap_s")
    lines.append(f"ITL target {tgt * 1e3:.0f} ms ({rep.get('itl_target_source')})" if tgt else "ITL target: unknown")
    lines.append(f"{rep['gaps']} inter-token gaps, median {med * 1e3:.1f} ms" if med else f"{rep['gaps']} inter-token gaps")
    if rep["basis"] == "aggregate":
        lines.append("basis: engine aggregates only (no per-request timings) — lower confidence")
    tot = rep["spikes_total"]
    lines.append(f"{tot} spikes above target")
    for c, v in rep["causes"].items():
        if v["count"]:
            mc = v["mean_confidence"]
            lines.append(f"  {c.replace('_', ' '):<22} {v['count']:>6}  {v['share']:6.1%}"
                         + (f"  (confidence {mc:.2f})" if mc is not None else ""))
    worst = sorted(rep["requests"], key=lambda r: -r["max_gap_s"])[:5]
    worst = [r for r in worst if r["spikes"]]
    if worst:
        lines.append("worst streams:")
        for r in worst:
            lines.append(f"  {r['request_id']:<24} max gap {r['max_gap_s'] * 1e3:8.0f} ms  spikes {r['spikes']}"
                         f"  preemption {r['preemption_spikes']}  last cause {r['last_cause']}")
    lines.append("")
    lines.append(render_verdict_text(rep["verdict"]))
    for w in rep.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)
