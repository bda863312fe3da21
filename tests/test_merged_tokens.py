"""Tokens that reach the client several to a chunk: the engine's usage at a stream's finish counts
them, the proxy's chunks do not. At a target of a few decode steps a merged chunk closes a gap that
misses it however fast the engine stepped, and the report says how many spikes can be such chunks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvtop.analysis.live import LiveAnalyzer
from kvtop.analysis.scan import analyze_trace
from kvtop.model.records import from_dict

STEP = 0.006  # the engine makes a token for every stream each 6 ms
HEADER = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-02T00:00:00Z",
          "engine": {"adapter": "vllm", "url": "http://127.0.0.1:8000"}, "interval_s": 1.0}


def _stream(rid: str, made: int, merge_every: int = 0, resync_at: int | None = None, slow_at: int | None = None,
            end: str = "finish", numbered: bool = False, **finish: object) -> tuple[list[dict], int]:
    """Stream ``rid``: the engine makes ``made`` tokens, one a step; every ``merge_every``-th reaches the
    client in the next token's chunk (one event the proxy numbers as one token, or as two where the
    chunks are ``numbered``: token ids, logprobs); ``resync_at``: the chunk there follows a hole in the
    captured bytes; ``slow_at``: one 30 ms step before that token; ``finish``: the finish record's
    fields (default: ended by length, with the engine's count). Returns its records and the tokens its
    chunks numbered."""
    recs: list[dict] = [{"kind": "request", "t": 0.5, "id": rid, "event": "arrive", "source": "proxy"}]
    t, counted, held = 1.0, 0, 0
    for i in range(made):
        t += 0.030 if i == slow_at else STEP
        if merge_every and i % merge_every == merge_every // 2:
            held += 1
            continue  # held: delivered with the next token
        ev = "first_token" if not counted else ("resync" if i == resync_at else "token")
        n = 1 + held if numbered else 1
        recs.append({"kind": "request", "t": round(t, 6), "id": rid, "event": ev, "n": n})
        counted, held = counted + n, 0
    done = {"kind": "request", "t": round(t + 0.001, 6), "id": rid, "event": end}
    if end == "finish":
        done.update(finish or {"finish_reason": "length", "completion_tokens": made})
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
    however many of their gaps miss a tight target; nor does a spike closed by a chunk of as many
    tokens as the stream's chunks always carry (s: two a step, numbered, as speculative decoding
    gives them; one 30 ms step)."""
    a, _ = _stream("a", 300, merge_every=30)
    for rec in a:
        rec.pop("completion_tokens", None)
    d, _ = _stream("d", 300, merge_every=30, end="cancel")
    s = [{"kind": "request", "t": 0.5, "id": "s", "event": "arrive", "source": "proxy"}]
    s += [{"kind": "request", "t": round(1.0 + STEP * i + (0.024 if i >= 100 else 0.0), 6), "id": "s",
           "event": "first_token" if i == 0 else "token", "n": 2} for i in range(150)]
    s.append({"kind": "request", "t": round(s[-1]["t"] + 0.001, 6), "id": "s", "event": "cancel"})
    _write(tmp_path / "t.jsonl", [a, d, s])
    rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.010)
    assert rep.spikes_total == 21
    assert rep.merged_tokens is None and rep.to_dict()["merged_tokens"] is None
    assert not any("tokens more than the chunks" in w for w in rep.warnings)


def test_what_the_engine_counts_and_never_sends_is_no_merge(tmp_path):
    """a stopped: the engine counts its end-of-sequence token, sent as no text (its 10 merges stand); j
    was answered without streaming (no chunks: its 500 tokens are no merges); h lost bytes after its
    last chunk (its finish says incomplete); k's chunks number their tokens (logprobs), so its usage
    shows nothing merged, but each of its 10 spikes closed on a chunk of two tokens; g's recorder wrote
    its finish before its last five chunks (its tokens all arrived: no merge, on every path)."""
    a, _ = _stream("a", 300, merge_every=30, finish_reason="stop", completion_tokens=301)
    j = [{"kind": "request", "t": 0.5, "id": "j", "event": "arrive", "source": "proxy"},
         {"kind": "request", "t": 2.0, "id": "j", "event": "finish", "finish_reason": "length", "completion_tokens": 500}]
    h, _ = _stream("h", 300, finish_reason="length", completion_tokens=340, incomplete=True)
    k, k_counted = _stream("k", 300, merge_every=30, numbered=True)
    assert k_counted == 300
    g, _ = _stream("g", 100)
    g[-1]["t"] = round(g[-7]["t"] + 0.001, 6)  # the finish, written before the last five chunks
    _write(tmp_path / "t.jsonl", [a, j, h, k, g])
    for fast in (True, False):
        rep = analyze_trace(str(tmp_path / "t.jsonl"), itl_target_s=0.010, fast=fast)
        assert rep.spikes_total == 20
        assert rep.to_dict()["merged_tokens"] == {"streams": 3, "usage_tokens": 701, "tokens": 10, "spikes_max": 20}
        assert any("up to 20 of the 20 spikes can be such chunks" in w for w in rep.warnings)
    live = LiveAnalyzer(itl_target_s=0.010)  # the console's path, record by record
    for d in sorted((d for s in (a, j, h, k, g) for d in s), key=lambda d: d["t"]):
        live.feed(from_dict(d))
    rep = live.report(now=20.0)
    assert rep is not None and rep.merged_tokens is not None
    assert rep.merged_tokens.to_dict() == {"streams": 3, "usage_tokens": 701, "tokens": 10, "spikes_max": 20}
