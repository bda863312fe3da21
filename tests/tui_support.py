"""Helpers for the console tests: the visible screen as plain text, and small fake feeds."""

from __future__ import annotations

import asyncio
from typing import Any


def _n(value: Any, unit: str, source: str) -> dict[str, Any]:
    return {"value": value, "unit": unit, "source": source}


# A fixed verdict in the shape kvtop.analysis.advice.advisor.advise() returns, to test how the console renders
# one (the sample generator makes none; screenshots show the real analysis').
RENDER_VERDICT: dict[str, Any] = {
    "action": "swap",
    "mechanism": "swap",
    "also": ["admission"],
    "numbers": {
        "itl_target": _n(0.1, "s", "given"),
        "kv_bytes_per_token_rank": _n(131072, "B/token", "model config"),
        "bw_eff": _n(24.8e9, "B/s", "measured"),
        "prefill_rate": _n(15600.0, "tokens/s", "measured"),
        "cancel_prob": _n(0.04, "", "measured"),
        "seq_tokens": _n(6400, "tokens", "measured"),
        "bytes_moved": _n(838860800, "B", "derived"),
        "swap_gpu_s": _n(0.085, "s", "derived"),
        "recompute_gpu_s": _n(0.41, "s", "derived"),
        "break_even_tokens": _n(1330, "tokens", "derived"),
    },
    "settings": {"--kv-offloading-size": 16, "--max-num-seqs": 192},
    "confidence": 0.78,
    "marginal": False,
    "reasons": [
        "14 of 19 spikes coincide with the preemption counter rising while KV usage >= 0.97",
        "preempted requests resume with 6,400 tokens on average: recompute is 4.8x the transfer",
        "host has 310 GiB available for an offload pool",
    ],
}


def screen_text(app: Any) -> str:
    """What a user sees right now (top screen, modal dialogs included), one line per row."""
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(seg.text for seg in strip).rstrip() for strip in strips)


def vllm_adapter() -> Any:
    """The real vLLM adapter, from the installed entry point or (editable checkouts where
    ``kvtop_plugins`` is not mapped) from plugins/vllm.py through the --plugin loader."""
    from pathlib import Path

    from kvtop.plugin import PluginError, load_adapter, load_plugin_file

    try:
        return load_adapter("vllm")()
    except PluginError:
        load_plugin_file(Path(__file__).resolve().parents[1] / "plugins" / "vllm.py")
        return load_adapter("vllm")()


class TickFeed:
    """A live-like feed: advances a sample generator by ``dt`` of run time every ``period`` s."""

    is_fleet = False

    def __init__(self, sample: Any, period: float = 0.02, dt: float = 1.0):
        self.sample = sample
        self.period = period
        self.dt = dt
        self.refreshes = 0
        self.interval_s = period
        self.notice: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample.advance(self.dt)
            try:
                await asyncio.wait_for(stop.wait(), self.period)
            except asyncio.TimeoutError:
                pass

    @property
    def core(self) -> Any:
        return self.sample.core

    def refresh_now(self) -> None:
        self.refreshes += 1
        self.sample.advance(self.dt)

    def controls(self) -> None:
        return None


class FakeReplay:
    """The replay feed's control surface (pause/resume/seek/step, t, duration) over a sample:
    seeking forward generates the sample up to the target time."""

    is_fleet = False

    def __init__(self, sample: Any, duration: float = 300.0):
        self.sample = sample
        self.duration = duration
        self.t = sample.t
        self.paused = False
        self.calls: list[tuple[str, float | None]] = []
        self.interval_s = 1.0
        self.notice: str | None = None

    @property
    def core(self) -> Any:
        return self.sample.core

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    def refresh_now(self) -> None:
        pass

    def controls(self) -> FakeReplay:
        return self

    def pause(self) -> None:
        self.paused = True
        self.calls.append(("pause", None))

    def resume(self) -> None:
        self.paused = False
        self.calls.append(("resume", None))

    def seek(self, t: float) -> None:
        self.calls.append(("seek", t))
        t = min(t, self.duration)
        while self.sample.t < t:
            self.sample.advance(1.0)
        self.t = t

    def step(self, s: float) -> None:
        self.calls.append(("step", s))
        self.seek(max(0.0, self.t + s))

    def warning(self) -> str | None:
        return None  # a generated sample has no unreadable line
