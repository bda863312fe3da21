"""What-if scenarios for ``kvtop advise`` (schema: kvtop/schemas/scenario.schema.json)."""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from kvtop.analysis import chunking
from kvtop.analysis.advisor import Num, Situation, advise
from kvtop.analysis.costmodel import Victim
from kvtop.analysis.kvbytes import (
    Geometry,
    ModelConfigError,
    geometry_from_config,
    kv_bytes_per_token,
    lookup_model,
)


class ScenarioError(ValueError):
    """A scenario that is not valid; the message is one line."""


def schema() -> dict[str, Any]:
    return json.loads(resources.files("kvtop.schemas").joinpath("scenario.schema.json").read_text(encoding="utf-8"))


def load(path: str | Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=_no_constant)
    except OSError as e:
        raise ScenarioError(f"cannot read scenario {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ScenarioError(f"scenario {path} is not JSON: {e}") from None
    bad = _non_finite(doc)
    if bad:
        raise ScenarioError(f"scenario {path}: {bad} is not a finite number of at most {MAX_NUMBER:g} in magnitude")
    validate(doc, str(path))
    return doc


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


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
    import jsonschema

    v = jsonschema.Draft202012Validator(schema())
    errs = sorted(v.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errs:
        e = errs[0]
        at = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        msg = e.message if len(e.message) < 160 else e.message[:157] + "..."
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
        from kvtop.plugin import PluginError, load_adapter

        try:
            cls = load_adapter(s.engine)
            s.settings_names = dict(cls.settings)
            s.preempts = bool(cls.preempts)
        except PluginError as e:
            s.notes.append(f"engine settings not named: {e}")
    geo, key = _geometry(doc)
    dtype = doc.get("kv_dtype", "bf16")
    tp = int(doc.get("tp", 1))
    if key:
        n["model_key"] = Num(key, "", "given")
    if "kv_bytes_per_token" in doc:
        n["kv_bytes_per_token"] = Num(float(doc["kv_bytes_per_token"]), "B/token", "given")
    elif geo is not None:
        n["kv_bytes_per_token"] = Num(kv_bytes_per_token(geo, dtype, 1) if not geo.mla else
                                      kv_bytes_per_token(geo, dtype, tp), "B/token", "config",
                                      f"{dtype}, all ranks" if not geo.mla else f"{dtype}, MLA latent")
    if "kv_bytes_per_token_rank" in doc:
        n["kv_bytes_per_token_rank"] = Num(float(doc["kv_bytes_per_token_rank"]), "B/token", "given")
    elif geo is not None:
        n["kv_bytes_per_token_rank"] = Num(kv_bytes_per_token(geo, dtype, tp), "B/token", "config", f"TP={tp}")
    if "kv_bytes_per_token" not in n and "kv_bytes_per_token_rank" in n:
        n["kv_bytes_per_token"] = Num(n["kv_bytes_per_token_rank"].value * tp, "B/token", "derived")
    n["ranks"] = Num(tp, "", "given")
    if geo is not None and geo.k_att is not None:
        n["k_att"] = Num(geo.k_att, "1/token", "config", "L·H_q·d_h / N")

    pf = doc.get("prefill", {})
    if "tokens_per_s" in pf:
        n["prefill_rate"] = Num(float(pf["tokens_per_s"]), "tokens/s", "given")
    if "k_att" in pf:
        n["k_att"] = Num(float(pf["k_att"]), "1/token", "given")
    if "free_tokens" in pf:
        n["free_tokens"] = Num(float(pf["free_tokens"]), "tokens", "given")

    ln = doc.get("link", {})
    for src, dst, unit, scale in (("bw_eff_gbps", "bw_eff", "B/s", 1e9), ("bw_peak_gbps", "bw_peak", "B/s", 1e9),
                                  ("alpha_us", "alpha", "s", 1e-6), ("copy_bytes", "copy_bytes", "B", 1.0),
                                  ("contention", "contention", "", 1.0), ("utilization", "link_utilization", "", 1.0),
                                  ("u_max", "u_max", "", 1.0), ("queue_out_bytes", "queue_out_bytes", "B", 1.0),
                                  ("queue_in_bytes", "queue_in_bytes", "B", 1.0)):
        if src in ln:
            n[dst] = Num(float(ln[src]) * scale, unit, "given")

    sw = doc.get("swap", {})
    if "kappa" in sw:
        n["kappa"] = Num(float(sw["kappa"]), "", "given")
    elif sw.get("mode") == "blocking":
        n["kappa"] = Num(1.0, "", "given", "blocking copy")
    elif sw.get("mode") == "async":
        n["kappa"] = Num(0.05, "", "given", "asynchronous copy (ε)")

    if "pinned_free_bytes" in doc.get("host", {}):
        n["host_free_bytes"] = Num(float(doc["host"]["pinned_free_bytes"]), "B", "given")

    pre = doc.get("preemption", {})
    for src, dst, unit in (("seq_tokens", "seq_tokens", "tokens"), ("shared_tokens", "shared_tokens", "tokens"),
                           ("resume_hit_tokens", "resume_hit_tokens", "tokens"), ("host_tokens", "host_tokens", "tokens"),
                           ("cancel_prob", "cancel_prob", ""), ("per_completed", "preemptions_per_completed", ""),
                           ("per_preempted", "preemptions_per_preempted", "")):
        if src in pre:
            n[dst] = Num(float(pre[src]), unit, "given")
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
                           ("long_prompts_per_s", "long_prompt_rate", "1/s")):
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
    cp = doc.get("capacity", {})
    if "kv_pool_bytes" in cp:
        n["kv_pool_bytes"] = Num(float(cp["kv_pool_bytes"]), "B", "given")
    if "kv_capacity_tokens" in cp:
        n["kv_capacity_tokens"] = Num(float(cp["kv_capacity_tokens"]), "tokens", "given")
    es = doc.get("engine_settings", {})
    if "max_num_seqs" in es:
        n["max_seqs_current"] = Num(es["max_num_seqs"], "sequences", "given")
    if "max_num_batched_tokens" in es:
        n["batched_tokens_current"] = Num(es["max_num_batched_tokens"], "tokens", "given")
    if "max_tokens" in es:
        n["max_tokens_current"] = Num(es["max_tokens"], "tokens", "given")

    s.cause = _cause(doc, s)
    s.itl_miss = s.cause is not None
    return s


def _cause(doc: dict[str, Any], s: Situation) -> str | None:
    c = doc.get("cause")
    if c == "none":
        return None
    if c:
        return c
    observed_pre = doc.get("observed", {}).get("preemptions")
    if ("preemption" in doc or "victims" in doc) and observed_pre != 0:
        return "preemption"
    slo, t_dec, P = s.v("itl_slo"), s.v("decode_step"), s.v("long_prompt_tokens")
    if slo and t_dec and t_dec >= slo:
        return "slow_decode"
    if slo and t_dec and P:
        a = 1.0 / (s.v("prefill_rate") or 25_000.0)
        k = s.v("k_att") or 0.0
        budget = s.v("batched_tokens_current")
        steps = chunking.chunk_steps(int(P), int(budget), t_dec, a, k) if budget else [chunking.t_step(0, P, t_dec, a, k)]
        if max(steps) > slo:
            return "prefill_interference"
    return None


def evaluate(doc: dict[str, Any]) -> dict[str, Any]:
    s = situation(doc)
    verdict = advise(s)
    return {"scenario": doc.get("name"), "cause": s.cause, "verdict": verdict}
