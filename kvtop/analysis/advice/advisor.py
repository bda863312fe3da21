"""The verdict: attribute first, then prescribe (docs/kv-science.md §0, §11).

``advise(situation)`` is shared by ``kvtop analyze`` (inputs measured from a trace) and
``kvtop advise`` (inputs given in a scenario file). Every number it reports carries its source:
``measured`` (from records), ``given`` (scenario / command line), ``config`` (model geometry),
``assumed`` (a documented default), or ``derived`` (computed from the others).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from kvtop.adapters.base import Setting
from kvtop.analysis.advice import capacity as cap
from kvtop.analysis.advice import chunking, swapimpl, versions
from kvtop.analysis.advice.costmodel import (
    EPSILON_ASYNC,
    EventCost,
    EventInputs,
    choose_victim,
    evaluate_event,
    prefix_policy,
)
from kvtop.analysis.advice.diagnosis import diagnose
from kvtop.analysis.advice.link import DEFAULT_ALPHA_S, DEFAULT_BW_PEAK, bw_eff
from kvtop.analysis.advice.situation import Num, Situation
from kvtop.analysis.advice.swapimpl import IMPLEMENTATIONS
from kvtop.model.analysis import DECIDED_BY, Decision, FlagSetting, Verdict
from kvtop.model.records import SIM_ENGINE_VERSION

ACTIONS = ("swap", "recompute", "admission", "chunked_prefill", "reduce_batch", "scale_out", "no_action",
           "insufficient_data")
FAIRNESS = ("Compare policies only at equal useful completion rate and equal p99 ITL/TTFT contract "
            "(goodput); throughput at a broken p99, or latency bought by aborting more, does not count.")
# Default prefill rates (tokens/s) per model for an H100 at ~35-40 % MFU (docs/kv-science.md §3.2).
DEFAULT_RHO = {"llama-3.1-8b": 25_000.0, "llama-3.1-70b": 10_000.0, "qwen2.5-7b": 27_000.0}
GENERIC_RHO = 25_000.0
GENERIC_K_ATT = 1.8781e-5  # an 8B-class model; used only when the model is unknown (assumed)

# Prompt tokens / a request's TTFT reads the engine's prefill rate low: a step's fixed cost and the other
# prompts of its steps fill the TTFT of short prompts. Against the engine's own step log (the witness),
# that figure was 3.0-21.5x under the engine's marginal rate on the shipped recompute storms
# (docs/witness.md). A swap chosen on such a rate (``Num.low``) must still win at LOW_RHO_FACTOR times
# it, the least of that range, or the verdict says it may not.
LOW_RHO_FACTOR = 3.0

# Below this confidence a verdict is tentative: it says so and what would confirm it.
CONFIDENCE_FLOOR = 0.5
# A recommended length bound is rounded up to this many tokens (a round figure an operator types).
LENGTH_ROUND = 256
# The token budget prescribed for prefill interference where nothing sizes one (a common chunk size,
# and a multiple of every KV block size engines use).
FALLBACK_BUDGET = 2048
# Concurrently preempted sequences a host pool holds when the trace never measured the peak.
DEFAULT_POOL_SEQS = 4
# Clients that abandon this share of preempted requests (or more) abandon queued ones too: an admission
# limit at the no-preemption floor then sheds them instead (the cancel-heavy preset: a limit of 8 or 10
# completed 5-17 % fewer requests, 12-16 did not). Such traffic gets the mean-occupancy ceiling.
ABANDON_CANCEL_PROB = 0.1

# The engine's current value of a setting, where the trace or scenario says it.
_CURRENT: dict[str, str] = {Setting.MAX_SEQS: "max_seqs_current", Setting.BATCHED_TOKENS: "batched_tokens_current",
            Setting.CTX: "max_model_len_current", Setting.KV_CACHE_BYTES: "kv_cache_bytes_current",
            Setting.GPU_MEMORY: "gpu_memory_current"}
# A larger KV cache may take at most this share of the memory the device has free: the rest stays for
# activations and fragmentation, as vLLM's default memory share (0.9) keeps a tenth of the device
# (docs/kv-science.md §8.1).
KV_HEADROOM_SHARE = 0.9
# Without a TTFT target, the time to first token an admission queue may add before more KV capacity is
# the better fix: this many ITL targets, the tightest ratio of MLPerf Inference's LLM latency pairs
# (docs/kv-science.md §8.1).
TTFT_PER_ITL = 10.0
# A batch limit is prescribed only where its measured throughput leaves this share of it for the offered
# load: a server busy a share rho of the time keeps a queue that grows as rho / (1 - rho) (Kingman), ten
# service times deep at 0.9 and without bound at 1.
LOAD_HEADROOM = 0.9
_MIB = 1 << 20


def _bytes(x: float) -> str:
    """A byte count as an operator reads it: GB down to 1 GB, then MB."""
    return f"{x / 1e9:.3g} GB" if abs(x) >= 1e9 else f"{x / 1e6:.3g} MB"


class _Flags:
    """The settings a verdict emits, in order; each with its flag as the engine spells it and why.

    A value equal to the engine's current setting is never emitted (the reasons say so instead):
    "change X to what it already is" is not a prescription.
    """

    def __init__(self, s: Situation, reasons: list[str]):
        self.s = s
        self.reasons = reasons
        self.items: list[FlagSetting] = []

    def put(self, key: str, flag: str | None, value: Any, why: str) -> bool:
        name = key.value if isinstance(key, Setting) else key
        cur_key = _CURRENT.get(name)  # Setting is a str enum: its plain name finds it
        cur = self.s.v(cur_key) if cur_key else None
        if cur is not None and value == cur:
            self.reasons.append(f"{flag or name} {value} is the engine's current setting: not a change, not emitted")
            return False
        self.items = [f for f in self.items if f.setting != name]
        note = self.s.setting_notes.get(name)
        self.items.append(FlagSetting(name, flag, value, f"{why}; {note}" if note else why))
        return True

    def value(self, key: Setting) -> Any:
        """The value this verdict gives a setting, None where it gives none."""
        return next((f.value for f in self.items if f.setting == key), None)

    def set(self, key: Setting, value: Any, why: str) -> bool:
        """A generic setting, spelled by the engine's adapter (no flag when the engine is unknown)."""
        return self.put(key, self.s.settings_names.get(key), value, why)


def _link(s: Situation, beta_rank: float) -> float:
    """BW_eff: measured/given directly, else the §2.2 model from (given or assumed) parts."""
    if s.v("bw_eff") is None and s.v("bw_d2h") is not None and s.v("bw_h2d") is not None:
        s.n["bw_eff"] = Num(min(s.v("bw_d2h"), s.v("bw_h2d")), "B/s", s.n["bw_d2h"].source,
                            "slower direction (break-even uses one figure)")
    if s.v("bw_eff") is not None:
        return float(s.v("bw_eff"))
    if s.v("bw_peak") is None:
        s.n["bw_peak"] = Num(DEFAULT_BW_PEAK, "B/s", "assumed", "H100 PCIe Gen5 pinned, one direction")
    if s.v("alpha") is None:
        s.n["alpha"] = Num(DEFAULT_ALPHA_S, "s", "assumed", "fixed cost per contiguous copy")
    if s.v("copy_bytes") is None:
        impl = IMPLEMENTATIONS.get(s.swap_impl or "", IMPLEMENTATIONS["vllm_v1_offload"])
        layers = s.size.layers_rank if s.size is not None else 0.0
        note = {"layer_block": "one layer's K or V for a 16-token block (blocking V0 swap)",
                "chunk": "one 256-token LMCache chunk across all layers"}.get(
                    impl.copy, "one 16-token block across all layers (vLLM >= 0.12 layout)")
        s.n["copy_bytes"] = Num(swapimpl.copy_bytes(impl, beta_rank, layers), "B",
                                "derived" if s.swap_impl else "assumed", note)
    if s.v("contention") is None:
        s.n["contention"] = Num(1.0, "", "assumed")
    bw = bw_eff(s.v("copy_bytes"), s.v("bw_peak"), s.v("alpha"), s.v("contention"))
    srcs = {s.n[k].source for k in ("bw_peak", "alpha", "copy_bytes", "contention")}
    s.n["bw_eff"] = Num(bw, "B/s", "assumed" if "assumed" in srcs else "derived",
                        "c·g/(g/BW_peak + α)")
    return bw


def _prefill(s: Situation) -> tuple[float, float]:
    if s.v("prefill_rate") is None:
        rho = DEFAULT_RHO.get(s.v("model_key") or "", GENERIC_RHO)
        s.n["prefill_rate"] = Num(rho, "tokens/s", "assumed", "~35-40 % MFU on an H100")
    if s.v("k_att") is None:
        s.n["k_att"] = Num(GENERIC_K_ATT, "1/token", "assumed", "8B-class attention coefficient")
    return 1.0 / float(s.v("prefill_rate")), float(s.v("k_att"))


def _host_limit(s: Situation) -> tuple[float | None, str | None]:
    """The tightest known bound on host memory a pinned pool may take, and what it is."""
    cands = []
    for key, what in (("host_free_bytes", "free pinned"), ("host_available_bytes", "available host memory"),
                      ("pinned_limit_bytes", "pinned-memory limit"), ("cgroup_free_bytes", "cgroup memory headroom")):
        v = s.v(key)
        if v is not None:
            cands.append((float(v), what))
    if not cands:
        return None, None
    return min(cands)


def _event(s: Situation, beta: float, beta_rank: float, a: float, k_att: float, bw: float) -> tuple[EventInputs, EventCost]:
    impl = IMPLEMENTATIONS.get(s.swap_impl or "")
    kappa = s.v("kappa")
    if kappa is None:
        if impl is not None and impl.kappa is not None:
            kappa = impl.kappa
            s.n["kappa"] = Num(kappa, "", "derived", impl.note)
        else:
            kappa = EPSILON_ASYNC
            s.n["kappa"] = Num(kappa, "", "assumed", "asynchronous DMA offload (vLLM connector)")
    host_free, _ = _host_limit(s)
    h_res = s.v("resume_hit_tokens")
    if s.size is not None and s.size.state_bytes_rank and h_res is None:
        # a fixed SSM/linear-attention state cannot be resumed from a partial prefix
        h_res = 0.0
        s.n["resume_hit_tokens"] = Num(0.0, "tokens", "assumed", "hybrid state is all-or-nothing")
    directional = s.v("bw_d2h") is not None and s.v("bw_h2d") is not None
    x = EventInputs(
        beta=beta, beta_rank=beta_rank, S=float(s.v("seq_tokens")), a=a, k_att=k_att, bw_eff=bw,
        h_sh=float(s.v("shared_tokens") or 0.0),
        h_res=None if h_res is None else float(h_res),
        h_host=float(s.v("host_tokens") or 0.0), p=float(s.v("cancel_prob") or 0.0), kappa=float(kappa),
        F=float(s.v("free_tokens") or 0.0), q_out=float(s.v("queue_out_bytes") or 0.0),
        q_in=float(s.v("queue_in_bytes") or 0.0), u_now=s.v("link_utilization"),
        u_max=float(s.v("u_max") or 0.8), host_free=host_free, ranks=int(s.v("ranks") or 1),
        rate=s.v("preemption_rate"), t_iter=s.v("decode_step"), size=s.size,
        bw_out=s.v("bw_d2h"), bw_in=s.v("bw_h2d"), directional=directional,
        duplex=float(s.v("duplex") if s.v("duplex") is not None else 1.0),
        swap_unavailable=("no host KV tier (swap.implementation: none); swap/offload needs one configured"
                          if s.swap_impl == "none" else None),
    )
    return x, evaluate_event(x)


def advise(s: Situation) -> Verdict:
    versions.apply(s)
    reasons: list[str] = []
    also: list[str] = []
    settings = _Flags(s, reasons)
    action: str
    mechanism: str | None = None
    marginal = False
    conf = s.attribution_confidence if s.attribution_confidence is not None else 0.9

    if s.size is not None:
        # per-token figures for labels and the break-even; every byte count uses s.size
        s.n.setdefault("kv_bytes_per_token", Num(s.size.token_bytes_total, "B/token", "config",
                                                 "all ranks, " + s.size.describe()))
        s.n.setdefault("kv_bytes_per_token_rank", Num(s.size.token_bytes_rank, "B/token", "config",
                                                      "one rank, " + s.size.describe()))
    beta = s.v("kv_bytes_per_token")
    beta_rank = s.v("kv_bytes_per_token_rank") or beta
    if beta is not None and s.v("kv_bytes_per_token_rank") is None:
        s.n["kv_bytes_per_token_rank"] = Num(beta_rank, "B/token", s.n["kv_bytes_per_token"].source)
    a, k_att = _prefill(s)

    diagnose(s)
    cause = s.cause
    if s.attribution_confidence is None and (s.basis != "given" or s.cause_confidence) and cause is not None:
        conf = s.cause_confidence.get(cause, 0.3) * s.confidence_scale
    if cause == "preemption" and not s.preempts:
        cause = "unknown"
        reasons.append("this engine never preempts a running request; stalls are not preemptions")
    if cause in (None, "unknown") and s.itl_miss is not False:
        churn_conf = _aggregate_churn(s, reasons)
        if churn_conf is not None:
            cause = "churn"
            conf = churn_conf

    # ---- diagnosis first (rule 1) ---------------------------------------------------------
    if cause == "churn":
        action, mechanism, marginal, conf = _preemption(s, beta, beta_rank, a, k_att, reasons, also, settings, conf)
    elif s.itl_miss is False or (cause is None and s.itl_miss is None and s.spikes == 0):
        action = "no_action"
        if not s.decided_by:
            reasons.append("no token-gap spikes above the ITL target")
        else:
            reasons.append("ITL target met: " + s.decided_by[-1]["detail"])
    elif cause is None and s.basis == "requests" and s.spikes is None:
        action = "insufficient_data"
        gaps, warm = s.v("gaps"), s.v("target_warmup_gaps")
        reasons.append(f"no ITL target yet to judge the {gaps or 0:,.0f} inter-token gaps by: one is derived from the "
                       + (f"first {warm:,.0f} gaps" if warm else "gaps once enough are seen")
                       + ", or give it (--itl-target-ms)")
        conf = min(conf, 0.2)
        _decided(s, "insufficient_data", "no ITL target yet")
    elif cause is None:
        action = "insufficient_data"
        reasons.append("no per-request token timings and no usable engine ITL histogram: cannot attribute")
        conf = min(conf, 0.2)
        _decided(s, "insufficient_data", "no spikes or cause weights to judge (no timings, no usable histogram)")
    elif cause == "unknown":
        action = "insufficient_data"
        reasons.append("token-gap spikes found but none matches a known signature (no preemption counter step, "
                       "no all-streams stall with a prefill): check the network path, GC pauses, the client")
        conf = min(conf, 0.4)
    elif cause == "prefill_interference":
        action, conf = _chunked(s, a, k_att, reasons, also, settings, conf)
    elif cause == "slow_decode":
        action = _slow_decode(s, reasons, settings)
    else:  # preemption
        action, mechanism, marginal, conf = _preemption(s, beta, beta_rank, a, k_att, reasons, also, settings, conf)

    _slots_keep_context(s, settings)
    # secondary causes worth a mention
    for c2, share in sorted(s.cause_shares.items(), key=lambda kv: -kv[1]):
        if c2 == cause or share < 0.2:
            continue
        extra = {"preemption": "admission", "prefill_interference": "chunked_prefill",
                 "slow_decode": "reduce_batch"}.get(c2)
        if extra and extra != action and extra not in also:
            also.append(extra)
            reasons.append(f"{share:.0%} of the weighed spikes are {c2.replace('_', ' ')}: "
                           f"also consider {extra.replace('_', ' ')}")

    tentative = action not in ("no_action", "insufficient_data") and conf < CONFIDENCE_FLOOR
    if tentative:
        reasons.insert(0, f"tentative: confidence {conf:.2f} < {CONFIDENCE_FLOOR:g}; " + _confirm(s, action))
    if s.evidence_hint:
        reasons.insert(0, s.evidence_hint)
    if action in ("swap", "recompute", "admission", "chunked_prefill", "reduce_batch"):
        reasons.append(FAIRNESS)
    reasons.extend(s.notes)
    # which gates decided, in order (kept with the numbers: every entry there says where it came from)
    s.n[DECIDED_BY] = Num(tuple(Decision(d["gate"], d["detail"]) for d in s.decided_by), "", "derived",
                          "gates in the order they decided")
    return Verdict(
        action=action,
        mechanism=mechanism,
        also=tuple(also),
        numbers={k: v.to_number() for k, v in s.n.items()},
        settings=tuple(settings.items),
        confidence=round(max(0.0, min(1.0, conf)), 3),
        marginal=marginal,
        reasons=tuple(reasons),
        tentative=tentative,
    )


def _slots_keep_context(s: Situation, settings: _Flags) -> None:
    """llama-server shares one KV cache among its slots when their number is left to it (each slot may
    use the whole -c) but splits -c evenly once --parallel is given (``-c 4096 --parallel 3``: three
    slots of 1,536, measured on the tier's build): a slot count alone would shrink every request's
    room. --kv-unified keeps the one shared cache, so no request that fitted before is refused."""
    seqs = s.settings_names.get(Setting.MAX_SEQS)
    unified = s.settings_names.get(Setting.KV_UNIFIED)
    if not unified or seqs != s.settings_names.get(Setting.PARALLEL):
        return
    n = settings.value(Setting.MAX_SEQS)
    if n is None:
        return
    settings.set(Setting.KV_UNIFIED, True,
                 f"with {seqs} given, llama-server splits -c evenly over the {n} slots (each gets -c / {n}); one "
                 "cache shared by all slots, as when their number is left to it, keeps each request's room at the "
                 "whole -c")


def _slow_decode(s: Situation, reasons: list[str], settings: _Flags) -> str:
    """A batch limit that meets the ITL target and serves the offered load, or none (docs/kv-science.md §8.2).

    A smaller batch takes a shorter step but generates fewer tokens per second (each step's fixed cost
    is shared by fewer sequences), so by Little's law a limit whose throughput is below the offered
    load (arrivals x mean output) queues the rest without bound. The engine's own scrapes say what each
    batch size took and generated (``decode_curve``); where every batch that meets the target generates
    less than the load, no engine flag helps: the verdict is ``scale_out``."""
    reasons.append("every stream's gaps rose together with no isolated outlier: the decode step itself is slow "
                   "(batch too large or context too long)")
    curve, lam, out, slo = s.v("decode_curve"), s.v("arrival_rate"), s.v("output_mean"), s.v("itl_slo")
    if curve and lam and out and slo:
        pts = sorted(curve, key=lambda p: float(p["running"]))
        demand = float(lam) * float(out)
        s.n["offered_tokens_per_s"] = Num(demand, "tokens/s", "derived",
                                          f"{float(lam):.2f} arrivals/s x {float(out):.0f} mean output tokens")
        load = (f"the traffic asks {float(lam):.2f} requests/s x {float(out):.0f} output tokens (mean of finished "
                f"requests) = {demand:,.0f} tokens/s")
        ok = [p for p in pts if float(p["itl_ms"]) <= float(slo) * 1e3]
        best = max(ok, key=lambda p: float(p["tokens_per_s"])) if ok else None
        serving = [p for p in ok if LOAD_HEADROOM * float(p["tokens_per_s"]) >= demand]
        if serving:
            p = max(serving, key=lambda p: float(p["running"]))
            n = max(1, math.floor(float(p["running"])))
            arith = (f"at ~{float(p['running']):.0f} running sequences the engine's mean step was "
                     f"{float(p['itl_ms']):.0f} ms (target {float(slo) * 1e3:.0f} ms) and it generated "
                     f"{float(p['tokens_per_s']):,.0f} tokens/s; {load} ({demand / float(p['tokens_per_s']):.0%} "
                     f"of it, <= {LOAD_HEADROOM:.0%})")
            settings.set(Setting.MAX_SEQS, n, arith + f"; {n} admitted")
            reasons.append(f"batch limit from the engine's own step per batch size: {arith}; the limit meets the "
                           "target and serves the load")
            return "reduce_batch"
        # the smallest measured batch from which every larger one missed the target: no batch at or above
        # it meets the target, and none below it generates more than the most measured up to it
        i = len(pts)
        while i > 0 and float(pts[i - 1]["itl_ms"]) > float(slo) * 1e3:
            i -= 1
        if i < len(pts):
            edge = pts[i]
            cap_tps = max(float(p["tokens_per_s"]) for p in pts[:i + 1])
            if cap_tps < demand:
                return _scale_out(s, reasons, pts, edge, cap_tps, best, demand, load, float(slo), float(out))
        reasons.append(f"{load}; the engine's measured batches leave open whether a limit both meets the "
                       f"{float(slo) * 1e3:.0f} ms target and serves it: re-measure the ITL p99 and the queue")
    else:
        reasons.append("the limit's throughput is not checked against the offered load: that needs the arrivals "
                       "and the engine's own scrapes (its running gauge, ITL histogram and generated tokens)")
    reasons.append("lower the concurrent sequence limit or scale out")
    ms = s.v("max_seqs_current")
    running = s.v("running_mean")
    # 3/4 of what actually runs: a limit far above the running batch binds nothing at 3/4 of itself
    base = min(ms, running) if ms and running else ms or running
    if base:
        what = "limit" if ms and base == ms else "mean running batch"
        n = max(1, int(base * 0.75))
        settings.set(Setting.MAX_SEQS, n, f"3/4 of the current {what} ({base:.0f}) ≈ {n}: a smaller batch "
                     "takes a shorter decode step; re-measure the ITL p99")
        reasons.append(f"start at 3/4 of the current {what} ({base:.0f}) "
                       "and re-measure the ITL p99")
    return "reduce_batch"


def _scale_out(s: Situation, reasons: list[str], pts: list[dict[str, float]], edge: dict[str, float],
               cap_tps: float, best: dict[str, float] | None, demand: float, load: str, slo: float,
               out: float) -> str:
    """No batch limit meets the ITL target and serves the load: the arithmetic, and what would."""
    line = (f"no batch limit meets the {slo * 1e3:.0f} ms ITL target and serves this load: {load}; the engine's "
            f"own scrapes: from ~{float(edge['running']):.0f} running sequences up its mean step was over the "
            f"target ({float(edge['itl_ms']):.0f} ms there, {float(pts[-1]['itl_ms']):.0f} ms at "
            f"~{float(pts[-1]['running']):.0f}), and no batch up to there generated more than {cap_tps:,.0f} tokens/s "
            f"({cap_tps / demand:.0%} of the load; a smaller batch generates less, its step's fixed cost shared "
            "by fewer sequences)")
    if best is not None:
        b_tps = float(best["tokens_per_s"])
        short = demand - b_tps
        line += (f"; a limit of {math.floor(float(best['running']))} (a {float(best['itl_ms']):.0f} ms step) "
                 f"generates {b_tps:,.0f} tokens/s, so {short:,.0f} tokens/s ({short / out:.1f} requests/s) "
                 "would queue without bound")
        replicas = math.ceil(demand / (LOAD_HEADROOM * b_tps))
        s.n["replicas_needed"] = Num(replicas, "", "derived",
                                     f"{demand:,.0f} tokens/s / ({LOAD_HEADROOM:.0%} of {b_tps:,.0f} tokens/s per "
                                     "replica within the target), rounded up")
        line += (f"; scale out to at least {replicas} replicas of this engine ({demand:,.0f} / "
                 f"({LOAD_HEADROOM:.0%} x {b_tps:,.0f}) tokens/s, rounded up), or make the step faster")
    else:
        line += (f"; even the smallest measured batch (~{float(pts[0]['running']):.0f}) took a "
                 f"{float(pts[0]['itl_ms']):.0f} ms step: make the step faster or scale out")
    reasons.append(line)
    reasons.append("a faster step: a faster GPU, more tensor parallelism, a smaller or quantized model; no engine "
                   "flag on this engine and hardware meets the target at this load, so none is emitted")
    _decided(s, "capacity", f"offered {demand:,.0f} tokens/s > {cap_tps:,.0f} tokens/s, the most any batch "
             f"up to ~{float(edge['running']):.0f} (from where the step passes {slo * 1e3:.0f} ms) generated")
    return "scale_out"


def _confirm(s: Situation, action: str) -> str:
    """What would confirm a low-confidence verdict before anyone changes a flag on it."""
    if s.basis == "aggregate":
        return ("confirm with per-request timings (--probe RATE, --capture or --proxy-listen): each stall then "
                "gets its own cause")
    if action == "chunked_prefill":
        return ("confirm that the stalls hit every running stream at once when a long prompt arrives "
                "(more traffic with long prompts, or the engine's step times)")
    if action in ("admission", "swap", "recompute"):
        return ("confirm that the stalls line up with preemption counter steps (a longer window, or vLLM's "
                "per-request preemption histogram)")
    return "confirm over a longer window with per-request timings before changing a flag"


def _decided(s: Situation, gate: str, detail: str) -> None:
    s.decided_by.append({"gate": gate, "detail": detail})


def _aggregate_churn(s: Situation, reasons: list[str]) -> float | None:
    """Churn read from counters alone: repeated preemption with KV pinned or a queue waiting.

    Without per-request timings nothing ties a stall to a preemption, but preemptions per completed
    request above the churn threshold, with the KV cache full or requests waiting, is admission's
    signature by itself (docs/kv-science.md §8). The confidence stays below what timings would give.
    """
    r_pre = s.v("preemptions_per_completed")
    if r_pre is None or r_pre <= cap.CHURN_R_PRE or not s.preempts:
        return None
    kv = s.v("kv_usage_max")
    if kv is None:
        kv = s.v("kv_usage")
    waiting = s.v("waiting")
    pinned = kv is not None and kv >= 0.95
    queued = waiting is not None and waiting > 0
    if not (pinned or queued):
        return None
    bits = [f"{r_pre:.2f} preemptions per completed request (> {cap.CHURN_R_PRE:g})"]
    if pinned:
        bits.append(f"KV usage up to {kv:.2f}")
    if queued:
        bits.append(f"{waiting:.0f} waiting")
    conf = 0.45 + (0.1 if pinned else 0.0) + (0.1 if queued else 0.0) + (0.1 if r_pre >= 0.5 else 0.0)
    _decided(s, "churn_counters", "; ".join(bits) + " — churn from the engine's counters alone")
    reasons.append("churn read from the engine's counters (no per-stream attribution): " + ", ".join(bits))
    return conf


def _chunked(s: Situation, a: float, k_att: float, reasons: list[str], also: list[str],
             settings: _Flags, conf: float) -> tuple[str, float]:
    action = "chunked_prefill"
    reasons.append("spikes hit every running stream at once when a long prompt is prefilled: prefill interference, "
                   "not an eviction problem (eviction policy: no change)")
    P = s.v("long_prompt_tokens")
    slo = s.v("itl_slo")
    t_dec = s.v("decode_step")
    if P and slo and t_dec:
        holds = s.budget_holds_decodes
        plan = chunking.plan_chunking(int(P), float(slo), float(t_dec), a, k_att,
                                      current_budget=s.v("batched_tokens_current"),
                                      rate=s.v("long_prompt_rate"), ttft_slo_s=s.v("ttft_slo"),
                                      decodes=s.v("running_mean") if holds else None,
                                      batch_peak=s.v("running_peak") if holds else None,
                                      multiple=_block_multiple(s))
        s.n["unchunked_step"] = Num(plan.unchunked_step_s, "s", "derived", f"t_dec + prefill of {int(P)} tokens")
        s.n["current_worst_step"] = Num(plan.current_worst_step_s, "s", "derived")
        if plan.spike_share is not None:
            s.n["spike_share"] = Num(plan.spike_share, "", "derived", "share of each stream's ITL samples on long steps")
            if plan.spike_share > 0.01:
                reasons.append(f"{plan.spike_share:.2%} of each stream's ITL samples land on a "
                               f"{plan.current_worst_step_s * 1e3:.0f} ms step (> 1 %), so p99 ITL ≈ that step")
        s.n["chunk_rows"] = Num([{"budget": r.budget, "worst_step_s": round(r.worst_step_s, 5), "steps": r.steps,
                                  "prefill_s": round(r.prefill_s, 5), "passes": r.passes,
                                  "holds_batch": r.holds_batch} for r in plan.rows
                                 if r.budget <= 4096], "", "derived")
        capped = [r for r in plan.rows if r.fits_step and not r.holds_batch]
        if capped and (plan.budget is None or capped[0].budget > plan.budget):
            peak, mean = s.v("running_peak"), s.v("running_mean")
            ran = " and ".join(([f"up to {float(peak):.0f} at once"] if peak is not None else [])
                               + ([f"{float(mean):.0f} on average"] if mean is not None else []))
            reasons.append(f"a budget of {capped[0].budget} tokens keeps each step within the target, but this engine "
                           f"counts decode tokens in it and holds no more sequences than it: it ran {ran}, so that "
                           "budget would also cap the batch below the traffic")
        if plan.budget is not None:
            row = next(r for r in plan.rows if r.budget == plan.budget)
            s.n["chunk_budget"] = Num(plan.budget, "tokens/step", "derived",
                                      f"largest round budget whose worst step <= {chunking.DEFAULT_MARGIN:.0%} under the SLO")
            s.n["chunk_worst_step"] = Num(row.worst_step_s, "s", "derived")
            s.n["chunk_steps"] = Num(row.steps, "", "derived")
            s.n["chunked_prefill_phase"] = Num(row.prefill_s, "s", "derived", "TTFT prefill phase with chunking")
            # chunking's known price: each chunk pays a step and re-reads the KV of the chunks before it
            cost = row.prefill_s - plan.unchunked_step_s
            s.n["chunked_ttft_cost"] = Num(cost, "s", "derived", f"TTFT a {int(P)}-token prompt pays for chunking")
            price = (f"the price is TTFT: a {int(P)}-token prompt's prefill grows {plan.unchunked_step_s * 1e3:.0f} -> "
                     f"{row.prefill_s * 1e3:.0f} ms ({cost * 1e3:+.0f} ms, {cost / plan.unchunked_step_s:+.0%})")
            settings.set(Setting.BATCHED_TOKENS, plan.budget,
                         f"a {int(P)}-token prompt in steps of {plan.budget} tokens: worst step "
                         f"{row.worst_step_s * 1e3:.1f} ms <= {1 - chunking.DEFAULT_MARGIN:.0%} of the "
                         f"{slo * 1e3:.0f} ms ITL target (unchunked {plan.unchunked_step_s * 1e3:.0f} ms); {price}")
            reasons.append(f"with {plan.budget} tokens per step the worst step is {row.worst_step_s * 1e3:.1f} ms "
                           f"(SLO {slo * 1e3:.0f} ms) in {row.steps} steps; {price}, which a contract without a "
                           "TTFT target does not judge (kvtop compare calls it a trade-off)")
        if plan.budget is None or plan.budget < int(P):
            _unthrottle_prefill(s, int(P), settings, reasons)
        if plan.budget is not None and settings.value(Setting.BATCHED_TOKENS) == plan.budget:
            _budget_holds_batch(s, settings)
        _chunking_on(s, settings, reasons)
        if plan.disaggregate:
            also.append("disaggregate")
            reasons.append("chunking cannot meet both the ITL and the TTFT target: disaggregate prefill/decode "
                           "or route long prompts to a prefill-heavy replica")
        elif plan.prefill_s is not None:
            reasons.append(f"if the TTFT target for these prompts is below ~{plan.prefill_s:.1f} s, "
                           "disaggregate prefill and decode instead")
    else:
        cur = s.v("batched_tokens_current")
        if cur is not None and float(cur) <= FALLBACK_BUDGET:
            # "lower it to 2048" would raise a smaller budget, and longer chunks stall longer
            reasons.append(f"the per-step prefill token budget is already {float(cur):.0f}: a lower one is sized from the "
                           "long prompts' length, the decode step and the ITL target, which this run lacks; no value "
                           "is given")
        else:
            reasons.append(f"lower the per-step prefill token budget (e.g. {FALLBACK_BUDGET} or less) and re-measure")
            if Setting.BATCHED_TOKENS in s.settings_names or s.engine is None:
                settings.set(Setting.BATCHED_TOKENS, FALLBACK_BUDGET, "a common chunk size (long prompt length, decode step "
                             "or ITL target unknown: not derived); re-measure the ITL p99")
                _budget_holds_batch(s, settings)
                _chunking_on(s, settings, reasons)
        conf = min(conf, 0.6)
    return action, conf


def _budget_holds_batch(s: Situation, settings: _Flags) -> None:
    """A token budget and a batch limit an engine whose budget counts decode tokens accepts together.

    vLLM refuses to start with ``--max-num-seqs`` above ``--max-num-batched-tokens`` (and, where none
    is given, lowers its default to the budget, capping the batch); llama.cpp's server aborts with
    ``--parallel`` above ``--batch-size``: a budget alone does not start a server whose batch limit
    is larger. The budget was chosen to hold the batch the engine was seen running
    (``chunking.plan_chunking``); where the engine's batch limit is known and larger, it is lowered to
    the budget with it, else the budget's why says so."""
    if not s.budget_holds_decodes:
        return
    flag = next((f for f in settings.items if f.setting == Setting.BATCHED_TOKENS), None)
    if flag is None or not isinstance(flag.value, int):
        return
    budget = flag.value
    seqs_flag = s.settings_names.get(Setting.MAX_SEQS) or "the batch limit"
    peak = s.v("running_peak")
    ran = f"; the engine ran at most {float(peak):.0f} sequences at once" if peak is not None else ""
    cur = s.v("max_seqs_current")
    if cur is not None:
        if float(cur) > budget:
            settings.set(Setting.MAX_SEQS, budget,
                         f"the engine will not start with a token budget of {budget} below its {seqs_flag} of "
                         f"{float(cur):.0f}; {budget} is the most sequences it then accepts{ran}")
        return
    note = f"the engine will not start with {seqs_flag} above {budget}: lower a larger one to {budget} too{ran}"
    settings.items = [replace(f, why=f"{f.why}; {note}") if f is flag else f for f in settings.items]


def _block_multiple(s: Situation) -> int | None:
    """The KV block size every token budget must be a multiple of, where the engine requires that."""
    bs = s.v("block_size")
    return int(bs) if s.budget_in_blocks and bs else None


def _chunking_on(s: Situation, settings: _Flags, reasons: list[str]) -> None:
    """A token budget below the longest prompt needs an engine that splits prompts over steps.

    vLLM refuses to start with a budget below --max-model-len without chunked prefill, TGI one below
    --max-input-tokens, and TensorRT-LLM rejects prompts longer than max_num_tokens unless
    enable_chunked_context is set. Where the run (or the scenario) says the engine does not chunk, or
    its adapter says it does not by default: the switch goes out with the budget where the engine has
    one of its own; where it has none (TGI: its attention backend decides), no budget goes out."""
    budget = settings.value(Setting.BATCHED_TOKENS)
    if not isinstance(budget, int):
        return
    state = s.n.get("chunked_current")
    on = bool(state.value) if state is not None else s.chunks_prefills
    if on is not False:
        return
    why = (f"the engine does not chunk prefills ({state.note or state.source})" if state is not None else
           "this engine does not chunk prefills unless told to")
    ctx = s.v("max_model_len_current")
    if ctx is not None and budget >= float(ctx):
        return  # a budget that holds the longest request in one step needs no chunking
    switch = s.settings_names.get(Setting.CHUNKED_PREFILL)
    if switch and switch != s.settings_names.get(Setting.BATCHED_TOKENS):
        settings.set(Setting.CHUNKED_PREFILL, True,
                     f"{why}: a budget of {budget} tokens per step needs it on (without it the engine refuses a budget "
                     "below its longest request at start, or rejects the longer prompts)")
        reasons.append(f"{why}: chunked prefill is switched on with the budget ({switch})")
        return
    settings.items = [f for f in settings.items if f.setting != Setting.BATCHED_TOKENS]
    reasons.append(f"{why}, and it has no switch kvtop can set: a budget of {budget} tokens per step below its longest "
                   "prompt would be refused (TGI: --max-batch-prefill-tokens below --max-input-tokens), so none is "
                   "given; an attention backend that chunks (TGI: flashinfer or flashdecoding) or disaggregated "
                   "prefill removes these stalls")


def _unthrottle_prefill(s: Situation, P: int, settings: _Flags, reasons: list[str]) -> None:
    """Requests waited in the engine's own queue longer than a whole long prompt's prefill, and no
    sequence was preempted (the KV cache had room): the per-step token budget throttles prefill.
    Chunking costs prefill throughput (each chunk re-reads the KV of the chunks before it and pays a
    step's fixed cost), so the budget that holds the long prompt in one step is prescribed; its
    prefill stall stays, which only disaggregation removes."""
    q, rate = s.v("engine_queue_p90"), s.v("prefill_rate")
    pre = s.v("preemptions_per_completed")
    if q is None or not rate or (pre is not None and float(pre) > 0):
        return
    whole = P / float(rate)
    if float(q) <= whole:
        return
    steps = chunking.ladder(_block_multiple(s))
    if not steps:
        return
    budget = next((b for b in reversed(steps) if b >= P), steps[0])
    cur = s.v("batched_tokens_current")
    if cur is not None and float(cur) >= budget:
        return  # the engine already holds such a prompt in one step: the queue is not the budget's
    held = (f"one step holds a {P}-token prompt (p99)" if budget >= P else
            f"{budget} tokens per step, the largest budget on kvtop's ladder, takes a {P}-token prompt (p99) in "
            f"{math.ceil(P / budget)} steps")
    settings.set(Setting.BATCHED_TOKENS, budget,
                 f"{held}: requests waited {float(q):.1f} s in the engine's queue "
                 f"(p90) without preemption, longer than that prompt's whole prefill at the measured "
                 f"{float(rate):.0f} tokens/s ({whole:.1f} s), so the budget throttles prefill"
                 + ("" if cur is not None else "; confirm the engine's current budget is below this"))
    reasons.append(f"prefill is throttled by the token budget: requests waited {float(q):.1f} s (p90) in the engine's "
                   f"own queue with no preemption, longer than a whole {P}-token prefill ({whole:.1f} s at "
                   f"{float(rate):.0f} tokens/s); chunking costs prefill throughput, so {budget} tokens per step "
                   + ("(one step per long prompt) " if budget >= P else f"({math.ceil(P / budget)} steps per long "
                      "prompt, the fewest kvtop prescribes) ")
                   + "lets the queue drain; the long prompt's own stall stays")


def _preemption(s: Situation, beta: Any, beta_rank: Any, a: float, k_att: float, reasons: list[str],
                also: list[str], settings: _Flags, conf: float) -> tuple[str, str | None, bool, float]:
    mechanism = None
    marginal = False
    gates_fail = False
    cost = None
    swap_settings: list[tuple[str, str | None, Any]] = []
    pool_why = ""
    if beta is None:
        reasons.append("KV bytes per token unknown (give --model-config or --kv-bytes-per-token): "
                       "swap vs recompute not evaluated")
        conf = min(conf, 0.5)
    bw = _link(s, beta_rank) if beta is not None else None

    if beta is not None and s.victims and s.deficit_bytes:
        name, rows = choose_victim(s.victims, s.deficit_bytes, beta)
        s.n["victims"] = Num(rows, "", "derived", "freed bytes count private tokens only")
        s.n["victim"] = Num(name, "", "derived")
        chosen = next(v for v in s.victims if v.name == name)
        s.n.setdefault("seq_tokens", Num(chosen.S, "tokens", "given"))
        s.n.setdefault("shared_tokens", Num(chosen.h_sh, "tokens", "given"))
        reasons.append(f"preempt victim {name}: it frees "
                       f"{next(r for r in rows if r['name'] == name)['freed_bytes'] / 1e6:.1f} MB of private KV")
    if beta is not None and s.prefix and bw:
        pp = prefix_policy(s.prefix["tokens"], s.prefix.get("reuse_rate", 0.0), beta_rank, bw, a, k_att)
        s.n["prefix_recompute"] = Num(pp["prefix_recompute_s"], "s", "derived")
        s.n["prefix_reload"] = Num(pp["prefix_reload_s"], "s", "derived")
        s.n["prefix_discard_cost"] = Num(pp["discard_cost_gpu_s_per_s"], "GPU-s/s", "derived")
        s.n["prefix_policy"] = Num(pp["policy"], "", "derived")
        reasons.append(f"shared prefix: recompute {float(pp['prefix_recompute_s']) * 1e3:.1f} ms per miss vs reload "
                       f"{float(pp['prefix_reload_s']) * 1e3:.1f} ms: keep or offload it, never discard")

    if beta is not None and s.v("seq_tokens") is not None and bw:
        x, cost = _event(s, beta, beta_rank, a, k_att, bw)
        s.n["freed_bytes"] = Num(cost.freed_bytes, "B", "derived", "GPU memory freed on all ranks (private tokens only)")
        s.n["bytes_moved"] = Num(cost.bytes_per_rank, "B", "derived", "per rank, one direction")
        s.n["bytes_moved_total"] = Num(cost.bytes_per_rank * x.ranks, "B", "derived", "all ranks")
        s.n["t_out"] = Num(cost.t_out, "s", "derived")
        s.n["t_in"] = Num(cost.t_in, "s", "derived")
        s.n["swap_gpu_s"] = Num(cost.c_swap, "s", "derived", f"κ={x.kappa:g}")
        s.n["swap_gpu_s_blocking"] = Num(cost.c_swap_blocking, "s", "derived", "κ=1")
        s.n["swap_gpu_s_if_all_resume"] = Num(x.kappa * (cost.t_out + cost.t_in), "s", "derived", "p = 0")
        s.n["recompute_gpu_s"] = Num(cost.c_rec, "s", "derived", "(1-p)·T_pf")
        if cost.c_swap_blocking > 0:
            s.n["swap_advantage_blocking"] = Num(cost.c_rec / cost.c_swap_blocking, "x", "derived",
                                                 "recompute GPU time / blocking swap GPU time")
        if cost.t_in > 0:
            s.n["resume_speedup"] = Num(cost.t_pf / cost.t_in, "x", "derived", "recompute resume / swap-in time")
        s.n["t_pf"] = Num(cost.t_pf, "s", "derived", "prefill of the evicted tokens")
        s.n["t_pf_attention"] = Num(cost.t_pf_attention, "s", "derived")
        s.n["p_star"] = Num(cost.p_star, "", "derived", "above p*, recompute is cheaper")
        s.n["break_even_tokens"] = Num(cost.break_even_tokens, "tokens", "derived",
                                       "below S*, recompute is cheaper")
        if cost.link_demand is not None:
            s.n["link_demand"] = Num(cost.link_demand, "B/s", "derived", "per rank: rate·V·(2-p)")
        if cost.tokens_per_iteration is not None:
            s.n["tokens_per_iteration"] = Num(cost.tokens_per_iteration, "tokens", "derived")
        s.n["gates"] = Num(cost.gates, "", "derived")
        mechanism = cost.mechanism
        gates_fail = not cost.swap_feasible
        marginal = cost.marginal(x.p, x.S)
        if mechanism == "swap":
            ratio = cost.c_rec / cost.c_swap if cost.c_swap > 0 else math.inf
            ratio_b = cost.c_rec / cost.c_swap_blocking if cost.c_swap_blocking > 0 else math.inf
            reasons.append(f"swap/offload: {cost.bytes_per_rank / 1e9:.3g} GB per rank moves in "
                           f"{cost.t_out * 1e3:.1f} ms each way; expected GPU time {cost.c_swap * 1e3:.2f} ms "
                           f"vs {cost.c_rec * 1e3:.1f} ms to recompute ({ratio:.0f}x cheaper, {ratio_b:.0f}x even blocking); "
                           f"resume {cost.t_in * 1e3:.0f} ms vs >= {cost.t_pf * 1e3:.0f} ms")
        else:
            failing = {k for k, v in cost.gates.items() if v is False}
            why = "; ".join([m for m in cost.gate_notes if m.split(":", 1)[0] in failing][:2]) if gates_fail else (
                f"recompute {cost.c_rec * 1e3:.1f} ms vs swap {cost.c_swap * 1e3:.1f} ms GPU time, "
                f"swap resume {cost.t_in * 1e3:.1f} ms vs recompute {cost.t_pf * 1e3:.1f} ms")
            reasons.append(f"recompute: {why}")
            if gates_fail and cost.c_swap < cost.c_rec:
                reasons.append("swap would be cheaper on GPU time but fails a feasibility gate")
        if cost.p_star is not None and x.p > 0:
            reasons.append(f"cancel probability p = {x.p:.2f} vs break-even p* = {cost.p_star:.2f}")
        if marginal:
            reasons.append("marginal: within ±30 % of a break-even; measure α, BW and ρ on this host before changing")
        if mechanism == "swap" and not gates_fail and s.n["prefill_rate"].low:
            hi = _event(s, beta, beta_rank, a / LOW_RHO_FACTOR, k_att, bw)[1]
            if hi.mechanism != "swap":
                marginal = True
                reasons.append(f"marginal: swap wins only at ρ = {1.0 / a:,.0f} tokens/s, a low estimate (prompt tokens "
                               f"/ TTFT); at {LOW_RHO_FACTOR:g}x that, recompute costs {hi.c_rec * 1e3:.1f} ms vs swap "
                               f"{hi.c_swap * 1e3:.1f} ms: measure ρ with kvtop's witness (docs/witness.md) "
                               "before changing")
        if gates_fail:
            failed = [k for k, v in cost.gates.items() if v is False]
            why_failed = [m for m in cost.gate_notes if m.split(":", 1)[0] in failed]
            _decided(s, "feasibility", f"swap infeasible ({', '.join(failed)}): "
                     + "; ".join(why_failed[:2]) + " -> recompute")
        elif mechanism == "swap":
            _decided(s, "cost", f"swap {cost.c_swap * 1e3:.2f} ms GPU < recompute {cost.c_rec * 1e3:.1f} ms and "
                     f"resume {cost.t_in * 1e3:.0f} ms <= {cost.t_pf * 1e3:.0f} ms")
        else:
            _decided(s, "cost", f"recompute {cost.c_rec * 1e3:.1f} ms GPU vs swap {cost.c_swap * 1e3:.1f} ms, "
                     f"resume {cost.t_pf * 1e3:.0f} ms vs swap-in {cost.t_in * 1e3:.0f} ms")
        if mechanism == "swap":
            per_seq = float(cost.bytes_total or cost.bytes_per_rank * x.ranks)
            peak_v = s.v("preempted_peak")
            if peak_v:
                peak = max(1, int(math.ceil(float(peak_v))))
                peak_what = f"the measured peak of {peak} concurrently preempted sequence(s)"
            else:
                peak = DEFAULT_POOL_SEQS
                s.n["preempted_peak"] = Num(peak, "sequences", "assumed",
                                            "concurrently preempted sequences (peak not measured)")
                peak_what = f"{peak} concurrently preempted sequences (assumed: the peak was not measured)"
            want = peak * per_seq
            limit, what = _host_limit(s)
            pool = want
            note = f"room for {peak} preempted sequence(s) of this size (all ranks)"
            pool_why = (f"{peak_what} × {per_seq / 1e9:.3g} GB per sequence (all ranks) = {want / 1e9:.3g} GB")
            if limit is not None and want > limit:
                # never recommend a pool the host cannot pin: as many whole sequences as fit
                fit = math.floor(limit / per_seq) if per_seq > 0 else 0
                pool = fit * per_seq
                note = f"{fit} sequence(s): the {what} ({limit / 1e9:.3g} GB) bounds the pool"
                pool_why = (f"{fit} whole sequence(s) of {per_seq / 1e9:.3g} GB: the {what} ({limit / 1e9:.3g} GB) "
                            f"bounds the pool below {peak_what}")
                reasons.append(f"host memory: {peak} sequences need {want / 1e9:.3g} GB but only "
                               f"{limit / 1e9:.3g} GB ({what}) is free; the pool holds {fit}")
                if fit < peak:
                    marginal = True
            device_pool = s.v("kv_pool_bytes") or (float(s.v("kv_capacity_tokens")) * beta
                                                    if s.v("kv_capacity_tokens") and beta else None)
            tier = swapimpl.settings_for(s.swap_impl or s.host_tier, pool, x.ranks, s.settings_names,
                                         device_pool_total_bytes=device_pool, host_limit_bytes=limit)
            swap_settings = tier.settings
            reasons.extend(tier.notes)
            if _is_v1_connector(s):
                reasons.append(V1_CONNECTOR)
                hit, seq = s.v("resume_hit_tokens"), s.v("seq_tokens")
                if hit is not None and seq:
                    by = ("measured by the engine's witness" if s.n["resume_hit_tokens"].source == "measured"
                          else s.n["resume_hit_tokens"].source)
                    reasons.append(f"a resumed request finds {float(hit):,.0f} of its ~{float(seq):,.0f} tokens again "
                                   f"without recompute ({by}: its prefix cache); the pool pays off only by what "
                                   "it reloads of the rest")
                ver = str(s.v("engine_version") or "")
                if s.basis != "given" and s.v("device_total_bytes") is None and not ver.startswith(SIM_ENGINE_VERSION):
                    # a recorded run of a real engine without GPU records
                    reasons.append(V1_CONNECTOR_NO_GPU)
            s.n["offload_pool"] = Num(pool, "B", "derived", note)
            if limit is not None:
                s.n["host_limit"] = Num(limit, "B", s.n["host_free_bytes"].source if what == "free pinned" and
                                        "host_free_bytes" in s.n else "given", what)
    else:
        if beta is not None:
            reasons.append("sequence length at preemption unknown: swap vs recompute not evaluated")

    # churn / abandonment -> admission (rule 6)
    ch = cap.churn_assessment(
        s.v("preemptions_per_completed"), s.v("preemptions_per_preempted"), s.v("cancel_prob"),
        S_pre=s.v("seq_tokens"), prompt_mean=s.v("prompt_mean"), a=a, k_att=k_att, beta=beta,
        h_res=float(s.v("resume_hit_tokens") or 0.0),
    )
    if ch.lost_share is not None and s.v("preemptions_per_completed") is not None:
        s.n["lost_after_work_share"] = Num(ch.lost_share, "", "derived", "preempted-then-cancelled per completed")
    if ch.churn and ch.wasted_per_completed_s is not None:
        s.n["recompute_per_event"] = Num(ch.recompute_per_event_s, "s", "derived")
        s.n["wasted_per_completed"] = Num(ch.wasted_per_completed_s, "s", "derived")
        if ch.useful_prefill_s is not None:
            s.n["useful_prefill"] = Num(ch.useful_prefill_s, "s", "derived")
        if ch.overhead is not None:
            s.n["churn_overhead"] = Num(ch.overhead, "", "derived", "wasted recompute / useful prefill")
        if ch.swap_bytes_per_event is not None:
            s.n["swap_bytes_per_event"] = Num(ch.swap_bytes_per_event, "B", "derived", "out + in")
    admission = ch.churn or ch.abandonment or (gates_fail and bool(s.v("gates_fail_persistently")))
    if admission:
        grounds: list[str] = []
        if ch.churn:
            grounds.append(f"churn (r_pre {ch.r_pre if ch.r_pre is not None else float('nan'):.3g} > {cap.CHURN_R_PRE:g}"
                       + (f", k̄ {ch.k_bar:.2g} > {cap.CHURN_KBAR:g}" if ch.k_bar is not None and ch.k_bar > cap.CHURN_KBAR
                          else "") + ")")
        if ch.abandonment:
            grounds.append(f"abandonment (p {ch.p:.2f} >= {cap.ABANDON_P:g})")
        if gates_fail and s.v("gates_fail_persistently"):
            grounds.append("swap gates fail persistently")
        _decided(s, "admission", "; ".join(grounds) + " -> admission takes priority over the mechanism")
    plan = None
    c_kv = s.v("kv_capacity_tokens")
    if c_kv is None and s.v("kv_pool_bytes") and beta:
        c_kv = s.v("kv_pool_bytes") / beta
        s.n["kv_capacity_tokens"] = Num(c_kv, "tokens", "derived", "KV pool bytes / β")
    if c_kv and s.v("prompt_mean") is not None and s.v("output_mean") is not None and s.v("output_p90") is not None:
        req90 = s.v("request_tokens_p90")
        plan = cap.capacity_plan(float(c_kv), float(s.v("prompt_mean")), float(s.v("output_mean")),
                                 float(s.v("output_p90")), None if req90 is None else float(req90))
        s.n["n_floor"] = Num(plan.n_floor, "sequences", "derived",
                             f"C_KV/({plan.seq_what}): almost no preemption")
        s.n["n_ceiling"] = Num(plan.n_ceiling, "sequences", "derived", "C_KV/(P̄ + Ō/2): mean occupancy")
    if admission:
        action = "admission"
        if ch.churn:
            bits = []
            if ch.r_pre is not None:
                bits.append(f"{ch.r_pre:.2f} preemptions per completed request")
            if ch.k_bar is not None:
                bits.append(f"{ch.k_bar:.1f} preemptions per preempted request")
            reasons.insert(0, "churn: " + ", ".join(bits) + " — neither swap nor recompute fixes repeated "
                           "preemption; admit fewer sequences")
            if ch.wasted_per_completed_s is not None and ch.useful_prefill_s:
                reasons.insert(1, f"recompute wastes {ch.wasted_per_completed_s * 1e3:.1f} ms per completed request "
                               f"vs {ch.useful_prefill_s * 1e3:.1f} ms useful prefill ({ch.overhead:.0%} overhead)")
        if ch.abandonment:
            reasons.insert(0, f"abandonment: {ch.p:.0%} of preempted requests are cancelled before resuming"
                           + (f" (≈{ch.lost_share:.1%} of requests lost after consuming work)" if ch.lost_share else ""))
        if plan is not None:
            _admission_limit(s, plan, settings, reasons)
        else:
            missing = [w for k, w in (("kv_capacity_tokens", "the KV capacity in tokens"),
                                      ("prompt_mean", "the mean prompt length"),
                                      ("output_mean", "the mean output length"),
                                      ("output_p90", "the output p90")) if s.v(k) is None and not
                       (k == "kv_capacity_tokens" and c_kv)]
            reasons.append("no concurrency limit computed: it is sized from the KV capacity and the measured "
                           "sequence sizes, and this run lacks " + ", ".join(missing))
        _length_bound(s, settings, reasons)
        out99 = s.v("output_p99")
        reasons.append("cap max_tokens (a request parameter) near the real p99 output"
                       + (f" ({float(out99):.0f} tokens)" if out99 is not None else "")
                       + " and reserve KV for interactive traffic")
        if mechanism:
            also.append(mechanism)
    else:
        action = mechanism or "recompute"
    if mechanism == "swap":
        # the mechanism's settings go out with the verdict whether it leads or follows admission
        for key, flag, value in swap_settings:
            settings.put(key, flag, value, pool_why if "size" in key or key == "swap_space" else
                         "enables the host KV tier that holds the preempted sequences")
    return action, mechanism, marginal, conf


V1_CONNECTOR = ("on vLLM V1 \"swap\" is the KV offloading connector, not live-sequence swapping (V1 preempts by "
                "recompute): it stores computed KV blocks in the host pool, and a preempted request reloads them "
                "on resume instead of recomputing only if prefix caching is on, the blocks were full (partial "
                "blocks are recomputed) and they are still resident in the pool when it resumes")


# vLLM 0.32 on CPU, started with --kv-offloading-size, exits with this (the tier's engine, 2026-12-02)
V1_CONNECTOR_NO_GPU = ("kvtop saw no GPU in this run: the offloading connector needs a CUDA or XPU GPU (vLLM 0.32 on CPU "
                       "refuses to start with --kv-offloading-size: \"CPU Offloading is currently only supported on "
                       "CUDA-alike and XPU GPUs\"); confirm the engine runs on a GPU before applying")


def _is_v1_connector(s: Situation) -> bool:
    if s.swap_impl is not None:
        return s.swap_impl in ("vllm_v1_offload", "lmcache")
    return s.engine == "vllm"


def _admission_limit(s: Situation, plan: cap.Capacity, settings: _Flags, reasons: list[str]) -> None:
    """The concurrency limit from the KV capacity and the measured sequence sizes, with the arithmetic."""
    n = plan.recommended_max_seqs
    arith = (f"{plan.c_kv_tokens:,.0f} KV tokens / ~{plan.seq_tokens:,.0f} tokens per sequence "
             f"({plan.seq_what}) ≈ {plan.n_floor:.1f} sequences without preemption; at mean occupancy "
             f"(~{plan.mean_tokens:,.0f} tokens) ≈ {plan.n_ceiling:.1f}")
    cancel = s.n.get("cancel_prob")
    if (cancel is not None and cancel.source == "measured" and float(cancel.value) >= ABANDON_CANCEL_PROB
            and math.floor(plan.n_ceiling) > n):
        n = math.floor(plan.n_ceiling)
        arith += (f"; clients abandoned {float(cancel.value):.0%} of preempted requests and would abandon queued "
                  f"ones as well, so the limit is the mean-occupancy ceiling")
    cur = s.v("max_seqs_current")
    if cur is not None and n > float(cur):
        reasons.append(f"capacity: {arith}; the current limit {float(cur):.0f} is already lower, so the limit is "
                       "not what lets too many sequences in: look at the output lengths (a few very long outputs "
                       "outgrow any limit) and reserve KV")
        return
    reasons.append(f"capacity: {arith}; start at {n} and steer to KV usage p99 <= 0.9 and <= 0.01 "
                   "preemptions per request")
    wait = _queue_cost(s, plan, n, reasons)
    larger = _kv_capacity(s, plan, wait, settings, reasons) if wait is not None else None
    if larger is None:
        if _under_budget(s, n, reasons):
            settings.set(Setting.MAX_SEQS, n, arith + f"; {n} admitted")
        return
    # the larger cache holds the peak: the limit is recomputed on it and stays only as a safety bound
    n2 = larger.recommended_max_seqs
    if cur is not None and n2 > float(cur):
        reasons.append(f"with the larger KV cache the limit would be {n2}, above the current {float(cur):.0f}: "
                       "the current limit stays")
        return
    if not _under_budget(s, n2, reasons):
        return
    settings.set(Setting.MAX_SEQS, n2,
                 f"a safety bound on the larger KV cache: {larger.c_kv_tokens:,.0f} KV tokens / ~"
                 f"{larger.seq_tokens:,.0f} tokens per sequence ≈ {larger.n_floor:.1f} sequences without "
                 f"preemption, at mean occupancy ≈ {larger.n_ceiling:.1f}; {n2} admitted (not {n}: the cache "
                 "now holds the peak, so the limit no longer has to queue it)")


def _under_budget(s: Situation, n: int, reasons: list[str]) -> bool:
    """Whether a batch limit of ``n`` can go out beside the engine's known token budget: where that
    budget holds every decode token (vLLM V1) the engine runs no more sequences than it, so a larger
    limit binds nothing, and vLLM refuses to start with --max-num-seqs above --max-num-batched-tokens."""
    budget = s.v("batched_tokens_current")
    if not s.budget_holds_decodes or budget is None or n <= float(budget):
        return True
    flag = s.settings_names.get(Setting.MAX_SEQS) or "the batch limit"
    bflag = s.settings_names.get(Setting.BATCHED_TOKENS) or "the token budget"
    reasons.append(f"a limit of {n} sequences is not given: the engine's token budget ({bflag} {float(budget):.0f}) "
                   f"already holds its batch to at most {float(budget):.0f} sequences, so {n} would bind nothing "
                   f"(and vLLM refuses {flag} above {bflag})")
    return False


def _queue_cost(s: Situation, plan: cap.Capacity, n: int, reasons: list[str]) -> float | None:
    """What the limit costs in time to first token: a burst of the peak in-flight requests admitted
    ``n`` at a time waits for (peak / n - 1) request lifetimes (output at the decode step) at its end."""
    peak, out, step = s.v("inflight_peak"), s.v("output_mean"), s.v("decode_step")
    if not (peak and out and step) or float(peak) <= n:
        return None
    life = float(out) * float(step)
    wait = (float(peak) / n - 1.0) * life
    s.n["queue_wait_est"] = Num(wait, "s", "derived",
                                f"({float(peak):.0f} in flight / {n} admitted - 1) x {life:.1f} s per request")
    line = (f"queueing: up to {float(peak):.0f} requests were in flight at once; admitted {n} at a time, the last of "
            f"such a burst waits about ({float(peak):.0f}/{n} - 1) x {life:.1f} s (a request's {float(out):.0f} "
            f"tokens at the {float(step) * 1e3:.1f} ms decode step) = {wait:.1f} s more for its first token")
    if plan.n_floor < float(peak):
        line += (f"; the KV cache holds {plan.n_floor:.1f} sequences of this traffic, so more KV capacity (memory "
                 "for the cache, or a smaller model footprint) is the fix that does not queue")
    reasons.append(line)
    return wait


def _kv_capacity(s: Situation, plan: cap.Capacity, wait: float, settings: _Flags,
                 reasons: list[str]) -> cap.Capacity | None:
    """More KV capacity instead of a queue: where the cache holds fewer sequences of this traffic than
    were in flight and the admission limit would make requests wait materially, size the cache for the
    peak (peak in flight x the capacity plan's sequence size in whole blocks x KV bytes per token) and
    prescribe it as the engine's own flag, where the device has the room. Returns the capacity plan on
    the larger cache when prescribed (the admission limit is recomputed on it), else None."""
    peak = s.v("inflight_peak")
    if not peak or plan.n_floor >= float(peak):
        return None
    life = float(s.v("output_mean")) * float(s.v("decode_step"))
    ttft, itl = s.v("ttft_slo"), s.v("itl_slo")
    if ttft:
        material, crit = wait > float(ttft), f"the {float(ttft) * 1e3:.0f} ms TTFT target"
    elif itl:
        budget = TTFT_PER_ITL * float(itl)
        material, crit = wait > budget, (f"a {budget * 1e3:.0f} ms time to first token ({TTFT_PER_ITL:g}x the "
                                         f"{float(itl) * 1e3:.0f} ms ITL target; no TTFT target given)")
    else:
        material, crit = wait > life, (f"one request's own lifetime ({life:.1f} s): the last of a burst would wait "
                                       "longer than it is served (no TTFT or ITL target given)")
    if not material:
        return None
    c_kv = plan.c_kv_tokens
    cur_bytes, cur_util = s.v("kv_cache_bytes_current"), s.v("gpu_memory_current")
    if cur_bytes:
        beta, beta_what = float(cur_bytes) / c_kv, "the engine's KV bytes / its KV tokens"
    elif s.v("kv_bytes_per_token_rank"):
        beta, beta_what = float(s.v("kv_bytes_per_token_rank")), "KV bytes per token per GPU"
    else:
        reasons.append("more KV capacity not sized: KV bytes per token unknown (give --model-config or "
                       "--kv-bytes-per-token)")
        return None
    now = float(cur_bytes) if cur_bytes else c_kv * beta
    want_seqs = math.ceil(float(peak))
    bs = s.v("block_size")
    seq = math.ceil(plan.seq_tokens / bs) * int(bs) if bs else math.ceil(plan.seq_tokens)
    want = want_seqs * seq * beta
    value = math.ceil(want / _MIB) * _MIB
    if value <= now:
        return None
    extra = value - now
    arith = (f"{want_seqs} requests in flight at the peak × {seq:,} tokens per sequence ({plan.seq_what}"
             + (f", in whole {int(bs)}-token blocks" if bs else "") + f") × {beta:,.0f} B per token ({beta_what})"
             f" = {_bytes(want)} per GPU, rounded up to whole MiB: {value:,} B ({value / now:.1f}x the "
             f"{now:,.0f} B the cache has now)")
    s.n["kv_capacity_needed"] = Num(value, "B", "derived", "KV cache per GPU that holds the peak in flight")
    # the room the device has: NVML's free GPU memory, else (kvtop saw no GPU) the host's available
    # memory, where a CPU engine keeps its KV cache
    room, room_what = s.v("device_free_bytes"), "GPU memory free (NVML, least over the run)"
    # kvtop's simulator models a GPU engine whose device kvtop cannot see: the host row beside it is
    # the laptop's, not its KV's room
    simulated = str(s.v("engine_version") or "").startswith(SIM_ENGINE_VERSION)
    if room is None and s.v("host_available_bytes") is not None and not simulated:
        room, room_what = s.v("host_available_bytes"), "host memory available (kvtop saw no GPU: a CPU engine's KV)"
    ranks = int(s.v("ranks") or 1) if room_what.startswith("host") else 1
    confirm = None
    if room is None:
        confirm = (f"the device's free memory is unknown (no NVML record): confirm {_bytes(extra)} more per GPU "
                   "is free before applying")
    elif extra * ranks > KV_HEADROOM_SHARE * float(room):
        reasons.append(f"more KV capacity: {arith}; it needs {_bytes(extra * ranks)} more but only "
                       f"{_bytes(float(room))} is {room_what} (at most {KV_HEADROOM_SHARE:.0%} of it is "
                       "used): not prescribed; a device with more memory, a smaller model or a narrower KV dtype "
                       "would hold the peak")
        return None
    head = (f"; {confirm}" if confirm else
            f"; {_bytes(extra * ranks)} more fits in the {_bytes(float(room))} {room_what}")
    why = arith + head
    total = s.v("device_total_bytes")
    if (not cur_bytes and cur_util and total and Setting.GPU_MEMORY in s.settings_names):
        # the engine sizes its cache by its memory share: raise that share by the extra bytes
        util = math.ceil((float(cur_util) + extra / float(total)) * 100) / 100
        if util > 1.0:
            reasons.append(f"more KV capacity: {arith}; the memory share would exceed 1.0 ({util:.2f}): not prescribed")
            return None
        settings.set(Setting.GPU_MEMORY, util, why + f"; {float(cur_util):.2f} + {_bytes(extra)} / "
                     f"{_bytes(float(total))} per GPU, rounded up to 0.01")
    elif Setting.KV_CACHE_BYTES in s.settings_names or s.engine is None:
        settings.set(Setting.KV_CACHE_BYTES, value, why)
    else:
        share = s.settings_names.get(Setting.GPU_MEMORY)
        reasons.append(f"more KV capacity: {arith}; " + (
            f"raise {share} by {_bytes(extra)} / the GPU's memory: "
            + ("its current value is" if total else "its current value and the GPU's total are")
            + " not known here, so no value is given"
            if share else "this engine's adapter names no KV-size flag: give the engine that much more memory "
            "for its cache"))
        return None
    reasons.append(f"more KV capacity instead of a queue: the limit's queue ({wait:.1f} s) exceeds {crit}; {arith}"
                   + head + "; the admission limit stays as a safety bound on the larger cache")
    if confirm:
        reasons.insert(0, "to confirm before applying: " + confirm)
    req90 = s.v("request_tokens_p90")
    return cap.capacity_plan(value / beta, float(s.v("prompt_mean")), float(s.v("output_mean")),
                             float(s.v("output_p90")), None if req90 is None else float(req90))


def _length_bound(s: Situation, settings: _Flags, reasons: list[str]) -> None:
    """A per-request length bound only where it admits every request the trace served.

    vLLM's --max-model-len (SGLang --context-length, TGI --max-total-tokens) bounds prompt + output of
    one request; it must not fall below the longest request observed, else it rejects the traffic.
    """
    if Setting.CTX not in s.settings_names and s.engine is not None:
        return
    longest = s.v("request_tokens_max")
    p99 = s.v("request_tokens_p99")
    name = s.settings_names.get(Setting.CTX) or "the per-request length bound"
    if longest is None:
        reasons.append(f"no {name} bound: the run has no per-request prompt + output sizes, and a bound below the "
                       "longest request rejects it")
        return
    if p99 is not None:
        p99 = min(float(p99), float(longest))
    bound = int(math.ceil(float(longest) / LENGTH_ROUND) * LENGTH_ROUND)
    cur = s.v("max_model_len_current")
    if cur is not None and bound > float(cur):
        return  # the engine served this traffic under its current bound: a larger one changes nothing
    settings.set(Setting.CTX, bound,
                 f"bounds prompt + output of one request: the longest request seen had {float(longest):,.0f} "
                 + (f"(p99 {float(p99):,.0f}) " if p99 is not None else "")
                 + f"tokens (its prompt and the output it was served, requests cancelled or unfinished included), "
                 f"rounded up to {LENGTH_ROUND}")
