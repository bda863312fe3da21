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
