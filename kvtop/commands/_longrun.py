"""What every long command shares: one Ctrl-C behaviour and a progress line on a terminal.

Ctrl-C (or SIGTERM) never throws work away: the command stops where it is, writes what it gathered
(the trace so far, the report of the window sampled so far) and says so on stderr. Progress goes to
stderr, only when stderr is a terminal, on one line it rewrites; a pipe or a log gets nothing.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from types import FrameType, TracebackType
from typing import Any, TextIO

from kvtop.model.records import EngineRecord, Record

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """``with Interrupt() as stop:`` SIGINT/SIGTERM set ``stop.requested`` instead of raising, so a
    synchronous loop can finish its current step and close its files; handlers restored on exit.
    A second Ctrl-C while stopping raises KeyboardInterrupt as usual (the user means it)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._old: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> Interrupt:
        for sig in INTERRUPTS:
            self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def interrupted_note(command: str, what: str) -> None:
    """The one line a command prints when a signal ended it early: what it kept."""
    sys.stderr.write(f"kvtop {command}: interrupted: {what}\n")
    sys.stderr.flush()


class Progress:
    """``progress.update(done, total)`` draws ``label: 42% (detail)`` on stderr, at most 5 times a
    second; ``close()`` clears the line. Does nothing unless stderr is a terminal."""

    def __init__(self, label: str, stream: TextIO | None = None, min_interval_s: float = 0.2):
        self.stream = stream or sys.stderr
        self.label = label
        self.on = _isatty(self.stream)
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._drawn = False

    def update(self, done: float, total: float | None = None, detail: str = "") -> None:
        if not self.on:
            return
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return
        self._last = now
        text = self.label
        if total:
            text += f": {min(100.0, max(0.0, 100.0 * done / total)):3.0f}%"
        if detail:
            text += f" ({detail})"
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class EngineWatch:
    """Logs each engine's changes of state, not every scrape: when it stops answering (warning, with
    why), again at most once a minute while it stays down, and when it answers again (info, with how
    long it was down). Fed by the run's records (a sink)."""

    REPEAT_S = 60.0

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._down_since: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._said: dict[str, float] = {}
        self._seen: set[str] = set()

    def sink(self, rec: Record) -> None:
        if not isinstance(rec, EngineRecord) or rec.url is None:
            return
        url = rec.url
        first = url not in self._seen
        self._seen.add(url)
        if rec.up:
            since = self._down_since.pop(url, None)
            failed = self._failures.pop(url, 0)
            if since is not None:
                self.log.info(f"engine {url} answers again after {rec.t - since:.0f} s ({failed} failed scrape(s))",
                         extra={"fields": {"event": "engine_up", "url": url, "down_s": round(rec.t - since, 3),
                                           "failed_scrapes": failed}})
            elif first:
                self.log.info(f"engine {url}: {rec.adapter or 'unknown adapter'}, model {rec.model or 'unknown'}",
                         extra={"fields": {"event": "engine_up", "url": url, "adapter": rec.adapter,
                                           "model": rec.model}})
            return
        reason = rec.warnings[0] if rec.warnings else "no answer"
        self._failures[url] = self._failures.get(url, 0) + 1
        if url not in self._down_since:
            self._down_since[url] = rec.t
            self._said[url] = rec.t
            self.log.warning(f"engine {url} does not answer: {reason}",
                        extra={"fields": {"event": "engine_down", "url": url, "error": reason}})
        elif rec.t - self._said[url] >= self.REPEAT_S:
            self._said[url] = rec.t
            down = rec.t - self._down_since[url]
            self.log.warning(f"engine {url} still does not answer after {down:.0f} s ({self._failures[url]} failed "
                        f"scrape(s)): {reason}", extra={"fields": {"event": "engine_down", "url": url, "error": reason,
                                                                   "down_s": round(down, 3)}})
