"""The analysis report as typed values: what `kvtop analyze` prints and what a Snapshot carries.

The analysis (``kvtop.analysis.report.build_report``) builds an ``AnalysisReport``; the console,
the text renderer, the exporter and the agent read its attributes. ``to_dict()`` is the
documented JSON (the ``analysis`` object of ``kvtop snapshot --format json``, the whole of
``kvtop analyze --format json``): same keys, same order, same values as the report has always
had, so the JSON contract does not move when the Python side does. ``from_dict`` reads such JSON
back (a saved report, a test's fixed verdict).

Values stay as the analysis computed them (NaN included); ``finite()`` gives the copy that JSON
and the terminal see, where unknown is ``None``. This module sits in ``kvtop.model`` so a
Snapshot can hold a report without importing the analysis package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtop.model.sanitize import finite_json, output_json

DECIDED_BY = "decided_by"  # the verdict number that lists the gates which decided, in order


@dataclass(frozen=True, slots=True)
class Decision:
    """One gate of the diagnosis or the cost model that decided the verdict, and why."""

    gate: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"gate": self.gate, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class Number:
    """A figure of the verdict with its unit and where it came from (measured, given, config,
    assumed, derived). ``value`` is a number, a string, a table (list/dict, JSON as is) or, for
    ``decided_by``, a tuple of ``Decision``."""

    value: Any
    unit: str
    source: str
    note: str | None = None
    low: bool = False  # a measured lower bound of the true figure

    def to_dict(self) -> dict[str, Any]:
        v = self.value
        if isinstance(v, tuple) and all(isinstance(x, Decision) for x in v):
            v = [x.to_dict() for x in v]
        d: dict[str, Any] = {"value": v, "unit": self.unit, "source": self.source}
        if self.note:
            d["note"] = self.note
        if self.low:
            d["low"] = True
        return d

    @staticmethod
    def from_dict(key: str, d: Mapping[str, Any]) -> Number:
        v = d.get("value")
        if key == DECIDED_BY and isinstance(v, list):
            v = tuple(Decision(str(x["gate"]), str(x["detail"])) for x in v)
        return Number(v, str(d.get("unit", "")), str(d.get("source", "")), d.get("note"), bool(d.get("low")))


def flag_value(v: object) -> str:
    """A setting's value as typed on a command line (a whole float without its ``.0``)."""
    if isinstance(v, bool):
        return "true" if v else "false"  # as config files (Triton's config.pbtxt) spell it
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


@dataclass(frozen=True, slots=True)
class FlagSetting:
    """One engine setting to change: ``flag`` as the engine spells it (``--max-num-seqs``; None when
    the engine is unknown and only the generic ``setting`` name is known), the value to give it and
    why (the arithmetic behind the value). Automation reads ``flag``/``value``; people read ``why``."""

    setting: str
    flag: str | None
    value: Any
    why: str = ""

    @property
    def label(self) -> str:
        """What a person types or looks for: the flag, else the generic setting name."""
        return self.flag or self.setting

    @property
    def launcher(self) -> bool:
        """A word of the engine's command line (``--max-num-seqs``), not a setting it reads elsewhere
        (Triton's config.pbtxt, a build option) or a generic name (unknown engine)."""
        return bool(self.flag and self.flag.startswith("-"))

    def words(self) -> list[str]:
        """The setting as the engine's command line takes it: a switch alone (``--enable-x``) or
        negated (``--no-enable-x``) for a yes/no value, else the flag and its value (``--enable-x True``
        is an unrecognised argument to a store_true flag)."""
        v = self.value
        if v is None:
            return []
        if self.launcher and isinstance(v, bool):
            return [self.label if v else "--no-" + self.label.removeprefix("--")]
        return [self.label, flag_value(v)]

    def shown(self) -> str:
        """The setting as a person reads it on the ``settings`` line (the command-line form)."""
        return " ".join(self.words())

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "flag": self.flag, "value": self.value, "why": self.why}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> FlagSetting:
        return FlagSetting(str(d.get("setting") or d.get("flag") or ""), d.get("flag"), d.get("value"),
                           str(d.get("why") or ""))


def _settings_from(raw: Any) -> tuple[FlagSetting, ...]:
    """Settings as a list of ``{"setting", "flag", "value", "why"}``; a report saved before that shape
    (``{"--max-num-seqs": 8}``) reads as flags without a reason."""
    if isinstance(raw, Mapping):
        return tuple(FlagSetting(str(k), str(k), v) for k, v in raw.items())
    return tuple(FlagSetting.from_dict(x) for x in raw or ())


@dataclass(frozen=True, slots=True)
class Verdict:
    """The advisor's answer: an action, the eviction mechanism behind it, the settings to change,
    the reasons and every number it used (``kvtop.analysis.advice.advisor.advise``)."""

    action: str
    mechanism: str | None = None
    also: tuple[str, ...] = ()
    numbers: Mapping[str, Number] = field(default_factory=dict)
    settings: tuple[FlagSetting, ...] = ()
    confidence: float = 0.0
    marginal: bool = False
    reasons: tuple[str, ...] = ()
    tentative: bool = False  # confidence under the floor: the reasons say what would confirm it

    def flags(self) -> dict[str, Any]:
        """The settings as ``{flag or setting name: value}``."""
        return {f.label: f.value for f in self.settings}

    def value(self, key: str) -> Any:
        """A number's value, None when the verdict does not carry it."""
        n = self.numbers.get(key)
        return None if n is None else n.value

    @property
    def decided_by(self) -> tuple[Decision, ...]:
        v = self.value(DECIDED_BY)
        return v if isinstance(v, tuple) else ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "mechanism": self.mechanism,
            "also": list(self.also),
            "numbers": {k: n.to_dict() for k, n in self.numbers.items()},
            "settings": [f.to_dict() for f in self.settings],
            "confidence": self.confidence,
            "tentative": self.tentative,
            "marginal": self.marginal,
            "reasons": list(self.reasons),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Verdict:
        return Verdict(
            action=str(d["action"]),
            mechanism=d.get("mechanism"),
            also=tuple(d.get("also") or ()),
            numbers={k: Number.from_dict(k, n) for k, n in (d.get("numbers") or {}).items()},
            settings=_settings_from(d.get("settings")),
            confidence=d.get("confidence", 0.0),
            marginal=bool(d.get("marginal", False)),
            reasons=tuple(d.get("reasons") or ()),
            tentative=bool(d.get("tentative", False)),
        )

    def finite(self) -> Verdict:
        """This verdict with every NaN/Infinity as None (what JSON and text show)."""
        return Verdict.from_dict(finite_json(self.to_dict()))


@dataclass(frozen=True, slots=True)
class SpikeView:
    """One inter-token gap above the target and the cause it was attributed to."""

    request_id: str
    t_start: float
    t_end: float
    gap_s: float
    cause: str
    rule: str | None = None  # the finding's finer name ("delivery", "recompute", ...)
    confidence: float | None = None
    ended_by: str | None = None  # token, finish, cancel, ...
    evidence: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "t_start": self.t_start, "t_end": self.t_end, "gap_s": self.gap_s,
                "cause": self.cause, "rule": self.rule, "confidence": self.confidence, "ended_by": self.ended_by,
                "evidence": list(self.evidence)}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> SpikeView:
        return SpikeView(str(d["request_id"]), d["t_start"], d["t_end"], d["gap_s"], str(d["cause"]), d.get("rule"),
                         d.get("confidence"), d.get("ended_by"), tuple(d.get("evidence") or ()))


@dataclass(frozen=True, slots=True)
class CauseRow:
    """Spikes attributed to one cause: how many, their share, their mean confidence."""

    count: int
    share: float
    mean_confidence: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "share": self.share, "mean_confidence": self.mean_confidence}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> CauseRow:
        return CauseRow(d["count"], d["share"], d.get("mean_confidence"))


@dataclass(frozen=True, slots=True)
class RequestRow:
    """One observed stream: its spikes, the preemption ones, its longest gap."""

    request_id: str
    spikes: int
    preemption_spikes: int
    max_gap_s: float
    tokens: int
    last_cause: str | None = None
    ended_by: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "spikes": self.spikes, "preemption_spikes": self.preemption_spikes,
                "max_gap_s": self.max_gap_s, "tokens": self.tokens, "last_cause": self.last_cause,
                "ended_by": self.ended_by}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RequestRow:
        return RequestRow(str(d["request_id"]), d["spikes"], d["preemption_spikes"], d["max_gap_s"], d["tokens"],
                          d.get("last_cause"), d.get("ended_by"))


@dataclass(frozen=True, slots=True)
class PreemptionCheck:
    """vLLM's per-request preemption histogram against kvtop's preemption spikes: of the requests
    whose finish pins one histogram observation, on how many the two agree, and of the preemptions
    the engine counted on them, how many kvtop found and how many it called beyond them."""

    finished_requests: float
    engine_preemptions: float
    pinned_requests: int
    pinned_agree: int
    pinned_kvtop_more: int
    pinned_kvtop_fewer: int
    pinned_engine_preemptions: int = 0  # the engine's count over the pinned requests
    pinned_kvtop_found: int = 0  # of those, the ones kvtop called (per request, at most the engine's count)
    pinned_kvtop_extra: int = 0  # kvtop's preemption spikes on them beyond the engine's count

    def to_dict(self) -> dict[str, Any]:
        return {"finished_requests": self.finished_requests, "engine_preemptions": self.engine_preemptions,
                "pinned_requests": self.pinned_requests, "pinned_agree": self.pinned_agree,
                "pinned_kvtop_more": self.pinned_kvtop_more, "pinned_kvtop_fewer": self.pinned_kvtop_fewer,
                "pinned_engine_preemptions": self.pinned_engine_preemptions,
                "pinned_kvtop_found": self.pinned_kvtop_found, "pinned_kvtop_extra": self.pinned_kvtop_extra}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> PreemptionCheck:
        return PreemptionCheck(d["finished_requests"], d["engine_preemptions"], d["pinned_requests"],
                               d["pinned_agree"], d["pinned_kvtop_more"], d["pinned_kvtop_fewer"],
                               d.get("pinned_engine_preemptions", 0), d.get("pinned_kvtop_found", 0),
                               d.get("pinned_kvtop_extra", 0))


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """How the engine's prefill time grows with a prompt's length, fitted to its own per-request
    times (``attribution.request_times``): ``fixed_s + a·n + a·k_att·n²`` for ``n`` computed prompt
    tokens. ``a`` prices a token at the prompt's start, ``k_att`` how much dearer each position makes
    the tokens after it (attention); a chunked prefill's last chunk costs ``1 + 2·k_att·n`` times its
    first."""

    prompts: int  # requests the fit read
    shortest_tokens: int
    longest_tokens: int
    s_per_token: float  # a (these three to 6 significant digits, as the report writes them)
    k_att: float | None  # None: the lengths seen could not separate it from the rest
    fixed_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "shortest_tokens": self.shortest_tokens,
                "longest_tokens": self.longest_tokens, "s_per_token": self.s_per_token, "k_att": self.k_att,
                "fixed_s": self.fixed_s}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> PrefillFit:
        return PrefillFit(int(d["prompts"]), int(d["shortest_tokens"]), int(d["longest_tokens"]),
                          float(d["s_per_token"]), None if d["k_att"] is None else float(d["k_att"]),
                          float(d["fixed_s"]))


_TIMES_KEYS = ("requests", "queued_requests", "queue_s_median", "queue_s_p90", "queue_s_max",
               "engine_prefill_tokens_per_s", "outside_engine_ttft_s_median", "tail_delivery_s_median",
               "tail_delivery_s_max")


@dataclass(frozen=True, slots=True)
class EngineRequestTimes:
    """The engine's own per-request times (vLLM ``--enable-per-request-metrics``, read from finish
    records) beside kvtop's observation of the same requests (``attribution.request_times``)."""

    requests: int
    queued_requests: int  # queued >= 0.1 s before first scheduled
    queue_s_median: float | None
    queue_s_p90: float | None
    queue_s_max: float | None
    engine_prefill_tokens_per_s: float | None  # median prompt tokens / engine TTFT
    outside_engine_ttft_s_median: float | None  # observed TTFT - queue - engine TTFT
    tail_delivery_s_median: float | None  # observed first..last token span - the engine's
    tail_delivery_s_max: float | None
    prefill_fit: PrefillFit | None = None  # prefill time against prompt length, where prompts varied enough

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in _TIMES_KEYS}
        if self.prefill_fit is not None:
            d["prefill_fit"] = self.prefill_fit.to_dict()
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> EngineRequestTimes:
        fit = d.get("prefill_fit")
        rest: dict[str, Any] = {k: d.get(k) for k in _TIMES_KEYS[2:]}
        return EngineRequestTimes(int(d.get("requests") or 0), int(d.get("queued_requests") or 0), **rest,
                                  prefill_fit=PrefillFit.from_dict(fit) if fit else None)


@dataclass(frozen=True, slots=True)
class ResumeCosts:
    """What resuming preempted requests cost the engine, by its own step log (the witness): positions
    it had again without computing them (its prefix cache's full blocks, or a KV connector's load,
    e.g. vLLM V1's offloading connector) against positions it recomputed."""

    resumes: int  # resumed requests the witness reported the restored positions of
    restored_tokens: int
    recomputed_tokens: int  # every recomputed position of the run

    @property
    def restored_share(self) -> float | None:
        total = self.restored_tokens + self.recomputed_tokens
        return self.restored_tokens / total if total else None

    def to_dict(self) -> dict[str, Any]:
        share = self.restored_share
        return {"resumes": self.resumes, "restored_tokens": self.restored_tokens,
                "recomputed_tokens": self.recomputed_tokens,
                "restored_share": None if share is None else round(share, 4)}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ResumeCosts:
        return ResumeCosts(int(d.get("resumes") or 0), int(d.get("restored_tokens") or 0),
                           int(d.get("recomputed_tokens") or 0))


@dataclass(frozen=True, slots=True)
class PrefillCompute:
    """What computing prompt and recompute tokens cost the engine, by its own step log (the witness):
    the steps that ran such tokens, and their time beyond the decode-only step just before each. Its
    rate is the engine's marginal prefill throughput, which prompt tokens / a request's TTFT cannot
    give where a step's fixed cost or other prompts in the same step fill the TTFT (short prompts,
    bursts, resumes)."""

    steps: int
    tokens: int  # prompt and recompute tokens those steps computed
    seconds: float  # their time beyond a decode-only step

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        rate = self.tokens_per_s
        return {"steps": self.steps, "tokens": self.tokens, "seconds": round(self.seconds, 6),
                "tokens_per_s": None if rate is None else round(rate, 1)}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> PrefillCompute:
        return PrefillCompute(int(d.get("steps") or 0), int(d.get("tokens") or 0), float(d.get("seconds") or 0.0))


@dataclass(frozen=True, slots=True)
class MergedTokens:
    """Tokens the engine counted (its usage at each stream's finish) beyond those the streams' chunks
    numbered: they reached the client several to a chunk (the API server merging outputs, or holding
    back text until a character, a stop string, a tool call or a reasoning block completes;
    speculative decoding's extra tokens count the same). A stop is counted by the engine and sent as no
    text: one token of a stream that stopped is not counted as merged. A merged chunk closes a gap of
    as many decode steps, which a target of a few steps misses whatever the engine did: ``spikes_max``
    bounds how many spikes can be such chunks (those closed by a record of more tokens than its
    stream's records usually carried, and per stream with usage the fewer of its merged tokens and its
    other spikes). Counted over the streams the analysis holds: all of a trace's; in a live run the
    latest few thousand."""

    streams: int  # finished streams whose engine reported usage (that had chunks, none of their bytes lost)
    usage_tokens: int  # the tokens the engine counted for them
    tokens: int  # of them, tokens beyond what the chunks numbered
    spikes_max: int  # spikes that can be merged chunks, at most

    def to_dict(self) -> dict[str, Any]:
        return {"streams": self.streams, "usage_tokens": self.usage_tokens, "tokens": self.tokens,
                "spikes_max": self.spikes_max}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> MergedTokens:
        return MergedTokens(int(d.get("streams") or 0), int(d.get("usage_tokens") or 0), int(d.get("tokens") or 0),
                            int(d.get("spikes_max") or 0))


# The shape `kvtop analyze --format json` prints (kvtop/schemas/analysis.schema.json); the number
# changes when a field changes meaning or goes away, not when one is added.
ANALYSIS_SCHEMA = "kvtop-analysis/1"


@dataclass(frozen=True, slots=True)
class AnalysisReport:
    """Spikes, their causes and the verdict over one trace or the live run so far.

    ``basis`` is ``requests`` (per-stream token timings attributed spike by spike) or
    ``aggregate`` (engine counters and histograms only). ``spikes`` lists at most the analysis'
    ``keep_spikes`` newest; ``spikes_total`` counts them all. ``pending_spikes`` is the live
    analysis' count of spikes still waiting for their evidence window (None in a batch report).
    """

    basis: str = "requests"
    itl_target_s: float | None = None
    itl_target_source: str | None = None
    median_gap_s: float | None = None
    records: int = 0
    gaps: int = 0
    spikes: tuple[SpikeView, ...] = ()
    spikes_total: int = 0
    causes: Mapping[str, CauseRow] = field(default_factory=dict)
    over_target_s: Mapping[str, float] | None = None  # seconds over the target per cause (requests basis)
    requests: tuple[RequestRow, ...] = ()
    request_preemptions: PreemptionCheck | None = None
    engine_request_times: EngineRequestTimes | None = None
    resume_costs: ResumeCosts | None = None  # where a witness reported resumes
    prefill_compute: PrefillCompute | None = None  # where a witness logged prompt/recompute steps
    # of the spikes a witness read, those whose tokens the engine made on pace and the client got in one
    # chunk (held outside its steps); None where no witness read a spike
    held_spikes: int | None = None
    merged_tokens: MergedTokens | None = None  # where the engine counted finished streams' tokens (usage)
    verdict: Verdict | None = None
    warnings: tuple[str, ...] = ()
    pending_spikes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "basis": self.basis,
            "itl_target_s": self.itl_target_s,
            "itl_target_source": self.itl_target_source,
            "median_gap_s": self.median_gap_s,
            "records": self.records,
            "gaps": self.gaps,
            "spikes": [s.to_dict() for s in self.spikes],
            "spikes_listed": len(self.spikes),
            "spikes_total": self.spikes_total,
            "causes": {c: row.to_dict() for c, row in self.causes.items()},
            "over_target_s": dict(self.over_target_s) if self.over_target_s is not None else None,
            "requests": [r.to_dict() for r in self.requests],
            "request_preemptions": self.request_preemptions.to_dict() if self.request_preemptions else None,
            "engine_request_times": self.engine_request_times.to_dict() if self.engine_request_times else None,
            "resume_costs": self.resume_costs.to_dict() if self.resume_costs else None,
            "prefill_compute": self.prefill_compute.to_dict() if self.prefill_compute else None,
            "held_spikes": self.held_spikes,
            "merged_tokens": self.merged_tokens.to_dict() if self.merged_tokens else None,
            "verdict": self.verdict.to_dict() if self.verdict is not None else None,
            "warnings": list(self.warnings),
        }
        if self.pending_spikes is not None:
            out["pending_spikes"] = self.pending_spikes
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> AnalysisReport:
        rp = d.get("request_preemptions")
        et = d.get("engine_request_times")
        rc = d.get("resume_costs")
        pc = d.get("prefill_compute")
        mt = d.get("merged_tokens")
        v = d.get("verdict")
        over = d.get("over_target_s")
        return AnalysisReport(
            basis=str(d.get("basis", "requests")),
            itl_target_s=d.get("itl_target_s"),
            itl_target_source=d.get("itl_target_source"),
            median_gap_s=d.get("median_gap_s"),
            records=d.get("records", 0),
            gaps=d.get("gaps", 0),
            spikes=tuple(SpikeView.from_dict(s) for s in d.get("spikes") or ()),
            spikes_total=d.get("spikes_total", 0),
            causes={c: CauseRow.from_dict(row) for c, row in (d.get("causes") or {}).items()},
            over_target_s=dict(over) if over is not None else None,
            requests=tuple(RequestRow.from_dict(r) for r in d.get("requests") or ()),
            request_preemptions=PreemptionCheck.from_dict(rp) if rp else None,
            engine_request_times=EngineRequestTimes.from_dict(et) if et else None,
            resume_costs=ResumeCosts.from_dict(rc) if rc else None,
            prefill_compute=PrefillCompute.from_dict(pc) if pc else None,
            held_spikes=d.get("held_spikes"),
            merged_tokens=MergedTokens.from_dict(mt) if mt else None,
            verdict=Verdict.from_dict(v) if v else None,
            warnings=tuple(d.get("warnings") or ()),
            pending_spikes=d.get("pending_spikes"),
        )

    def finite(self) -> AnalysisReport:
        """This report with every NaN/Infinity as None (what JSON and text show)."""
        return AnalysisReport.from_dict(finite_json(self.to_dict()))

    def to_json(self, version: str) -> dict[str, Any]:
        """What `kvtop analyze --format json` prints: the report under its version and schema
        name, floats rounded for output (``output_json``)."""
        out: dict[str, Any] = output_json({"kvtop_version": version, "schema": ANALYSIS_SCHEMA, **self.to_dict()})
        return out


@dataclass(frozen=True, slots=True)
class AnalysisCounters:
    """Running totals of a live analysis since it started (what `kvtop agent` exports as counters)."""

    spikes_by_cause: Mapping[str, int]
    stall_s_by_cause: Mapping[str, float]
    preemptions_attributed: int  # streams with at least one stall attributed to preemption
