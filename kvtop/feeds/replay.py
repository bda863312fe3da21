"""Replaying a trace file through the same Core a live run uses (docs/design.md §1, §3).

The feed streams the file (never loads it whole) and keeps a trace clock ``t``: records are
ingested once the trace clock passes their ``t``. At ``speed=1`` the trace clock follows the wall
clock; ``speed=0`` feeds as fast as possible. Pause, step and seek move the trace clock by hand.
UI-free: a view polls ``feed.core.snapshot(now=feed.t)``; after a backward seek ``feed.core`` is a
fresh core (``on_reset`` is called with it).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvtop.core import Core
from kvtop.model.records import Record
from kvtop.model.trace import TraceReader, is_gzip, open_binary
from kvtop.model.validate import parse_line

_TICK_S = 0.1  # the trace clock advances at least this often while running
_BATCH = 2000  # records fed between yields to the event loop at speed 0


def last_record_time(path: str | os.PathLike[str]) -> float | None:
    """``t`` of the last readable record, reading only the file's tail (traces can be huge)."""
    p = Path(path)
    if p.is_dir() or is_gzip(p):
        # a compressed segment cannot seek back cheaply: stream it (segments are size-bounded)
        last = None
        with open_binary(p) as g:
            for line in g:
                d = parse_line(line)  # the reader's own check: a hostile line must not raise here
                if d is not None and d.get("kind") != "header":
                    last = float(d["t"])
        return last
    size = p.stat().st_size
    window = 64 << 10
    with open(p, "rb") as f:
        while True:
            start = max(0, size - window)
            f.seek(start)
            lines = f.read(size - start).split(b"\n")
            if start > 0:
                lines = lines[1:]  # the first one is probably cut
            for line in reversed(lines):
                d = parse_line(line)  # the reader's own check: a hostile tail must not raise here
                if d is not None and d.get("kind") != "header":
                    return float(d["t"])
            if start == 0:
                return None
            window *= 8


class ReplayFeed:
    is_fleet = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        core: Core,
        speed: float = 1.0,
        core_factory: Callable[[], Core] | None = None,
        on_reset: Callable[[Core], None] | None = None,
    ):
        if isinstance(path, Core):  # ReplayFeed(core, path) reads just as well
            path, core = core, path  # type: ignore[assignment]
        if speed < 0:
            raise ValueError("speed must be >= 0")
        self.path = Path(path)
        self.core = core
        self.core_factory = core_factory
        self.on_reset = on_reset
        self._reader = TraceReader(self.path)  # raises TraceError for a missing / non-trace file
        self.header: dict[str, Any] = self._reader.header
        self.duration: float = last_record_time(self.path) or 0.0
        self._it: Iterator[Record] = self._reader.records()
        self._pending: Record | None = None
        self._exhausted = False
        self._finished = False  # the analysis was told the trace ended
        self.t = 0.0
        self.fed = 0
        self._speed = speed
        self._paused = False
        self._wake = asyncio.Event() if _has_loop() else None
        self._anchor: tuple[float, float] | None = None  # (loop time, trace time) while running
        self.interval_s = 1.0  # nothing to poll: the trace clock moves on its own
        self.notice: str | None = None

    # -- state --------------------------------------------------------------------------------
    @property
    def speed(self) -> float:
        return self._speed

    @speed.setter
    def speed(self, value: float) -> None:
        if value < 0:
            raise ValueError("speed must be >= 0")
        self._speed = value
        self._anchor = None
        self._poke()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def done(self) -> bool:
        """Every record has been fed."""
        return self._exhausted and self._pending is None

    @property
    def skipped(self) -> int:
        """Malformed lines skipped so far (a torn last line after a crash is the usual one)."""
        return self._reader.skipped

    def warning(self) -> str | None:
        return self._reader.warning()

    def pause(self) -> None:
        self._paused = True
        self._anchor = None
        self._poke()

    def resume(self) -> None:
        self._paused = False
        self._anchor = None
        self._poke()

    def controls(self) -> ReplayFeed:
        return self

    def refresh_now(self) -> None:
        """The trace clock moves on its own; a refresh needs nothing from the file."""

    def step(self, n_seconds: float) -> int:
        """Advance the trace clock by ``n_seconds`` now (paused or not); returns records fed."""
        n = self._feed_until(self.t + n_seconds)
        self._anchor = None
        return n

    def seek(self, t: float) -> int:
        """Jump the trace clock to ``t``. Backwards re-feeds from the start into a fresh core state:
        a new core from ``core_factory`` when given (``on_reset`` hears of it), else the same core
        object reset in place, so a view holding it stays valid."""
        t = max(0.0, t)
        if t < self.t:
            self._reader.close()
            self._reader = TraceReader(self.path)
            self._it = self._reader.records()
            self._pending = None
            self._exhausted = False
            self._finished = False
            self.t = 0.0
            self.fed = 0
            if self.core_factory is not None:
                self.core = self.core_factory()
            else:
                self.core.reset()
            if self.on_reset is not None:
                self.on_reset(self.core)
        n = self._feed_until(t)
        self._anchor = None
        self._poke()
        return n

    # -- feeding ------------------------------------------------------------------------------
    def _next(self) -> Record | None:
        if self._pending is None and not self._exhausted:
            self._pending = next(self._it, None)
            if self._pending is None:
                self._exhausted = True
        return self._pending

    def _feed_until(self, t: float, limit: int | None = None) -> int:
        """Ingest every record with ``rec.t <= t`` (at most ``limit``); the trace clock ends at ``t``."""
        n = 0
        ingest = self.core.ingest
        last = self.t
        while limit is None or n < limit:
            rec = self._next()
            if rec is None or rec.t > t:
                break
            ingest(rec)
            last = rec.t
            self._pending = None
            n += 1
        else:
            # stopped by the limit: the clock reaches the last record fed (it stayed at 0 while a
            # --speed 0 replay fed the whole trace: rates over "0s", a staleness of -211 s)
            self.fed += n
            self.t = max(self.t, last)
            return n
        self.fed += n
        self.t = max(self.t, min(t, self.duration) if self.done else t)
        if self.done and not self._finished:
            # the trace is over: its pending spikes get no more evidence (analyze judges them now too)
            self._finished = True
            finish = getattr(self.core.analysis, "finish", None)
            if finish is not None:
                finish()
        return n

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Feed until the end of the trace (or ``stop``); honours pause/resume/seek/speed meanwhile."""
        stop = stop or asyncio.Event()
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        while not stop.is_set() and not self.done:
            if self._paused:
                await self._sleep(stop, None)
                continue
            if self._speed == 0:
                self._feed_until(float("inf"), limit=_BATCH)
                await asyncio.sleep(0)
                continue
            now = loop.time()
            if self._anchor is None:
                self._anchor = (now, self.t)
            wall0, trace0 = self._anchor
            target = trace0 + (now - wall0) * self._speed
            self._feed_until(target)
            if self.done:
                break
            nxt = self._next()
            wait = _TICK_S if nxt is None else min(_TICK_S, max(0.0, (nxt.t - target) / self._speed))
            await self._sleep(stop, wait)
        if self.done:
            self.t = max(self.t, self.duration)

    async def _sleep(self, stop: asyncio.Event, seconds: float | None) -> None:
        assert self._wake is not None
        self._wake.clear()
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def close(self) -> None:
        self._reader.close()


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
