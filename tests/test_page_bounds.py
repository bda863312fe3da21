"""Bounded cost per scrape (issue 14 item 4): a series cap and a parse budget cut a pathological page
with a warning, one bad line costs its neighbours nothing, and per-engine selection on a page with
thousands of engines reads each engine's own rows (speed figures: bench/scrape_bounds.py)."""

from __future__ import annotations

from kvtop.adapters import Page, parse_page
from kvtop.plugin import load_adapter


def _gauge_page(n: int, bad_at: int | None = None) -> str:
    lines = ["# TYPE g gauge"] + [f'g{{i="{i}"}} {i}' for i in range(n)]
    if bad_at is not None:
        lines[bad_at] = 'g{i="oops" 1'
    return "\n".join(lines) + "\n"


def test_series_cap_cuts_the_page_with_a_warning():
    page = parse_page(_gauge_page(20_000), max_samples=5_000)
    n = len(page.samples["g"])
    assert 5_000 <= n < 20_000  # cut at the first chunk boundary past the cap
    assert any("cut short: more than 5000 samples" in w for w in page.warnings)


def test_parse_budget_cuts_the_page_but_reads_the_first_chunk():
    page = parse_page(_gauge_page(20_000), budget_s=0.0)
    assert 0 < len(page.samples["g"]) < 20_000
    assert any("parsing took over 0s" in w for w in page.warnings)


def test_one_bad_line_loses_only_itself():
    page = parse_page(_gauge_page(10_000, bad_at=6_000))
    vals = sorted(v for _, v in page.samples["g"])
    assert len(vals) == 9_999 and 5_999 not in vals and vals[-1] == 9_999
    (w,) = page.warnings
    assert "skipped 1 unparseable line" in w


def test_type_declaration_survives_chunking():
    """A counter declared once keeps its ``_total`` sample name in every chunk of a long family."""
    lines = ["# TYPE c counter"] + [f'c{{i="{i}"}} {i}' for i in range(9_000)]
    page = parse_page("\n".join(lines) + "\n")
    assert set(page.samples) == {"c_total"} and len(page.samples["c_total"]) == 9_000


def test_three_thousand_engines_each_read_from_its_own_rows():
    n = 3_000
    lines = []
    for fam, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                      ("vllm:kv_cache_usage_perc", "gauge")):
        lines.append(f"# TYPE {fam} {kind}")
        lines += [f'{fam}{{engine="{e}",model_name="m"}} {e % 97}' for e in range(n)]
    text = "\n".join(lines) + "\n"
    recs = load_adapter("vllm")().parse(text, 0.0)
    assert len(recs) == n
    by = {r.engine: r for r in recs}
    assert by["2999"].running == 2999 % 97 and by["0"].waiting == 0 and by["1234"].kv_usage == 1234 % 97
    page = parse_page(text)
    page.select("vllm:num_requests_running", {"engine": "7"})
    page.select("vllm:num_requests_running", {"engine": "8"})
    # one index per (series, label), built once and reused by every engine
    assert list(page._index) == [("vllm:num_requests_running", "engine")]


def test_select_by_labels_and_predicate_agree():
    page = Page()
    page.samples["x"] = [({"engine": str(e % 3), "k": str(e % 2)}, float(e)) for e in range(12)]
    a = page.select("x", {"engine": "1", "k": "0"})
    b = page.select("x", lambda lb: lb.get("engine") == "1" and lb.get("k") == "0")
    assert a == b and [v for _, v in a] == [4.0, 10.0]
    assert page.value("x", {"engine": "2"}) == 2 + 5 + 8 + 11
    assert page.value(("missing", "x"), {"engine": "0"}) == 0 + 3 + 6 + 9
