"""Rotating trace segments for the long-running agent (`kvtop agent --trace-dir`).

The agent never stops, so one trace file would grow without bound. Records go to an active
segment (a plain trace: header line, then records); when it passes ``max_bytes`` or ``max_age_s``
it is closed and gzip-compressed to ``<name>.jsonl.gz`` and a new segment starts. Every segment is
a complete trace on its own, so `kvtop replay` / `kvtop analyze` open any of them directly (the
readers decompress transparently). Old compressed segments are deleted once the directory holds
more than ``keep_bytes`` of them or they are older than ``keep_age_s``.

Compression runs in a background thread: a 64 MiB segment takes a second or two to compress and
the agent's event loop (which also serves the proxy) must not stall on it.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvtop.model.records import Record
from kvtop.model.trace import ACTIVE_SUFFIX, DONE_SUFFIX, SEGMENT_PREFIX, TraceWriter, latest_run

log = logging.getLogger(__name__)
OPEN_RETRY_S = 5.0  # how long a directory that took no segment is left alone

__all__ = ["RotatingTrace", "latest_run", "segments"]


def segments(directory: str | os.PathLike[str]) -> list[Path]:
    """Compressed segments in ``directory``, oldest first (names sort by their UTC start)."""
    d = Path(directory)
    return sorted(p for p in d.glob(f"{SEGMENT_PREFIX}*{DONE_SUFFIX}") if p.is_file())


class RotatingTrace:
    """A record sink that writes size/age-bounded, compressed trace segments into one directory."""

    def __init__(self, directory: str | os.PathLike[str], header: Callable[[], dict[str, Any]],
                 max_bytes: int = 64 << 20, max_age_s: float = 600.0, keep_bytes: int = 1 << 30,
                 keep_age_s: float = 86400.0, flush_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.dir = Path(directory)
        # request timings are operational data: the directory is the agent user's alone
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._header = header
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.keep_bytes = keep_bytes
        self.keep_age_s = keep_age_s
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._writer: TraceWriter | None = None
        self._opened_at = 0.0
        self._compressing: list[threading.Thread] = []
        self.rotations = 0
        self._n = 0
        self.dropped = 0  # records not kept: kvtop_dropped_records_total
        self.last_error: str | None = None
        # after a segment could not be opened (a full disk) the next try waits: one empty file and
        # one warning per try, not one per record
        self._retry_at = 0.0
        self._failing = False
        self._unsaved: list[Path] = []  # closed segments whose compression failed (the disk was full)
        # a run of failures: (the last record's time written before it, records dropped before it);
        # written as a "loss" record once writing works again, so the gap is in the trace
        self._last_t: float | None = None
        self._loss: tuple[float | None, int] | None = None
        # a segment left uncompressed by a previous agent that died: compress it now
        for stale in sorted(self.dir.glob(f"{SEGMENT_PREFIX}*{ACTIVE_SUFFIX}")):
            self._compress_later(stale)

    @property
    def active_path(self) -> Path | None:
        return self._writer.path if self._writer is not None else None

    def _open(self) -> TraceWriter:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        path = self.dir / f"{SEGMENT_PREFIX}{stamp}{ACTIVE_SUFFIX}"
        try:
            w = TraceWriter(path, self._header(), flush_interval_s=self.flush_interval_s)
        except OSError:
            self._retry_at = self._clock() + OPEN_RETRY_S
            try:
                if path.stat().st_size == 0:
                    path.unlink()  # a segment that holds not even its header is no segment
            except OSError:
                pass
            raise
        os.chmod(path, 0o600)  # also in a directory someone else made world-readable
        self._opened_at = self._clock()
        if self._failing:
            # the header reached the disk: the streak is over (a buffered write that "succeeds" proves
            # nothing, it only filled the buffer). Segments closed meanwhile are compressed now.
            self._failing = False
            log.warning("trace segments in %s: writing again", self.dir)
            unsaved, self._unsaved = self._unsaved, []
            for old in unsaved:
                if old.exists():
                    self._compress_later(old)
        return w

    def _failed(self, e: Exception, record: bool = True) -> None:
        """A write (``record``: of a record, which is dropped), flush or rotation failed."""
        if self._loss is None:
            self._loss = (self._last_t, self.dropped)
        self.dropped += record
        self.last_error = str(e)
        w, self._writer = self._writer, None
        if w is not None:
            # A segment that failed a write is closed and kept as it is on disk (a complete trace up
            # to its last flush), and the next one waits for the back-off: kept open, every record
            # would try the full disk again and the warning would come and go with the write buffer.
            self._retry_at = self._clock() + OPEN_RETRY_S
            try:
                w.close()
            except (OSError, ValueError):
                pass  # TraceWriter.close closes the file even so
            # the records the write buffer held when the disk filled are lost with it: dropped too
            self.dropped += w.unsaved()
            self._compress_later(w.path)
        if not self._failing:  # once per run of failures: the agent keeps serving /metrics meanwhile
            self._failing = True
            log.warning("trace segments in %s: %s; records are dropped (kvtop_dropped_records_total) until "
                        "writing works again", self.dir, e)

    def write(self, rec: Record) -> None:
        """Append one record (rotating first when the segment is full or old). Never raises:
        a full disk must not stop monitoring, so failures are counted (kvtop_dropped_records_total)."""
        try:
            w = self._writer
            self._n += 1
            # the size on disk lags the write buffer by at most 64 KiB: close enough for a limit,
            # and an fstat every 256 records costs nothing on the token hot path
            if w is not None and not self._n & 255 and (
                    self._clock() - self._opened_at >= self.max_age_s
                    or os.fstat(w._f.fileno()).st_size >= self.max_bytes):
                self.rotate()
                w = None
            if w is None:
                if self._clock() < self._retry_at:
                    self.dropped += 1
                    return
                w = self._writer = self._open()
                if self._loss is not None:
                    w.write(self._loss_record(rec.t))
            w.write(rec)
            self._last_t = rec.t
        except (OSError, ValueError) as e:
            self._failed(e)

    def _loss_record(self, t: float) -> dict[str, Any]:
        """What a run of failed writes lost, said in the trace where it resumes (``analyze`` and
        ``replay`` name the gap, rather than read a torn line as a crash and streams as cut)."""
        assert self._loss is not None
        since, before = self._loss
        self._loss = None
        out: dict[str, Any] = {"kind": "loss", "t": t, "records": self.dropped - before,
                               "reason": (self.last_error or "the disk refused them")[:200]}
        if since is not None:
            out["from_t"] = since
        return out

    def flush_if_due(self) -> None:
        w = self._writer
        if w is not None:
            try:
                if self._clock() - self._opened_at >= self.max_age_s:
                    self.rotate()  # an idle agent still closes its segment on time
                else:
                    w.flush_if_due()
            except OSError as e:
                self._failed(e, record=False)

    def rotate(self) -> None:
        w, self._writer = self._writer, None
        if w is None:
            return
        try:
            w.close()
        except OSError:
            self.dropped += w.unsaved()  # the buffer's records its last flush could not write
            raise
        finally:
            # also after a failed last flush: what reached the disk is a trace to keep
            self.rotations += 1
            self._compress_later(w.path)

    def _compress_later(self, path: Path) -> None:
        t = threading.Thread(target=self._compress, args=(path,), name="kvtop trace gzip", daemon=True)
        self._compressing = [x for x in self._compressing if x.is_alive()]
        self._compressing.append(t)
        t.start()

    def _compress(self, path: Path) -> None:
        done = path.with_name(path.name[: -len(ACTIVE_SUFFIX)] + DONE_SUFFIX)
        tmp = done.with_name(done.name + ".part")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as raw:
                with open(path, "rb") as src, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                raw.flush()
                # on the disk before the plain segment goes: a power cut after the unlink would
                # otherwise lose the whole segment (the page cache held the .gz)
                os.fsync(raw.fileno())
            os.replace(tmp, done)  # readers never see a half-written .gz under the final name
            _sync_dir(done.parent)  # ... and the rename too
            path.unlink()
        except OSError as e:
            # no record is lost: the plain segment stays
            self.last_error = f"compressing {path.name}: {e}"
            tmp.unlink(missing_ok=True)
            # the plain segment stays, complete: compressed when writing works again (or at the next start)
            self._unsaved.append(path)
            return
        self._prune()

    def _prune(self) -> None:
        segs = segments(self.dir)
        now = time.time()
        sizes = []
        for p in segs:
            try:
                st = p.stat()
            except OSError:
                continue
            sizes.append((p, st.st_size, st.st_mtime))
        total = sum(s for _, s, _ in sizes)
        for p, size, mtime in sizes[:-1]:  # the newest segment always stays
            if total <= self.keep_bytes and now - mtime <= self.keep_age_s:
                break
            try:
                p.unlink()
            except OSError:
                continue
            total -= size

    def close(self, wait_s: float = 30.0) -> None:
        """Close and compress the active segment; wait for compression to finish."""
        try:
            self.rotate()
        except OSError as e:
            self.last_error = str(e)  # rotate counted the records it could not write
        deadline = time.monotonic() + wait_s
        for t in self._compressing:
            t.join(max(0.0, deadline - time.monotonic()))


def _sync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable (where the filesystem can)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a filesystem that cannot sync a directory: the rename is as durable as it gets
    finally:
        os.close(fd)
