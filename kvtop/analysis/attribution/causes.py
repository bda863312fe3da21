"""The causes a token-gap spike is attributed to."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Cause(str, Enum):
    """A str subclass, so reports and JSON carry the plain names ("preemption", ...)."""

    PREEMPTION = "preemption"
    PREFILL = "prefill_interference"
    SLOW_DECODE = "slow_decode"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# in the order reports list them
ALL = (Cause.PREEMPTION, Cause.PREFILL, Cause.SLOW_DECODE, Cause.UNKNOWN)

# the ``rule`` of a spike read from the engine's own step log (a witness): its cause, or that the log
# cannot tell it (kvtop/analysis/witness.py)
WITNESS_KINDS = ("witness", "witness-ambiguous")


@dataclass
class Finding:
    """A rule's answer: the cause, how sure, and the evidence in words (shown to the operator)."""

    cause: Cause
    confidence: float
    lines: list[str] = field(default_factory=list)
    kind: str | None = None  # a finer name where it helps: "host", "delivery", "recompute", "onset"
    key: str | None = None  # its entry in thresholds.CONFIDENCE (the calibrated base confidence)
    discounts: tuple[str, ...] = ()  # thresholds.DISCOUNT entries applied (coarse, sparse, chunked)
    tight: bool = False  # judged at a tight target: its base is thresholds.CONFIDENCE_TIGHT's, where it has one


@dataclass
class Signs:
    """What a rule saw but found too weak to answer on: the lines lead whatever answer a later rule
    gives instead (``classify`` carries them)."""

    lines: list[str]
