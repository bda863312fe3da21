"""Reads an engine's witness file (``kvtop.witness``) as it grows: one ``StepRecord`` per engine step.

The engine writes wall-clock times; a run's records carry its own clock, so the reader is given the
wall-clock instant of the run's zero. Request ids are the engine's own (vLLM: ``cmpl-<X-Request-Id>-0-
<8 hex>``); they are given back as the id the client sent (the recording proxy sends its trace id as
``X-Request-Id``), so the engine's steps join the trace's streams. A torn or foreign line is skipped
and counted, never an error; the file rolling over (``<file>.1``) is followed.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from kvtop.model.records import StepRecord

WITNESS_FORMAT = "kvtop-witness"
MAX_LINE = 4 << 20  # a step of thousands of requests is ~100 KB; anything far longer is not ours
_VLLM_ID = re.compile(r"^(?:chatcmpl|cmpl)-(.+?)(?:-\d+)?-[0-9a-f]{8}$")


def client_id(engine_id: str) -> str:
    """The id the client sent, where the engine's id carries it."""
    m = _VLLM_ID.match(engine_id)
    return m.group(1) if m else engine_id


def _limits(head: dict[str, Any]) -> dict[str, int | bool]:
    """The scheduler limits a witness header states (positive whole numbers, and whether it chunks
    prefills)."""
    lim = head.get("limits")
    if not isinstance(lim, dict):
        return {}
    return {str(k): v for k, v in lim.items()
            if (isinstance(v, bool) and k == "chunked_prefill") or (isinstance(v, int) and not isinstance(v, bool) and v > 0)}


_HEADER_AT = b'{"format":"' + WITNESS_FORMAT.encode() + b'"'
_BACK_CHUNK = 1 << 20


def _last_header(f: Any, size: int) -> dict[str, Any] | None:
    """The last header line of an open witness file (searched back from its end, a megabyte at a
    time); the file position is left where it was."""
    here = f.tell()
    end, tail = size, b""
    try:
        while end > 0:
            start = max(0, end - _BACK_CHUNK)
            f.seek(start)
            block = f.read(end - start) + tail
            i = block.rfind(b"\n" + _HEADER_AT)
            if i >= 0 or start == 0:
                at = i + 1 if i >= 0 else (0 if block.startswith(_HEADER_AT) else -1)
                if at < 0:
                    return None
                f.seek(start + at)
                head = json.loads(f.readline(MAX_LINE))
                return head if isinstance(head, dict) else None
            tail = block[:len(_HEADER_AT) + 1]  # a header split across two blocks
            end = start
        return None
    except ValueError:
        return None
    finally:
        f.seek(here)


class WitnessError(ValueError):
    """The file is not a witness file (one line, for the command to print)."""


class WitnessReader:
    """Tails one witness file. ``read()`` returns the steps written since the last call."""

    def __init__(self, path: str, wall_zero: float, engine: str | None = None, from_start: bool = False):
        self.path = path
        self.wall_zero = wall_zero  # wall-clock seconds at the run's t = 0
        self.engine = engine
        self.header: dict[str, Any] | None = None
        self.skipped = 0
        self.steps = 0
        self.names: dict[int, str] = {}  # request numbers of the file being read -> client ids
        self.unnamed = 0  # entries of requests whose number was not yet mapped (a reader starting mid-file)
        self._f: Any = None
        self._ino: int | None = None
        self._buf = b""
        self._from_start = from_start
        self._limits: dict[str, int | bool] = {}  # a header's limits, for the next step read after it

    def _open(self, from_start: bool) -> bool:
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - held open while tailing
        except FileNotFoundError:
            return False
        st = os.fstat(f.fileno())
        first = f.readline(MAX_LINE)
        if not first.endswith(b"\n"):
            f.close()  # just created (a roll-over, an engine starting): its header is not written yet
            return False
        try:
            head = json.loads(first)
        except ValueError:
            head = None
        if not isinstance(head, dict) or head.get("format") != WITNESS_FORMAT:
            f.close()
            raise WitnessError(f"{self.path}: not a kvtop witness file (its first line is no witness header)")
        if not from_start:
            f.seek(0, os.SEEK_END)  # steps before the run began are not the run's
            # an engine restarted on the same file appends its own header: the latest is this engine's
            head = _last_header(f, st.st_size) or head
        self.header = head
        self._limits = _limits(head)
        self._f, self._ino, self._buf = f, st.st_ino, b""
        return True

    def read(self) -> list[StepRecord]:
        if self._f is None:
            if not self._open(self._from_start):
                return []
            self._from_start = True  # after a roll-over, the new file is read from its start
        out = self._drain()
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return out
        if st.st_ino != self._ino or st.st_size < self._f.tell():  # rolled over or truncated
            out += self._drain()  # what the engine wrote to the old file between the read and the roll
            self._f.close()
            self._f = None
            if self._open(True):
                out += self._drain()
        return out

    def _drain(self) -> list[StepRecord]:
        data = self._buf + self._f.read()
        lines = data.split(b"\n")
        self._buf = lines.pop()
        if len(self._buf) > MAX_LINE:
            self._buf = b""
            self.skipped += 1
        out = []
        for ln in lines:
            rec = self.parse(ln)
            if rec is not None:
                out.append(rec)
        return out

    def parse(self, line: bytes) -> StepRecord | None:
        try:
            d = json.loads(line)
            if "format" in d:  # a header line: a new file, or the engine restarted and appended
                self.names.clear()
                self._limits = _limits(d)
                return None
            names = self.names
            for key in ("m", "n"):  # numbers of the requests in this file (kvtop.witness.steplog)
                for h, rid in (d.get(key) or {}).items():
                    names[int(h)] = client_id(str(rid))
            ended = [x[0] for x in d.get("fin", ())] + list(d.get("ab", ()))
            t0 = float(d["t0"]) - self.wall_zero
            t1 = float(d["t1"]) - self.wall_zero
            name = self._name
            # plain decodes (one token in, one out) come as bare numbers in "d", the rest in full in "r"
            reqs = [[n, 1, 0, 0, 1] for n in map(name, d.get("d", ())) if n is not None]
            reqs += [[n, int(r[1]), int(r[2]), int(r[3]), int(r[4])] for r in d.get("r", ())
                     if (n := name(r[0])) is not None]
            rec = StepRecord(
                round(max(t0, 0.0), 6), round(max(t1, 0.0), 6), self.engine, reqs,
                [n for n in map(name, d.get("pre", ())) if n is not None],
                [n for n in map(name, d.get("res", ())) if n is not None],
                [[n, str(x[1])] for x in d.get("fin", ()) if (n := name(x[0])) is not None],
                [n for n in map(name, d.get("ab", ())) if n is not None],
                [[n, int(x[1])] for x in d.get("rst", ()) if (n := name(x[0])) is not None],
                self._limits,
            )
            self._limits = {}
            for h in ended:  # its number is not used again: a reader of days keeps no map of them all
                names.pop(h, None)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError):
            if line.strip():
                self.skipped += 1
            return None
        self.steps += 1
        return rec

    def _name(self, h: object) -> str | None:
        """A request's id from its number; None (counted) before the file has said which it is."""
        if isinstance(h, str):
            return client_id(h)
        rid = self.names.get(h) if isinstance(h, int) else None
        if rid is None:
            self.unnamed += 1
        return rid

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
