"""Hand-built traces for end-to-end tests: a header and records, written as kvtop writes a trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_trace(path: Path, header: dict[str, Any], recs: list[dict[str, Any]]) -> None:
    """``recs`` in time order (a stable sort: one request's records keep their order) after ``header``."""
    recs.sort(key=lambda d: d["t"])
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for d in recs:
            f.write(json.dumps(d) + "\n")


def decoding_streams(recs: list[dict[str, Any]], times: list[float], arrive: float, finish: float,
                     prompt_tokens: int | None = None) -> list[float]:
    """Three decoding streams a, b, c with tokens at ``times`` (each 0.2 ms after the one before it),
    arrived at ``arrive`` and finished at ``finish``; their first-token times."""
    firsts = []
    for i, rid in enumerate(("a", "b", "c")):
        off = 0.0002 * i
        recs.append({"kind": "request", "t": arrive, "id": rid, "event": "arrive", "source": "proxy"})
        recs.append({"kind": "request", "t": times[0] + off, "id": rid, "event": "first_token", "n": 1})
        recs += [{"kind": "request", "t": t + off, "id": rid, "event": "token", "n": 1} for t in times[1:]]
        fin = {"kind": "request", "t": finish, "id": rid, "event": "finish", "completion_tokens": len(times)}
        if prompt_tokens is not None:
            fin["prompt_tokens"] = prompt_tokens
        recs.append(fin)
        firsts.append(times[0] + off)
    return firsts
