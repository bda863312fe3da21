"""Workloads and presets for the simulated engine: engine geometry, step costs, traffic classes.

A workload is a JSON object (see ``kvtop/sim/presets/*.json`` and docs/simulator.md "Workload
files"). ``Workload.requests(seed, duration_s)`` yields the arrivals in time order;
the same generator feeds ``kvtop simulate`` and the HTTP load generator, so both see the same
traffic for the same seed.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvtop.errors import UsageError
from kvtop.model import jsonio
from kvtop.model.records import trace_time
from kvtop.model.trace import TraceError, TraceReader

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T", bound="DataclassInstance")


class WorkloadError(UsageError):
    """Invalid preset or workload file (one line for the user)."""


@dataclass
class StepCost:
    """Engine step time = fixed + prefill + decode terms (docs/kv-science.md §3, §9)."""

    fixed_s: float = 0.006
    prefill_token_s: float = 4.0e-5  # a = 1/rho, Llama-3.1-8B on H100 at ~25K tok/s
    k_att: float = 1.878e-5  # attention term: a*k_att*((start+len)^2 - start^2)
    decode_seq_s: float = 1.0e-4  # per running sequence in the step
    decode_ctx_token_s: float = 4.5e-8  # per context token of each decoding sequence (KV reads)


@dataclass
class SwapConfig:
    """Host link for swap/offload (docs/kv-science.md §2.2: t = copies*alpha + bytes/BW)."""

    link_bytes_per_s: float = 50e9
    copy_overhead_s: float = 6e-6
    copy_bytes: int | None = None  # bytes per contiguous copy; None = one whole KV block
    host_capacity_bytes: float = 64e9
    overlap: bool = False  # False: copies block the engine step (V0 swap); True: async offload


@dataclass
class EngineConfig:
    model: str = "sim-llama-3.1-8b"
    bytes_per_token: int = 131072
    block_size: int = 16
    num_gpu_blocks: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    prefix_caching: bool = True
    max_model_len: int = 32768
    preemption_mode: str = "recompute"  # recompute | swap
    itl_target_s: float = 0.1  # only used to label truth records (slow steps / prefill stalls)
    step: StepCost = field(default_factory=StepCost)
    swap: SwapConfig = field(default_factory=SwapConfig)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


@dataclass
class Dist:
    """Lognormal length distribution given by its median, clipped to [min, max]."""

    median: float
    sigma: float = 0.0
    min: int = 1
    max: int | None = None  # None: only the engine's max_model_len caps it

    def sample(self, rng: random.Random) -> int:
        v = self.median if self.sigma <= 0 else rng.lognormvariate(math.log(self.median), self.sigma)
        v = max(self.min, round(v))
        return int(v if self.max is None else min(self.max, v))


@dataclass
class TrafficClass:
    name: str
    prompt: Dist
    output: Dist
    rate_per_s: float = 0.0  # Poisson arrivals; 0 with arrival_times_s for a given list
    arrival_times_s: list[float] | None = None
    start_s: float = 0.0  # Poisson arrivals begin here
    max_tokens: int | None = None  # request max_tokens (None: output.max); output == max -> "length"
    patience_s: float | None = None  # client abandons when no token arrives for this long
    priority: int = 0  # lower = more important (victims are taken from the highest number first)
    reserved_kv_frac: float = 0.0  # share of KV blocks only this class (and more important) may use
    prefix_id: str | None = None  # requests of this class share a common prefix (system prompt)
    prefix_tokens: int = 0


@dataclass(slots=True)
class RequestSpec:
    id: str
    t: float
    cls: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    patience_s: float | None = None
    priority: int = 0
    prefix_id: str | None = None
    prefix_tokens: int = 0


@dataclass
class Workload:
    name: str
    description: str
    engine: EngineConfig
    classes: list[TrafficClass]
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    demonstrates: str = ""
    # the longest prompt the traffic sends, where an engine setting other than the workload's own
    # was applied (``--engine-flags``): a smaller max_model_len then rejects the longer prompts, as
    # vLLM does, instead of the traffic shrinking to fit it
    traffic_len_cap: int | None = None

    def with_policy(self, policy: str | None) -> Workload:
        """The workload with a named policy applied (``recompute``/``swap`` or a preset variant)."""
        if not policy:
            return self
        over = self.policies.get(policy)
        if over is None:
            if policy not in ("recompute", "swap"):
                known = ", ".join(sorted({"recompute", "swap", *self.policies})) or "recompute, swap"
                raise WorkloadError(f"unknown policy {policy!r} (known: {known})")
            over = {"preemption_mode": policy}
        eng = _engine_from(_merge(_engine_to_dict(self.engine), over), f"{self.name} policy {policy}")
        return replace(self, engine=eng)

    def requests(self, seed: int, duration_s: float) -> Iterator[RequestSpec]:
        """Arrivals before ``duration_s`` in time order; deterministic for a seed."""
        cap = self.traffic_len_cap or self.engine.max_model_len
        gens = [_class_arrivals(c, seed, i, duration_s, cap) for i, c in enumerate(self.classes)]
        for n, (t, _i, spec) in enumerate(heapq.merge(*gens, key=lambda x: (x[0], x[1]))):
            spec.id = f"sim-{n}"
            spec.t = t
            yield spec


def _class_arrivals(c: TrafficClass, seed: int, idx: int, duration_s: float,
                    max_model_len: int) -> Iterator[tuple[float, int, RequestSpec]]:
    rng = random.Random(f"{seed}/{c.name}/{idx}")
    max_tokens = c.max_tokens or c.output.max or max_model_len

    def spec(t: float) -> RequestSpec:
        p = min(c.prompt.sample(rng), max_model_len - 1)
        o = min(c.output.sample(rng), max_tokens)
        return RequestSpec("", t, c.name, max(p, c.prefix_tokens + 1) if c.prefix_id else p, o, max_tokens,
                           c.patience_s, c.priority, c.prefix_id, c.prefix_tokens)

    # arrivals on the microsecond grid traces are written on: a what-if run that reads them back
    # from a trace replays exactly the same arrivals
    if c.arrival_times_s is not None:
        for t in sorted(trace_time(x) for x in c.arrival_times_s):
            if t < duration_s:
                yield t, idx, spec(t)
        return
    if c.rate_per_s <= 0:
        return
    t = c.start_s
    while True:
        t += rng.expovariate(c.rate_per_s)
        tq = trace_time(t)
        if tq >= duration_s:
            return
        yield tq, idx, spec(tq)


# --- loading and validation -------------------------------------------------------------------

def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _engine_to_dict(e: EngineConfig) -> dict[str, Any]:
    d = {f.name: getattr(e, f.name) for f in fields(e)}
    d["step"] = {f.name: getattr(e.step, f.name) for f in fields(e.step)}
    d["swap"] = {f.name: getattr(e.swap, f.name) for f in fields(e.swap)}
    return d


def _build(cls: type[_T], d: Any, where: str) -> _T:
    if not isinstance(d, dict):
        raise WorkloadError(f"{where}: expected an object")
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {', '.join(unknown)}")
    try:
        return cls(**d)
    except TypeError as e:
        raise WorkloadError(f"{where}: {e}") from None


def _num(v: Any, where: str, lo: float | None = None, integer: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and int(v) != v):
        raise WorkloadError(f"{where}: expected a {'whole ' if integer else ''}number, got {v!r}")
    if lo is not None and v < lo:
        raise WorkloadError(f"{where}: must be >= {lo}, got {v!r}")


def _engine_from(d: dict[str, Any], where: str) -> EngineConfig:
    if not isinstance(d, dict):
        raise WorkloadError(f"{where}: 'engine' must be an object")
    d = dict(d)
    kv_bytes = d.pop("kv_cache_bytes", None)
    step = _build(StepCost, d.pop("step", {}) or {}, f"{where}: engine.step")
    swap = _build(SwapConfig, d.pop("swap", {}) or {}, f"{where}: engine.swap")
    eng = _build(EngineConfig, {**d, "step": step, "swap": swap}, f"{where}: engine")
    for name in ("bytes_per_token", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        _num(getattr(eng, name), f"{where}: engine.{name}", 1, integer=True)
    if kv_bytes is not None:
        _num(kv_bytes, f"{where}: engine.kv_cache_bytes", 1)
        eng.num_gpu_blocks = int(kv_bytes // eng.block_bytes)
    _num(eng.num_gpu_blocks, f"{where}: engine.num_gpu_blocks", 2, integer=True)
    if eng.preemption_mode not in ("recompute", "swap"):
        raise WorkloadError(f"{where}: engine.preemption_mode must be recompute or swap, got {eng.preemption_mode!r}")
    for f in fields(StepCost):
        _num(getattr(step, f.name), f"{where}: engine.step.{f.name}", 0)
    _num(swap.link_bytes_per_s, f"{where}: engine.swap.link_bytes_per_s", 1)
    _num(swap.copy_overhead_s, f"{where}: engine.swap.copy_overhead_s", 0)
    _num(swap.host_capacity_bytes, f"{where}: engine.swap.host_capacity_bytes", 0)
    if swap.copy_bytes is not None:
        _num(swap.copy_bytes, f"{where}: engine.swap.copy_bytes", 1, integer=True)
    _num(eng.itl_target_s, f"{where}: engine.itl_target_s", 0)
    if not isinstance(eng.model, str) or not eng.model:
        raise WorkloadError(f"{where}: engine.model must be a name, got {eng.model!r}")
    for name in ("chunked_prefill", "prefix_caching"):
        if not isinstance(getattr(eng, name), bool):  # "no" read as true
            raise WorkloadError(f"{where}: engine.{name} must be true or false, got {getattr(eng, name)!r}")
    if not isinstance(swap.overlap, bool):
        raise WorkloadError(f"{where}: engine.swap.overlap must be true or false, got {swap.overlap!r}")
    return eng


_MAX_MEDIAN = 1e9  # tokens
# one class's arrivals per second: far past what one engine serves, and bounded so a run's arrivals
# (generated in memory) fit in it (1e7/s for 5 s was a MemoryError)
MAX_RATE_PER_S = 10_000.0
_MAX_SIGMA = 10.0


def _dist(d: Any, where: str) -> Dist:
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        d = {"median": d}
    dist = _build(Dist, d, where)
    _num(dist.median, f"{where}.median", 1)
    _num(dist.sigma, f"{where}.sigma", 0)
    # a lognormal draw is exp(log(median) + sigma·z): past these it overflows a float (a traceback)
    if dist.median > _MAX_MEDIAN or dist.sigma > _MAX_SIGMA:
        raise WorkloadError(f"{where}: median must be <= {_MAX_MEDIAN:g} and sigma <= {_MAX_SIGMA:g}")
    _num(dist.min, f"{where}.min", 1, integer=True)
    if dist.max is not None:
        _num(dist.max, f"{where}.max", dist.min, integer=True)
    return dist


def parse_workload(obj: Any, where: str = "workload") -> Workload:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object")
    unknown = sorted(set(obj) - {"name", "description", "demonstrates", "engine", "classes", "policies"})
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {', '.join(unknown)}")
    eng = _engine_from(obj.get("engine", {}) or {}, where)
    raw_classes = obj.get("classes")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise WorkloadError(f"{where}: 'classes' must be a non-empty list")
    classes = []
    for i, rc in enumerate(raw_classes):
        cw = f"{where}: classes[{i}]"
        if not isinstance(rc, dict):
            raise WorkloadError(f"{cw}: expected an object")
        rc = dict(rc)
        rc.setdefault("name", f"class{i}")
        if "prompt" not in rc or "output" not in rc:
            raise WorkloadError(f"{cw}: needs 'prompt' and 'output' length distributions")
        rc["prompt"] = _dist(rc["prompt"], f"{cw}.prompt")
        rc["output"] = _dist(rc["output"], f"{cw}.output")
        tc = _build(TrafficClass, rc, cw)
        if not isinstance(tc.name, str) or not tc.name:
            raise WorkloadError(f"{cw}.name must be a name, got {tc.name!r}")
        _num(tc.rate_per_s, f"{cw}.rate_per_s", 0)
        if tc.rate_per_s > MAX_RATE_PER_S:  # the arrivals of a run are generated in memory
            raise WorkloadError(f"{cw}.rate_per_s must be at most {MAX_RATE_PER_S:g} requests/s, got {tc.rate_per_s!r}")
        _num(tc.start_s, f"{cw}.start_s", 0)
        if tc.max_tokens is not None:
            _num(tc.max_tokens, f"{cw}.max_tokens", 1, integer=True)
        _num(tc.reserved_kv_frac, f"{cw}.reserved_kv_frac", 0)
        _num(tc.priority, f"{cw}.priority", integer=True)
        if tc.arrival_times_s is not None:
            if not isinstance(tc.arrival_times_s, list):
                raise WorkloadError(f"{cw}.arrival_times_s: expected a list of seconds")
            for t in tc.arrival_times_s:
                _num(t, f"{cw}.arrival_times_s", 0)
        if tc.patience_s is not None:
            _num(tc.patience_s, f"{cw}.patience_s", 0)
        if not 0 <= tc.reserved_kv_frac < 1:
            raise WorkloadError(f"{cw}.reserved_kv_frac must be in [0, 1)")
        if tc.prefix_id is not None:
            _num(tc.prefix_tokens, f"{cw}.prefix_tokens", 1, integer=True)
        if tc.prompt.min >= eng.max_model_len:
            raise WorkloadError(f"{cw}.prompt: its shortest prompt ({tc.prompt.min}) does not fit engine.max_model_len "
                                f"({eng.max_model_len})")
        longest = max(tc.prompt.max or 0, tc.prefix_tokens + 1)
        if longest + (tc.max_tokens or tc.output.max or 0) > eng.max_model_len:
            raise WorkloadError(f"{cw}: longest prompt + max_tokens exceeds engine.max_model_len ({eng.max_model_len})")
        classes.append(tc)
    policies = obj.get("policies", {}) or {}
    if not isinstance(policies, dict):
        raise WorkloadError(f"{where}: 'policies' must be an object of engine overrides")
    for pname, over in policies.items():
        _engine_from(_merge(_engine_to_dict(eng), over), f"{where}: policies.{pname}")
    # unnamed: the file's name ("workload workload zero.json" read the prefix twice)
    return Workload(str(obj.get("name", where.removeprefix("workload "))), str(obj.get("description", "")), eng,
                    classes, policies,
                    str(obj.get("demonstrates", "")))


def preset_names() -> list[str]:
    d = resources.files("kvtop.sim") / "presets"
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> Workload:
    path = resources.files("kvtop.sim") / "presets" / f"{name}.json"
    if not path.is_file():
        raise WorkloadError(f"unknown preset {name!r} (known: {', '.join(preset_names())})")
    return parse_workload(json.loads(path.read_text(encoding="utf-8")), f"preset {name}")


def load_workload_file(path: str | Path) -> Workload:
    p = Path(path)
    obj = jsonio.read_json(p, "workload", WorkloadError)
    return parse_workload(obj, f"workload {p.name}")


def requests_from_trace(path: str | Path, workload: Workload, seed: int = 1,
                        duration_s: float | None = None) -> list[RequestSpec]:
    """What-if input: the arrivals of a recorded kvtop trace (time, prompt length, class) with the
    output lengths the clients received, to replay under this workload's engine and policy.

    Requests that did not finish in the trace get at least one token more than they received there
    (a draw from their class's output distribution, or the first class's), so a replay under the same
    engine and policy reproduces the recorded run exactly. Times are the trace's run clock.
    """
    try:
        reader = TraceReader(path)
    except TraceError as e:
        raise WorkloadError(str(e)) from None
    arrivals: dict[str, tuple[float, int, str | None]] = {}
    arrived: dict[str, tuple[float, str | None]] = {}  # arrivals whose prompt length comes at the finish
    done: dict[str, int] = {}
    seen: dict[str, int] = {}

    def whole(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    for d in reader.dicts():
        if d.get("kind") != "request":
            continue
        rid, ev = d.get("id"), d.get("event")
        if not isinstance(rid, str):
            continue
        if ev == "arrive":
            p = whole(d.get("prompt_tokens"))
            if p is not None:
                arrivals.setdefault(rid, (float(d["t"]), p, d.get("class")))
            else:
                arrived.setdefault(rid, (float(d["t"]), d.get("class")))
        elif ev in ("first_token", "token"):
            seen[rid] = seen.get(rid, 0) + int(d.get("n") or 1)
        elif ev == "finish":
            ct = d.get("completion_tokens")
            done[rid] = int(ct) if isinstance(ct, int) and ct > 0 else seen.get(rid, 1)
            # a text prompt's length is told by the usage block at its finish (as load --from reads it)
            p = whole(d.get("prompt_tokens"))
            if p is not None and rid in arrived and rid not in arrivals:
                t_arr, cls_arr = arrived[rid]
                arrivals[rid] = (t_arr, p, cls_arr)
    if not arrivals:
        raise WorkloadError(f"{path}: no request arrivals with prompt_tokens in this trace")
    rng = random.Random(f"{seed}/replay")
    classes = {c.name: c for c in workload.classes}
    lim = workload.engine.max_model_len
    out = []
    for rid, (t, prompt, cls) in sorted(arrivals.items(), key=lambda kv: kv[1][0]):
        if duration_s is not None and t >= duration_s:
            continue
        tc = classes.get(cls or "", workload.classes[0])
        p = min(prompt, lim - 1)
        o = done.get(rid) or max(seen.get(rid, 0) + 1, tc.output.sample(rng))
        o = max(1, min(o, lim - p))
        max_tokens = max(o, tc.max_tokens or tc.output.max or o)
        out.append(RequestSpec(rid, t, cls or tc.name, p, o, max_tokens, tc.patience_s, tc.priority))
    return out
