"""One scrape's samples and the selection API adapters read them with.

Reading is tolerant and bounded. The page is parsed by prometheus-client in chunks of whole lines;
a chunk the parser rejects is re-read line by line, so one bad line costs one chunk, not the page.
A page with more than ``MAX_SAMPLES`` samples, or whose parse runs past ``PARSE_BUDGET_S``, is
cut there with a warning: partial data beats a console stalled on one pathological engine.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.parser import text_string_to_metric_families

from kvtop.model.records import Histogram

Labels = dict[str, str]
Keep = Callable[[Labels], bool]
# A selection: exact label values (fast, indexed), a predicate, or nothing (every series).
Match = Labels | Keep | None
Row = tuple[Labels, float]

# A real page is a few thousand samples (vLLM with 8 DP ranks: ~3,000); prometheus-client reads
# ~30-50k samples/s, so these bound one scrape's parse to about 2-3 s of one core.
MAX_SAMPLES = 100_000
PARSE_BUDGET_S = 3.0
CHUNK_LINES = 4096
_INF_LE = ("+Inf", "Inf", "inf")


class Page:
    """Samples of one scrape, indexed by sample (wire) name.

    Selections by exact label value use a per-(name, label) index built on first use, so selecting
    each of N engines costs the engine's own rows, not N x all rows.
    """

    __slots__ = ("samples", "warnings", "_index", "_nan_said")

    def __init__(self) -> None:
        self.samples: dict[str, list[Row]] = defaultdict(list)
        self.warnings: list[str] = []
        self._index: dict[tuple[str, str], dict[str | None, list[Row]]] = {}
        self._nan_said: set[str] = set()

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

    def _by_label(self, name: str, label: str) -> dict[str | None, list[Row]]:
        key = (name, label)
        idx = self._index.get(key)
        if idx is None:
            idx = defaultdict(list)
            for row in self.samples.get(name, ()):
                idx[row[0].get(label)].append(row)
            self._index[key] = idx
        return idx

    def select(self, name: str, match: Match = None) -> list[Row]:
        """Rows of sample ``name`` whose labels match (label equality, or a predicate)."""
        rows = self.samples.get(name)
        if not rows:
            return []
        if match is None:
            return rows
        if callable(match):
            return [r for r in rows if match(r[0])]
        if not match:
            return rows
        items = iter(match.items())
        k0, want0 = next(items)
        rest = list(items)
        cand = self._by_label(name, k0).get(want0, [])
        if not rest:
            return cand
        return [(lb, v) for lb, v in cand if all(lb.get(k) == w for k, w in rest)]

    def value(self, names: str | tuple[str, ...], match: Match = None) -> float | None:
        """Sum of the first present name's matching, non-NaN samples (None if absent or all NaN).

        ``names`` may list spellings newest first; the first one on the page is used.
        """
        for n in (names,) if isinstance(names, str) else names:
            if n in self.samples:
                rows = self.select(n, match)
                vals = [v for _, v in rows if not math.isnan(v)]
                if rows and not vals and n not in self._nan_said:
                    # the engine exported NaN: n/a, and said (it showed as n/a with no reason)
                    self._nan_said.add(n)
                    self.warnings.append(f"{n} is not a number on the page: shown as n/a")
                return sum(vals) if vals else None
        return None

    def histogram(self, base: str, match: Match = None, scale: float = 1.0) -> Histogram | None:
        """Cumulative histogram ``base`` summed over matching series; ``scale`` converts units
        (ms -> s: 0.001)."""
        by_le: dict[float, float] = defaultdict(float)
        for lb, v in self.select(base + "_bucket", match):
            le = lb.get("le")
            if le is None:
                continue
            try:
                by_le[float(le) * scale] += v
            except ValueError:
                continue
        if not by_le:
            return None
        buckets = sorted(by_le.items())
        count = self.value(base + "_count", match)
        total = self.value(base + "_sum", match)
        if count is None:
            if math.inf not in by_le:
                # cut inside its buckets (a truncated page): no count to trust, and the next whole
                # page would read as a reset, the lifetime's observations as the window's
                # (incomplete_histograms warns)
                return None
            count = buckets[-1][1]
        return Histogram(buckets, count, total * scale if total is not None else math.nan)

    def first_label(self, names: Iterable[str], label: str, match: Match = None) -> str | None:
        """The first non-empty value of ``label`` on the matching series of ``names``."""
        for n in names:
            for lb, _ in self.select(n, match):
                if lb.get(label):
                    return lb[label]
        return None

    def incomplete_histograms(self, bases: Iterable[str]) -> list[str]:
        """Warnings for histograms cut before their ``+Inf`` bucket (a page truncated mid-family)."""
        out = []
        for b in bases:
            bucket_rows = self.samples.get(b + "_bucket")
            if bucket_rows and not any(lb.get("le") in _INF_LE for lb, _ in bucket_rows):
                out.append(f"histogram {b} has no +Inf bucket: page truncated?")
        return out


def counter_names(base: str) -> tuple[str, ...]:
    """Both spellings of a counter: prometheus-client appends ``_total`` to a sample whose family is
    declared a counter, so an engine exporting one without the suffix can be read either way."""
    return (base,) if base.endswith("_total") else (base, base + "_total")


def _chunks(lines: list[str], size: int) -> Iterator[tuple[str | None, list[str]]]:
    """Consecutive runs of about ``size`` lines, each with the ``# TYPE`` line in force at its start
    (repeated so a family split across chunks keeps its declared type and sample names)."""
    type_line: str | None = None
    start = 0
    chunk_type: str | None = None
    for i, line in enumerate(lines):
        if i - start >= size:
            yield chunk_type, lines[start:i]
            start, chunk_type = i, type_line
        if line.startswith("# TYPE "):
            type_line = line
            if i == start:
                chunk_type = None
    yield chunk_type, lines[start:]


def _ingest(page: Page, text: str) -> int:
    """Add the samples of ``text`` all or nothing: the parser raises mid-way on a bad line, after
    yielding the families before it, and the caller then re-reads those lines one by one."""
    got = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]
    add = page.samples
    for name, labels, value in got:
        add[name].append((labels, value))
    return len(got)


def _text(type_line: str | None, lines: list[str]) -> str:
    body = "\n".join(lines) + "\n"
    return body if type_line is None else type_line + "\n" + body


def _bisect(page: Page, type_line: str | None, lines: list[str]) -> tuple[int, int]:
    """Ingest what parses of ``lines`` (which failed as a whole) by halving around the bad lines:
    one bad line in a chunk costs about two extra parses of the chunk, not one parse per line.
    Returns (samples ingested, lines skipped)."""
    if len(lines) == 1:
        s = lines[0].strip()
        if not s or s.startswith("#"):
            return 0, 0
        try:
            return _ingest(page, _text(type_line, [s])), 0
        except Exception:
            try:  # the declared type itself may be what is wrong
                return _ingest(page, s + "\n"), 0
            except Exception:
                return 0, 1
    mid = len(lines) // 2
    halves = (lines[:mid], lines[mid:])
    got = lost = 0
    for half in halves:
        try:
            got += _ingest(page, _text(type_line, half))
        except Exception:
            g, b = _bisect(page, type_line, half)
            got, lost = got + g, lost + b
        for ln in reversed(half):  # the second half runs under the last TYPE of the first
            if ln.startswith("# TYPE "):
                type_line = ln
                break
    return got, lost


def parse_page(text: str, max_samples: int | None = None, budget_s: float | None = None) -> Page:
    """Parse an exposition; never raises on bad content (warnings say what was skipped or cut).

    ``max_samples`` / ``budget_s`` default to the module's ``MAX_SAMPLES`` / ``PARSE_BUDGET_S``.
    """
    max_samples = MAX_SAMPLES if max_samples is None else max_samples
    budget_s = PARSE_BUDGET_S if budget_s is None else budget_s
    page = Page()
    lines = text.splitlines()
    deadline = time.monotonic() + budget_s
    bad = 0
    first_error = ""
    cut: str | None = None
    n = 0
    for type_line, chunk in _chunks(lines, CHUNK_LINES):
        if n >= max_samples:
            cut = f"more than {max_samples} samples"
            break
        if n and time.monotonic() > deadline:  # the first chunk is always read
            cut = f"parsing took over {budget_s:g}s"
            break
        try:
            n += _ingest(page, _text(type_line, chunk))
            continue
        except Exception as e:  # the parser raises ValueError/IndexError/... on bad lines
            if not first_error:
                first_error = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        got, lost = _bisect(page, type_line, chunk)
        n += got
        bad += lost
    if bad:
        page.warnings.append(f"partly invalid metrics page: skipped {bad} unparseable line(s) (first error: {first_error})")
    if cut:
        page.warnings.append(f"metrics page cut short: {cut}; later series ignored")
    return page


def read_page(text: str, core: tuple[str, ...] = ()) -> Page:
    """``parse_page`` plus warnings about signs of a cut-off page.

    ``core`` are sample names every version of the engine exports; a page lacking all of them
    while carrying other names was most likely cut short (or is not this engine at all).
    """
    page = parse_page(text)
    if text and not text.endswith("\n"):
        page.warnings.append("metrics page does not end with a newline: truncated?")
    if core and page.samples and not any(c in page.samples for c in core):
        page.warnings.append("metrics page lacks every core family (" + ", ".join(core) + "): truncated or renamed?")
    return page
