"""Resilience: the console keeps running and shows the condition when an engine goes down, NVML
is absent, a /metrics page is malformed, or 1,000 requests are live."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("textual")

from conftest import FIXTURES  # noqa: E402
from tui_support import TickFeed, screen_text, vllm_adapter  # noqa: E402

from kvtop.core import Core  # noqa: E402
from kvtop.feeds.sample import FIXED_TAKEN_AT, Sample, sample  # noqa: E402
from kvtop.views.tui.app import KvtopApp  # noqa: E402

SIZE = (120, 40)


async def test_engine_down_mid_run_is_shown_and_the_console_keeps_going():
    s = sample()
    url = s.core.snapshot().engines[0].url
    app = KvtopApp(s.core, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        s.core.engine_down(url, s.t + 7.5, "connection refused")
        s.core.now = s.t + 7.5
        await pilot.press("space")
        text = screen_text(app)
        assert "✖ ENGINE DOWN" in text and "connection refused" in text
        assert "last good scrape 7.50s ago" in text
        assert "1 engine(s) down: http://127.0.0.1:8000" in text
        await pilot.press("5")
        assert "engine_down" in screen_text(app)
        await pilot.press("2")
        assert app.view_name == "requests"


async def test_nvml_absent_shows_the_reason():
    core = Core(itl_target_s=0.1)
    core.set_gpu_status("NVML library not found (libnvidia-ml.so.1)")
    app = KvtopApp(core, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        text = screen_text(app)
        assert "GPUs NVML library not found (libnvidia-ml.so.1)" in text  # one line, no banner
        assert "no engine data yet" in text and "no host data yet" in text
        await pilot.press("4")
        assert "No analysis yet" in screen_text(app)
        await pilot.press("3")
        assert "No request selected" in screen_text(app)


async def test_malformed_metrics_page_shows_the_adapter_warning():
    page = (FIXTURES / "vllm-0.32.0-cpu-live-idle.prom").read_text()
    lines = page.splitlines()
    broken = "\n".join(lines[:30] + ['vllm:num_requests_running{engine="0" 3 oops'] + lines[30:])
    core = Core(itl_target_s=0.1)
    for rec in vllm_adapter().parse(broken, 1.0):
        rec.url = "http://127.0.0.1:8000"
        core.ingest(rec)
    warning = core.snapshot().engines[0].warnings[0]
    assert "skipped 1 unparseable line" in warning
    app = KvtopApp(core, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(200, 30)) as pilot:
        await pilot.pause()
        text = screen_text(app)
        assert "⚠ partly invalid metrics page: skipped 1 unparseable line(s)" in text
        # fields the page did carry still show; rates need two scrapes and say n/a
        assert "preempt n/a" in text


async def test_thousand_live_requests_stay_responsive():
    s = Sample(gpus=8, engines=2, requests=1000, fine=False, seed=11)
    s.run(5)
    feed = TickFeed(s, period=0.3)
    app = KvtopApp(s.core, feed=feed, interval=0.3, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2")
        await pilot.pause(0.5)
        n = len(app.snap.requests)
        assert n >= 1000
        assert app.main.query_one("#req-table").row_count == n
        assert re.search(rf"\b{n} of {n} requests", screen_text(app))
        ticks = app.ticks
        await pilot.press("s", "slash", *"batch", "enter")
        await pilot.pause(0.7)
        assert app.ticks > ticks  # refreshes kept coming while we typed
        shown = app.main.query_one("#req-table").row_count
        assert shown == sum(1 for r in app.snap.requests if r.cls == "batch")
        assert app.views.requests.sort_col == "spikes"


async def test_live_runner_feed_then_the_engine_goes_away():
    """The real live runner as the feed, scraping a served vLLM capture; then the server stops."""
    import http.server
    import threading

    from kvtop.pipeline import SourceOptions, live_feed

    page = (FIXTURES / "vllm-0.32.0-cpu-live-idle.prom").read_bytes()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    core = Core(itl_target_s=0.1)
    feed = live_feed(SourceOptions(urls=(url,), interval_s=0.1, timeout_s=0.5, gpu=False, host=False), core=core)
    app = KvtopApp(core, feed=feed, interval=0.1, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(140, 30)) as pilot:
        # the engine panel and the banner are drawn in one tick, but the banner's first showing waits
        # for a layout pass: wait for the whole screen, not its first line
        def up(text: str) -> bool:
            return "● vllm " + url in text and "GPUs disabled (--no-gpu)" in text

        def down(text: str) -> bool:
            return "✖ ENGINE DOWN" in text and "1 engine(s) down: " + url in text

        for _ in range(50):
            await pilot.pause(0.1)
            if up(screen_text(app)):
                break
        assert up(screen_text(app))
        srv.shutdown()
        srv.server_close()
        for _ in range(50):
            await pilot.pause(0.1)
            if down(screen_text(app)):
                break
        assert down(screen_text(app))
        await pilot.press("5")
        assert "engine_down" in screen_text(app)
