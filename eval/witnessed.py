"""The witnessed real-vLLM rounds shipped in ``eval/witness_rounds/`` (see its README.md): names,
selection by letter ("A-G", "H,K", "all") and their traces decompressed for the analysis."""

from __future__ import annotations

import lzma
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).with_name("witness_rounds")


def _code(name: str) -> str:
    """A round's letters: "B-21" -> "B" (after Z come AA, AB, ...)."""
    return name.split("-")[0]


def _order(code: str) -> tuple[int, str]:
    return len(code), code


def names() -> list[str]:
    """Every round, in letter order ("A", "B-21", ..., "Z-271", "AA-301", ...)."""
    return sorted((p.name for p in ROOT.iterdir() if p.is_dir()), key=lambda n: _order(_code(n)))


def select(spec: str) -> list[str]:
    """Rounds by letter: "all", "A-G" (a range, in letter order: "U-AB" runs through Z), "H,K,O" or a
    mix ("A-C,K")."""
    every = names()
    by_code = {_code(n): n for n in every}
    if spec.strip().lower() == "all":
        return every
    out: list[str] = []
    for part in (p.strip().upper() for p in spec.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        hi = hi or lo
        if lo not in by_code or hi not in by_code or _order(lo) > _order(hi):
            raise ValueError(f"no witnessed round {part!r} (rounds: {', '.join(sorted(by_code, key=_order))})")
        out += [n for n in every if _order(lo) <= _order(_code(n)) <= _order(hi) and n not in out]
    return out


@contextmanager
def traces(rounds: list[str]) -> Iterator[list[str]]:
    """The rounds' traces, decompressed into a temporary directory for as long as the block runs
    (``ROUND/name.jsonl`` each)."""
    d = tempfile.mkdtemp(prefix="kvtop-witness-rounds-")
    try:
        out = []
        for r in rounds:
            os.makedirs(os.path.join(d, r))
            for src in sorted((ROOT / r).glob("*.jsonl.xz")):
                dst = os.path.join(d, r, src.name[:-3])
                with lzma.open(src, "rb") as fi, open(dst, "wb") as fo:
                    shutil.copyfileobj(fi, fo)
                out.append(dst)
        yield out
    finally:
        shutil.rmtree(d, ignore_errors=True)
