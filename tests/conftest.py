"""Shared test helpers: fixture paths and running the real `kvtop` CLI in a subprocess."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Engine captures live in the repo (tests/fixtures/engines/SOURCES.md says where each came from).
FIXTURES = REPO / "tests" / "fixtures" / "engines"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def small_kv_storm() -> dict:
    """A scenario: 16 long streams (prompts of ~400-2,000 tokens, max_tokens 1,800) preempting each
    other on a 22,880-token KV cache of llama-3.1-8b on vLLM (a fresh copy each call)."""
    return {
        "name": "16 long streams on a small KV cache",
        "engine": "vllm",
        "model": "llama-3.1-8b",
        "prefill": {"tokens_per_s": 25000},
        "link": {"bw_eff_gbps": 25},
        "host": {"pinned_free_bytes": 200e9},
        "preemption": {"seq_tokens": 2600, "cancel_prob": 0.0, "per_minute": 30, "per_completed": 0.8,
                       "per_preempted": 2.5},
        "traffic": {"prompt_mean": 1000, "output_mean": 1400, "output_p90": 1799, "output_p99": 1799,
                    "request_tokens_p90": 2400, "request_tokens_p99": 3700, "request_tokens_max": 3800},
        "capacity": {"kv_capacity_tokens": 22880},
    }


def judge(doc: dict) -> dict:
    """The verdict `kvtop advise` gives a scenario document (validated first, as the CLI does)."""
    from kvtop.analysis.advice import scenario

    scenario.validate(doc)
    return scenario.evaluate(doc)["verdict"]


def flags(verdict: dict) -> dict:
    """A verdict's settings as {flag (or the generic setting where the engine names none): value}."""
    return {f["flag"] or f["setting"]: f["value"] for f in verdict["settings"]}


def run_kvtop(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
              input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m kvtop ARGS` as a user would, with this checkout on the path."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("XDG_CONFIG_HOME", str(REPO / ".cache" / "no-config"))
    if env:
        e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "kvtop", *args], capture_output=True, text=True, timeout=timeout, env=e, input=input
    )


@pytest.fixture
def kvtop_cli():
    return run_kvtop


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The `prometheus` tier starts a real Prometheus server (~1 min): it runs when asked for
    # (`-m prometheus`, as .ci/run does, or KVTOP_PROMETHEUS=1), not in the quick unit run.
    if "prometheus" in (config.option.markexpr or "") or os.environ.get("KVTOP_PROMETHEUS") == "1":
        return
    keep = [i for i in items if i.get_closest_marker("prometheus") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("prometheus") is not None])
        items[:] = keep


def wait_for_line(stream, pattern: str, timeout_s: float = 30.0) -> re.Match[str]:  # noqa: ANN001
    """The first line of a child's output stream matching ``pattern`` (read on a thread, so a
    child that prints nothing fails the test after ``timeout_s`` with what it did print)."""
    found: list[re.Match[str]] = []
    seen: list[str] = []

    def reader() -> None:
        for line in stream:
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                found.append(m)
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout_s)
    if not found:
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s: {''.join(seen)[-2000:]}")
    return found[0]


@contextlib.contextmanager
def logged(logger: logging.Logger, level: int = logging.WARNING) -> Iterator[list[logging.LogRecord]]:
    """The records ``logger`` emits inside the block. A handler on the logger itself, not pytest's
    caplog: the CLI's log setup (tests that run ``main()``) stops "kvtop" propagating to the root."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = seen.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
