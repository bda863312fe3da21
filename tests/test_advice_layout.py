"""kvtop.analysis.advice has no import circle, not even one for a type (issue 21: advisor <-> diagnosis)."""

from __future__ import annotations

import grimp


def test_no_import_circle_inside_kvtop_analysis_advice_type_checking_imports_included():
    g = grimp.build_graph("kvtop", exclude_type_checking_imports=False, cache_dir=None)  # no stale cache
    mods = sorted(m for m in g.modules if m.startswith("kvtop.analysis.advice."))
    assert {"kvtop.analysis.advice.advisor", "kvtop.analysis.advice.diagnosis",
            "kvtop.analysis.advice.situation"} <= set(mods)
    circles = [(a, b) for i, a in enumerate(mods) for b in mods[i + 1:]
               if g.chain_exists(importer=a, imported=b) and g.chain_exists(importer=b, imported=a)]
    assert circles == []
