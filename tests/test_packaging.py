"""What the package index page and `pip install` show: licence, links, extras, dependency bounds."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]


def test_the_license_file_is_the_apache_2_text_the_metadata_names():
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert PROJECT["license"] == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a stub pointing elsewhere
    assert "LICENSE" in PROJECT["license-files"]


def test_the_index_page_has_links_and_classifiers():
    urls = PROJECT["urls"]
    assert {"Homepage", "Repository", "Issues", "Changelog"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    classifiers = PROJECT["classifiers"]
    assert "Programming Language :: Python :: 3.10" in classifiers
    assert any(c.startswith("Topic :: System :: Monitoring") for c in classifiers)
    # PEP 639: with a licence expression, a licence classifier is an error at build time
    assert not any(c.startswith("License ::") for c in classifiers)


def test_readme_images_are_absolute_links_into_the_repository():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", readme)
    assert len(images) >= 8
    repo = PROJECT["urls"]["Repository"]
    owner_name = repo.removeprefix("https://github.com/")
    raw = f"https://raw.githubusercontent.com/{owner_name}/main/"
    for src in images:
        # a relative path is broken on the package index page, which renders the README alone
        assert src.startswith(raw), src
        assert (REPO / src.removeprefix(raw)).is_file(), src


def _bounded(name: str) -> str:
    spec = next(d for d in PROJECT["dependencies"] if re.match(rf"{name}\b", d))
    return spec.split(";")[0]


def test_http_stacks_and_apis_kvtop_relies_on_have_an_upper_bound():
    assert "<1" in _bounded("httpx")  # httpx 1.0 changes the client API
    assert "<4" in _bounded("aiohttp")  # aiohttp 4 changes the server and client APIs
    assert "<3" in _bounded("numpy")
    assert "<5" in _bounded("jsonschema")


def test_linters_are_a_dev_extra_and_ci_installs_what_the_readme_says():
    extras = PROJECT["optional-dependencies"]
    dev = " ".join(extras["dev"])
    test = " ".join(extras["test"])
    for tool in ("ruff", "mypy", "import-linter"):
        assert tool in dev and tool not in test, tool
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install -e '.[test,dev]'" in readme
    assert "pip install -q -e '.[test,dev]'" in ci


def test_install_hints_name_the_distribution_not_the_unrelated_kvtop():
    # `kvtop` on the package index is an unrelated Rust tool: every hint names kvtop-console
    wrong = []
    for path in [*(REPO / "kvtop").rglob("*.py"), REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for m in re.finditer(r"pip install[^\n`]*?[' ]kvtop(\[|[ '\n]|$)", path.read_text(encoding="utf-8")):
            wrong.append(f"{path.relative_to(REPO)}: {m.group(0)}")
    assert not wrong, wrong
