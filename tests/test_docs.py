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
        if not (REPO / d).is_dir():
            continue
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


# The README is the manual; the reference it links to lives in docs/. These guard the links between
# them: a moved section, a renamed heading or a deleted file breaks a test instead of a reader's click.
MANUAL_MAX_LINES = 400
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a `# comment` in a shell block is not a heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    # GitHub's anchor for a heading: lower case, punctuation dropped (backticks, dots, colons,
    # parentheses, §), spaces to hyphens.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(doc.read_text(encoding="utf-8")), re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _headings(doc: Path) -> set[str]:
    text = _prose(doc.read_text(encoding="utf-8"))
    return {" ".join(m.group(1).replace("`", "").split()) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]


def _broken_links(doc: Path, root: Path = REPO) -> list[str]:
    bad = []
    prose = re.sub(r"`[^`\n]*`", "", _prose(doc.read_text(encoding="utf-8")))  # `[a](b)` in code is no link
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{doc.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{doc.relative_to(root)}: {target} (no such section in {dest.relative_to(root)})")
    return bad


def test_every_link_in_the_manual_and_docs_reaches_a_file_and_section():
    linked = 0
    bad = []
    for doc in _markdown_files():
        linked += len(LINK.findall(_prose(doc.read_text(encoding="utf-8"))))
        bad += _broken_links(doc)
    assert linked >= 60  # the README reaches its reference through links; losing them would show here
    assert not bad, bad


def test_the_link_check_catches_a_missing_file_and_a_missing_section(tmp_path):
    doc = tmp_path / "x.md"
    (tmp_path / "y.md").write_text("# Why `kvtop` (really)\n\n## 6. The tier\n\n## Why `kvtop` (really)\n", encoding="utf-8")
    doc.write_text("[a](y.md#why-kvtop-really) [b](y.md#6-the-tier) [c](y.md#why-kvtop-really-1) [d](#top)\n"
                   "# Top\n[e](z.md) [f](y.md#nowhere) [g](https://example.org/#x) `[i](gone.md)`\n"
                   "```\n[h](gone.md)\n```\n",
                   encoding="utf-8")
    assert _broken_links(doc, root=tmp_path) == ["x.md: z.md (no such file)", "x.md: y.md#nowhere (no such section in y.md)"]


def test_every_readme_section_named_in_text_exists():
    # Code, help texts and documents name README sections by title: quoted after the word, or after
    # the word and a colon in a --help text. Each must still be a heading of the README.
    readme = _headings(REPO / "README.md")
    named = re.compile(r"README(?:'s)?(?: section)?,?\s*\(?\"([^\"]+)\"|README: ([A-Z][\w ]+[\w])")
    missing, cited = [], 0
    for path, text in _texts():
        if path.name == "test_docs.py":
            continue
        for m in named.finditer(text):
            title = " ".join((m.group(1) or m.group(2)).split())
            cited += 1
            if title not in readme:
                missing.append(f"{path.relative_to(REPO)}: README {title!r}")
    for doc in (REPO / "docs").glob("*.md"):
        for m in named.finditer(doc.read_text(encoding="utf-8")):
            title = " ".join((m.group(1) or m.group(2)).split())
            if title not in readme and "/" not in title:
                missing.append(f"{doc.relative_to(REPO)}: README {title!r}")
    assert cited >= 3  # the pattern still finds the citations the code makes (help texts name presets)
    assert not missing, missing


def test_the_readme_is_a_manual_that_links_its_reference():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MANUAL_MAX_LINES
    linked = {m.partition("#")[0] for m in LINK.findall(_prose(text))}
    for doc in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{doc.name}" in linked, f"README does not link docs/{doc.name}"
    # CI installs exactly as the README says and runs the README's test command (.ci/run).
    assert "python3 -m venv .venv && .venv/bin/pip install -e '.[test,dev]' && .venv/bin/python -m pytest -q" in text


def test_the_rules_table_sits_between_its_markers():
    # what lies between the markers is generated from the rules' data (tests/test_rules_table.py)
    text = (REPO / "docs" / "rules.md").read_text(encoding="utf-8")
    assert text.count("<!-- rules-table:begin -->\n") == 1 and text.count("<!-- rules-table:end -->\n") == 1
    table = text.split("<!-- rules-table:begin -->\n", 1)[1].split("<!-- rules-table:end -->", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) >= 10 and rows[0].startswith("| order | key | cause (`rule`) |")
