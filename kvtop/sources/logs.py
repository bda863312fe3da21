"""Engine log lines that carry KV-pressure facts, parsed into typed events.

Formats: docs/engines.md §2.5 (vLLM) and §3.2 (SGLang).

* SGLang retraction (SGLang's preemption), three historical forms:
  - since 2025-12-24, WARNING: ``KV cache pool is full. Retract requests. #retracted_reqs: N,
    #new_tokens_gained: M[, #mamba_num_gained: K], #new_token_ratio: a -> b`` (optionally prefixed
    ``Testing retraction. `` under ``SGLANG_TEST_RETRACT``);
  - 2025-05-31 .. 2025-12-24, INFO: the same without ``#new_tokens_gained``;
  - before 2025-05-31: ``Decode out of memory happened. #retracted_reqs: N, #new_token_ratio: a -> b``.
* SGLang periodic decode line ``Decode batch[.,] #running-req: N, ... #queue-req: N`` (PD decode
  nodes add ``#prealloc-req``, ``#transfer-req``, ``#retracted-req``).
* vLLM V0 preemption warning (V0 only; printed for the 1st, 51st, 101st ... preemption, so the
  cumulative number it carries is the useful part), in the code's form
  ``scheduler.py:<n>] ... total_num_cumulative_preemption=<n>`` and the docs' variant
  (no ``]``, ``total_cumulative_preemption_cnt=``).

SGLang lines may start with ``[YYYY-MM-DD HH:MM:SS DP0 TP0] `` (ranks vary); vLLM lines with an
optional process prefix ``(EngineCore pid=1) `` and ``LEVEL MM-DD HH:MM:SS [file:line] ``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvtop.model.records import RequestRecord

_SG_PREFIX = re.compile(r"^\[(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?P<ranks>(?: [A-Z]+\d+)*)\]\s*")
_RANK = re.compile(r"([A-Z]+)(\d+)")
_NUM = r"[-+]?\d+(?:\.\d+)?"

_RETRACT = re.compile(
    r"(?P<test>Testing retraction\. )?"
    r"(?P<head>KV cache pool is full\. Retract requests\.|Decode out of memory happened\.)\s*"
    r"#retracted_reqs: (?P<n>\d+)"
    r"(?:, #new_tokens_gained: (?P<gained>\d+))?"
    r"(?:, #mamba_num_gained: (?P<mamba>\d+))?"
    rf", #new_token_ratio: (?P<old>{_NUM}) -> (?P<new>{_NUM})"
)
_DECODE = re.compile(r"Decode batch(?:\.|,| \d+,)?\s*(?P<body>#running-req: .*)$")
_FIELD = re.compile(r"(#?[A-Za-z][\w\- ()/]*?):\s*([^,]+)")

_VLLM_PREEMPT = re.compile(
    r"^(?:\((?P<proc>[^)]*)\)\s+)?"
    r"(?:(?P<level>[A-Z]+)\s+(?P<ts>\d{2}-\d{2} \d{2}:\d{2}:\d{2})\s+\[?(?P<src>[\w./-]+:\d+)(?P<bracket>\])?\s+)?"
    r"Sequence group (?P<rid>\S+) is preempted by PreemptionMode\.(?P<mode>RECOMPUTE|SWAP) mode "
    r"because there is not enough KV cache space\..*?"
    r"(?P<key>total_num_cumulative_preemption|total_cumulative_preemption_cnt)=(?P<n>\d+)"
)


@dataclass(frozen=True, slots=True)
class SglangRetraction:
    """SGLang retracted running requests to free KV (requests are re-queued and recomputed)."""

    retracted_reqs: int
    new_token_ratio_before: float
    new_token_ratio_after: float
    # "2025-12+" (WARNING, with #new_tokens_gained), "2025-05..2025-12" (INFO), "pre-2025-05"
    form: str
    new_tokens_gained: int | None = None
    mamba_num_gained: int | None = None
    testing: bool = False  # SGLANG_TEST_RETRACT forced it: not real KV pressure
    timestamp: str | None = None
    ranks: dict[str, int] = field(default_factory=dict)
    engine: str = "sglang"


@dataclass(frozen=True, slots=True)
class SglangDecodeBatch:
    """SGLang's periodic decode statistics line."""

    running_reqs: int
    queue_reqs: int | None = None
    num_tokens: int | None = None
    token_usage: float | None = None
    gen_throughput: float | None = None
    retracted_reqs: int | None = None  # PD decode nodes: size of the retracted queue
    prealloc_reqs: int | None = None
    transfer_reqs: int | None = None
    timestamp: str | None = None
    ranks: dict[str, int] = field(default_factory=dict)
    engine: str = "sglang"


@dataclass(frozen=True, slots=True)
class VllmPreemption:
    """vLLM V0 scheduler warning: one request preempted; ``cumulative`` counts all preemptions."""

    request_id: str
    mode: str  # RECOMPUTE or SWAP
    cumulative: int
    docs_variant: bool  # the documentation's wording, not the code's
    timestamp: str | None = None
    source: str | None = None  # "scheduler.py:1057"
    engine: str = "vllm"

    def to_record(self, t: float) -> RequestRecord:
        """A request ``preempt`` event; V0 names the sequence group by the engine's request id."""
        return RequestRecord(t=t, id=self.request_id, event="preempt", source="engine")


LogEvent = SglangRetraction | SglangDecodeBatch | VllmPreemption


def _ranks(s: str) -> dict[str, int]:
    return {k: int(v) for k, v in _RANK.findall(s)}


def _num(v: str | None, kind: type = int) -> int | float | None:
    if v is None:
        return None
    v = v.strip()
    try:
        return kind(float(v)) if kind is int else float(v)
    except ValueError:
        return None


def parse_line(line: str) -> LogEvent | None:
    """The event a log line carries, or None for any other line."""
    line = line.rstrip("\r\n")
    if "Sequence group" in line:
        m = _VLLM_PREEMPT.search(line)
        if m:
            return VllmPreemption(
                request_id=m["rid"], mode=m["mode"], cumulative=int(m["n"]),
                docs_variant=m["key"] == "total_cumulative_preemption_cnt" or (m["src"] is not None and not m["bracket"]),
                timestamp=m["ts"], source=m["src"],
            )
        return None
    ts = None
    ranks: dict[str, int] = {}
    pm = _SG_PREFIX.match(line)
    if pm:
        ts, ranks = pm["ts"], _ranks(pm["ranks"])
    if "#retracted_reqs" in line:
        m = _RETRACT.search(line)
        if not m:
            return None
        if m["head"].startswith("Decode out of memory"):
            form = "pre-2025-05"
        elif m["gained"] is not None:
            form = "2025-12+"
        else:
            form = "2025-05..2025-12"
        return SglangRetraction(
            retracted_reqs=int(m["n"]), new_token_ratio_before=float(m["old"]), new_token_ratio_after=float(m["new"]),
            form=form, new_tokens_gained=_num(m["gained"]), mamba_num_gained=_num(m["mamba"]),  # type: ignore[arg-type]
            testing=m["test"] is not None, timestamp=ts, ranks=ranks,
        )
    if "Decode batch" in line:
        m = _DECODE.search(line)
        if not m:
            return None
        f = {k.strip(): v for k, v in _FIELD.findall(m["body"])}
        running = _num(f.get("#running-req"))
        if running is None:
            return None
        tp = next((v for k, v in f.items() if k.startswith("gen throughput")), None)
        return SglangDecodeBatch(
            running_reqs=int(running), queue_reqs=_num(f.get("#queue-req")),  # type: ignore[arg-type]
            num_tokens=_num(f.get("#token")), token_usage=_num(f.get("token usage"), float),  # type: ignore[arg-type]
            gen_throughput=_num(tp, float), retracted_reqs=_num(f.get("#retracted-req")),  # type: ignore[arg-type]
            prealloc_reqs=_num(f.get("#prealloc-req")), transfer_reqs=_num(f.get("#transfer-req")),  # type: ignore[arg-type]
            timestamp=ts, ranks=ranks,
        )
    return None


def parse_lines(lines: Iterable[str]) -> Iterator[LogEvent]:
    """Events from a stream of lines (a file, a ``docker logs -f`` pipe); other lines are skipped."""
    for line in lines:
        ev = parse_line(line)
        if ev is not None:
            yield ev
