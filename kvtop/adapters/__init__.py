"""The public adapter SDK: everything an engine adapter (built in or third party) needs.

An adapter imports only this package and ``kvtop.model``::

    from kvtop.adapters import EngineAdapter, Setting, prefix_score, read_page
    from kvtop.model.records import EngineRecord

``Page`` selects series by exact labels or a predicate and reads values and histograms;
``prefix_score`` gives the shared detection scale; ``Setting`` names the knobs the advisor
recommends; ``as_int`` converts a scraped number without ever raising; ``positive_whole`` keeps a
limit (``EngineRecord.limits``) only where it is a whole number of at least 1.
"""

from kvtop.adapters.base import NORMALIZED_FIELDS, EngineAdapter, Setting
from kvtop.adapters.detect import LIKELY, SURE, prefix_score
from kvtop.adapters.page import (
    MAX_SAMPLES,
    PARSE_BUDGET_S,
    Keep,
    Labels,
    Match,
    Page,
    counter_names,
    parse_page,
    read_page,
)
from kvtop.model.sanitize import as_int, finite_or_none, positive_whole

__all__ = [
    "LIKELY", "MAX_SAMPLES", "NORMALIZED_FIELDS", "PARSE_BUDGET_S", "SURE", "EngineAdapter", "Keep",
    "Labels", "Match", "Page", "Setting", "as_int", "counter_names", "finite_or_none", "parse_page",
    "positive_whole", "prefix_score", "read_page",
]
