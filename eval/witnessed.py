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


def names() -> list[str]:
    """Every round, in letter order ("A", "B-21", ...)."""
    return sorted(p.name for p in ROOT.iterdir() if p.is_dir())


def select(spec: str) -> list[str]:
    """Rounds by letter: "all", "A-G" (a range), "H,K,O" or a mix ("A-C,K")."""
    every = names()
    by_letter = {n.split("-")[0]: n for n in every}
    if spec.strip().lower() == "all":
        return every
    out: list[str] = []
    for part in (p.strip().upper() for p in spec.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        letters = [chr(c) for c in range(ord(lo), ord(hi or lo) + 1)] if len(lo) == 1 and len(hi or lo) == 1 else []
        if not letters or any(x not in by_letter for x in letters):
            raise ValueError(f"no witnessed round {part!r} (rounds: {', '.join(sorted(by_letter))})")
        out += [by_letter[x] for x in letters if by_letter[x] not in out]
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
