"""What-if scenarios for ``kvtop advise`` (schema: kvtop/schemas/scenario.schema.json)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from kvtop.analysis.advice.advisor import advise
from kvtop.analysis.advice.costmodel import Victim
from kvtop.analysis.advice.kvbytes import (
    Geometry,
    ModelConfigError,
    checked_geometry,
    geometry_from_config,
    kv_size,
    lookup_model,
)
from kvtop.analysis.advice.situation import AGGREGATE_CONFIDENCE_SCALE, Num, Situation
from kvtop.model import jsonio
from kvtop.model.analysis import AnalysisReport, Number, Verdict


class ScenarioError(ValueError):
    """A scenario that is not valid; the message is one line."""


def schema() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        resources.files("kvtop.schemas").joinpath("scenario.schema.json").read_text(encoding="utf-8"))
    return doc


def load(path: str | Path) -> dict[str, Any]:
    doc = jsonio.read_json(path, "scenario", ScenarioError)
    bad = _non_finite(doc)
    if bad:
        raise ScenarioError(f"scenario {path}: {bad} is not a finite number of at most {MAX_NUMBER:g} in magnitude")
    validate(doc, str(path))
    if not isinstance(doc, dict):  # validate() already refused anything but an object
        raise ScenarioError(f"scenario {path} is not a JSON object")
    if isinstance(doc.get("model_config"), dict):  # the schema leaves a Hugging Face config's fields open
        try:
            checked_geometry(doc["model_config"])
        except ModelConfigError as e:
            raise ScenarioError(f"scenario {path}: model_config: {e}") from None
    return doc


# Larger than any byte count, rate or token count a scenario describes (1 PB); a 1e300-token prompt
# would make the cost model build absurd step plans.
MAX_NUMBER = 1e15


def _non_finite(obj: Any, where: str = "$", depth: int = 0) -> str | None:
    """Path of the first non-finite or absurdly large number (1e400 parses as infinity), else None."""
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and not (
            math.isfinite(obj) and abs(obj) <= MAX_NUMBER):
        return where
    if depth > 50:
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        bad = _non_finite(v, f"{where}.{k}" if isinstance(obj, dict) else f"{where}[{k}]", depth + 1)
        if bad:
            return bad
    return None


def validate(doc: Any, where: str = "scenario") -> None:
    import jsonschema  # slow to import: only when a scenario file is checked (not for `kvtop analyze`)

    v = jsonschema.Draft202012Validator(schema())
    errs = sorted(v.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errs:
        e = errs[0]
        at = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        msg = e.message if len(e.message) < 160 else e.message[:157] + "..."
        if e.validator == "anyOf" and not e.absolute_path:
            # the schema's top-level anyOf: the KV size, named one of four ways (its message quoted the
            # whole document "is not valid under any of the given schemas")
            msg = ("the KV cache's size per token is not given: add \"model\" (a built-in name), \"model_config\" "
                   "(a Hugging Face config.json object), \"kv_bytes_per_token\" or \"kv_bytes_per_token_rank\"")
        raise ScenarioError(f"{where}: invalid scenario at {at}: {msg}")


def _geometry(doc: dict[str, Any]) -> tuple[Geometry | None, str | None]:
    if "model_config" in doc:
        try:
            return geometry_from_config(doc["model_config"]), None
        except ModelConfigError as e:
            raise ScenarioError(f"model_config: {e}") from None
    if "model" in doc:
        hit = lookup_model(doc["model"])
        if hit is None:
            if "kv_bytes_per_token" in doc or "kv_bytes_per_token_rank" in doc:
                return None, None
            raise ScenarioError(f"unknown model {doc['model']!r}: give model_config or kv_bytes_per_token")
        return geometry_from_config(hit[1]), hit[0]
    return None, None


def situation(doc: dict[str, Any]) -> Situation:
    s = Situation(engine=doc.get("engine"), basis="given")
    n = s.n
    if s.engine:
        # the adapter registry (entry points) only for a scenario that names its engine
        from kvtop.analysis.engines import engine_semantics

        sem = engine_semantics(s.engine)
        if sem.warning:
            s.notes.append(sem.warning)
        else:
            s.use_engine(sem)
            s.preempts = sem.preempts
    geo, key = _geometry(doc)
    dtype = doc.get("kv_dtype", "bf16")
    tp = int(doc.get("tp", 1))
    pp = int(doc.get("pp", 1))
    state = float(doc.get("state_bytes_per_seq", 0.0))
    if key:
        n["model_key"] = Num(key, "", "given")
    if doc.get("engine_version"):
        n["engine_version"] = Num(str(doc["engine_version"]), "", "given", "the engine's version")
    given_rank = doc.get("kv_bytes_per_token_rank")
    if given_rank is None and "kv_bytes_per_token" in doc:
        given_rank = float(doc["kv_bytes_per_token"]) / (tp * pp)
    try:
        s.size = kv_size(geo, dtype, tp, pp, None if given_rank is None else float(given_rank), state)
    except ModelConfigError as e:
        raise ScenarioError(str(e)) from None
    if "kv_bytes_per_token" in doc:
        n["kv_bytes_per_token"] = Num(float(doc["kv_bytes_per_token"]), "B/token", "given", "all ranks")
    if "kv_bytes_per_token_rank" in doc:
        n["kv_bytes_per_token_rank"] = Num(float(doc["kv_bytes_per_token_rank"]), "B/token", "given", "one rank")
    if state:
        n["state_bytes_per_seq"] = Num(state, "B", "given", "fixed per-sequence state, all ranks")
    n["ranks"] = Num(tp * pp, "", "given")
    if geo is not None and geo.k_att is not None:
        n["k_att"] = Num(geo.k_att, "1/token", "config", "L·H_q·d_h / N")

    pf = doc.get("prefill", {})
    if "tokens_per_s" in pf:
        n["prefill_rate"] = Num(float(pf["tokens_per_s"]), "tokens/s", "given", low=bool(pf.get("tokens_per_s_low")))
    if "k_att" in pf:
        n["k_att"] = Num(float(pf["k_att"]), "1/token", "given")
    if "free_tokens" in pf:
        n["free_tokens"] = Num(float(pf["free_tokens"]), "tokens", "given")

    ln = doc.get("link", {})
    for src, dst, unit, scale in (("bw_eff_gbps", "bw_eff", "B/s", 1e9), ("bw_peak_gbps", "bw_peak", "B/s", 1e9),
                                  ("alpha_us", "alpha", "s", 1e-6), ("copy_bytes", "copy_bytes", "B", 1.0),
                                  ("contention", "contention", "", 1.0), ("utilization", "link_utilization", "", 1.0),
                                  ("u_max", "u_max", "", 1.0), ("queue_out_bytes", "queue_out_bytes", "B", 1.0),
                                  ("queue_in_bytes", "queue_in_bytes", "B", 1.0),
                                  ("bw_h2d_gbps", "bw_h2d", "B/s", 1e9), ("bw_d2h_gbps", "bw_d2h", "B/s", 1e9),
                                  ("duplex", "duplex", "", 1.0)):
        if src in ln:
            n[dst] = Num(float(ln[src]) * scale, unit, "given")

    sw = doc.get("swap", {})
    if "implementation" in sw:
        s.swap_impl = sw["implementation"]
    if "kappa" in sw:
        n["kappa"] = Num(float(sw["kappa"]), "", "given")
    elif sw.get("mode") == "blocking":
        n["kappa"] = Num(1.0, "", "given", "blocking copy")
    elif sw.get("mode") == "async":
        n["kappa"] = Num(0.05, "", "given", "asynchronous copy (ε)")

    host = doc.get("host", {})
    for src, dst, note in (("pinned_free_bytes", "host_free_bytes", "free pinned"),
                           ("mem_available_bytes", "host_available_bytes", "available host memory"),
                           ("pinned_limit_bytes", "pinned_limit_bytes", "pinned-memory limit"),
                           ("cgroup_free_bytes", "cgroup_free_bytes", "cgroup memory.max - memory.current")):
        if src in host:
            n[dst] = Num(float(host[src]), "B", "given", note)

    pre = doc.get("preemption", {})
    for src, dst, unit in (("seq_tokens", "seq_tokens", "tokens"), ("shared_tokens", "shared_tokens", "tokens"),
                           ("resume_hit_tokens", "resume_hit_tokens", "tokens"), ("host_tokens", "host_tokens", "tokens"),
                           ("cancel_prob", "cancel_prob", ""), ("per_completed", "preemptions_per_completed", ""),
                           ("per_preempted", "preemptions_per_preempted", "")):
        if src in pre:
            n[dst] = Num(float(pre[src]), unit, "given")
    if "peak_preempted" in pre:
        n["preempted_peak"] = Num(float(pre["peak_preempted"]), "sequences", "given",
                                  "most sequences preempted at once")
    if "per_minute" in pre:
        n["preemption_rate"] = Num(float(pre["per_minute"]) / 60.0, "1/s", "given")
    if pre.get("gates_fail_persistently"):
        n["gates_fail_persistently"] = Num(True, "", "given")

    vic = doc.get("victims")
    if vic:
        s.victims = [Victim(c["name"], float(c["seq_tokens"]), float(c.get("shared_tokens", 0))) for c in vic["candidates"]]
        s.deficit_bytes = float(vic["free_bytes"])
        n["deficit_bytes"] = Num(s.deficit_bytes, "B", "given")
    if "prefix" in doc:
        s.prefix = {"tokens": float(doc["prefix"]["tokens"]), "reuse_rate": float(doc["prefix"].get("reuse_per_s", 0))}

    tr = doc.get("traffic", {})
    for src, dst, unit in (("prompt_mean", "prompt_mean", "tokens"), ("output_mean", "output_mean", "tokens"),
                           ("output_p90", "output_p90", "tokens"), ("output_p99", "output_p99", "tokens"),
                           ("long_prompt_tokens", "long_prompt_tokens", "tokens"),
                           ("long_prompts_per_s", "long_prompt_rate", "1/s"),
                           ("request_tokens_p90", "request_tokens_p90", "tokens"),
                           ("request_tokens_p99", "request_tokens_p99", "tokens"),
                           ("request_tokens_max", "request_tokens_max", "tokens"),
                           ("inflight_peak", "inflight_peak", "requests"),
                           ("arrivals_per_s", "arrival_rate", "1/s")):
        if src in tr:
            n[dst] = Num(float(tr[src]) if dst != "long_prompt_tokens" else int(tr[src]), unit, "given")
    slo = doc.get("slo", {})
    if "itl_ms" in slo:
        n["itl_slo"] = Num(slo["itl_ms"] / 1e3, "s", "given")
    if "ttft_ms" in slo:
        n["ttft_slo"] = Num(slo["ttft_ms"] / 1e3, "s", "given")
    ob = doc.get("observed", {})
    if "decode_step_ms" in ob:
        n["decode_step"] = Num(ob["decode_step_ms"] / 1e3, "s", "given")
    if "kv_usage" in ob:
        n["kv_usage"] = Num(float(ob["kv_usage"]), "", "given")
    if "running" in ob:
        n["running_mean"] = Num(float(ob["running"]), "sequences", "given")
    if "running_peak" in ob:
        n["running_peak"] = Num(float(ob["running_peak"]), "sequences", "given")
    if ob.get("decode_curve"):
        n["decode_curve"] = Num([{k: float(v) for k, v in p.items()} for p in ob["decode_curve"]], "", "given",
                                "the engine's mean step and generated tokens/s per running batch")
    for src, dst, unit, scale in (("itl_p99_ms", "itl_p99", "s", 1e-3), ("miss_rate", "miss_rate", "", 1.0),
                                  ("engine_queue_p90_ms", "engine_queue_p90", "s", 1e-3),
                                  ("gaps", "gaps", "", 1.0), ("window_s", "window", "s", 1.0),
                                  ("streams", "streams", "", 1.0), ("streams_hit", "streams_hit", "", 1.0),
                                  ("preemptions", "preemptions", "", 1.0), ("waiting", "waiting", "", 1.0),
                                  ("completed", "completed", "", 1.0)):
        if src in ob:
            n[dst] = Num(float(ob[src]) * scale, unit, "given")
    if "spikes" in ob:
        s.spikes = int(ob["spikes"])
    for c, v in (ob.get("causes") or {}).items():
        if "spikes" in v:
            s.cause_counts[c] = float(v["spikes"])
        if "lost_s" in v:
            s.cause_lost_s[c] = float(v["lost_s"])
        if "streams" in v:
            s.cause_streams[c] = int(v["streams"])
        if "confidence" in v:
            # the saving analysis' attribution confidence (already scaled for its basis)
            s.cause_confidence[c] = float(v["confidence"])
    if ob.get("basis") in ("requests", "aggregate"):
        # saved by `kvtop analyze`: the diagnosis takes the same path it took there
        s.basis = ob["basis"]
    if s.spikes is None and s.cause_counts:
        s.spikes = int(sum(s.cause_counts.values()))
    if "preemptions" in ob and "completed" in ob and ob["completed"] and "preemptions_per_completed" not in n:
        n["preemptions_per_completed"] = Num(float(ob["preemptions"]) / float(ob["completed"]), "", "derived",
                                             "observed preemptions / completed")
    if "preemptions" in ob and "window_s" in ob and ob["window_s"] and "preemption_rate" not in n:
        n["preemption_rate"] = Num(float(ob["preemptions"]) / float(ob["window_s"]), "1/s", "derived",
                                   "observed preemptions / window")
    cp = doc.get("capacity", {})
    if "kv_pool_bytes" in cp:
        n["kv_pool_bytes"] = Num(float(cp["kv_pool_bytes"]), "B", "given")
    if "kv_capacity_tokens" in cp:
        n["kv_capacity_tokens"] = Num(float(cp["kv_capacity_tokens"]), "tokens", "given")
    if "block_size" in cp:
        n["block_size"] = Num(int(cp["block_size"]), "tokens", "given", "KV block size")
    if "device_free_bytes" in cp:
        n["device_free_bytes"] = Num(float(cp["device_free_bytes"]), "B", "given", "free GPU memory")
    if "device_total_bytes" in cp:
        n["device_total_bytes"] = Num(float(cp["device_total_bytes"]), "B", "given", "GPU memory")
    es = doc.get("engine_settings", {})
    if "max_num_seqs" in es:
        n["max_seqs_current"] = Num(es["max_num_seqs"], "sequences", "given")
    if "max_num_batched_tokens" in es:
        n["batched_tokens_current"] = Num(es["max_num_batched_tokens"], "tokens", "given")
    if "max_tokens" in es:
        n["max_tokens_current"] = Num(es["max_tokens"], "tokens", "given")
    if "max_model_len" in es:
        n["max_model_len_current"] = Num(es["max_model_len"], "tokens", "given")
    if "kv_cache_memory_bytes" in es:
        n["kv_cache_bytes_current"] = Num(es["kv_cache_memory_bytes"], "B", "given", "KV cache size per GPU")
    if "gpu_memory_utilization" in es:
        n["gpu_memory_current"] = Num(float(es["gpu_memory_utilization"]), "", "given", "memory share")
    if "enable_chunked_prefill" in es:
        n["chunked_current"] = Num(bool(es["enable_chunked_prefill"]), "", "given", "as the scenario says")

    s.cause_given = doc.get("cause")
    s.has_preemption_section = "preemption" in doc or "victims" in doc
    return s


def judge(doc: dict[str, Any]) -> tuple[str | None, Verdict]:
    """The scenario's cause (given or diagnosed) and the verdict on it."""
    s = situation(doc)
    verdict = advise(s)
    return s.cause, verdict


def result_json(doc: dict[str, Any], cause: str | None, verdict: Verdict) -> dict[str, Any]:
    """`kvtop advise --format json`: the scenario's name, its cause and the verdict."""
    return {"scenario": doc.get("name"), "cause": cause, "verdict": verdict.to_dict()}


def evaluate(doc: dict[str, Any]) -> dict[str, Any]:
    """The scenario judged, as `kvtop advise --format json` prints it."""
    return result_json(doc, *judge(doc))


# ---- an analyze report as a scenario (kvtop analyze --save-scenario) --------------------------

# (number in the report, section, field, scale). Only measured/given/config figures travel: the
# what-if keeps kvtop's documented defaults as defaults instead of freezing them as "given".
_FROM_REPORT = (
    ("kv_bytes_per_token_rank", None, "kv_bytes_per_token_rank", 1.0),
    ("prefill_rate", "prefill", "tokens_per_s", 1.0),
    ("k_att", "prefill", "k_att", 1.0),
    ("bw_eff", "link", "bw_eff_gbps", 1e-9),
    ("bw_h2d", "link", "bw_h2d_gbps", 1e-9),
    ("bw_d2h", "link", "bw_d2h_gbps", 1e-9),
    ("host_free_bytes", "host", "pinned_free_bytes", 1.0),
    ("host_available_bytes", "host", "mem_available_bytes", 1.0),
    ("cgroup_free_bytes", "host", "cgroup_free_bytes", 1.0),
    ("seq_tokens", "preemption", "seq_tokens", 1.0),
    ("cancel_prob", "preemption", "cancel_prob", 1.0),
    ("preemption_rate", "preemption", "per_minute", 60.0),
    ("preemptions_per_completed", "preemption", "per_completed", 1.0),
    ("preemptions_per_preempted", "preemption", "per_preempted", 1.0),
    ("prompt_mean", "traffic", "prompt_mean", 1.0),
    ("output_mean", "traffic", "output_mean", 1.0),
    ("output_p90", "traffic", "output_p90", 1.0),
    ("output_p99", "traffic", "output_p99", 1.0),
    ("long_prompt_tokens", "traffic", "long_prompt_tokens", 1.0),
    ("long_prompt_rate", "traffic", "long_prompts_per_s", 1.0),
    ("request_tokens_p90", "traffic", "request_tokens_p90", 1.0),
    ("request_tokens_p99", "traffic", "request_tokens_p99", 1.0),
    ("request_tokens_max", "traffic", "request_tokens_max", 1.0),
    ("inflight_peak", "traffic", "inflight_peak", 1.0),
    ("arrival_rate", "traffic", "arrivals_per_s", 1.0),
    ("preempted_peak", "preemption", "peak_preempted", 1.0),
    ("resume_hit_tokens", "preemption", "resume_hit_tokens", 1.0),
    ("itl_target", "slo", "itl_ms", 1e3),
    ("decode_step", "observed", "decode_step_ms", 1e3),
    ("itl_p99", "observed", "itl_p99_ms", 1e3),
    ("engine_queue_p90", "observed", "engine_queue_p90_ms", 1e3),
    ("miss_rate", "observed", "miss_rate", 1.0),
    ("kv_usage_max", "observed", "kv_usage", 1.0),
    ("running_mean", "observed", "running", 1.0),
    ("running_peak", "observed", "running_peak", 1.0),
    ("preemptions", "observed", "preemptions", 1.0),
    ("waiting", "observed", "waiting", 1.0),
    ("gaps", "observed", "gaps", 1.0),
    ("streams", "observed", "streams", 1.0),
    ("streams_hit", "observed", "streams_hit", 1.0),
    ("window", "observed", "window_s", 1.0),
    ("kv_capacity_tokens", "capacity", "kv_capacity_tokens", 1.0),
    ("max_seqs_current", "engine_settings", "max_num_seqs", 1.0),
    ("batched_tokens_current", "engine_settings", "max_num_batched_tokens", 1.0),
    ("max_model_len_current", "engine_settings", "max_model_len", 1.0),
    ("kv_cache_bytes_current", "engine_settings", "kv_cache_memory_bytes", 1.0),
    ("gpu_memory_current", "engine_settings", "gpu_memory_utilization", 1.0),
    ("chunked_current", "engine_settings", "enable_chunked_prefill", 1.0),
    ("block_size", "capacity", "block_size", 1.0),
    ("device_free_bytes", "capacity", "device_free_bytes", 1.0),
    ("device_total_bytes", "capacity", "device_total_bytes", 1.0),
)
_INTEGER_FIELDS = {"long_prompt_tokens", "gaps", "streams", "streams_hit", "spikes", "max_num_seqs",
                   "max_num_batched_tokens", "max_model_len", "kv_cache_memory_bytes", "block_size"}


def from_report(rep: AnalysisReport, name: str, engine: str | None = None, tp: int = 1) -> dict[str, Any]:
    """A scenario holding what an ``analyze`` report measured, ready for ``kvtop advise``.

    Editing one field and re-running ``advise`` is a what-if that starts from a real trace.
    """
    nums: Mapping[str, Number] = rep.verdict.numbers if rep.verdict is not None else {}
    doc: dict[str, Any] = {"name": name,
                           "description": "saved by kvtop analyze --save-scenario: measured figures of one trace"}
    if engine:
        doc["engine"] = engine
    mk = nums.get("model_key")
    if mk and mk.value:
        doc["model"] = mk.value
    ev = nums.get("engine_version")
    if ev and ev.value:
        doc["engine_version"] = str(ev.value)
    if tp > 1:
        doc["tp"] = tp
    for key, section, fld, scale in _FROM_REPORT:
        n = nums.get(key)
        if not n or n.value is None or n.source not in ("measured", "given", "config"):
            continue
        if key == "kv_bytes_per_token_rank" and n.source == "config" and "model" in doc:
            continue  # the model name carries it (with its window layout)
        if key == "k_att" and n.source == "config":
            continue
        if isinstance(n.value, bool):  # a yes/no state (chunked prefill) stays one
            if section is not None:
                doc.setdefault(section, {})[fld] = n.value
            continue
        v = float(n.value) * scale
        if fld in _INTEGER_FIELDS:
            v = int(round(v))
        if fld == "kv_usage":
            v = min(1.0, max(0.0, v))
        if fld == "cancel_prob":
            v = min(1.0, v)
        if section is None:
            doc[fld] = v
        else:
            doc.setdefault(section, {})[fld] = v
        if key == "prefill_rate" and n.low:
            doc["prefill"]["tokens_per_s_low"] = True  # a lower bound: the advisor weighs a swap that hinges on it
    curve = nums.get("decode_curve")
    if curve and isinstance(curve.value, list) and curve.source in ("measured", "given"):
        doc.setdefault("observed", {})["decode_curve"] = [dict(p) for p in curve.value]
    if "seq_tokens" in doc.get("preemption", {}) and doc["preemption"]["seq_tokens"] < 1:
        doc["preemption"].pop("seq_tokens")
    ob = doc.setdefault("observed", {})
    # the basis and each cause's confidence: `advise` then takes analyze's path and gives its confidence
    ob["basis"] = rep.basis
    scale = 1.0 if rep.basis == "requests" else AGGREGATE_CONFIDENCE_SCALE
    if rep.basis == "requests" or rep.itl_target_s is not None:
        ob["spikes"] = int(rep.spikes_total)
        causes: dict[str, Any] = {}
        for c, info in rep.causes.items():
            if not info.count:
                continue
            entry: dict[str, Any] = {"spikes": int(info.count)}
            if info.mean_confidence is not None:
                entry["confidence"] = min(1.0, float(info.mean_confidence) * scale)
            lost = nums.get(f"lost_s_{c}")
            if lost and lost.value is not None:
                entry["lost_s"] = float(lost.value)
            hit = nums.get(f"streams_{c}")
            if hit and hit.value is not None:
                entry["streams"] = int(hit.value)
            causes[c] = entry
        if causes:
            ob["causes"] = causes
    if not ob:
        doc.pop("observed")
    if not any(k in doc for k in ("model", "model_config", "kv_bytes_per_token", "kv_bytes_per_token_rank")):
        raise ScenarioError("the report does not know the KV size: give --model-config or --kv-bytes-per-token")
    validate(doc, "saved scenario")
    return doc
