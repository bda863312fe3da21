"""Core: streams that end in error together become one `requests_aborted` event (no server needed).

This is what a real llama.cpp server does when its unified KV cache runs out: every active stream
gets an in-stream error at the same moment (test_real_llamacpp.py checks it on the real engine).
"""

from __future__ import annotations

from kvtop.core import Core
from kvtop.model.records import RequestRecord


def _events(core: Core) -> list:
    return [e for e in core.snapshot().events if e.kind == "requests_aborted"]


def test_errors_together_make_one_event_and_a_lone_error_none():
    core = Core()
    for i in range(4):
        core.ingest(RequestRecord(t=1.0 + i * 0.01, id=f"r{i}", event="arrive"))
    core.ingest(RequestRecord(t=2.0, id="r0", event="error", error="stream_error"))
    assert _events(core) == []  # one error alone is a failed request, not an abort
    for i, t in ((1, 2.3), (2, 2.5), (3, 3.2)):
        core.ingest(RequestRecord(t=t, id=f"r{i}", event="error", error="stream_error"))
    [ev] = _events(core)
    assert ev.t == 2.3 and ev.severity == "error"
    assert "stream_error" in ev.message
    core.ingest(RequestRecord(t=9.0, id="r9", event="arrive"))
    core.ingest(RequestRecord(t=10.0, id="r9", event="error", error="http_500"))
    assert len(_events(core)) == 1  # 6.8 s later: not the same burst, and alone


def test_a_second_burst_is_a_second_event():
    core = Core()
    for t, rid in ((1.0, "a"), (1.5, "b"), (5.0, "c"), (5.1, "d")):
        core.ingest(RequestRecord(t=t, id=rid, event="error", error="stream_error"))
    assert [e.t for e in _events(core)] == [1.5, 5.1]
