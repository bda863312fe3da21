"""Auto-detection picks the right adapter for every captured page; each adapter claims only its own."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES

from kvtop.model.records import from_dict, to_dict
from kvtop.plugin import detect_adapter, list_adapters, load_adapter
from kvtop.sources.prom import parse_page

PAGES = sorted(p.name for p in FIXTURES.glob("*.prom"))


def _engine(name: str) -> str:
    """A capture is named after the adapter that must claim it (``vllm-0.32.0-....prom``), so a new
    adapter's fixture joins these tests without an edit here."""
    return name.split("-")[0]


# the adapters kvtop ships (entry points of the kvtop_plugins package), each with a capture
BUILT_IN = {a.name for a in list_adapters() if a.target.startswith("kvtop_plugins.")}
ENGINES = sorted({_engine(p) for p in PAGES})


def test_every_engine_has_a_fixture_and_a_registered_adapter():
    assert {"vllm", "sglang", "tgi", "llamacpp", "triton"} <= BUILT_IN
    assert set(ENGINES) == BUILT_IN


@pytest.mark.parametrize("page", PAGES)
def test_detect_picks_the_engine_of_each_fixture(page):
    names = parse_page((FIXTURES / page).read_text()).names
    cls = detect_adapter(names)
    assert cls is not None and cls.name == _engine(page)


@pytest.mark.parametrize("page", PAGES)
def test_other_builtin_adapters_score_zero(page):
    names = parse_page((FIXTURES / page).read_text()).names
    for a in ENGINES:
        score = load_adapter(a).detect(names)
        if a == _engine(page):
            assert score >= 0.9
        else:
            assert score == 0.0, a


@pytest.mark.parametrize("page", PAGES)
def test_detected_adapter_parses_its_page(page):
    text = (FIXTURES / page).read_text()
    cls = detect_adapter(parse_page(text).names)
    recs = cls().parse(text, 0.0)
    assert recs and all(r.adapter == cls.name for r in recs)
    # every record fills at least running or kv_usage or a token counter
    assert any(r.running is not None or r.kv_usage is not None or r.prompt_tokens_total is not None for r in recs)
    # records survive the trace format (extra must be plain JSON)
    for r in recs:
        line = json.dumps(to_dict(r))
        again = json.dumps(to_dict(from_dict(json.loads(line))))
        # NaN != NaN, and the reader turns histogram counts into floats (4 == 4.0 still holds)
        assert json.loads(again.replace("NaN", "null")) == json.loads(line.replace("NaN", "null"))


def test_detect_works_on_names_as_a_scraper_sees_them_after_a_parse_error():
    # a page re-read line by line keeps wire names (TGI counters without _total)
    assert detect_adapter({"tgi_request_count", "tgi_queue_size"}).name == "tgi"
    assert detect_adapter({"llamacpp:n_decode_total"}).name == "llamacpp"


def test_triton_vllm_backend_page_goes_to_vllm():
    names = {"nv_inference_request_success_total", "nv_inference_count_total", "vllm:num_requests_running"}
    assert detect_adapter(names).name == "vllm"
    assert detect_adapter({"nv_inference_count_total"}).name == "triton"


def test_unknown_page_detects_nothing():
    assert detect_adapter({"process_cpu_seconds_total", "http_requests_total"}) is None


def _expand(field: str) -> list[str]:
    """`offload_{out,in}_{bytes,seconds}_total` -> the four names."""
    import itertools
    import re

    parts = re.split(r"\{([^}]*)\}", field)
    choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def test_documented_field_tables_match_each_adapters_fields():
    import re

    from conftest import REPO

    from kvtop.plugin import NORMALIZED_FIELDS

    text = (REPO / "docs" / "adapters.md").read_text(encoding="utf-8")
    section = text.split("\n## Built-in adapters\n", 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"### [^\n]*\(`(\w+)`\)\n(.*?)(?=\n### |\Z)", section, re.S)
    # A table is documentation, not a registration step: a new adapter may come without one
    # (`kvtop plugins --describe NAME` prints what it reads), but a table that exists must be right.
    assert {name for name, _ in tables} <= set(ENGINES)
    for name, body in tables:
        documented: set[str] = set()
        for row in re.findall(r"^\| (`[^|]*) \|", body, re.M):
            for f in re.findall(r"`([a-z_{},]+)`", row):
                documented.update(_expand(f))
        assert documented <= set(NORMALIZED_FIELDS), name
        assert documented == set(load_adapter(name).fields), name


@pytest.mark.parametrize("page", [p for p in PAGES if not p.startswith("vllm")])
def test_any_cut_of_a_page_parses_with_a_warning_never_raises(page):
    text = (FIXTURES / page).read_text()
    adapter = load_adapter(_engine(page))()
    for i in range(1, 25):
        cut = len(text) * i // 25
        recs = adapter.parse(text[:cut], 0.0)
        assert recs
        if text[cut - 1] != "\n":  # cut inside a line: the page cannot be complete
            assert all(r.warnings for r in recs), (page, cut)


@pytest.mark.parametrize("page", [p for p in PAGES if not p.startswith("vllm")])
def test_garbage_in_the_middle_keeps_the_rest(page):
    text = (FIXTURES / page).read_text()
    mid = text.index("\n", len(text) // 2) + 1
    recs = load_adapter(_engine(page))().parse(text[:mid] + "\x00\xff}{ not a metric\n" + text[mid:], 0.0)
    assert recs and all(any("unparseable" in w for w in r.warnings) for r in recs)


@pytest.mark.parametrize("engine", ENGINES)
def test_plugins_describe_prints_what_the_adapter_reads(engine, capsys):
    import json

    from kvtop.cli import main

    assert main(["plugins", "--describe", engine, "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    cls = load_adapter(engine)
    assert d["fields"] == sorted(cls.fields) and d["preempts"] is cls.preempts
    assert d["admits_in_order"] is cls.admits_in_order
    # every endpoint it asks beside /metrics (a firewall or auth proxy in front must pass them too)
    assert d["per_start_paths"] == {"vllm": ["/version", "/v1/models"], "sglang": ["/v1/models"]}.get(engine, [])
    # the advisor names the engine's own flag; the description must carry it
    for setting, flag in cls.settings.items():
        assert d["settings"][setting.value] == flag


def test_plugins_describe_unknown_adapter_is_a_one_line_error(capsys):
    from kvtop.cli import main

    assert main(["plugins", "--describe", "no-such-engine"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no-such-engine" in err and "\n" not in err
