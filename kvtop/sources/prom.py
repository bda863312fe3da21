"""Tolerant reading of a Prometheus text exposition, shared by every adapter.

The fast path is one pass of prometheus-client's parser. If the page is truncated or partly
invalid (the parser raises), the page is re-read line by line and every line that parses is kept,
with a warning — partial data beats no data on a bad scrape.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from kvtop.model.records import Histogram

Labels = dict[str, str]


class Page:
    """Samples of one scrape, indexed by sample (wire) name."""

    __slots__ = ("samples", "warnings")

    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[Labels, float]]] = defaultdict(list)
        self.warnings: list[str] = []

    @property
    def names(self) -> set[str]:
        return set(self.samples)

    def has(self, name: str) -> bool:
        return name in self.samples

    def first_present(self, *names: str) -> str | None:
        for n in names:
            if n in self.samples:
                return n
        return None

    def label_values(self, label: str, names: Iterable[str] | None = None) -> list[str | None]:
        """Distinct values of ``label`` across the given (or all) sample names; [None] if never set."""
        seen: dict[str | None, None] = {}
        for n in names if names is not None else self.samples:
            for labels, _ in self.samples.get(n, ()):
                seen.setdefault(labels.get(label))
        return list(seen) or [None]

    def select(self, name: str, match: Labels | None = None) -> list[tuple[Labels, float]]:
        rows = self.samples.get(name)
        if not rows:
            return []
        if not match:
            return rows
        return [(lb, v) for lb, v in rows if all(lb.get(k) == want for k, want in match.items())]

    def value(self, name: str, match: Labels | None = None) -> float | None:
        """Sum of the matching samples (None if absent or all NaN)."""
        rows = self.select(name, match)
        vals = [v for _, v in rows if not math.isnan(v)]
        return sum(vals) if vals else None

    def histogram(self, base: str, match: Labels | None = None) -> Histogram | None:
        """Cumulative histogram ``base`` summed over series that match (e.g. one engine)."""
        rows = self.select(base + "_bucket", match)
        if not rows:
            return None
        by_le: dict[float, float] = defaultdict(float)
        for lb, v in rows:
            le = lb.get("le")
            if le is None:
                continue
            try:
                by_le[float(le)] += v
            except ValueError:
                continue
        if not by_le:
            return None
        buckets = sorted(by_le.items())
        count = self.value(base + "_count", match)
        total = self.value(base + "_sum", match)
        if count is None:
            count = buckets[-1][1]
        return Histogram(buckets, count, total if total is not None else math.nan)


def _ingest(page: Page, families: Iterable) -> None:
    add = page.samples
    for fam in families:
        for s in fam.samples:
            add[s.name].append((s.labels, s.value))


def parse_page(text: str) -> Page:
    """Parse an exposition; never raises on bad content (warnings say what was skipped)."""
    page = Page()
    try:
        _ingest(page, text_string_to_metric_families(text))
        return page
    except Exception as e:  # the parser raises ValueError/IndexError/... on bad lines
        first_error = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
    page = Page()
    bad = 0
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            _ingest(page, text_string_to_metric_families(s + "\n"))
        except Exception:
            bad += 1
    page.warnings.append(f"partly invalid metrics page: skipped {bad} unparseable line(s) (first error: {first_error})")
    return page
