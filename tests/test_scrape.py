"""EngineScraper against a loopback server: detection, token, size limit, timeouts, backoff, extra paths."""

from __future__ import annotations

import textwrap

import pytest
from conftest import fixture_text
from page_server import PageServer

from kvtop.plugin import load_plugin_file
from kvtop.sources.scrape import BACKOFF_MAX_S, EngineScraper, split_url

CAPTURE = fixture_text("vllm-0.32.0-cpu-live-idle.prom")


@pytest.fixture
def server():
    with PageServer() as s:
        yield s


def test_split_url_forms():
    assert split_url("http://h:8000") == ("http://h:8000", "http://h:8000/metrics")
    assert split_url("http://h:8000/") == ("http://h:8000", "http://h:8000/metrics")
    assert split_url("h:8000/metrics") == ("http://h:8000", "http://h:8000/metrics")
    assert split_url("https://h/prefix/metrics?model=x") == ("https://h/prefix", "https://h/prefix/metrics?model=x")


@pytest.mark.parametrize("suffix", ["", "/", "/metrics"])
async def test_scrape_detects_vllm_and_sets_url(server, suffix):
    server.route("/metrics", CAPTURE)
    url = server.url + suffix
    s = EngineScraper(url)
    try:
        (r,) = await s.scrape(3.0)
    finally:
        await s.aclose()
    assert r.up and r.adapter == "vllm" and r.url == url.rstrip("/")
    assert r.t == 3.0 and r.kv_capacity_tokens == 1056 and r.model == "tiny-llama"
    assert s.adapter_cls is not None and s.adapter_cls.name == "vllm"
    assert s.last_ok_t == 3.0 and s.consecutive_failures == 0


async def test_bearer_token(server):
    route = server.route("/metrics", CAPTURE, token="s3cret")
    s = EngineScraper(server.url)
    (r,) = await s.scrape(0.0)
    assert not r.up and "HTTP 401" in r.warnings[0] and "--token" in r.warnings[0]
    await s.aclose()
    s = EngineScraper(server.url, token="s3cret")
    (r,) = await s.scrape(0.0)
    await s.aclose()
    assert r.up
    assert route.auth[-1] == "Bearer s3cret"


async def test_unreachable_backs_off_without_requests():
    s = EngineScraper("http://127.0.0.1:1", timeout_s=1.0)
    (r,) = await s.scrape(0.0)
    assert not r.up and r.adapter == "unknown" and r.url == "http://127.0.0.1:1"
    assert len(r.warnings) == 1 and "cannot connect" in r.warnings[0] and "\n" not in r.warnings[0]
    assert s.requests == 1 and s.consecutive_failures == 1 and s.backoff_s == 1.0
    (r2,) = await s.scrape(0.5)  # inside the 1 s backoff: no request, same reason
    assert s.requests == 1 and not r2.up and r2.warnings == r.warnings and r2.t == 0.5
    await s.scrape(1.0)  # due: retried
    assert s.requests == 2 and s.consecutive_failures == 2 and s.backoff_s == 2.0
    await s.scrape(2.9)
    assert s.requests == 2
    await s.scrape(3.0)
    assert s.requests == 3 and s.backoff_s == 4.0
    s.consecutive_failures = 10
    assert s.backoff_s == BACKOFF_MAX_S
    await s.aclose()


async def test_recovers_after_failure(server):
    route = server.route("/metrics", CAPTURE, status=500)
    s = EngineScraper(server.url)
    (r,) = await s.scrape(0.0)
    assert not r.up and "HTTP 500" in r.warnings[0]
    route.status = 200
    (r,) = await s.scrape(1.0)
    await s.aclose()
    assert r.up and s.consecutive_failures == 0 and s.last_ok_t == 1.0


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        ("<!doctype html><html><body>Welcome</body></html>", "text/html"),
        ('{"object": "list", "data": []}', "application/json"),
        ("<html>served as text</html>", "text/plain"),
        ("node_cpu_seconds_total{cpu=\"0\"} 5\nnode_load1 0.1\n", "text/plain"),  # no adapter claims it
        ("hello world\n", "text/plain"),
    ],
)
async def test_not_a_metrics_endpoint(server, body, ctype):
    server.route("/metrics", body, content_type=ctype)
    s = EngineScraper(server.url)
    (r,) = await s.scrape(0.0)
    await s.aclose()
    assert not r.up
    assert "not a metrics endpoint" in r.warnings[0]


async def test_size_limit_reads_first_part_with_warning(server):
    server.route("/metrics", CAPTURE)
    cut = CAPTURE.index("vllm:cache_config_info{")  # (line 549) beyond the limit
    s = EngineScraper(server.url, max_bytes=cut)
    (r,) = await s.scrape(0.0)
    await s.aclose()
    assert r.up
    assert r.running == 0.0 and r.model == "tiny-llama"  # line 57, before the limit
    assert r.kv_capacity_tokens is None  # cache_config_info was past the limit
    assert any("larger than" in w for w in r.warnings)


async def test_timeout(server):
    server.route("/metrics", CAPTURE, delay_s=1.0)
    s = EngineScraper(server.url, timeout_s=0.2)
    (r,) = await s.scrape(0.0)
    await s.aclose()
    assert not r.up and "timed out after 0.2s" in r.warnings[0]


async def test_named_adapter_and_unknown_adapter(server):
    server.route("/metrics", CAPTURE)
    s = EngineScraper(server.url, adapter="vllm")
    (r,) = await s.scrape(0.0)
    await s.aclose()
    assert r.up and r.adapter == "vllm"
    s = EngineScraper(server.url, adapter="no-such-engine")
    (r,) = await s.scrape(0.0)
    await s.aclose()
    assert not r.up and r.adapter == "no-such-engine" and "unknown adapter" in r.warnings[0]


PLUGIN = textwrap.dedent(
    """
    from kvtop.model.records import EngineRecord
    from kvtop.plugin import EngineAdapter
    from kvtop.sources.prom import parse_page


    class SlotsAdapter(EngineAdapter):
        name = "slotsy"
        preempts = False
        extra_paths = ("/slots",)

        @classmethod
        def detect(cls, names):
            return 1.0 if "slotsy_requests_processing" in names else 0.0

        def parse(self, text, t):
            page = parse_page(text)
            return [EngineRecord(t=t, adapter=self.name, running=page.value("slotsy_requests_processing"))]

        def parse_extra(self, path, body, records):
            import json
            slots = json.loads(body)
            for r in records:
                r.kv_capacity_tokens = sum(s["n_ctx"] for s in slots)
    """
)


async def test_extra_paths_are_fetched_and_parsed(server, tmp_path):
    f = tmp_path / "slotsy.py"
    f.write_text(PLUGIN)
    assert load_plugin_file(f) == ["slotsy"]
    server.route("/metrics", "slotsy_requests_processing 2\n")
    # the real llama.cpp /slots body (fixture) has one idle slot with n_ctx 256
    server.route("/slots", fixture_text("llamacpp-b9014-cassette-slots-idle.json"), content_type="application/json")
    s = EngineScraper(server.url)
    (r,) = await s.scrape(0.0)
    assert r.up and r.adapter == "slotsy" and r.running == 2.0
    assert r.kv_capacity_tokens == 256
    # /slots failing is a warning on the record, not a failed scrape
    server.routes["/slots"].status = 503
    (r,) = await s.scrape(1.0)
    await s.aclose()
    assert r.up and r.running == 2.0 and any("/slots" in w and "HTTP 503" in w for w in r.warnings)


async def test_missing_extra_path_is_reported_once_then_not_fetched(server, tmp_path):
    f = tmp_path / "slotsy.py"
    f.write_text(PLUGIN)
    load_plugin_file(f)
    server.route("/metrics", "slotsy_requests_processing 2\n")  # no /slots route: 404
    s = EngineScraper(server.url)
    (r1,) = await s.scrape(0.0)
    (r2,) = await s.scrape(1.0)
    (r3,) = await s.scrape(2.0)
    await s.aclose()
    assert all(r.up and r.running == 2.0 for r in (r1, r2, r3))
    assert any("/slots" in w and "404" in w for w in r1.warnings)
    # said once; later scrapes neither warn nor spend a request on it
    assert not any("/slots" in w for w in r2.warnings + r3.warnings)
    assert len(server.routes["/metrics"].hits) == 3


async def test_router_query_string_reaches_extra_paths(server, tmp_path):
    f = tmp_path / "slotsy.py"
    f.write_text(PLUGIN)
    load_plugin_file(f)
    m = server.route("/metrics", "slotsy_requests_processing 1\n")
    sl = server.route("/slots", fixture_text("llamacpp-b9014-cassette-slots-idle.json"), content_type="application/json")
    s = EngineScraper(server.url + "/metrics?model=gemma")
    (r,) = await s.scrape(0.0)
    await s.aclose()
    assert r.kv_capacity_tokens == 256
    assert m.queries == ["model=gemma"] and sl.queries == ["model=gemma"]


async def test_the_engines_version_is_asked_once_per_engine_start(server):
    server.route("/metrics", CAPTURE)
    ver = server.route("/version", '{"version": "0.32.0"}', content_type="application/json")
    s = EngineScraper(server.url)
    try:
        recs = [(await s.scrape(float(t)))[0] for t in range(3)]
        assert [r.version for r in recs] == ["0.32.0"] * 3
        assert len(ver.hits) == 1  # one ask, not one per scrape
        # the engine restarted (its counters' creation time moved), upgraded meanwhile: asked again
        server.route("/metrics", CAPTURE.replace("1.7959921882817874e+09", "1.7959999e+09"))
        server.route("/version", '{"version": "0.33.1"}', content_type="application/json")
        (r,) = await s.scrape(3.0)
        assert r.version == "0.33.1"
    finally:
        await s.aclose()


async def _two_scrapes(url: str) -> tuple:
    """A fresh scraper's first two records (the version is asked on the first)."""
    s = EngineScraper(url)
    try:
        (r1,) = await s.scrape(0.0)
        (r2,) = await s.scrape(1.0)
    finally:
        await s.aclose()
    return r1, r2


async def test_an_engine_without_a_version_path_is_scraped_as_before(server):
    server.route("/metrics", CAPTURE)  # no /version: 404
    r1, r2 = await _two_scrapes(server.url)
    assert r1.up and r2.up and r1.version is None and r2.version is None
    assert not any("/version" in w for w in r1.warnings + r2.warnings)
    # a garbled reply is said once, on the record of the scrape that asked
    server.route("/version", "<html>", content_type="text/html")
    r1, r2 = await _two_scrapes(server.url)
    assert r1.up and r1.version is None and any("/version: no version in the reply" in w for w in r1.warnings)
    assert not any("/version" in w for w in r2.warnings)


MODELS = fixture_text("vllm-0.32.0-cpu-v1-models.json")  # the real vLLM's /v1/models


async def test_the_engines_limits_are_asked_once_per_engine_start(server):
    """vLLM's /v1/models states its --max-model-len (after its defaults): on every record, asked once
    per start, and asked again after the engine was away (it may have come back with other flags)."""
    server.route("/metrics", CAPTURE)
    models = server.route("/v1/models", MODELS, content_type="application/json")
    s = EngineScraper(server.url)
    try:
        recs = [(await s.scrape(float(t)))[0] for t in range(3)]
        assert [r.limits for r in recs] == [{"max_model_len": 1024}] * 3
        assert len(models.hits) == 1
        # the engine went away and came back with another bound (same counters' start: a scraper
        # cannot tell a restart between two scrapes from none, but a failed scrape it can)
        server.route("/metrics", "", status=503)
        (down,) = await s.scrape(3.0)
        assert not down.up
        server.route("/metrics", CAPTURE)
        server.route("/v1/models", MODELS.replace('"max_model_len":1024', '"max_model_len":4096'),
                     content_type="application/json")
        (r,) = await s.scrape(10.0)
        assert r.up and r.limits == {"max_model_len": 4096}
    finally:
        await s.aclose()


async def test_limits_the_engine_does_not_state_are_left_unknown(server):
    server.route("/metrics", CAPTURE)  # no /v1/models (a router in front, an old engine): nothing said
    r1, r2 = await _two_scrapes(server.url)
    assert r1.up and r1.limits == {} and not any("/v1/models" in w for w in r1.warnings + r2.warnings)
    # cards without the bound (an older release): nothing to say either
    server.route("/v1/models", '{"object":"list","data":[{"id":"m","max_model_len":null}]}',
                 content_type="application/json")
    r1, r2 = await _two_scrapes(server.url)
    assert r1.up and r1.limits == {} and not any("/v1/models" in w for w in r1.warnings + r2.warnings)
    # a reply that is no model list: said once, on the record of the scrape that asked
    server.route("/v1/models", "<html>", content_type="text/html")
    r1, r2 = await _two_scrapes(server.url)
    assert r1.up and r1.limits == {} and any("/v1/models: no limits in the reply" in w for w in r1.warnings)
    assert not any("/v1/models" in w for w in r2.warnings)


async def test_a_forced_adapter_that_recognises_nothing_names_whose_page_it_is(server):
    from vllm_pages import vllm_page

    server.route("/metrics", vllm_page(running=3))
    s = EngineScraper(server.url, adapter="sglang")
    try:
        [r] = await s.scrape(1.0)
    finally:
        await s.aclose()
    assert not r.up  # nothing read: the page is vLLM's, and the scrape says so
    assert any("--adapter sglang" in w and "looks like vllm's" in w for w in r.warnings), r.warnings


@pytest.mark.parametrize("body", ["", "garbage that is no metric line\n" * 100])
async def test_an_empty_or_garbled_page_after_a_good_one_is_a_failed_scrape_not_a_second_engine(server, body):
    # the page came back 200 with nothing readable: it was taken as an engine of its own (no label),
    # a second card all n/a that stayed, and a banner naming an engine that does not exist
    from kvtop.core import Core

    route = server.route("/metrics", [CAPTURE, body, CAPTURE])
    s = EngineScraper(server.url)
    core = Core()
    try:
        for t in (0.0, 1.0, 2.0):
            if t == 2.0:
                s._retry_at = -1.0  # the backoff after the failure would skip the third scrape
            for r in await s.scrape(t):
                core.ingest(r)
            if t == 1.0:
                (bad,) = core.snapshot(t).engines
                assert not bad.up and "nothing kvtop reads" in (bad.error or "")
    finally:
        await s.aclose()
    assert len(route.hits) == 3
    (e,) = core.snapshot(2.0).engines
    assert e.up and e.kv_capacity_tokens == 1056
