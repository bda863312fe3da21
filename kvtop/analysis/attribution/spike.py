"""A judged spike: the candidate gap detection built and the finding attribution made of it.

The two are kept side by side; the finding is never written into the candidate (a ``Gap`` is frozen).
What a later rule needs of a stream's previous spike (its cause, kind, where it ended) it reads here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.gaps import Gap


@dataclass(frozen=True, slots=True)
class Spike:
    candidate: Gap
    finding: Finding

    # which spike: read from the candidate
    @property
    def request_id(self) -> str:
        return self.candidate.request_id

    @property
    def t_start(self) -> float:
        return self.candidate.t_start

    @property
    def t_end(self) -> float:
        return self.candidate.t_end

    @property
    def ended_by(self) -> str:
        return self.candidate.ended_by

    # what it was judged: read from the finding
    @property
    def cause(self) -> Cause:
        return self.finding.cause

    @property
    def kind(self) -> str | None:
        return self.finding.kind

    @property
    def confidence(self) -> float:
        return self.finding.confidence

    @property
    def evidence(self) -> list[str]:
        return self.finding.lines

    @property
    def rule_key(self) -> str | None:
        return self.finding.key

    @property
    def discounts(self) -> tuple[str, ...]:
        return self.finding.discounts

    @property
    def tight(self) -> bool:
        return self.finding.tight
