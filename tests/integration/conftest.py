"""Session fixtures for the real-engine tier: install/build once (cached), start servers, stop them.

Setup failures (no registry, build error) FAIL the tests with the script's message: CI must not go
green by skipping. Locally, deselect the tier with ``-m "not real_engine"``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The engine helpers live in testkit/engines, where bench/real_engines.py imports them too.
from testkit.engines import servers

_T0 = time.monotonic()


def _tier_requested(config: pytest.Config) -> bool:
    return "real_engine" in (config.option.markexpr or "") or os.environ.get("KVTOP_REAL_ENGINES") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every test_real_*.py here needs a real engine (the captured-page tests do not). The tier is
    # opt-in (-m real_engine, or KVTOP_REAL_ENGINES=1) so the plain unit-test command stays fast; CI
    # runs it as its own step, where a failed install fails the run instead of skipping.
    here = config.rootpath / "tests" / "integration"
    real = []
    for item in items:
        p = item.path
        if p.parent == here and p.name.startswith("test_real_"):
            item.add_marker(pytest.mark.real_engine)
            real.append(item)
    if real and not _tier_requested(config):
        _DESELECTED.extend(real)
        config.hook.pytest_deselected(items=real)
        items[:] = [i for i in items if i not in real]


_DESELECTED: list[pytest.Item] = []


@pytest.fixture(scope="session")
def trace_dir() -> Path:
    """Traces and reports of the last tier run, kept for a post-mortem (pytest's tmp dirs rotate away)."""
    d = servers.CACHE / "last-tier-run"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


@pytest.fixture(scope="session")
def vllm_install() -> tuple:
    try:
        return servers.setup_vllm()
    except servers.EngineSetupError as e:
        pytest.fail(f"real vLLM could not be set up: {e}", pytrace=False)


@pytest.fixture(scope="session")
def llamacpp_install() -> tuple:
    try:
        return servers.setup_llamacpp()
    except servers.EngineSetupError as e:
        pytest.fail(f"real llama.cpp could not be set up: {e}", pytrace=False)


@pytest.fixture(scope="session")
def vllm(vllm_install) -> Iterator[servers.Server]:
    python, model = vllm_install
    srv = servers.vllm_server(python, model)
    try:
        srv.start(timeout=300)
    except servers.EngineSetupError as e:
        servers.cleanup(srv)
        pytest.fail(f"real vLLM server did not start: {e}", pytrace=False)
    yield srv
    servers.cleanup(srv)


@pytest.fixture(scope="session")
def llamacpp(llamacpp_install) -> Iterator[servers.Server]:
    binary, model = llamacpp_install
    # 4 slots of 2,048 tokens: room for a ~1,500-token prompt beside three decoding streams.
    srv = servers.llama_server(binary, model, ctx=8192, parallel=4)
    try:
        srv.start(timeout=120)
    except servers.EngineSetupError as e:
        servers.cleanup(srv)
        pytest.fail(f"real llama-server did not start: {e}", pytrace=False)
    yield srv
    servers.cleanup(srv)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if _DESELECTED:
        terminalreporter.write_line(
            f"real-engine tier: {len(_DESELECTED)} tests not run (opt in with -m real_engine or KVTOP_REAL_ENGINES=1)")
    reps = [r for k in ("passed", "failed", "error") for r in terminalreporter.stats.get(k, [])
            if "real_engine" in getattr(r, "keywords", {}) and r.when == "call"]
    if reps:
        tr = terminalreporter
        tr.write_sep("-", "real-engine tier timing")
        for r in sorted(reps, key=lambda r: -r.duration)[:15]:
            tr.write_line(f"{r.duration:7.1f} s  {r.nodeid}")
        tr.write_line(f"tier wall time so far: {time.monotonic() - _T0:.0f} s")
