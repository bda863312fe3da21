"""A capture hole is never a stall: the time across lost bytes ("resync") is not an inter-token gap,
in the trace analysis (fast and streaming paths) and in the live console's request view."""

from __future__ import annotations

import pytest

from kvtop.core import Core
from kvtop.model.records import RequestRecord
from kvtop.model.trace import TraceWriter, make_header


def streams(resync_event: str) -> list[dict]:
    recs: list[dict] = []
    for i in range(4):
        rid = f"r{i}"
        recs.append({"kind": "request", "t": 0.0, "id": rid, "event": "arrive", "source": "capture"})
        t = 0.1
        first = True
        while t < 10.0:
            if rid == "r0" and 3.0 < t < 5.0:  # the capture lost these bytes
                t += 0.02
                continue
            ev = "first_token" if first else "token"
            if rid == "r0" and 5.0 <= t < 5.02:
                ev = resync_event
            recs.append({"kind": "request", "t": round(t, 6), "id": rid, "event": ev, "n": 1})
            first = False
            t += 0.02
        end = {"kind": "request", "t": 10.0, "id": rid, "event": "finish"}
        if rid == "r0":
            end["incomplete"] = True
        recs.append(end)
    return sorted(recs, key=lambda d: d["t"])


@pytest.mark.parametrize("fast", [False, True])
def test_a_gap_across_a_capture_hole_is_not_a_spike(tmp_path, fast):
    from kvtop.analysis.scan import analyze_trace

    for ev, want_spike in (("resync", False), ("token", True)):  # "token": the same times read as a stall
        p = tmp_path / f"{ev}.jsonl"
        with TraceWriter(p, make_header(engine={"adapter": "vllm"})) as w:
            for d in streams(ev):
                w.write(d)
        rep = analyze_trace(str(p), fast=fast, itl_target_s=0.2)
        r0 = [s for s in rep.spikes if s.request_id == "r0"]
        req = {r.request_id: r for r in rep.requests}["r0"]
        if want_spike:
            assert len(r0) == 1 and r0[0].gap_s == pytest.approx(2.04, abs=0.02)
        else:
            assert r0 == [] and req.max_gap_s < 0.05
            # the tokens after the hole still count
            assert req.tokens == sum(1 for d in streams(ev) if d["id"] == "r0" and "n" in d)


def test_console_request_view_does_not_show_the_hole_as_a_gap():
    core = Core()
    for d in streams("resync"):
        if d["id"] != "r0":
            continue
        core.ingest(RequestRecord(d["t"], d["id"], d["event"], n=d.get("n"), source=d.get("source"),
                                  incomplete=d.get("incomplete")))
    view = next(r for r in core.snapshot().requests if r.id == "r0")
    assert view.max_gap_s is not None and view.max_gap_s < 0.05
    assert view.tokens == sum(1 for d in streams("resync") if d["id"] == "r0" and "n" in d)


async def test_console_banner_says_how_to_grant_capture_and_counts_loss():
    pytest.importorskip("textual")
    from tui_support import screen_text

    from kvtop.feeds.sample import FIXED_TAKEN_AT, sample
    from kvtop.views.tui.app import KvtopApp

    s = sample()
    s.core.capture = {"port": 8000, "status": "passive capture needs CAP_NET_RAW: run as root, or grant it"}
    app = KvtopApp(s.core, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.pause()
        assert "capture: passive capture needs CAP_NET_RAW" in screen_text(app)
        s.core.capture = {"port": 8000, "status": "ok", "kernel_drops": 12, "holes": 3}
        await pilot.press("space")
        assert "capture lost data: 12 kernel drop(s), 3 hole(s)" in screen_text(app)
        s.core.capture = {"port": 8000, "status": "ok", "kernel_drops": 0, "holes": 0}
        await pilot.press("space")
        text = screen_text(app)
        assert "capture lost data" not in text and "capture: " not in text  # nothing to say: no banner


async def test_live_runner_without_privilege_keeps_running_and_says_why(monkeypatch):
    """The console's path: capture cannot open -> the snapshot's capture status and an event carry the
    one-line fix, and the other sources keep running."""
    import kvtop.sources.capture.source as source_mod
    from kvtop.pipeline import SourceOptions, live_feed
    from kvtop.sources.capture.packets import CaptureUnavailable

    def no_socket(port: int) -> None:
        raise CaptureUnavailable("passive capture needs CAP_NET_RAW: run as root")

    monkeypatch.setattr(source_mod, "PacketSocket", no_socket)
    core = Core()
    runner = live_feed(SourceOptions(gpu=False, host=False, capture_port=8000), core=core)
    await runner.run(duration_s=0.1)
    snap = core.snapshot()
    assert snap.capture == {"port": 8000, "status": "passive capture needs CAP_NET_RAW: run as root"}
    assert any(e.kind == "capture" and "CAP_NET_RAW" in e.message for e in snap.events)
    assert snap.to_json()["capture"]["status"].startswith("passive capture needs")
