"""The repository documents itself: every `docs/X.md §n` a file cites names a section that exists there,
and nothing points outside the checkout for its facts."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CITE = re.compile(r"docs/([a-z-]+)\.md\s*§\s*(\d+(?:\.\d+)?[a-z]?)")
SEARCHED = ("kvtop", "plugins", "tests", "bench", "eval", "testkit", "scripts")


def _sections(doc: Path) -> set[str]:
    out = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#{1,6}\s+§?(\d+(?:\.\d+)?[a-z]?)[.\s]", line + " ")
        if m:
            out.add(m.group(1))
    return out


def _texts():
    for d in SEARCHED:
        for p in (REPO / d).rglob("*"):
            if p.is_file() and p.suffix in (".py", ".md", ".json", ".sh") and "__snapshots__" not in p.parts:
                yield p, p.read_text(encoding="utf-8", errors="replace")
    for name in ("README.md", "CONTRIBUTING.md"):
        yield REPO / name, (REPO / name).read_text(encoding="utf-8")


def test_every_docs_citation_names_an_existing_section():
    sections = {p.stem: _sections(p) for p in (REPO / "docs").glob("*.md")}
    assert {"design", "engines", "kv-science", "host-and-gpu", "real-engines"} <= set(sections)
    cited, missing = 0, []
    for path, text in _texts():
        for doc, sec in CITE.findall(text):
            cited += 1
            if doc not in sections or sec not in sections[doc]:
                missing.append(f"{path.relative_to(REPO)}: docs/{doc}.md §{sec}")
    assert cited >= 40  # the code cites its facts; a rewrite that dropped them would show here
    assert not missing, missing


def test_nothing_cites_documents_outside_the_repository():
    outside = re.compile(r"\.\./shared|shared/reference|(?<![\w/])reference/[a-z-]+\.md|\bDESIGN §")
    bad = [str(p.relative_to(REPO)) for p, text in _texts() if p.name != "test_docs.py" and outside.search(text)]
    assert not bad, bad
