"""`kvtop load` on the real vLLM: what the engine's prefix cache served a replay, read from its own
counters. The prompts are a function of ``--seed``; a replay repeated with the same seed on the same
engine finds them cached, and `kvtop load` says so at the end of the run."""

from __future__ import annotations

import json
import re

import pytest

from testkit.engines.kvtop_run import kvtop

pytestmark = pytest.mark.real_engine

N, PROMPT, OUT = 4, 200, 8  # 4 x 7 blocks of 32 slots: all stay cached in the tier engine's 33


def _source(path) -> None:
    recs = [{"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-12-05T00:00:00.000Z",
             "host": "h", "engine": {}, "kv": {}}]
    for i in range(N):
        t = 0.5 * i
        rid = f"cache-{i}"
        recs.append({"kind": "request", "t": t, "id": rid, "event": "arrive", "prompt_tokens": PROMPT})
        recs += [{"kind": "request", "t": t + 0.05 + 0.01 * k, "id": rid, "event": "first_token" if k == 0 else "token",
                  "n": 1} for k in range(OUT)]
        recs.append({"kind": "request", "t": t + 0.2, "id": rid, "event": "finish", "completion_tokens": OUT})
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def _served(stderr: str) -> tuple[int, int]:
    m = re.search(r"prefix cache served (\d+)% of the ([\d,]+) prompt tokens it was asked for", stderr)
    assert m is not None, stderr
    return int(m[1]), int(m[2].replace(",", ""))


def test_a_replay_repeated_with_its_seed_is_named_as_served_from_the_cache(vllm, trace_dir):
    src = trace_dir / "load-cache-source.jsonl"
    _source(src)
    runs = []
    for seed in (4242, 4242, 4343):
        r = kvtop("load", "--from", str(src), "--url", vllm.url, "-o", str(trace_dir / f"load-cache-{len(runs)}.jsonl"),
                  "--seed", str(seed), "--no-gpu", "--no-host", "--interval", "0.5", "--force", timeout=300)
        assert r.returncode == 0, r.stderr
        runs.append(r.stderr)
    first, again, other = (_served(e) for e in runs)
    print(f"\n[real-engines] load's prefix cache served, seed 4242, again, 4343: {first[0]}%, {again[0]}%, "
          f"{other[0]}% of {first[1]} prompt tokens")
    # every prompt token counted, scraped before the first request and after the last
    assert first[1] == again[1] == other[1] == N * PROMPT
    # a new seed: token ids the engine never saw, nothing cached, no hint
    assert first[0] < 5 and other[0] < 5 and "--seed to measure" not in runs[0] + runs[2]
    # the same seed again: each prompt's full blocks (192 of its 200 tokens) came from the cache
    assert again[0] >= 90 and "give each replay its own --seed" in runs[1]
