"""Trace files: JSON Lines, a header line then records in time order (docs/design.md §3).

Writing appends and flushes at least once a second, so a crash loses at most the last second.
Reading streams line by line; a torn or malformed line is skipped and counted, never fatal.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import math
import os
import socket
import time
import zlib
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, cast

from kvtop.errors import RunFailure
from kvtop.model import jsonio
from kvtop.model import token_columns as TC
from kvtop.model.records import (
    TRACE_FORMAT,
    TRACE_VERSION,
    Record,
    RequestRecord,
    from_dict,
    to_dict,
    trace_time,
)
from kvtop.model.validate import (
    MAX_LINE_BYTES,
    T_MAX,
    T_MIN,
    DecodeError,
    TokenLine,
    decode_line,
    decode_token_line,
    header_problems,
    parse_line,
    record_ok,
)


class TraceError(Exception):
    """The file is not a kvtop trace (bad header / unsupported version)."""


GZIP_MAGIC = b"\x1f\x8b"
# the agent's rotating segments (kvtop/model/trace_rotate.py): kvtop-<UTC start>.jsonl[.gz]
SEGMENT_PREFIX = "kvtop-"
ACTIVE_SUFFIX = ".jsonl"
DONE_SUFFIX = ".jsonl.gz"


def is_gzip(path: str | os.PathLike[str]) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """The trace's bytes, decompressed when it is a gzip file (the agent's rotated segments are).

    A directory of agent segments (`kvtop agent --trace-dir`) reads as one trace: the segments of
    the agent's latest run joined in order, the first segment's header only."""
    if os.path.isdir(path):
        segs = latest_run(path)
        if not segs:
            raise FileNotFoundError(f"no kvtop trace segments in {path}")
        return cast(IO[bytes], io.BufferedReader(_Joined(segs), 1 << 20))
    if is_gzip(path):
        return _gunzip(path)
    return open(path, "rb")


def _gunzip(path: str | os.PathLike[str]) -> IO[bytes]:
    return cast(IO[bytes], io.BufferedReader(_Gunzip(open(path, "rb")), 1 << 20))


class _Gunzip(io.RawIOBase):
    """A gzip file's bytes, which end where its data stops decompressing instead of raising.

    An agent killed while compressing leaves a cut segment; a flipped bit fails zlib's check or its
    CRC. Every reader (the streaming reader and the fast path alike) keeps each byte decompressed
    before that point (``gzip.open`` dropped a whole read's worth, up to a megabyte, at the cut): a
    torn last line is skipped and counted as after a crash, and ``problem`` says why the stream
    ended early (``stream_problems``) -- a cut that falls between two lines tears none, and would
    otherwise go unsaid. Concatenated members (``cat a.gz b.gz``) read as one stream, as gzip reads them."""

    CHUNK = 1 << 16

    def __init__(self, raw: IO[bytes]):
        self.problem: str | None = None
        self._raw = raw
        self._z = zlib.decompressobj(wbits=31)
        self._fed = False  # the current member has had input (so an end of file here is a cut)
        self._pending = b""  # compressed input not yet decompressed (output is bounded per call)
        self._out = b""
        self._done = False

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        while not self._out and not self._done:
            data = self._pending or self._raw.read(self.CHUNK)
            self._pending = b""
            if not data:
                self._done = True
                if self._fed and not self._z.eof:
                    self.problem = "the compressed data ends early (the .gz file was cut): every whole line before the cut was read"
                return
            self._fed = True
            before = self._z.copy()
            try:
                self._out = self._z.decompress(data, 1 << 20)
            except zlib.error as e:
                self._done = True
                self._out = self._salvage(before, data)
                self.problem = f"the compressed data is damaged ({e}): every whole line before the damage was read"
                return
            self._pending = self._z.unconsumed_tail
            if self._z.eof:
                rest = self._z.unused_data
                self._z, self._fed = zlib.decompressobj(wbits=31), False
                if rest.strip(b"\x00"):  # another member follows (zero padding is no member)
                    self._pending = rest

    @staticmethod
    def _salvage(z: Any, data: bytes) -> bytes:
        """What ``data`` decompresses to up to its damage: fed again in small pieces, since zlib
        returns nothing of a call that fails."""
        out = []
        for i in range(0, len(data), 64):
            try:
                out.append(z.decompress(data[i:i + 64]))
            except zlib.error:
                break
        return b"".join(out)

    def readinto(self, b: Any) -> int:
        self._fill()
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def stream_problems(f: IO[bytes]) -> list[str]:
    """Why a stream from ``open_binary`` ended before its file's end (a cut or damaged gzip file,
    or segment of a directory), as far as it has been read: one line each, for the reader's warning."""
    raw = getattr(f, "raw", None)
    if isinstance(raw, _Gunzip):
        return [raw.problem] if raw.problem else []
    if isinstance(raw, _Joined):
        return raw.problems + raw.current_problems()
    return []


class _Joined(io.RawIOBase):
    """Segments read back to back; every segment after the first loses its header line."""

    def __init__(self, paths: list[Path]):
        self._paths = list(paths)
        self._cur: IO[bytes] | None = None
        self._cur_name = ""
        self._first = True
        self._ended_line = True  # the current segment's bytes so far end with a newline (or are none)
        self.problems: list[str] = []  # of the segments read to their end, each named

    def readable(self) -> bool:
        return True

    def current_problems(self) -> list[str]:
        if self._cur is None:
            return []
        return [f"segment {self._cur_name}: {p}" for p in stream_problems(self._cur)]

    def _end_segment(self) -> None:
        if self._cur is not None:
            self.problems += self.current_problems()
            self._cur.close()
            self._cur = None

    def _next(self) -> bool:
        self._end_segment()
        if not self._paths:
            return False
        p = self._paths.pop(0)
        self._cur_name = p.name
        self._cur = _gunzip(p) if is_gzip(p) else open(p, "rb")
        if not self._first:
            self._cur.readline()
        self._first = False
        return True

    def readinto(self, b: Any) -> int:
        while True:
            if self._cur is None and not self._next():
                return 0
            assert self._cur is not None
            n = int(self._cur.readinto(b))  # type: ignore[attr-defined]
            if n:
                self._ended_line = b[n - 1] == 10
                return n
            self._end_segment()
            if not self._ended_line:
                # a segment cut mid-line: its torn line ends here, or the next segment's first
                # record would be read as the rest of it and lost with it
                self._ended_line = True
                b[0] = 10
                return 1

    def close(self) -> None:
        self._end_segment()
        super().close()


def clock_origin_unix(clock: Callable[[], float] = time.monotonic) -> float:
    """The wall-clock time (Unix seconds) at which `clock` read 0, to the microsecond.

    Two back-to-back reads can straddle a preemption on a busy host (milliseconds apart), which
    would misalign traces of two recorders by that much: bracket the wall read between two clock
    reads and keep the tightest of a few tries.
    """
    best: tuple[float, float] | None = None
    for _ in range(5):
        a = clock()
        wall = time.time()
        b = clock()
        if best is None or b - a < best[0]:
            best = (b - a, wall - (a + b) / 2)
        if b - a < 20e-6:
            break
    assert best is not None
    return round(best[1], 6)


def make_header(
    engine: dict[str, Any] | None = None, kv: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "kind": "header",
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "host": socket.gethostname(),
        "engine": engine or {},
        "kv": kv or {},
        **extra,
    }


class TraceWriteError(RunFailure, OSError):
    """Writing an opened trace failed (a full disk, a quota): the run failed, exit 1, in one line
    (``cannot write PATH: No space left on device``) from every command that writes a trace. Still
    an ``OSError``: a caller that goes on after a failed write (the agent's rotating trace) catches it
    as one. What was flushed before stays a readable trace (a torn last line is skipped)."""

    def __init__(self, path: str | os.PathLike[str], err: OSError):
        self.message = f"cannot write {path}: {err.strerror or err}"
        super().__init__(self.message)
        self.errno = err.errno  # for a caller that tells ENOSPC from the rest
        self.strerror = err.strerror

    def __str__(self) -> str:
        return self.message  # not OSError's "[Errno 28] ...": the line the CLI prints


class TraceWriter:
    """Append-only trace writer. Safe to call ``write`` from one thread at a time.

    Opening the file raises ``OSError`` (the path is wrong: a usage error); a write, flush or close
    that fails after that raises ``TraceWriteError`` (the run failed)."""

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any], flush_interval_s: float = 1.0,
                 columns: bool = False):
        """``columns``: also write the token sidecar (``kvtop.model.token_columns``) for a new trace."""
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        new = not self.path.exists() or self.path.stat().st_size == 0
        # Traces are private by default (0600): they hold engine URLs, model names and timings.
        self._f: IO[str] = open(self.path, "a", encoding="utf-8", buffering=1 << 16, opener=_private)
        self._last_flush = time.monotonic()
        self.count = 0
        # what the file held at the last flush that succeeded: records, and its size in bytes. After a
        # failed write the records accepted since then that the file does not hold are ``unsaved()``
        self._saved = (0, os.fstat(self._f.fileno()).st_size)
        self._ids: dict[str, str] = {}  # request id -> its JSON string, for the token fast path
        self._cols: IO[bytes] | None = None
        if new:
            head = json.dumps(header, separators=(",", ":")) + "\n"
            try:
                try:
                    self._f.write(head)
                except OSError as e:
                    raise TraceWriteError(self.path, e) from e
                if columns and self.path.is_file():  # no sidecar beside a device (-o /dev/null)
                    self._open_columns(head)
                self.flush()
            except BaseException:
                self._discard()  # no open file left behind by a writer the caller never got
                raise

    def _open_columns(self, head: str) -> None:
        # every line is ASCII (the JSON encoders escape the rest): a line's bytes are its characters
        self._pos = len(head)  # bytes of the JSONL written so far
        self._last = head
        self._codes: dict[str, int] = {}  # request id -> its code in the sidecar
        self._next_code = 0
        self._pending = bytearray()  # records not yet written (they go out with the JSONL's flush)
        try:
            self._cols = open(TC.sidecar_path(str(self.path)), "wb", opener=_private)
            self._cols.write(TC.head_bytes(head.encode("ascii")))
        except OSError:
            self._cols = None  # the JSONL is what matters: no sidecar, the analysis parses it all

    def _column(self, line: str, entry: tuple[float, int, int, int, bool] | None) -> None:
        """Note ``line`` (just written, newline included) in the sidecar: a token line as a record."""
        pos = self._pos
        self._pos = pos + len(line)
        self._last = line
        if entry is not None:
            self._add(line, pos, entry)

    def _add(self, line: str, pos: int, entry: tuple[float, int, int, int, bool]) -> None:
        t, id_at, id_len, n, ft = entry
        rid = line[id_at:id_at + id_len]
        code = self._codes.get(rid)
        pend = self._pending
        if code is not None:
            pend += _pack(pos, t, code, len(line) - 1, n, TC.FIRST if ft else TC.TOKEN)
            return
        if len(self._codes) >= 1 << 16:
            self._codes.clear()  # bounded: an id seen again gets a new code
        code = self._codes[rid] = self._next_code
        self._next_code += 1
        # the id's record after its line's: the records' offsets never decrease
        pend += TC.RECORD.pack(pos, t, code, len(line) - 1, n, TC.FIRST if ft else TC.TOKEN)
        pend += TC.RECORD.pack(pos + id_at, 0.0, code, id_len, 0, TC.ID)

    def _token_column(self, line: str, tr: str, mid: str, rid: str, n: int) -> None:
        """Note the token line ``line`` (time text ``tr``, ``mid`` its id part) in the sidecar."""
        pos = self._pos
        self._pos = pos + len(line)
        self._last = line
        tt = float(tr)
        jlen = len(mid) - len(_ID_KEY) - len(_TOKEN_N_KEY)  # the id's JSON string, quotes included
        code = self._codes.get(rid)
        # the fast path's limits (kvtop.model.token_columns.token_entry), known here
        if (code is not None and 0 <= n <= 99 and len(tr) < TC.T_WIDTH and T_MIN <= tt <= T_MAX
                and jlen - 2 < TC.ID_WIDTH):
            self._pending += _pack(pos, tt, code, len(line) - 1, n, TC.TOKEN)
        elif (0 <= n <= 99 and len(tr) < TC.T_WIDTH and 0 < jlen - 2 < TC.ID_WIDTH
              and T_MIN <= tt <= T_MAX and "\\" not in mid):
            self._add(line, pos, (tt, 29 + len(tr), jlen - 2, n, False))

    def write(self, rec: Record | dict[str, Any]) -> None:
        if type(rec) is RequestRecord:
            # The hot path: one per streamed chunk. Every optional field is checked: one set would
            # be written by the general path below, which this line must equal byte for byte.
            t = rec.t
            n = rec.n
            if (rec.event == "token" and type(n) is int and type(t) is float
                    and rec.prompt_tokens is None and rec.cls is None and rec.source is None
                    and rec.finish_reason is None and rec.status is None and rec.error is None
                    and rec.completion_tokens is None and rec.incomplete is None and rec.engine is None
                    and rec.engine_queue_s is None and rec.engine_ttft_s is None and rec.engine_decode_s is None
                    and rec.cached_tokens is None):
                if 1e-3 <= t < 4e9:
                    # repr(trace_time(t)) (run-clock and Unix times) at a third of its cost: ``round``
                    # to 6 decimals is slow. Both round the exact binary value to 6 decimals the same
                    # way (CPython's dtoa, mode 3); below 2**32 two floats are less than 1e-6 apart,
                    # so no other text of 6 decimals or fewer reads back as the rounded float: that
                    # decimal is the shortest text that does, which is ``repr`` (from 1e-3 up,
                    # without an exponent). tests/test_trace_fastline.py pins the two together.
                    tr = f"{t:.6f}".rstrip("0")
                    if tr[-1] == ".":
                        tr += "0"
                elif math.isfinite(t):
                    tr = repr(trace_time(t))
                else:
                    tr = ""
                if tr:
                    # the general path's line, built from its parts: the id's part is kept per id
                    rid = rec.id
                    ids = self._ids
                    mid = ids.get(rid)
                    if mid is None:
                        if len(ids) >= 4096:
                            ids.clear()
                        mid = ids[rid] = _ID_KEY + _encode(rid) + _TOKEN_N_KEY
                    line = f"{_TOKEN_HEAD}{tr}{mid}{n}}}\n"
                    try:
                        self._f.write(line)
                    except OSError as e:  # the buffer spilled onto a full disk
                        raise TraceWriteError(self.path, e) from e
                    self.count += 1
                    if self._cols is not None:
                        self._token_column(line, tr, mid, rid, n)
                    if time.monotonic() - self._last_flush >= self.flush_interval_s:
                        self.flush()
                    return
            d = _request_dict(rec)
        elif isinstance(rec, dict):
            d = rec
        else:
            d = to_dict(rec)
        dt = d.get("t")
        if type(dt) is float:
            if d is rec:
                d = dict(d)  # the caller's dict stays as it was
            d["t"] = trace_time(dt)
        try:
            line = _encode(d)
        except ValueError:
            # NaN/Infinity are not JSON (jq and most parsers reject them): unknown is null.
            line = _encode(_finite(d))
        try:
            self._f.write(line + "\n")
        except OSError as e:  # the buffer spilled onto a full disk
            raise TraceWriteError(self.path, e) from e
        self.count += 1
        if self._cols is not None:
            ev = d.get("event")
            self._column(line + "\n", TC.token_entry(line, T_MIN, T_MAX) if ev == "token" or ev == "first_token" else None)
        self.flush_if_due()

    def flush_if_due(self) -> None:
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        try:
            self._f.flush()
            # one fstat a flush (a second apart): where the records accepted so far end on disk
            self._saved = (self.count, os.fstat(self._f.fileno()).st_size)
        except OSError as e:
            raise TraceWriteError(self.path, e) from e
        self._last_flush = time.monotonic()
        if self._cols is not None:
            self._flush_columns()

    def _flush_columns(self) -> None:
        # after the JSONL's flush: a mark never names bytes the trace does not hold yet
        assert self._cols is not None
        tail = self._last[-TC.TAIL_BYTES:].encode("ascii")
        self._pending += TC.RECORD.pack(self._pos, float(self.count), TC.tail_crc(tail), len(tail), 0, TC.MARK)
        try:
            self._cols.write(self._pending)
            self._cols.flush()
        except OSError:
            self._cols.close()
            self._cols = None  # a full disk: the sidecar stops at its last mark, the JSONL goes on
        self._pending = bytearray()

    def close(self) -> None:
        if not self._f.closed:
            try:
                self.flush()
                try:
                    os.fsync(self._f.fileno())
                except OSError as e:
                    if e.errno != errno.EINVAL:  # a device (-o /dev/null) syncs nothing: nothing lost
                        raise TraceWriteError(self.path, e) from e
            except BaseException:
                # the file is closed even so (no descriptor leaks per failed segment of a long run):
                # what the buffer still holds cannot be written, the trace ends at its last flush
                self._discard()
                raise
            self._f.close()
        if self._cols is not None:
            self._cols.close()
            self._cols = None

    def unsaved(self) -> int:
        """Records this writer accepted (``count``) that its file does not hold as whole lines: after
        a failed write, flush or close (a full disk), what the write buffer held and could not put on
        disk. Read from the file itself (the lines after the last good flush), so a buffer that spilled
        in part before the failure is counted right; a torn last line is unsaved (readers skip it)."""
        n, size = self._saved
        held = 0
        try:
            with open(self.path, "rb") as f:
                f.seek(size)
                while chunk := f.read(1 << 20):
                    held += chunk.count(b"\n")
        except OSError:
            pass  # the file is gone (pruned, moved): nothing after the last flush is known to be there
        return max(0, self.count - n - held)

    def _discard(self) -> None:
        """Close the files, dropping what could not be written (the failure is being raised)."""
        for f in (self._f, self._cols):
            if f is not None:
                try:
                    f.close()  # flushes once more, and closes the descriptor even when that fails
                except OSError:
                    pass
        self._cols = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_pack = TC.RECORD.pack
# a token line's fixed parts: head, the time, _ID_KEY, the id's JSON string, _TOKEN_N_KEY, n, "}"
_TOKEN_HEAD = '{"kind":"request","t":'
_ID_KEY = ',"id":'
_TOKEN_N_KEY = ',"event":"token","n":'

# every optional field, in declaration order (as ``to_dict``): a field added to RequestRecord is
# written without touching this list (a hand-kept list once dropped ``incomplete``)
_REQUEST_OPTIONAL = tuple(f.name for f in dataclasses.fields(RequestRecord) if f.name not in ("t", "id", "event"))


def _request_dict(rec: RequestRecord) -> dict[str, Any]:
    """Same dict as ``to_dict`` for a request record (same keys, same order), several times faster."""
    d: dict[str, Any] = {"kind": "request", "t": rec.t, "id": rec.id, "event": rec.event}
    for name in _REQUEST_OPTIONAL:
        v = getattr(rec, name)
        if v is not None:
            d["class" if name == "cls" else name] = v
    return d


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


class TraceReader:
    """Streams a trace. ``header`` is read on open; iterate for record dicts (kind != header).

    ``skipped`` counts malformed lines (a torn last line after a crash is the common case), lines
    longer than ``MAX_LINE_BYTES`` and records whose fields have the wrong type; none is fatal.
    ``header_dropped`` names header fields of the wrong type that were ignored.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.skipped = 0
        self.unknown_kinds = 0
        try:
            self._bin = open_binary(self.path)
            self._f: IO[str] = io.TextIOWrapper(self._bin, encoding="utf-8", errors="replace")
        except OSError as e:
            raise TraceError(f"cannot open trace {self.path}: {e.strerror or e}") from None
        try:
            first = self._f.readline(MAX_LINE_BYTES + 1)
        except (OSError, EOFError) as e:  # a corrupt or cut gzip segment
            self._f.close()
            raise TraceError(f"cannot read trace {self.path}: {e}") from None
        if len(first) > MAX_LINE_BYTES:
            self._f.close()
            raise TraceError(f"{self.path} is not a kvtop trace (first line longer than {MAX_LINE_BYTES} bytes)")
        try:
            # NaN kept (header_problems drops a non-finite field); depth and integer size bounded
            header = jsonio.loads(first, "trace", self.path, allow_nan=True)
        except jsonio.InputError:
            self._f.close()
            if stream_problems(self._bin):  # a .gz cut inside its header: unreadable, not of another kind
                raise TraceError(f"cannot read trace {self.path}: its gzip data is cut or damaged in the first line") from None
            raise TraceError(f"{self.path} is not a kvtop trace (first line is not a JSON header)") from None
        if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
            self._f.close()
            raise TraceError(f"{self.path} is not a kvtop trace (header format is not {TRACE_FORMAT!r})")
        if header.get("version") != TRACE_VERSION:
            self._f.close()
            raise TraceError(f"{self.path}: unsupported trace version {header.get('version')!r}")
        self.header_dropped = header_problems(header)
        self.header: dict[str, Any] = header

    def dicts(self) -> Iterator[dict[str, Any]]:
        return cast(Iterator[dict[str, Any]], self._read(False))  # without tokens: dicts only

    def items(self) -> Iterator[TokenLine | dict[str, Any]]:
        """The records of ``dicts``, each plain token line as a ``TokenLine`` instead (no dict built:
        the streaming analysis's commonest line at a third of the cost)."""
        return self._read(True)

    def _read(self, tokens: bool) -> Iterator[TokenLine | dict[str, Any]]:
        # one generator reads, bounds and parses (``parse_line``'s common case inline): the
        # streaming path's cost per record is mostly Python calls
        readline = self._f.readline
        limit = MAX_LINE_BYTES + 1
        decode, ok, decode_token = decode_line, record_ok, decode_token_line
        while True:
            try:
                line = readline(limit)
            except (OSError, EOFError):
                # a gzip segment cut short (the agent died while compressing): keep what was read
                self.skipped += 1
                break
            if not line:
                break
            if len(line) == limit:  # longer than MAX_LINE_BYTES
                if line.endswith("\n"):
                    if line.strip():
                        self.skipped += 1
                    continue
                self.skipped += 1
                try:
                    while line and not line.endswith("\n"):  # drop the rest without holding it
                        line = readline(limit)
                except (OSError, EOFError):
                    break
                continue
            if tokens:
                try:
                    tl = decode_token(line)
                except DecodeError:
                    pass  # any other line: read as dicts() reads it
                else:
                    yield tl
                    continue
            try:
                d = decode(line)
                if d is not None and not ok(d):
                    d = None
            except DecodeError:
                d = parse_line(line)
            if d is None:
                if line.strip():
                    self.skipped += 1
                continue
            yield d
        self._f.close()

    def records(self) -> Iterator[Record]:
        for d in self.dicts():
            try:
                r = from_dict(d)
            except (TypeError, KeyError, ValueError):
                self.skipped += 1
                continue
            if r is None:
                self.unknown_kinds += 1
                continue
            yield r

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.dicts()

    def close(self) -> None:
        self._f.close()

    def header_note(self) -> str:
        """What of the header was ignored ("" where nothing was)."""
        return "ignored wrong-typed header field(s): " + ", ".join(self.header_dropped) if self.header_dropped else ""

    def warning(self) -> str | None:
        parts = []
        if self.skipped:
            parts.append(skipped_note(self.skipped))
        if self.header_dropped:
            parts.append(self.header_note())
        parts += stream_problems(self._bin)
        return f"{self.path}: " + "; ".join(parts) if parts else None


def skipped_note(n: int) -> str:
    """What ``n`` malformed lines skipped in a trace mean to the reader."""
    if n == 1:
        return "skipped 1 malformed line (a torn last line after a crash is normal)"
    return f"skipped {n} malformed lines (more than a crash's torn last line: the file is damaged or not all a trace)"


def latest_run(directory: str | os.PathLike[str]) -> list[Path]:
    """Segments (compressed, and the one still being written) of the agent's latest run, in order.

    A restarted agent starts its clock again, so runs are kept apart by the ``agent_wall_t0`` their
    headers carry; a segment being compressed right now is taken once (the .gz when both exist)."""
    d = Path(directory)
    by_stem: dict[str, Path] = {}
    for p in sorted(d.glob(f"{SEGMENT_PREFIX}*{ACTIVE_SUFFIX}")) + sorted(d.glob(f"{SEGMENT_PREFIX}*{DONE_SUFFIX}")):
        stem = p.name.removesuffix(".gz").removesuffix(ACTIVE_SUFFIX)
        by_stem[stem] = p  # .gz listed last: it wins
    runs: list[tuple[Any, list[Path]]] = []
    for stem in sorted(by_stem):
        p = by_stem[stem]
        try:
            r = TraceReader(p)
        except TraceError:
            continue
        run = r.header.get("agent_wall_t0")
        r.close()
        run = round(run, 1) if isinstance(run, (int, float)) else stem
        if runs and runs[-1][0] == run:
            runs[-1][1].append(p)
        else:
            runs.append((run, [p]))
    return runs[-1][1] if runs else []
