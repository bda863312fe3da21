"""Measured cost-model inputs from what an analysis saw (its ``AnalysisState``), each with its source.

``measured`` means read from this trace's records; ``config`` from the model geometry (a
--model-config file or the built-in table); ``given`` from the command line; ``assumed`` a
documented default (docs/kv-science.md §12) used because the trace did not show it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvtop.analysis.advice import versions
from kvtop.analysis.advice.advisor import DEFAULT_RHO
from kvtop.analysis.advice.kvbytes import Geometry, geometry_from_config, kv_bytes_per_token, lookup_model
from kvtop.analysis.advice.situation import Num, Situation
from kvtop.analysis.attribution import Cause
from kvtop.analysis.state import AnalysisState
from kvtop.analysis.tally import Tally
from kvtop.model.sanitize import positive_whole

MIN_SAMPLES = 5  # fewer observations than this: fall back to an assumed value
MIN_COMPUTE_STEPS = 3  # witnessed prompt/recompute steps a measured prefill rate needs


def _delta(first: Mapping[str, Any], last: Mapping[str, Any], key: str) -> float | None:
    a, b = first.get(key), last.get(key)
    if a is None or b is None:
        return None
    return float(b - a if b >= a else b)


def counters_delta(firsts: Mapping[Any, Mapping[str, Any]], lasts: Mapping[Any, Mapping[str, Any]],
                   key: str) -> float | None:
    """A counter's increase from each engine's first scrape to its last, summed over the engines."""
    tot = None
    for k, first in firsts.items():
        d = _delta(first, lasts[k], key)
        if d is not None:
            tot = (tot or 0.0) + d
    return tot


def sum_delta(st: AnalysisState, key: str) -> float | None:
    return counters_delta(st.tally.engine_first, st.tally.engine_last, key)


def prefix_served(firsts: Mapping[Any, Mapping[str, Any]],
                  lasts: Mapping[Any, Mapping[str, Any]]) -> tuple[float, float] | None:
    """(prompt tokens the engines' prefix caches served, prompt tokens they were asked for) between
    each engine's first and last scrape; None where the engines count neither or were asked for none."""
    hits = counters_delta(firsts, lasts, "prefix_hits_total")
    queries = counters_delta(firsts, lasts, "prefix_queries_total")
    if hits is None or not queries:
        return None
    return hits, queries


def _peak_overlap(spans: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (a sweep over starts and ends; an end at t closes
    before a start at t opens)."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    peak = cur = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    return peak


def _scraped_limits(acc: Tally) -> dict[str, Any]:
    """The limits the engines' own interfaces stated at their latest scrape (``EngineRecord.limits``);
    with several engines, the largest of each (a prescription must hold on every one)."""
    out: dict[str, Any] = {}
    for last in acc.engine_last.values():
        lim = last.get("limits")
        if not isinstance(lim, dict):
            continue
        for k, v in lim.items():
            if positive_whole(v) is not None and (k not in out or v > out[k]):
                out[k] = v
    return out


def build_situation(st: AnalysisState, model_config: dict[str, Any] | None = None, kv_bytes: float | None = None,
                    dtype: str = "bf16", tp: int = 1) -> Situation:
    s = Situation(preempts=st.preempts, basis="requests")
    n = s.n
    acc = st.tally
    hdr = st.header or {}
    eng = hdr.get("engine") or {}
    model_name = eng.get("model")
    if not model_name:
        for last in acc.engine_last.values():
            if last.get("model"):
                model_name = last["model"]
                break
    # KV bytes per token: command line > model config > trace header > built-in table
    geo: Geometry | None = None
    if model_config is not None:
        geo = geometry_from_config(model_config)
    else:
        hit = lookup_model(model_name)
        if hit:
            geo = geometry_from_config(hit[1])
            n["model_key"] = Num(hit[0], "", "config", f"built-in table entry for {model_name!r}")
    if kv_bytes:
        n["kv_bytes_per_token_rank"] = Num(float(kv_bytes), "B/token", "given")
    elif geo is not None and model_config is not None:
        n["kv_bytes_per_token_rank"] = Num(kv_bytes_per_token(geo, dtype, tp), "B/token", "config", f"{dtype}, TP={tp}")
    elif (hdr.get("kv") or {}).get("bytes_per_token"):
        n["kv_bytes_per_token_rank"] = Num(float(hdr["kv"]["bytes_per_token"]), "B/token", "measured", "trace header")
    elif geo is not None:
        n["kv_bytes_per_token_rank"] = Num(kv_bytes_per_token(geo, dtype, tp), "B/token", "config",
                                           f"built-in table, {dtype}, TP={tp}")
    if "kv_bytes_per_token_rank" in n:
        n["kv_bytes_per_token"] = Num(n["kv_bytes_per_token_rank"].value * tp, "B/token",
                                      n["kv_bytes_per_token_rank"].source, f"TP={tp}")
    n["ranks"] = Num(tp, "", "given" if tp != 1 else "assumed")
    # the engine's latest records, else the trace header (`record` writes the first scrape's there)
    ver = versions.engine_version(next((str(d["version"]) for d in acc.engine_last.values() if d.get("version")),
                                       eng.get("version") if isinstance(eng.get("version"), str) else None))
    if ver is not None:
        n["engine_version"] = ver
    if geo is not None and geo.k_att is not None:
        n["k_att"] = Num(geo.k_att, "1/token", "config")

    # ITL target and decode step
    if st.itl_target_s:
        n["itl_target"] = Num(st.itl_target_s, "s", "given" if st.target_source == "given" else "measured",
                              st.target_source)
        n["itl_slo"] = Num(st.itl_target_s, "s", n["itl_target"].source)
    med = st.median_gap
    if med:
        n["decode_step"] = Num(med, "s", "measured", "median inter-token gap")

    # prefill rate: the engine's marginal rate where its witness logged the steps (PrefillCompute),
    # else a fit of the engine's own per-request times against prompt length where prompts varied
    # (its rate at a prompt's start and its attention coefficient, measured on this hardware: ahead
    # of the model's configured geometry), else the engine's own per-request figure (prompt tokens /
    # its TTFT, the figure attribution uses: a low estimate, so a chunk budget sized on it errs
    # small, and far too low where a step's fixed cost fills the TTFT of short prompts: 3-21x under
    # the witness on recompute storms), else from prefill stalls (stall length per prompt token of
    # the request that ended it; under chunked prefill a stall is one chunk of the prompt, so this
    # overstates the rate), else from TTFT of the least contended long-prompt requests (low again:
    # queueing and other prompts are in a TTFT)
    pa = sorted(acc.prefill_a)
    ert = st.engine_request_times
    if ert is not None and ert.requests and ert.queue_s_p90 is not None:
        n["engine_queue_p90"] = Num(ert.queue_s_p90, "s", "measured",
                                    f"p90 of the engine's own queue time of {ert.requests} requests")
    # what a resume finds again instead of recomputing (the cost model's h_res), where the engine's
    # witness reported it: its prefix cache's full blocks of the victim (or a KV connector's load)
    rc = st.resume_costs
    if rc is not None and rc.resumes:
        n["resume_hit_tokens"] = Num(rc.restored_tokens / rc.resumes, "tokens", "measured",
                                     f"mean of {rc.resumes} resumes by the engine's witness: {rc.restored_tokens} "
                                     f"positions had again without compute, {rc.recomputed_tokens} recomputed")
    pc = st.prefill_compute
    if pc is not None and pc.steps >= MIN_COMPUTE_STEPS and pc.tokens_per_s:
        n["prefill_rate"] = Num(pc.tokens_per_s, "tokens/s", "measured",
                                f"engine's witness: {pc.tokens} prompt and recompute tokens in {pc.steps} steps, "
                                f"{pc.seconds:.3g} s beyond a decode-only step")
    elif ert is not None and ert.prefill_fit is not None:
        fit = ert.prefill_fit
        # low, as the median it replaces: the steps that prefilled a prompt also ran the batch's
        # decodes, and other prompts' chunks where several shared a step
        n["prefill_rate"] = Num(1.0 / fit.s_per_token, "tokens/s", "measured",
                                f"a token at a prompt's start, fitted to the engine's own TTFT of {fit.prompts} "
                                f"requests of {fit.shortest_tokens}-{fit.longest_tokens} computed prompt tokens",
                                low=True)
        if fit.k_att is not None:
            n["k_att"] = Num(fit.k_att, "1/token", "measured",
                             "the same fit: how much dearer each position makes the tokens after it")
    elif ert is not None and ert.engine_prefill_tokens_per_s:
        n["prefill_rate"] = Num(ert.engine_prefill_tokens_per_s, "tokens/s", "measured",
                                f"median prompt tokens / the engine's own TTFT of {ert.requests} requests (a low "
                                "estimate)", low=True)
    elif len(pa) >= 3:
        n["prefill_rate"] = Num(1.0 / pa[len(pa) // 2], "tokens/s", "measured",
                                f"median of {len(pa)} prefill stalls / prompt tokens")
    elif acc.ttft_rate_hist.n >= MIN_SAMPLES:
        n["prefill_rate"] = Num(acc.ttft_rate_hist.quantile(0.9), "tokens/s", "measured",
                                "p90 of prompt tokens / TTFT (least contended requests; a low estimate)", low=True)
    else:
        key = n["model_key"].value if "model_key" in n else ""
        if key in DEFAULT_RHO:
            n["prefill_rate"] = Num(DEFAULT_RHO[key], "tokens/s", "assumed", "H100 default for this model")

    # link bandwidth: the engine's offload byte/time counters, else GPU PCIe peaks during offload
    bw_parts = []
    for d in ("out", "in"):
        b = sum_delta(st, f"offload_{d}_bytes_total")
        sec = sum_delta(st, f"offload_{d}_seconds_total")
        if b and sec and sec > 0:
            bw_parts.append(b / sec)
    if bw_parts:
        n["bw_eff"] = Num(min(bw_parts), "B/s", "measured", "engine offload bytes / offload seconds")
    elif acc.gpu_pcie_max > 1e9 and (sum_delta(st, "offload_out_bytes_total") or 0) > 0:
        n["bw_eff"] = Num(acc.gpu_pcie_max, "B/s", "measured", "peak NVML PCIe throughput during offload traffic")

    # preemption statistics
    n_pre_spikes = st.cause_counts[Cause.PREEMPTION]
    preempted = acc.preempted_requests
    counter = sum_delta(st, "preemptions_total")
    finished = acc.finished or sum_delta(st, "requests_finished_total") or 0
    duration = max(1e-9, st.now - (st.t0 or 0.0))
    if counter is not None:
        n["preemptions"] = Num(counter, "", "measured", "engine counter increase")
    pre_count = counter if counter else n_pre_spikes
    if pre_count:
        n["preemption_rate"] = Num(pre_count / duration, "1/s", "measured")
    if finished:
        # without the engine's counter the count is kvtop's preemption spikes: say so (a trace with no
        # engine scrapes cannot show a preemption that left no stall, nor tell one from another stall)
        what = f"{pre_count:.0f}" if counter is not None else f"{pre_count:.0f} preemption spikes (no engine counter)"
        n["preemptions_per_completed"] = Num(pre_count / finished, "", "measured", f"{what} / {finished:.0f}")
    if preempted:
        n["preemptions_per_preempted"] = Num(n_pre_spikes / preempted, "", "measured")
    if preempted >= MIN_SAMPLES:
        n["cancel_prob"] = Num(acc.preempted_cancelled / preempted, "", "measured",
                               f"{acc.preempted_cancelled} of {preempted} preempted requests cancelled before resuming")
    elif preempted:
        n["cancel_prob"] = Num(0.0, "", "assumed", f"only {preempted} preempted requests seen")
    peak = _peak_overlap(acc.preempt_stalls)
    if peak:
        n["preempted_peak"] = Num(peak, "sequences", "measured", "most preemption stalls open at once")
    if acc.seq_pre_n:
        n["seq_tokens"] = Num(acc.seq_pre_sum / acc.seq_pre_n, "tokens", "measured",
                              "mean prompt + generated tokens of preemption victims")

    # shared prefixes
    served = prefix_served(acc.engine_first, acc.engine_last)
    if served is not None:
        share = served[0] / served[1]
        n["prefix_hit_share"] = Num(share, "", "measured", "prefix cache hits / queries")
        if "seq_tokens" in n and share > 0:
            n["shared_tokens"] = Num(share * n["seq_tokens"].value, "tokens", "derived",
                                     "hit share x S (tokens in shared blocks stay resident)")

    # host pinned capacity
    pool = None
    for last in acc.engine_last.values():
        if last.get("offload_capacity_bytes"):
            pool = (pool or 0) + last["offload_capacity_bytes"]
    host = acc.host
    if pool:
        n["host_free_bytes"] = Num(float(pool), "B", "measured", "engine offload pool size")
    elif host and host.get("mem_available_bytes"):
        n["host_free_bytes"] = Num(0.5 * host["mem_available_bytes"], "B", "assumed",
                                   "half of available host memory could be pinned")

    # traffic and capacity
    if acc.prompt_n:
        n["prompt_mean"] = Num(acc.prompt_sum / acc.prompt_n, "tokens", "measured")
        p99 = acc.prompt_hist.quantile(0.99) or 0.0  # prompt_n > 0: the histogram is not empty
        n["long_prompt_tokens"] = Num(int(p99), "tokens", "measured", "p99 prompt length")
        long_n = sum(c for i, c in enumerate(acc.prompt_hist.counts)
                     if c and acc.prompt_hist.value_at(i) >= 0.5 * p99)
        n["long_prompt_rate"] = Num(long_n / duration, "1/s", "measured", "prompts >= half the p99 length")
    if acc.output_n:
        n["output_mean"] = Num(acc.output_sum / acc.output_n, "tokens", "measured")
        n["output_p90"] = Num(acc.output_hist.quantile(0.9), "tokens", "measured")
        n["output_p99"] = Num(acc.output_hist.quantile(0.99), "tokens", "measured")
    if acc.request_max:
        # a histogram bin's value can lie above the longest request: the exact maximum caps it
        top = float(acc.request_max)
        n["request_tokens_p90"] = Num(min(top, acc.request_hist.quantile(0.9) or top), "tokens", "measured",
                                      "prompt + output of the same finished requests")
        n["request_tokens_p99"] = Num(min(top, acc.request_hist.quantile(0.99) or top), "tokens", "measured",
                                      "prompt + output of the same finished requests")
        n["request_tokens_max"] = Num(acc.request_max, "tokens", "measured",
                                      "longest request: prompt + output served, cancelled and unfinished ones included")
    cap = (hdr.get("kv") or {}).get("capacity_tokens")
    if not cap:
        for last in acc.engine_last.values():
            if last.get("kv_capacity_tokens"):
                cap = (cap or 0) + last["kv_capacity_tokens"]
    if cap:
        n["kv_capacity_tokens"] = Num(float(cap), "tokens", "measured")
    _kv_config(st, n)
    # the engine's current limits, where the trace says them (the simulator's header, the engine's
    # witness): a recommendation equal to one of them is no change
    sim = hdr.get("sim") or {}
    for key, dst, unit in (("max_num_seqs", "max_seqs_current", "sequences"),
                           ("max_num_batched_tokens", "batched_tokens_current", "tokens"),
                           ("max_model_len", "max_model_len_current", "tokens")):
        for src, note in ((acc.engine_limits, "the engine's witness"), (_scraped_limits(acc), "the engine's scrapes"),
                          (sim, "trace header")):
            v = src.get(key)
            if positive_whole(v) is not None:
                n[dst] = Num(v, unit, "measured", note)
                break
    for src, note in ((acc.engine_limits, "the engine's witness"), (sim, "the trace header")):
        on = src.get("chunked_prefill")
        if isinstance(on, bool):
            n["chunked_current"] = Num(on, "", "measured", f"as {note} says")
            break
    if acc.running_n:
        n["running_mean"] = Num(acc.running_sum / acc.running_n, "sequences", "measured")
        n["running_peak"] = Num(acc.running_peak, "sequences", "measured",
                                "most sequences one engine ran at a scrape (its running gauge)")
    if acc.inflight_peak:
        n["inflight_peak"] = Num(acc.inflight_peak, "requests", "measured", "most requests between arrival and end at once")
    span = (acc.last_arrival or 0.0) - (acc.first_arrival or 0.0)
    if acc.arrived >= MIN_SAMPLES and span > 0:
        # over the arrivals' own span: a run that drains after its traffic stops offered nothing then
        n["arrival_rate"] = Num((acc.arrived - 1) / span, "1/s", "measured",
                                f"{acc.arrived} arrivals over {span:.0f} s")
    if len(acc.engine_last) == 1 and len(acc.step_curves) == 1:
        # one engine: the load it was offered is the load its curve has to serve
        pts = next(iter(acc.step_curves.values())).points()
        if len(pts) >= 2:
            n["decode_curve"] = Num(pts, "", "measured", "the engine's mean ITL and generated tokens/s per "
                                    "running batch, between its scrapes")
    if acc.kv_max is not None:
        n["kv_usage_max"] = Num(acc.kv_max, "", "measured")
    return s


def _kv_config(st: AnalysisState, n: dict[str, Num]) -> None:
    """How the engine sized its KV cache and what room the device has for a larger one: the block
    size, the engine's own KV-size setting (vLLM's cache_config_info: kv_cache_memory_bytes when the
    flag was given, else gpu_memory_utilization governs) and NVML's least free memory per GPU."""
    acc = st.tally
    bs = (st.header or {}).get("kv", {}).get("block_size") if isinstance((st.header or {}).get("kv"), dict) else None
    if not bs:
        bs = next((d["block_size"] for d in acc.engine_last.values() if d.get("block_size")), None)
    if isinstance(bs, (int, float)) and not isinstance(bs, bool) and bs >= 1:
        n["block_size"] = Num(int(bs), "tokens", "measured", "KV block size")
    if len(acc.engine_last) == 1:  # one engine: its setting is the flag's current value
        last = next(iter(acc.engine_last.values()))
        cc = (last.get("extra") or {}).get("cache_config") or {}
        for key, dst, unit, what in (("kv_cache_memory_bytes", "kv_cache_bytes_current", "B",
                                      "the engine's KV cache size per GPU (cache_config_info)"),
                                     ("gpu_memory_utilization", "gpu_memory_current", "",
                                      "the engine's memory share (cache_config_info)")):
            try:
                v = float(cc[key]) if key in cc else None
            except (TypeError, ValueError):
                v = None
            if v is not None and math.isfinite(v) and v > 0:
                n[dst] = Num(int(v) if unit == "B" else v, unit, "measured", what)
    if acc.gpu_mem:
        free = min(f for f, _ in acc.gpu_mem.values())
        total = min(t for _, t in acc.gpu_mem.values())
        n["device_free_bytes"] = Num(float(free), "B", "measured",
                                     f"least NVML free memory of {len(acc.gpu_mem)} GPU(s) over the run")
        n["device_total_bytes"] = Num(float(total), "B", "measured", "NVML total memory (smallest GPU)")
