"""What one engine step did, per request, and the file it is written to.

Pure bookkeeping with the standard library only: the vLLM glue (``kvtop.witness.vllm``) feeds it the
scheduler's numbers, so the accounting is tested without an engine.

A step's tokens for one request are positions ``[computed, computed + scheduled)`` of its sequence.
Positions the engine had computed before (below the request's high-water mark) are *recompute*: the
request lost its KV (preemption) and pays for it again. Positions of the prompt never computed before
are *prefill*. The rest is decode (one position per step, k + 1 with speculative decoding).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import IO

FORMAT = "kvtop-witness"
VERSION = 1
# A production engine runs for days: the file rolls over at this size (one previous file kept).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
FLUSH_EVERY_S = 0.05


@dataclass
class Scheduled:
    """One request's share of one step, as the scheduler planned it."""

    rid: str
    scheduled: int
    prefill: int
    recompute: int


@dataclass
class StepBook:
    """Per-request high-water marks, and the steps planned but not yet answered by the model."""

    high: dict[str, int] = field(default_factory=dict)

    def plan(self, rid: str, computed: int, scheduled: int, prompt_len: int) -> Scheduled:
        """Split ``scheduled`` positions from ``computed`` into recompute / prefill / decode."""
        hw = self.high.get(rid, 0)
        end = computed + scheduled
        recompute = max(0, min(end, hw) - computed)
        fresh_from = max(computed, hw)
        prefill = max(0, min(end, prompt_len) - fresh_from)
        if end > hw:
            self.high[rid] = end
        return Scheduled(rid, scheduled, prefill, recompute)

    def forget(self, rid: str) -> None:
        self.high.pop(rid, None)


class StepLog:
    """Writes the witness file: a header line, then one line per step. Never raises into the engine:
    a failed write closes the log (the caller stops witnessing) and says so once."""

    def __init__(self, path: str, engine: str, engine_version: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 extra: dict[str, object] | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._header = {"format": FORMAT, "version": VERSION, "engine": engine, "engine_version": engine_version,
                        "pid": os.getpid(), **(extra or {})}
        self._f: IO[str] | None = None
        self._size = 0
        self._last_flush = 0.0
        self.lines = 0
        self._open()

    def _open(self) -> None:
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        # 0600: request ids are the only identifiers in it, but they are still the operator's business
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._f = os.fdopen(fd, "a", buffering=1 << 16)
        self._size = os.fstat(fd).st_size
        self._write({**self._header, "t": round(time.time(), 6)})

    def _write(self, obj: dict[str, object], flush: bool = False) -> None:
        assert self._f is not None
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        self._f.write(line)
        self._size += len(line)
        self.lines += 1
        now = time.monotonic()
        # a reader tails the file: flush often enough for a live console, not on every step
        if flush or now - self._last_flush >= FLUSH_EVERY_S:
            self._f.flush()
            self._last_flush = now

    def step(self, t0: float, t1: float, reqs: list[tuple[str, int, int, int, int]], preempted: list[str],
             resumed: list[str], finished: list[tuple[str, str]], aborted: list[str], idle: bool = False) -> None:
        """One step: wall-clock start/end, per request [id, scheduled, prefill, recompute, tokens out].
        ``idle``: no step follows soon (nothing left to run), so the reader gets it now."""
        rec: dict[str, object] = {"t0": round(t0, 6), "t1": round(t1, 6), "r": reqs}
        if preempted:
            rec["pre"] = preempted
        if resumed:
            rec["res"] = resumed
        if finished:
            rec["fin"] = finished
        if aborted:
            rec["ab"] = aborted
        self._write(rec, flush=idle)
        if self._size >= self.max_bytes:
            self._roll()

    def _roll(self) -> None:
        assert self._f is not None
        self._f.close()
        os.replace(self.path, self.path + ".1")
        self._open()

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
