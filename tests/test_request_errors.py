"""The console's alarm for streams ending in error together: the engine's failures, not the clients'."""

from __future__ import annotations

from kvtop.core import Core
from kvtop.model.records import RequestRecord


def _aborted(core: Core) -> list[str]:
    return [e.message for e in core.snapshot(10.0).events if e.kind == "requests_aborted"]


def test_requests_the_server_refused_are_no_engine_abort():
    # two bad requests (max_tokens -1, invalid JSON) answered 400: the console said "the engine
    # aborted its active requests"
    core = Core()
    for i, t in enumerate((1.0, 1.2)):
        core.ingest(RequestRecord(t, f"bad-{i}", "arrive"))
        core.ingest(RequestRecord(t + 0.01, f"bad-{i}", "error", status=400, error="BadRequestError"))
    assert _aborted(core) == []


def test_streams_that_break_together_mid_output_are_an_engine_abort():
    core = Core()
    for i in range(2):
        rid = f"s-{i}"
        core.ingest(RequestRecord(1.0, rid, "arrive"))
        core.ingest(RequestRecord(1.5, rid, "first_token", 1))
        core.ingest(RequestRecord(1.6, rid, "token", 1))
        core.ingest(RequestRecord(2.0 + 0.1 * i, rid, "error", status=400, error="InternalServerError"))
    (msg,) = _aborted(core)
    assert msg.startswith("2+ streams ended in error together")
