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
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from kvtop.errors import RunFailure
from kvtop.model.records import EngineRecord, Record

if TYPE_CHECKING:
    from kvtop.model.trace import TraceWriter

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
# a recorder also stops in order when its terminal goes (an SSH session that drops sends SIGHUP):
# the streams in flight are recorded as cut off and the buffer reaches the disk
STOP_SIGNALS = (*INTERRUPTS, signal.SIGHUP)


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


class GuardedTrace:
    """The trace of a run that must outlive its disk (``record``, ``load``, ``proxy --record``): the
    first failed write (a full disk, a quota) stops the recording, not the run (a proxy goes on
    forwarding the traffic its clients depend on); it is said at once in one warning line, every
    record after it is counted, and ``finish`` fails the run (exit 1) with how many were not recorded.
    The writer is the runner's sink: a sink's exception would only have become a console event."""

    def __init__(self, writer: TraceWriter, command: str, forwards: bool = False,
                 on_fail: Callable[[], None] | None = None) -> None:
        """``forwards``: the run carries traffic (a recording proxy) and goes on; ``on_fail``: how a
        run that only records stops."""
        self.writer: TraceWriter | None = writer
        self.command = command
        self.forwards = forwards
        self.on_fail = on_fail
        self.failed: str | None = None
        self.dropped = 0
        self._written = 0

    @property
    def count(self) -> int:
        """Records on disk (all the writer accepted, until a failure: those its file holds)."""
        return self.writer.count if self.writer is not None else self._written

    def write(self, rec: Record | dict[str, Any]) -> None:
        w = self.writer
        if w is not None:
            try:
                w.write(rec)
                return
            except OSError as e:  # TraceWriteError (the writer raises no other after it opened)
                self._fail(e)
        if self.failed is not None:
            self.dropped += 1

    def flush_if_due(self) -> None:
        if self.writer is not None:
            try:
                self.writer.flush_if_due()
            except OSError as e:  # TraceWriteError (the writer raises no other after it opened)
                self._fail(e)

    def close(self) -> None:
        w, self.writer = self.writer, None
        if w is None:
            return
        try:
            w.close()
            self._written = w.count
        except OSError as e:
            self._lost(w, str(e))

    def finish(self) -> None:
        """Close, then fail the run (exit 1) if the disk refused any record."""
        self.close()
        if self.failed is not None:
            carried = " (the traffic was forwarded)" if self.forwards else ""
            raise RunFailure(f"{self.failed}; {self.dropped} record(s) not recorded{carried}")

    def _fail(self, e: OSError) -> None:
        w, self.writer = self.writer, None
        assert w is not None
        after = "still forwarding" if self.forwards else "stopping" if self.on_fail is not None else "still running"
        print(f"{self.command}: warning: {e}; {after}, no longer recording", file=sys.stderr, flush=True)
        try:
            w.close()
        except OSError:
            pass
        self._lost(w, str(e))
        if self.on_fail is not None:
            self.on_fail()

    def _lost(self, w: TraceWriter, why: str) -> None:
        # what the write buffer held when the disk filled is lost too
        unsaved = w.unsaved()
        self.failed = self.failed or why
        self.dropped += unsaved
        self._written = w.count - unsaved
