"""Classify one spike: ask the rules in their table's order (``rules.RULES``), the first finding wins."""

from __future__ import annotations

from kvtop.analysis.attribution.causes import Finding, Signs
from kvtop.analysis.attribution.evidence import Evidence
from kvtop.analysis.attribution.rules import ANY, RULES, Rule, Stall, stall_of


def classify(ev: Evidence, rules: tuple[Rule, ...] = RULES) -> Finding:
    signs: list[str] = []
    stall: Stall | None = None  # read once, by the first row that asks: the rows before it never need it
    for rule in rules:
        if rule.when is not ANY:
            if stall is None:
                stall = stall_of(ev)
            if stall not in rule.when.stalls:
                continue
        out = rule.explain(ev)
        if isinstance(out, Signs):
            signs += out.lines
        elif out is not None:
            if rule.context:
                out.lines = ev.context_lines() + signs + out.lines
            return out
    raise LookupError("no rule answered: the table must end with a rule for every stall")
