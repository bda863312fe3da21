"""The analysis package has no import cycles (issue 11: analyzer <-> fastscan/inputs/live/report/scan)."""

from __future__ import annotations

import grimp


def test_no_import_cycle_inside_kvtop_analysis():
    # imports under `if TYPE_CHECKING:` never run, so they cannot form a cycle
    g = grimp.build_graph("kvtop", exclude_type_checking_imports=True)
    mods = sorted(m for m in g.modules if m.startswith("kvtop.analysis"))
    assert "kvtop.analysis.attribution.evidence" in mods
    cycles = [(a, b) for i, a in enumerate(mods) for b in mods[i + 1:]
              if g.chain_exists(importer=a, imported=b) and g.chain_exists(importer=b, imported=a)]
    assert cycles == []
