"""Tokens that reach the client several to a chunk: the engine's usage at a stream's finish counts
them, the proxy's chunks do not. At a target of a few decode steps a merged chunk closes a gap that
misses it however fast the engine stepped, and the report says how many spikes can be such chunks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvtop.analysis.scan import analyze_trace

STEP = 0.006  # the engine makes a token for every stream each 6 ms
HEADER = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-02T00:00:00Z",
          "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "interval_s": 1.0}


def _stream(rid: str, made: int, merge_every: int = 0, resync_at: int | None = None, slow_at: int | None = None,
            end: str = "finish") -> tuple[list[dict], int]:
    """Stream ``rid``: the engine makes ``made`` tokens, one a step; every ``merge_every``-th reaches the
    client in the next token's chunk (one event the proxy numbers as one token); ``resync_at``: the
    chunk there follows a hole in the captured bytes; ``slow_at``: one 30 ms step before that token.
    Returns its records and the tokens its chunks numbered."""
    recs: list[dict] = [{"kind": "request", "t": 0.5, "id": rid, "event": "arrive", "source": "proxy"}]
    t, counted = 1.0, 0
    for i in range(made):
        t += 0.030 if i == slow_at else STEP
        if merge_every and i % merge_every == merge_every // 2:
            continue  # held: delivered with the next token
        ev = "first_token" if not counted else ("resync" if i == resync_at else "token")
        recs.append({"kind": "request", "t": round(t, 6), "id": rid, "event": ev, "n": 1})
        counted += 1
    done = {"kind": "request", "t": round(t + 0.001, 6), "id": rid, "event": end}
    if end == "finish":
        done.update(finish_reason="length", completion_tokens=made)
    recs.append(done)
    return recs, counted


def _write(path: Path, streams: list[list[dict]]) -> None:
    recs = sorted((d for s in streams for d in s), key=lambda d: d["t"])
    with open(path, "w") as f:
        f.write(json.dumps(HEADER) + "\n")
        for d in recs:
            f.write(json.dumps(d) + "\n")


def test_the_report_bounds_the_spikes_that_can_be_merged_chunks(tmp_path):
    """a: 10 of its 300 tokens merged into the next chunk (10 gaps of two steps); b: the same, but a hole
    in the captured bytes (its count proves nothing); c: no merge, one 30 ms step; d: cancelled (no
    usage). At 10 ms (under 3 decode steps) the report says up to 10 of the 21 spikes can be merged
    chunks; at 100 ms it counts the tokens and warns of nothing."""
    a, a_counted = _stream("a", 300, merge_every=30)
    b, _ = _stream("b", 300, merge_every=30, resync_at=150)
    c, c_counted = _stream("c", 300, slow_at=200)
    d, _ = _stream("d", 120, end="cancel")
    assert (a_counted, c_counted) == (290, 300)
    _write(tmp_path / "t.jsonl", [a, b, c, d])

    for fast in (True, False):  # both ingestion paths count the same
        rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.010, fast=fast)
        assert rep.spikes_total == 21  # a's 10 and b's 10 two-step gaps, c's slow step
        assert rep.merged_tokens is not None
        assert rep.to_dict()["merged_tokens"] == {"streams": 2, "usage_tokens": 600, "tokens": 10, "spikes_max": 10}
        assert any("up to 10 of the 21 spikes can be such chunks" in w for w in rep.warnings)

    out = subprocess.run([sys.executable, "-m", "kvtop", "analyze", str(tmp_path / "t.jsonl"), "--itl-target-ms", "10"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert ("warning: the engine counted 10 tokens more than the chunks of its 2 finished streams carried "
            "(1.7% of 600)") in out.stdout

    loose = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.1)
    assert loose.spikes_total == 0
    assert loose.to_dict()["merged_tokens"] == {"streams": 2, "usage_tokens": 600, "tokens": 10, "spikes_max": 0}
    assert not any("tokens more than the chunks" in w for w in loose.warnings)


def test_without_usage_nothing_is_counted_as_merged(tmp_path):
    """Streams whose finish carries no usage (or that were cancelled) give no count and no warning,
    however many of their gaps miss a tight target."""
    a, _ = _stream("a", 300, merge_every=30)
    for rec in a:
        rec.pop("completion_tokens", None)
    d, _ = _stream("d", 300, merge_every=30, end="cancel")
    _write(tmp_path / "t.jsonl", [a, d])
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.010)
    assert rep.spikes_total == 20
    assert rep.merged_tokens is None and rep.to_dict()["merged_tokens"] is None
    assert not any("tokens more than the chunks" in w for w in rep.warnings)
