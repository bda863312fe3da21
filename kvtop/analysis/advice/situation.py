"""What the advisor decides from: ``Situation`` (every input, observed or given) and ``Num`` (one
figure with its unit and source).

Their own module so that the diagnosis, the advisor, the scenario reader and the trace analysis all
read one type without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtop.analysis.advice.costmodel import Victim
from kvtop.analysis.advice.kvbytes import KVSize
from kvtop.model.analysis import Number

if TYPE_CHECKING:
    from kvtop.analysis.engines import EngineSemantics

# `kvtop analyze` scales an aggregate-only attribution's confidence by this; a saved scenario
# carries the scaled figure so that `kvtop advise` gives the same confidence
AGGREGATE_CONFIDENCE_SCALE = 0.6


@dataclass
class Num:
    value: Any
    unit: str
    source: str  # measured | given | config | assumed | derived
    note: str | None = None
    low: bool = False  # a measured lower bound of the true figure (a verdict that hinges on it says so)

    def to_number(self) -> Number:
        """The report's figure: floats to 6 significant digits (more is noise in a verdict)."""
        v = self.value
        if isinstance(v, float):
            v = float(f"{v:.6g}")
        return Number(v, self.unit, self.source, self.note, self.low)


@dataclass
class Situation:
    """Everything the advisor needs; any field may be missing (None)."""

    engine: str | None = None
    preempts: bool = True
    settings_names: dict[str, str] = field(default_factory=dict)
    budget_holds_decodes: bool = False  # the adapter's ``budget_holds_decodes`` (vLLM V1)
    setting_notes: dict[str, str] = field(default_factory=dict)  # the adapter's ``setting_notes``
    chunks_prefills: bool | None = None  # the adapter's ``chunks_prefills`` (a run's own state wins)
    budget_in_blocks: bool = False  # the adapter's ``budget_in_blocks`` (SGLang)
    # diagnosis
    cause: str | None = None  # dominant cause of ITL misses, None = no misses observed
    cause_shares: dict[str, float] = field(default_factory=dict)
    spikes: int | None = None
    itl_miss: bool | None = None
    attribution_confidence: float | None = None
    basis: str = "given"  # given | requests | aggregate
    cause_given: str | None = None  # a scenario's explicit cause (decides the diagnosis)
    cause_counts: dict[str, float] = field(default_factory=dict)  # spikes per cause
    cause_lost_s: dict[str, float] = field(default_factory=dict)  # seconds over target per cause
    cause_streams: dict[str, int] = field(default_factory=dict)  # streams hit per cause
    has_preemption_section: bool = False
    decided_by: list[dict[str, str]] = field(default_factory=list)
    size: KVSize | None = None  # the one KV-size function (windows, MLA, state, TP/PP)
    swap_impl: str | None = None  # vllm_v0_swap | vllm_v1_offload | lmcache | sglang_hicache | none
    host_tier: str | None = None  # the adapter's ``host_tier``: the implementation where none is stated
    evidence_hint: str | None = None
    cause_confidence: dict[str, float] = field(default_factory=dict)  # mean attribution confidence per cause
    confidence_scale: float = 1.0
    # inputs (Num values)
    n: dict[str, Num] = field(default_factory=dict)
    victims: list[Victim] = field(default_factory=list)
    deficit_bytes: float | None = None
    prefix: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)

    def use_engine(self, sem: EngineSemantics) -> None:
        """What the engine's adapter says the advisor must respect: its flags, whether its token budget
        holds the decodes, what it requires of a value."""
        self.settings_names = dict(sem.settings)
        self.budget_holds_decodes = sem.budget_holds_decodes
        self.setting_notes = dict(sem.setting_notes)
        self.host_tier = sem.host_tier
        self.chunks_prefills = sem.chunks_prefills
        self.budget_in_blocks = sem.budget_in_blocks

    def v(self, key: str) -> Any:
        x = self.n.get(key)
        return None if x is None else x.value
