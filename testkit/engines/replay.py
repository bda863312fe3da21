"""Replaying a recording against a real engine, as the tier's prescription loops do: the same
traffic offered before and after a change (``kvtop load --from``), on an engine that has served it once.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from testkit.engines.kvtop_run import kvtop, read_trace
from testkit.engines.servers import Server, cleanup


def arrival_span(path: Path) -> float:
    ts = sorted(d["t"] for d in read_trace(path) if d.get("kind") == "request" and d.get("event") == "arrive")
    return ts[-1] - ts[0] if ts else 0.0


def replay(src: Path, url: str, out_path: Path, seed: int) -> list[float]:
    """``kvtop load --from`` the recording; the arrival spans of its tries. A replay that did not offer
    the recorded arrivals (the eight within a few ms) is run again, and `compare` rightly calls such
    a pair not comparable; a third miss fails. On this 2-core VM, 3 of 36 replays by hand (2026-12-02)
    recorded all but the first arrival 1.1-1.8 s late. A packet capture on loopback of one: the
    client sent all eight requests within 3 ms; the proxy, which stamps an arrival when its handler
    runs, forwarded none of them for 1.8 s, and vLLM sent nothing on the one stream it served from
    +0.76 s to +1.80 s. The whole box stalled, not kvtop load. A CI run (2026-12-04) missed twice in a
    row, both `after` tries (2.6 and 2.3 s), and passed by hand at once (all spans under 0.14 s): a
    third try, before a miss fails.

    Each replay on one engine sends prompts it has not seen: ``--seed`` draws the token ids, and the
    same seed twice on a running vLLM is served from its prefix cache. A CI run (2026-12-05) replayed
    the prefill loop's `before` twice with one seed: the second replay's 1,500-token prompts took 18 ms
    to first token (0.3-1.3 s in the first) and no stream stalled, so the pooled `before` showed half
    its stalls and the budget's goodput gain (16 -> 16 of 20) vanished. ``seed`` is the replay's own;
    a retry adds 100 (the before and after engines are separate processes: one seed on each is a cold
    cache both times)."""
    spans = []
    for attempt in range(3):
        r = kvtop("load", "--from", str(src), "--url", url, "-o", str(out_path), "--seed", str(seed + 100 * attempt),
                  "--no-gpu", "--force", timeout=900)
        assert r.returncode == 0, r.stderr
        spans.append(arrival_span(out_path))
        if spans[-1] <= arrival_span(src) + 0.25:
            break
    return spans


WARMUP_SEED = 99  # the restarted engine's unmeasured replay: a seed no measured replay uses


def warm(src: Path, url: str, out_path: Path) -> None:
    """One unmeasured replay on the engine restarted with the flags, so that each configuration is
    measured on an engine that has served the traffic once (the recording warmed the one before). A
    fresh vLLM's first seconds are slow: in one tier run (2026-12-05) the restarted engine took
    115-240 ms decode steps for 3.5 s, a long prompt or none, and its first replay lost 2.6 s over
    the 100 ms target where its second lost none; the engine before the change, warmed by the
    recording, paid nothing of the kind."""
    r = kvtop("load", "--from", str(src), "--url", url, "-o", str(out_path), "--seed", str(WARMUP_SEED),
              "--no-gpu", "--force", timeout=900)
    assert r.returncode == 0, r.stderr


def measure(src: Path, url: str, trace_dir: Path, name: str, which: str,
            times: int = 2) -> tuple[list[Path], list[list[float]]]:
    """The recording replayed ``times`` times on the engine at ``url`` (seeds 1, 2, ...: prompts it has
    not seen), as ``{name}-{which}1.jsonl``, ...; the engine after a change (``which`` "after") first
    serves it once unmeasured (``warm``). The traces, and each replay's arrival spans by try."""
    if which == "after":
        warm(src, url, trace_dir / f"{name}-after-warmup.jsonl")
    paths = [trace_dir / f"{name}-{which}{i}.jsonl" for i in range(1, times + 1)]
    return paths, [replay(src, url, p, seed) for seed, p in enumerate(paths, 1)]


def compare_pairs(before: list[Path], after: list[Path], target_ms: float, out_path: Path,
                  *extra: str) -> dict[str, Any]:
    """``kvtop compare`` of the replays before against those after (pairs beyond the first pooled with
    ``--also``), at ``target_ms``; its JSON, also written to ``out_path`` for a post-mortem."""
    also = [a for b, f in zip(before[1:], after[1:], strict=True) for a in ("--also", str(b), str(f))]
    r = kvtop("compare", str(before[0]), str(after[0]), *also,
              "--itl-target-ms", f"{target_ms:g}", *extra, "--format", "json")
    assert r.returncode == 0, r.stderr
    out_path.write_text(r.stdout)
    return json.loads(r.stdout)


def advised(src: Path, target_ms: float | None = None) -> tuple[list[str], dict[str, Any]]:
    """What ``kvtop advise`` makes of a recording (at ``target_ms`` where given): the flags it emits
    (``--emit-flags``, as an operator would paste them) and its verdict (JSON)."""
    at = ("--itl-target-ms", f"{target_ms:g}") if target_ms is not None else ()
    r = kvtop("advise", "--trace", str(src), *at, "--emit-flags")
    assert r.returncode == 0, r.stderr
    flags = shlex.split(r.stdout.strip())
    r = kvtop("advise", "--trace", str(src), *at, "--format", "json")
    assert r.returncode == 0, r.stderr
    return flags, json.loads(r.stdout)


def measure_on(srv: Server, src: Path, trace_dir: Path, name: str, which: str, times: int = 2,
               timeout: float = 240) -> tuple[list[Path], list[list[float]]]:
    """``measure`` on a server started for it (the engine restarted with a change), stopped after."""
    try:
        srv.start(timeout=timeout)
        return measure(src, srv.url, trace_dir, name, which, times)
    finally:
        cleanup(srv)
