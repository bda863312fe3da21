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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

FORMAT = "kvtop-witness"
VERSION = 1
# A production engine runs for days: the file rolls over at this size (one previous file kept).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
FLUSH_EVERY_S = 0.05
MAP_EVERY_S = 1.0
_encode = json.encoder.encode_basestring_ascii  # C-accelerated; quotes and escapes any id


# One request's share of one step: (id, tokens scheduled, of them prefill, of them recompute).
Scheduled = tuple[str, int, int, int]


@dataclass
class StepBook:
    """Per-request high-water marks: the positions each request has had computed."""

    high: dict[str, int] = field(default_factory=dict)
    # speculative tokens each request was last scheduled with: the engine rolls back the rejected
    # ones (num_computed_tokens -= rejected), which is no lost KV to recompute
    drafts: dict[str, int] = field(default_factory=dict)

    def plan(self, rid: str, computed: int, scheduled: int, prompt_len: int, drafts: int = 0,
             resumed: bool = False) -> Scheduled:
        """Split ``scheduled`` positions from ``computed`` into recompute / prefill / decode.
        ``drafts``: the speculative tokens among them; ``resumed``: the request comes back from a
        preemption in this step (its positions below the high-water mark are then recomputed)."""
        hw = was = self.high.get(rid, 0)
        if computed < hw and not resumed and hw - computed <= self.drafts.get(rid, 0):
            hw = computed  # the last step's rejected drafts, rolled back: not recompute
        if drafts:
            self.drafts[rid] = drafts
        elif self.drafts:  # without speculative decoding this stays empty: no pop per request per step
            self.drafts.pop(rid, None)
        end = computed + scheduled
        if end > hw or hw != was:
            self.high[rid] = max(end, hw)
        if computed >= hw:  # the common case, a decode step: nothing lost, nothing of the prompt left
            return rid, scheduled, (min(end, prompt_len) - computed if computed < prompt_len else 0), 0
        recompute = min(end, hw) - computed
        fresh_from = hw if hw > computed else computed
        prefill = max(0, min(end, prompt_len) - fresh_from)
        return rid, scheduled, prefill, recompute

    def forget(self, rid: str) -> None:
        self.high.pop(rid, None)
        self.drafts.pop(rid, None)


class StepLog:
    """Writes the witness file: a header line, then one line per step. Never raises into the engine:
    a failed write closes the log (the caller stops witnessing) and says so once."""

    def __init__(self, path: str, engine: str, engine_version: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 extra: dict[str, object] | None = None, private: bool = False) -> None:
        self.path = path
        self.private = private
        self.max_bytes = max_bytes
        self._header = {"format": FORMAT, "version": VERSION, "engine": engine, "engine_version": engine_version,
                        "pid": os.getpid(), **(extra or {})}
        self._f: IO[str] | None = None
        self._handles: dict[str, str] = {}  # running request id -> its number in the file, as text
        self._next = 1
        self._new: list[str] = []  # '"number":"id"' of numbers first used in the line being written
        self._last_map = 0.0
        self._size = 0
        self._last_flush = 0.0
        self._open()

    def _open(self) -> None:
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, mode=0o700, exist_ok=True)
        # 0600: request ids are the only identifiers in it, but they are still the operator's business.
        # In a shared folder (the default, under /tmp) never through a link another user planted, nor
        # into a file of theirs; a file the operator named may be one they made readable to kvtop.
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_NOFOLLOW if self.private else 0),
                     0o600)
        st = os.fstat(fd)
        if self.private and (st.st_uid != os.getuid() or st.st_mode & 0o077):
            os.close(fd)
            raise PermissionError(f"{self.path} belongs to another user or is readable by others: not written")
        self._f = os.fdopen(fd, "a", buffering=1 << 16)
        self._size = st.st_size
        self._last_map = 0.0  # a new file starts with the whole map
        # on disk at once: a reader that finds the new file (a roll-over, on an idle engine) must not
        # find it empty until the next request comes
        self._put(json.dumps({**self._header, "t": round(time.time(), 6)}, separators=(",", ":")) + "\n", flush=True)

    def _put(self, line: str, flush: bool = False) -> None:
        assert self._f is not None
        self._f.write(line)
        self._size += len(line)
        now = time.monotonic()
        # a reader tails the file: flush often enough for a live console, not on every step
        if flush or now - self._last_flush >= FLUSH_EVERY_S:
            self._f.flush()
            self._last_flush = now

    def handle(self, rid: str) -> str:
        """The request's number in this file (as text); its first use puts the id in the line's ``n``."""
        h = self._handles.get(rid)
        if h is None:
            h = self._handles[rid] = str(self._next)
            self._next += 1
            self._new.append(f'"{h}":{_encode(rid)}')
        return h

    def forget(self, rid: str) -> None:
        """The request ended: its number is not used again."""
        self._handles.pop(rid, None)

    def step(self, t0: float, t1: float, reqs: list[tuple[str, int, int, int, int]], preempted: list[str],
             resumed: list[str], finished: list[tuple[str, str]], aborted: list[str], idle: bool = False,
             restored: Sequence[tuple[str, int]] = ()) -> None:
        """One step: wall-clock start/end, per request (id, scheduled, prefill, recompute, tokens out).
        ``idle``: no step follows soon (nothing left to run), so the reader gets it now. ``restored``:
        per resumed request, the positions the engine had again without computing them (its prefix
        cache, or a KV connector such as the offloading one, loaded them), written as ``rst`` for every
        resumed request, 0 included, so a reader tells "none restored" from a file that does not say.

        Written by hand rather than by ``json.dumps``: it runs on every engine step, at a batch of
        hundreds. Requests go by number (``handle``): ``n`` maps the numbers first used in this line to
        request ids, and once a second ``m`` repeats the map of every request still running, so a
        reader that starts in the middle of the file knows them all within a second. Most requests in
        a step are plain decodes (one token in, one out): ``d`` lists their numbers; the rest go in
        ``r`` as ``[number, scheduled, prefill, recompute, out]``."""
        handle, known = self.handle, self._handles
        dec: list[str] = []
        other: list[str] = []
        for rid, n, pf, rc, out in reqs:
            h = known.get(rid) or handle(rid)
            if n == 1 and out == 1 and not pf and not rc:
                dec.append(h)
            else:
                other.append(f"[{h},{n},{pf},{rc},{out}]")
        line = f'{{"t0":{t0:.6f},"t1":{t1:.6f}'
        if dec:
            line += ',"d":[' + ",".join(dec) + "]"
        if other:
            line += ',"r":[' + ",".join(other) + "]"
        if preempted:
            line += ',"pre":[' + ",".join(handle(x) for x in preempted) + "]"
        if resumed:
            line += ',"res":[' + ",".join(handle(x) for x in resumed) + "]"
        if restored:
            line += ',"rst":[' + ",".join(f"[{handle(x)},{n}]" for x, n in restored) + "]"
        if finished:
            line += ',"fin":[' + ",".join(f"[{handle(x)},{_encode(why)}]" for x, why in finished) + "]"
        if aborted:
            line += ',"ab":[' + ",".join(handle(x) for x in aborted) + "]"
        if self._new:
            line += ',"n":{' + ",".join(self._new) + "}"
            self._new.clear()
        if t1 - self._last_map >= MAP_EVERY_S:
            self._last_map = t1
            line += ',"m":{' + ",".join(f'"{h}":{_encode(r)}' for r, h in self._handles.items()) + "}"
        self._put(line + "}\n", flush=idle)
        for x, _why in finished:
            self.forget(x)
        for x in aborted:
            self.forget(x)
        if self._size >= self.max_bytes:
            self._roll()

    def _roll(self) -> None:
        assert self._f is not None
        self._f.close()
        os.replace(self.path, self.path + ".1")
        self._open()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
