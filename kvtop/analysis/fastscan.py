"""Fast path for ``kvtop analyze``: token records parsed and gapped with numpy, a chunk at a time.

A trace is mostly token lines written by ``TraceWriter`` in a fixed key order
(``{"kind":"request","t":T,"id":"ID","event":"token","n":N,...}``). Those are recognised and parsed
as byte columns (no per-line JSON); inter-token gaps come from a stable sort by request and a diff.
Every other line (engine, host, arrive, finish, cancel, first_token bookkeeping, anything written
differently) goes through ``json.loads`` and the same ``Analyzer`` methods as the streaming path,
in file order. Gaps of the parsed token events come from the gap tracker's batch API
(``Analyzer.add_token_batch``). Memory is bounded by the chunk size. Results equal the streaming
path's (tested).

Where the trace has a token sidecar (``kvtop.model.token_columns``, written by ``kvtop record``)
that matches it, a chunk's token columns come from the sidecar instead, and only its other lines
are read from the JSONL and parsed (``_parse_cols``: the same ``Parsed`` as ``_parse``, tested).
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import sys
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import IO, TYPE_CHECKING, Any, NamedTuple, TypeGuard

from kvtop.analysis.analyzer import Analyzer
from kvtop.model import token_columns as TC
from kvtop.model.trace import GZIP_MAGIC, open_binary, stream_problems
from kvtop.model.validate import MAX_LINE_BYTES, T_MAX, T_MIN, parse_line

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the install; keep the slow path working
    np = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import numpy.typing as npt

    Bytes = npt.NDArray[np.uint8]  # the chunk's bytes, or fixed-width rows of them
    Index = npt.NDArray[np.intp]  # one position in the chunk per line
    Mask = npt.NDArray[np.bool_]  # one flag per line
    Strings = npt.NDArray[np.bytes_]  # fixed-width byte strings, one per line

PREFIX = TC.PREFIX.encode()
ID_SEP = TC.ID_SEP.encode()
EV_TOK = TC.EV_TOK.encode()
EV_FT = TC.EV_FT.encode()
EV_ARRIVE = b'","event":"arrive"'
N_KEY = b',"n":'
T_WIDTH = TC.T_WIDTH
ID_WIDTH = TC.ID_WIDTH
CHUNK = 8 << 20


def available() -> bool:
    return np is not None


def scan(path: str, an: Analyzer, chunk_bytes: int = CHUNK, tick: Callable[[int], bool] | None = None,
         workers: int | None = None, columns: bool = True, notes: list[str] | None = None) -> int:
    """Feed every record after the header line into ``an``; returns the count of malformed lines.
    ``tick(bytes read)`` after each chunk: True stops there (the records of whole lines read so far
    are in ``an``). ``workers``: processes that parse chunks ahead while this one analyses (None:
    one per core, for a large plain file where fork is safe; 0: none). ``columns``: read the token
    lines from the trace's token sidecar where it has a valid one (``open_columns``; a sidecar it
    ignores is said in ``notes``). The chunks, and so the results, are the same every way."""
    cols = None
    if columns:
        cols, note = open_columns(path)
        if note is not None and notes is not None:
            notes.append(note)
    if workers is None:
        # the sidecar covers most of the trace (a trace written on without it: the workers parse the rest)
        workers = _workers(path, chunk_bytes, cols is not None and cols.covered * 2 >= os.path.getsize(path))
    if workers > 0 or cols is not None:
        return _scan_parallel(path, an, chunk_bytes, tick, workers, cols)
    skipped = 0
    done = 0
    with open_binary(path) as f:
        done += len(f.readline())
        carry = b""
        while True:
            if tick is not None and tick(done):
                break
            block = f.read(chunk_bytes)
            done += len(block)
            if not block:
                if carry.strip():
                    skipped += _chunk(an, carry + b"\n")
                break
            buf = carry + block
            cut = buf.rfind(b"\n")
            if cut < 0:
                carry = buf
                continue
            carry = buf[cut + 1:]
            skipped += _chunk(an, buf[: cut + 1])
        if notes is not None:
            notes.extend(f"{path}: {p}" for p in stream_problems(f))  # why a .gz read ended early
    return skipped


PARALLEL_MIN_CHUNKS = 6  # below this many chunks, starting worker processes costs more than it saves
# chunks parsed ahead per worker: a worker that waits for this process to take a chunk leaves a
# core idle (with one ahead, while this process read the first chunk); each parsed chunk waiting
# here costs about 1.6 MB (8 MB chunks of token lines)
AHEAD = 3


def _workers(path: str, chunk_bytes: int, columns: bool = False) -> int:
    """Worker processes for ``scan``: one per core the process may use, when the file is a large
    plain trace (a gzip segment or a directory reads as one stream) and fork is safe (Linux, no
    other thread running: a forked child of a threaded process can deadlock)."""
    if columns or sys.platform != "linux" or threading.active_count() > 1:
        # with the sidecar there is little left to parse: handing each chunk's columns back from
        # a worker costs more than reading them here
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
        if not os.path.isfile(path) or os.path.getsize(path) < PARALLEL_MIN_CHUNKS * chunk_bytes:
            return 0
        with open(path, "rb") as f:
            if f.read(2) == GZIP_MAGIC:
                return 0
    except OSError:
        return 0
    return min(cores, 4) if cores > 1 else 0


def _bounds(f: IO[bytes], head: int, size: int, chunk_bytes: int) -> list[int]:
    """Where each chunk of the serial ``scan`` ends: after the last newline of each block it reads
    (a block without one adds nothing: its bytes go with the next)."""
    out = []
    prev = head
    for end in range(head + chunk_bytes, size + chunk_bytes, chunk_bytes):
        end = min(end, size)
        cut = -1
        lo = end
        width = 1 << 16
        while cut < 0 and lo > prev:
            lo = max(prev, end - width)
            cut = os.pread(f.fileno(), end - lo, lo).rfind(b"\n")
            width *= 4
        if cut >= 0:
            prev = lo + cut + 1
        out.append(prev)
    return out


_WORKER_COLS: Columns | None = None  # a worker's sidecar (inherited through fork, never pickled)


def _keep_heap(cols: Columns | None = None) -> None:
    """A worker allocates the same large buffers for every chunk: glibc hands each back to the
    kernel on free (mmap), and the next chunk pays page faults to get it again, a fifth of the
    worker's time. Keep them in the heap instead (glibc only: elsewhere nothing changes)."""
    global _WORKER_COLS
    _WORKER_COLS = cols
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _parse_region(path: str, start: int, end: int, last: bool, cols: Columns | None = None) -> Parsed | None:
    """One chunk, from the sidecar where it covers the chunk and agrees with it, else from the JSONL."""
    cols = cols if cols is not None else _WORKER_COLS
    if cols is not None and end <= cols.covered:
        used, p = _parse_cols(cols, start, end)
        if used:
            return p
    return _parse_range(path, start, end, last)


def _parse_packed(path: str, start: int, end: int, last: bool) -> Parsed | None:
    """``_parse_region`` in a worker, its columns in the narrowest types that hold them (a request
    code in 16 bits where a chunk has at most 65,536 ids, ``n`` in 8): half the bytes to pickle,
    send and unpickle. ``_unpacked`` restores the types."""
    p = _parse_region(path, start, end, last)
    if p is None or p.slow is not None:
        return p
    return p._replace(codes=p.codes.astype(np.uint16) if len(p.ids) <= 1 << 16 else p.codes,
                      ns=p.ns.astype(np.uint8))


def _unpacked(p: Parsed | None) -> Parsed | None:
    if p is None or p.slow is not None:
        return p
    return p._replace(codes=p.codes.astype(np.intp), ns=p.ns.astype(np.int64))


def _parse_range(path: str, start: int, end: int, last: bool) -> Parsed | None:
    """``_parse`` of the bytes start..end of the file (in a worker process), read straight into a
    buffer with the zero padding (no copy of the chunk to pad it)."""
    n = end - start
    buf = bytearray(n + 1 + PAD)
    with open(path, "rb") as f:
        f.seek(start)
        n = f.readinto(memoryview(buf)[:n])
    if last:
        buf[n] = 10
        n += 1
    return _parse_padded(buf, n)


def _scan_parallel(path: str, an: Analyzer, chunk_bytes: int, tick: Callable[[int], bool] | None,
                   workers: int, cols: Columns | None = None) -> int:
    """``scan``'s serial loop, with the chunks parsed ahead by ``workers`` processes (none: here):
    this one feeds them into the analyzer in file order (the same chunks, the same results). A
    chunk the sidecar ``cols`` covers is read from it."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = len(f.readline())
        ends = _bounds(f, head, size, chunk_bytes)
        # the chunk after each block read, and the torn last line (no newline after it), if any
        regions = [(a, b, False) for a, b in zip([head, *ends[:-1]], ends, strict=True)]
        tail = os.pread(f.fileno(), size - ends[-1], ends[-1]) if ends else b""
    if tail.strip():
        regions.append((ends[-1], size, True))
    done = [min(size, head + i * chunk_bytes) for i in range(len(ends))] + [size]
    skipped = 0
    # the workers start on the chunks after the first while this process reads that one: the ITL
    # target comes from the first gaps in file order (a chunk before it is known is read here, and
    # its worker's parse is dropped)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_keep_heap,
                               initargs=(cols,)) if workers > 0 else None
    try:
        ahead: dict[int, Future[Parsed | None]] = {}
        nxt = 0 if an.itl_target_s is not None else 1

        with open(path, "rb") as f:
            for i, (a, b, last) in enumerate(regions):
                while pool is not None and nxt < len(regions) and nxt <= i + AHEAD * workers:
                    # a few ahead (parsed chunks cost memory here), the first ones while this
                    # process reads the first chunk
                    ahead[nxt] = pool.submit(_parse_packed, path, *regions[nxt])
                    nxt += 1
                if tick is not None and tick(done[i]):
                    break
                fut = ahead.pop(i, None)
                if an.itl_target_s is None:
                    if fut is not None:
                        fut.cancel()
                    if b > a and cols is None:
                        skipped += _chunk(an, os.pread(f.fileno(), b - a, a) + (b"\n" if last else b""))
                    elif b > a:
                        # the same lines as ``_chunk``: the first ones streamed, the rest as a chunk
                        bad, pos = _warm(an, os.pread(f.fileno(), b - a, a) + (b"\n" if last else b""))
                        skipped += bad
                        if a + pos < b:
                            p = _parse_region(path, a + pos, b, last, cols)
                            if p is not None:
                                skipped += _apply(an, p)
                    continue
                p = _unpacked(fut.result()) if fut is not None else _parse_region(path, a, b, last, cols)
                if p is not None:
                    skipped += _apply(an, p)
            else:
                if tick is not None and len(regions) == len(ends):
                    tick(size)  # the serial loop's last call, at the end of the file
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return skipped


def _feed_line(an: Analyzer, line: bytes) -> int:
    """One line through the streaming path; 1 when it is malformed (blank lines are not)."""
    if not line.strip():
        return 0
    d = parse_line(line)  # the trace reader's own check: malformed, too deep or wrong-typed -> skipped
    if d is None:
        return 1
    an.feed_dict(d)
    return 0


PAD = 256  # zero bytes after each chunk: every fixed-width window below stays inside the buffer
DIGITS = 16  # timestamps up to 16 characters (15 digits) are parsed exactly as integers
# powers of ten looked up, not raised per row (the same values: numpy's own powers, made once)
_I10 = 10 ** np.arange(DIGITS + 1, dtype=np.int64) if np is not None else None
_F10 = 10.0 ** np.arange(DIGITS + 1) if np is not None else None
# the low k bytes of an 8-byte integer, k = 0..8
_KEEP = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64) if np is not None else None
_N_WORD = np.uint64(int.from_bytes(N_KEY, "little")) if np is not None else 0


def _words(arr: Bytes) -> npt.NDArray[np.uint64]:
    """The 8 bytes at each offset of ``arr`` as one little-endian integer (a view, no copy)."""
    w: npt.NDArray[np.uint64] = np.ndarray((len(arr) - 7,), dtype="<u8", buffer=arr, strides=(1,))
    return w


def _rows(arr: Bytes, pos: Index, width: int) -> Bytes:
    """The ``width`` bytes at each position, one row per position (a copy, no index matrix)."""
    return np.lib.stride_tricks.sliding_window_view(arr, width)[pos]


def _match(arr: Bytes, pos: Index, pat: bytes, ok: Mask, sparse: bool = False) -> Mask:
    """ok & (arr[pos:pos+len(pat)] == pat).

    Evaluated on every row (most rows are token lines: picking out the rows still ok costs more
    than it saves), or with ``sparse`` on the rows still ok only (a test for the few other lines);
    a row's position is within its line plus PAD, so the reads stay in the buffer."""
    # 8 bytes at a time, each read as one integer at any offset (no row copies)
    words = np.ndarray((len(arr) - 7,), dtype="<u8", buffer=arr, strides=(1,))
    rows = np.flatnonzero(ok) if sparse else None
    at = pos[rows] if rows is not None else pos
    hit: Mask = np.ones(len(at), bool) if rows is not None else ok.copy()
    for j in range(0, len(pat), 8):
        piece = pat[j:j + 8]
        w = words[at + j] if j else words[at]
        if len(piece) < 8:
            w &= np.uint64((1 << (8 * len(piece))) - 1)
        hit &= w == np.uint64(int.from_bytes(piece, "little"))
    if rows is None:
        return hit
    out: Mask = np.zeros(len(ok), bool)
    out[rows[hit]] = True
    return out


def _find(arr: Bytes, start: Index, byte: int, width: int, ok: Mask) -> Index:
    """Offset of the first ``byte`` within ``width`` bytes of each start (rows not ok: -1 / cleared).

    Eight bytes at a time as one integer: a byte equal to ``byte`` becomes a zero byte, and the
    exact zero-byte test below (no carry crosses a byte) marks it in its top bit."""
    words = np.ndarray((len(arr) - 7,), dtype="<u8", buffer=arr, strides=(1,))
    rep = np.uint64(byte * 0x0101010101010101)
    low7 = np.uint64(0x7F7F7F7F7F7F7F7F)
    out = np.full(len(start), -1, dtype=np.int64)
    idx = np.flatnonzero(ok)
    for j in range(0, width, 8):
        if len(idx) == 0:
            break
        x = words[start[idx] + j] ^ rep
        t = ~(((x & low7) + low7) | x | low7)
        if width - j < 8:
            t &= np.uint64((1 << (8 * (width - j))) - 1)
        found = t != 0
        tf = t[found]
        # the lowest marked bit (a power of two, exact as a float) names the first such byte
        out[idx[found]] = j + (np.log2((tf & (~tf + np.uint64(1))).astype(np.float64)).astype(np.int64) >> 3)
        idx = idx[~found]
    ok[idx] = False
    return out


def _has(arr: Bytes, start: Index, end: Index, byte: int, width: int, ok: Mask) -> Mask:
    res = np.zeros(len(start), dtype=bool)
    idx = np.flatnonzero(ok)
    if len(idx) == 0:
        return res
    inside = np.arange(width) < (end[idx] - start[idx])[:, None]
    res[idx] = ((_rows(arr, start[idx], width) == byte) & inside).any(axis=1)
    return res


def _field(arr: Bytes, start: Index, end: Index) -> Bytes:
    """Each [start, end) as a row of the narrowest width that holds them all, zero-filled after its end."""
    lens = end - start
    width = int(lens.max())
    m = _rows(arr, start, width)
    if int(lens.min()) < width:
        m *= np.arange(width) < lens[:, None]  # a multiply: faster than a masked assignment
    return m


def _field8(arr: Bytes, start: Index, end: Index) -> Bytes:
    """``_field`` of fields at most 8 bytes long: one 8-byte integer read at each start, the bytes
    past the field's end cleared (the same rows, without a row of the window per field)."""
    words = np.ndarray((len(arr) - 7,), dtype="<u8", buffer=arr, strides=(1,))
    lens = end - start
    w = words[start] & _KEEP[lens]
    # contiguous rows: ``_times`` reads them column by column
    m: Bytes = np.ascontiguousarray(w.view(np.uint8).reshape(len(w), 8)[:, :int(lens.max())])
    return m


def _strings(m: Bytes) -> Strings:
    return m.view(f"S{m.shape[1]}").ravel()


def _times(m: Bytes, lens: Index) -> npt.NDArray[np.float64]:
    """Decimal timestamps (rows from ``_field``) as float64, equal to ``float(text)``.

    Up to 15 digits the digits form an exact int64 and one IEEE division by a power of ten rounds
    it correctly, as the JSON parser does; longer or unusual numbers (repr's 17 digits, exponents,
    signs) go through numpy's own string conversion."""
    n, width = m.shape
    k = min(width, DIGITS)
    head = m[:, :k]
    dig = (head - 48) < 10  # uint8 wraps: any other byte is >= 10
    dot = head == 46
    dpos = dot.argmax(axis=1)
    has_dot = dot[np.arange(n), dpos]
    ones = np.ones(k, np.uint8)  # row counts as a small matmul: several times count_nonzero(axis=1)'s speed
    fast = ((dig.view(np.uint8) @ ones + has_dot) == lens) & (dot.view(np.uint8) @ ones <= 1)
    fast &= (lens <= k) & dig[:, 0] & (lens > 0)
    fast &= dig[np.arange(n), np.clip(lens - 1, 0, k - 1)]  # "5." is no JSON number
    vals = np.where(dig, head - 48, 0)
    s = vals[:, 0].astype(np.int64)  # the text, dot as a 0, left-aligned, column by column: no
    for j in range(1, k):  # int64 copy of the whole field (8 bytes a character) in memory
        s *= 10
        s += vals[:, j]
    s //= _I10[k - np.minimum(lens, k)]
    # digits after the dot (a longer tail than DIGITS only on rows taken the slow way below)
    frac = np.minimum(np.where(has_dot, lens - 1 - dpos, 0), DIGITS)
    r = s % _I10[frac]
    mant = np.where(has_dot, (s - r) // 10 + r, s)
    out: npt.NDArray[np.float64] = mant / _F10[frac]
    slow = np.flatnonzero(~fast)
    if len(slow):
        try:
            out[slow] = _strings(m[slow]).astype(np.float64)
        except ValueError:  # "t":null or other junk: NaN, and the caller takes the JSON path
            out[slow] = [_float_or_nan(b) for b in _strings(m[slow]).tolist()]
    return out


_ZEROS = np.uint64(0x3030303030303030) if np is not None else 0  # eight "0"
_HIGH = np.uint64(0x8080808080808080) if np is not None else 0
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F) if np is not None else 0
_DOTS = np.uint64(0x2E2E2E2E2E2E2E2E) if np is not None else 0
_U10 = 10 ** np.arange(9, dtype=np.uint64) if np is not None else None


def _dots(w: Any) -> Any:
    """The top bit of each byte of ``w`` that is a dot (the exact zero-byte test of ``_find``)."""
    x = w ^ _DOTS
    return ~(((x & _LOW7) + _LOW7) | x | _LOW7)


def _all_digits(w: Any) -> Any:
    """Whether every byte of ``w`` is an ASCII digit (no carry crosses a byte: each is below 0x80)."""
    return (((w & _HIGH) == 0) & (((w + np.uint64(0x4646464646464646)) & _HIGH) == 0)
            & ((((w | _HIGH) - _ZEROS) & _HIGH) == _HIGH))


def _eight(w: Any, k: Any) -> Any:
    """The integer of the ``k`` (1-8) digits at the start of ``w``: leading zeros put before them,
    the eight digits combined pairwise (simdjson's parse_eight_digits_unrolled)."""
    v = ((w << ((8 - k) * 8).astype(np.uint64)) | (_ZEROS & _KEEP[8 - k])) - _ZEROS
    v = v * np.uint64(10) + (v >> np.uint64(8))
    return (((v & np.uint64(0x000000FF000000FF)) * np.uint64(100 + (1000000 << 32))
             + ((v >> np.uint64(16)) & np.uint64(0x000000FF000000FF)) * np.uint64(1 + (10000 << 32)))
            >> np.uint64(32))


def _times_swar(arr: Bytes, start: Index, lens: Index) -> npt.NDArray[np.float64]:
    """``_times`` of fields at most 16 bytes long, each read as two 8-byte integers and parsed in
    them (SWAR: no row of bytes per field; one integer where every field fits in 8). The same
    values, and the same rows left to numpy's string conversion: a field of digits with at most
    one dot, neither first nor last."""
    words = _words(arr)
    short = int(lens.max()) <= 8
    lo = words[start] & _KEEP[lens if short else np.minimum(lens, 8)]
    eight = np.uint64(8)
    with np.errstate(over="ignore"):
        dl = _dots(lo)
        in_lo = dl != 0
        if short:
            has_dot = in_lo
            one = (dl & (dl - np.uint64(1))) == 0  # one dot at most
            # the dot's place (0 where there is none), and the digits with it taken out
            dpos = p = np.log2(dl.astype(np.float64) + (~has_dot)).astype(np.int64) >> 3
            low = _KEEP[p]
            lo = np.where(in_lo, (lo & low) | ((lo >> eight) & ~low), lo)
            n = lens - has_dot
            lo |= _ZEROS & ~_KEEP[n]  # "0" after the digits: every byte must read as one
            fast = _all_digits(lo) & one
            v = _eight(lo, np.maximum(n, 1))
        else:
            hi = words[start + 8] & _KEEP[np.clip(lens - 8, 0, 8)]
            dh = _dots(hi)
            in_hi = dh != 0
            has_dot = in_lo | in_hi
            one = ((dl & (dl - np.uint64(1))) == 0) & ((dh & (dh - np.uint64(1))) == 0) & ~(in_lo & in_hi)
            p = np.log2(np.where(in_lo, dl, dh).astype(np.float64) + (~has_dot)).astype(np.int64) >> 3
            dpos = p + 8 * in_hi
            low = _KEEP[p]
            # the bytes after the dot move down one, across the two words
            lo, hi = (np.where(in_lo, (lo & low) | ((lo >> eight) & ~low) | ((hi & _KEEP[1]) << np.uint64(56)), lo),
                      np.where(in_lo, hi >> eight, np.where(in_hi, (hi & low) | ((hi >> eight) & ~low), hi)))
            n = lens - has_dot
            lo |= _ZEROS & ~_KEEP[np.clip(n, 0, 8)]
            hi |= _ZEROS & ~_KEEP[np.clip(n - 8, 0, 8)]
            fast = _all_digits(lo) & _all_digits(hi) & one
            v = _eight(lo, np.clip(n, 1, 8))  # the first 8 digits where there are more
            rest = np.clip(n - 8, 1, 8)
            v = np.where(n > 8, v * _U10[rest] + _eight(hi, rest), v)
        fast &= (lens > 0) & ~(has_dot & ((dpos == 0) | (dpos == lens - 1)))  # "5." and ".5" are no JSON
    frac = np.where(has_dot, lens - 1 - dpos, 0)
    out: npt.NDArray[np.float64] = v.astype(np.int64) / _F10[frac]
    slow = np.flatnonzero(~fast)
    if len(slow):
        m = _field(arr, start[slow], start[slow] + lens[slow])
        try:
            out[slow] = _strings(m).astype(np.float64)
        except ValueError:  # "t":null or other junk: NaN, and the caller takes the JSON path
            out[slow] = [_float_or_nan(b) for b in _strings(m).tolist()]
    return out


def _float_or_nan(b: bytes) -> float:
    try:
        return float(b)
    except ValueError:
        return math.nan


def _chunk(an: Analyzer, buf: bytes) -> int:
    if an.itl_target_s is None:
        # the target comes from the first gaps in file order: the streaming path derives it,
        # then the rest of the chunk takes the fast path
        bad, pos = _warm(an, buf)
        if pos >= len(buf):
            return bad
        return bad + _chunk(an, buf[pos:])
    p = _parse(buf)
    return _apply(an, p) if p is not None else 0


def _warm(an: Analyzer, buf: bytes) -> tuple[int, int]:
    """Lines of ``buf`` through the streaming path until the ITL target is known: (malformed lines,
    where the rest begins; len(buf) or more: nothing is left)."""
    pos = 0
    bad = 0
    while an.itl_target_s is None:
        nl = buf.find(b"\n", pos)
        if nl < 0:
            return bad + _feed_line(an, buf[pos:]), len(buf)
        bad += _feed_line(an, buf[pos:nl])
        pos = nl + 1
    return bad, pos


class Parsed(NamedTuple):
    """One chunk as ``_parse`` read it, without the analyzer (a worker process can make it)."""

    engines: list[tuple[str, Any]]  # (request id, engine) of arrive lines naming one, in file order
    # every line as the streaming path reads it (dict, or None when malformed; blank lines left
    # out), when the chunk must go through the streaming path whole; else None
    slow: list[dict[str, Any] | None] | None
    held: bool  # ``slow`` goes in with attribution held (a token time the batch could not take)
    ids: list[str]  # the batch: distinct request ids, each event's index into them, times, tokens,
    codes: Index  # whether it is a first_token event
    ts: npt.NDArray[np.float64]
    ns: npt.NDArray[np.int64]
    ft: Mask
    # the other lines in file order: (a first_token line the batch counted, its dict or None)
    others: list[tuple[bool, dict[str, Any] | None]]
    tokens: int  # token lines (not first_token) in the batch


def _slow(buf: bytes) -> list[dict[str, Any] | None]:
    return [parse_line(line) for line in buf.split(b"\n") if line.strip()]


def _feed_dicts(an: Analyzer, ds: list[dict[str, Any] | None]) -> int:
    bad = 0
    for d in ds:
        if d is None:
            bad += 1
        else:
            an.feed_dict(d)
    return bad


def _apply(an: Analyzer, p: Parsed) -> int:
    """Feed one parsed chunk into ``an``; returns its count of malformed lines."""
    for rid, engine in p.engines:
        an.name_engine(rid, engine)
    if p.slow is not None and not p.held:
        return _feed_dicts(an, p.slow)
    skipped = 0
    with an.batch():
        if p.slow is not None:
            return _feed_dicts(an, p.slow)
        if len(p.ts):
            an.add_token_batch(p.ids, p.codes, p.ts, p.ns, p.ft)
        # every other line, and first_token bookkeeping, in file order through the normal methods
        for first, d in p.others:
            if d is None:
                skipped += 1
            elif first:
                an.records += 1
                an.request_event(d["t"], str(d["id"]), "first_token", d.get("n"), d.get("prompt_tokens"),
                                 d.get("class"), tokens_done=True)
            else:
                an.feed_dict(d)
        an.records += p.tokens
    return skipped


def _parse(buf: bytes) -> Parsed | None:
    """Read one chunk (whole lines, the last ending in a newline): the token lines as columns,
    every other line as a checked dict. Needs no analyzer: it can run in another process."""
    return _parse_padded(buf + bytes(PAD), len(buf))


def _parse_padded(buf: bytes | bytearray, n: int) -> Parsed | None:
    """``_parse`` of ``buf[:n]``, followed in ``buf`` by at least PAD zero bytes."""
    arr = np.frombuffer(buf, np.uint8)
    # newlines a megabyte at a time: a whole-chunk comparison would hold a byte per byte of it
    ends = np.concatenate([np.flatnonzero(arr[a:min(a + (1 << 20), n)] == 10) + a for a in range(0, n, 1 << 20)]
                          or [np.zeros(0, np.intp)])
    if len(ends) == 0:
        return None
    empty = np.zeros(0, dtype=np.int64)
    nothing = Parsed([], None, False, [], empty, empty.astype(np.float64), empty, empty.astype(bool), [], 0)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    ok = (ends - starts) > len(PREFIX) + 16
    ok &= arr[np.maximum(ends - 1, 0)] == 125  # a complete object ends the line
    ok = _match(arr, starts, PREFIX, ok)
    tstart = starts + len(PREFIX)
    # field ends from short fixed windows after each start (no whole-buffer scans for , and ")
    tend = tstart + _find(arr, tstart, 44, T_WIDTH, ok)
    ok &= (tend > tstart) & (tend < ends)
    ok = _match(arr, tend, ID_SEP, ok)
    idstart = tend + len(ID_SEP)
    idend = idstart + _find(arr, idstart, 34, ID_WIDTH, ok)
    ok &= (idend > idstart) & (idend < ends)
    if b"\\" in buf:
        ok &= ~_has(arr, idstart, idend, 92, ID_WIDTH, ok)  # escaped ids take the JSON path
    is_tok = _match(arr, idend, EV_TOK, ok)
    is_ft = _match(arr, idend, EV_FT, ok & ~is_tok, sparse=True)
    fast = is_tok | is_ft
    after = np.where(is_tok, idend + len(EV_TOK), idend + len(EV_FT))
    # n: absent (1), or one or two digits. The 8 bytes after the event are one word: ',"n":', the
    # first digit and the two bytes after it (no gather per byte)
    w = _words(arr)[after].view(np.uint8).reshape(-1, 8)  # a row of those 8 bytes per line
    has_n = fast & ((w.view("<u8")[:, 0] & _KEEP[5]) == _N_WORD)
    c0, e1, e2 = w[:, 0], w[:, 6], w[:, 7]
    d1 = w[:, 5].astype(np.int64) - 48
    d2 = e1.astype(np.int64) - 48
    one = has_n & (d1 >= 0) & (d1 <= 9) & ((e1 == 44) | (e1 == 125))
    two = has_n & ~one & (d1 >= 0) & (d1 <= 9) & (d2 >= 0) & (d2 <= 9) & ((e2 == 44) | (e2 == 125))
    no_n = fast & ~has_n & ((c0 == 44) | (c0 == 125))
    fast &= one | two | no_n
    nval = np.where(one, d1, np.where(two, d1 * 10 + d2, 1))
    del w, c0, e1, e2, d1, d2

    fi = np.flatnonzero(fast)
    rows = np.flatnonzero(~fast | is_ft)  # the lines read as dicts, in file order
    # the lines ``Parsed.engines`` may come from: arrive lines in the writer's key order, found like
    # the token lines, and any line of another shape (read from their dicts in the loop below)
    named = (_match(arr, idend, EV_ARRIVE, ok & ~fast, sparse=True) | ~ok)[rows].tolist()
    others: list[tuple[bool, dict[str, Any] | None]] = []
    engines: list[tuple[str, Any]] = []
    for first, name, a, b in zip((is_ft & fast)[rows].tolist(), named, starts[rows].tolist(), ends[rows].tolist(),
                                 strict=True):
        line = buf[a:b]
        if first:
            # its shape looked right; a flipped byte can still break the JSON
            others.append((True, parse_line(line)))
        elif b'"token"' in line or b'"first_token"' in line or b'"resync"' in line:
            # A token event the fast path cannot read (n >= 100, escaped id, another key order or
            # spacing) would reach the JSON path out of file order and corrupt its stream's gaps:
            # such a chunk goes through the streaming path whole. Correctness first; these lines
            # are rare.
            return nothing._replace(slow=_slow(bytes(buf[:n])))
        elif line.strip():
            d = parse_line(line)
            others.append((False, d))
            if name and _names_engine(d, line):
                engines.append((str(d["id"]), d.get("engine")))
    if not len(fi):
        ts = nothing.ts
        ids: list[str] = []
        codes = nothing.codes
    else:
        ts_, te_ = tstart[fi], tend[fi]
        is_, ie_ = idstart[fi], idend[fi]
        # narrowest fixed width that holds every value of this chunk
        tl = te_ - ts_
        ts = _times_swar(arr, ts_, tl) if int(tl.max()) <= 16 else _times(_field(arr, ts_, te_), tl)
        if np.isnan(ts).any() or (ts < T_MIN).any() or (ts > T_MAX).any():
            # a token line whose time is not a number or out of range: the streaming path
            # judges the chunk (the trace reader's check skips such lines)
            return nothing._replace(engines=engines, slow=_slow(bytes(buf[:n])), held=True)
        uniq, codes = _unique_at(arr, is_, ie_)
        ids = [raw.decode("utf-8", "replace") for raw in uniq.tolist()]
    return Parsed(engines, None, False, ids, codes, ts, nval[fi].astype(np.int64), is_ft[fi], others,
                  int(np.count_nonzero(is_tok & fast)))


def _names_engine(d: dict[str, Any] | None, line: bytes | bytearray) -> TypeGuard[dict[str, Any]]:
    """Whether ``line`` (read as ``d``) is a stream that names its engine on "arrive": such streams are
    named before the chunk's token batch (``Parsed.engines``), as the batch's gaps are made before
    the chunk's other lines go through in file order, and a gap is compared with other streams of
    its own engine."""
    return (d is not None and b'"arrive"' in line and b'"engine":' in line and d.get("kind") == "request"
            and d.get("event") == "arrive")


_MIX = np.uint64(0x9E3779B97F4A7C15) if np is not None else 0


def _unique_at(arr: Bytes, start: Index, end: Index) -> tuple[Strings, Index]:
    """``_unique`` of the ids at [start, end), read 8 bytes at a time as integers where they lie
    (no row of every id is built; only the distinct ones become strings)."""
    lens = end - start
    words = np.ndarray((len(arr) - 7,), dtype="<u8", buffer=arr, strides=(1,))
    h = lens.astype(np.uint64)
    cols = []
    with np.errstate(over="ignore"):
        for j in range(0, int(lens.max()), 8):
            w = words[start + j]
            rem = lens - j  # bytes of this word inside the id
            w &= _KEEP[np.clip(rem, 0, 8)]
            cols.append(w)
            h = (h ^ w) * _MIX
            h ^= h >> np.uint64(29)
    rep, hinv = _hash_groups(h)  # one row of each distinct hash; each row's group
    back = rep[hinv]
    # every row the same bytes as its group's representative, or a hash collision: the slow way
    if not (np.array_equal(lens[back], lens) and all(np.array_equal(c[back], c) for c in cols)):
        return _unique(_strings(_field(arr, start, end)))
    cand = _strings(_field(arr, start[rep], end[rep]))
    perm = np.argsort(cand, kind="stable")
    rank = np.empty_like(perm)
    rank[perm] = np.arange(len(perm))
    return cand[perm], rank[hinv]


def _hash_groups(h: Any) -> tuple[Index, Index]:
    """(one row of each distinct value of the low 32 bits of ``h``, each row's group number).

    Grouped by a sort of the 32 bits as two 16-bit keys, each by numpy's radix sort (about half
    the time of a sort of the 64-bit values). Rows whose hashes share the low 32 bits fall into
    one group: the callers compare every row's bytes with its group's (a collision takes their
    slow way)."""
    n = len(h)
    lo = (h & np.uint64(0xFFFF)).astype(np.uint16)
    hi = ((h >> np.uint64(16)) & np.uint64(0xFFFF)).astype(np.uint16)
    first = np.argsort(lo, kind="stable")
    order = first[np.argsort(hi[first], kind="stable")]
    key = (h & np.uint64(0xFFFFFFFF))[order]
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    hinv = np.empty(n, np.intp)
    hinv[order] = np.cumsum(new) - 1
    return order[new], hinv


def _unique(ids: Strings) -> tuple[Strings, Index]:
    """``np.unique(ids, return_inverse=True)`` for fixed-width byte strings, through a 64-bit hash.

    Sorting many strings is the slow part of np.unique; the hashes sort as integers and only the
    few distinct ids sort as strings. A collision (checked) falls back to np.unique."""
    n, width = len(ids), ids.dtype.itemsize
    m = ids.view(np.uint8).reshape(n, width)
    if width % 8:
        m = np.concatenate([m, np.zeros((n, 8 - width % 8), np.uint8)], axis=1)
    words = np.ascontiguousarray(m).view(np.uint64)
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(words.shape[1]):
            h = (h ^ words[:, j]) * np.uint64(0x9E3779B97F4A7C15)
            h ^= h >> np.uint64(29)
    rep, hinv = _hash_groups(h)
    cand = ids[rep]
    if not np.array_equal(cand[hinv], ids):
        return np.unique(ids, return_inverse=True)
    perm = np.argsort(cand, kind="stable")
    rank = np.empty_like(perm)
    rank[perm] = np.arange(len(perm))
    return cand[perm], rank[hinv]


# ---- the token sidecar (kvtop.model.token_columns) -------------------------------------------
RECORD_DTYPE = np.dtype([("off", "<u8"), ("t", "<f8"), ("code", "<u4"), ("length", "<u2"), ("n", "u1"),
                         ("kind", "u1")]) if np is not None else None
OPEN_WINDOW = 1 << 17  # records read at once when a sidecar is opened or its ids taken in (3 MB)
MARK_TRIES = 16  # marks tried, from the last one within the trace back
_END = 1 << 64  # the offset of a record past the sidecar's end


class Columns:
    """A trace's token sidecar, checked against the trace: its first ``count`` records, which speak
    for the JSONL's first ``covered`` bytes, and the request ids read so far.

    Records are read with pread, a chunk's worth at a time (not mapped: a file that shrinks under a
    mapping kills its reader with SIGBUS, a short read is only a chunk read from the JSONL)."""

    def __init__(self, path: str, side: str, count: int, covered: int):
        self.path = path  # the JSONL
        self.side = side  # the sidecar
        self.count = count
        self.covered = covered
        self.ids: dict[int, tuple[int, int]] = {}  # code -> (offset, length) of its id in the JSONL
        self.names: dict[int, bytes] = {}  # code -> its id, read and checked in place
        self.seen = 0  # the records whose id records are in ``ids``

    def take_ids(self, part: Any) -> None:
        """Take in the id records of ``part``, the records from ``seen`` on."""
        defs = part[part["kind"] == TC.ID]
        self.ids.update(zip(defs["code"].tolist(), zip(defs["off"].tolist(), defs["length"].tolist(), strict=True),
                            strict=True))
        self.seen += len(part)


def _records(fd: int, i0: int, i1: int) -> Any:
    """Records i0..i1-1 of a sidecar (fewer where the file ends sooner)."""
    raw = os.pread(fd, max(0, i1 - i0) * TC.RECORD.size, TC.HEAD.size + i0 * TC.RECORD.size)
    return np.frombuffer(raw, RECORD_DTYPE, count=len(raw) // TC.RECORD.size)


def _off(fd: int, i: int) -> int:
    raw = os.pread(fd, 8, TC.HEAD.size + i * TC.RECORD.size)
    return int.from_bytes(raw, "little") if len(raw) == 8 else _END


def _bisect(fd: int, x: int, lo: int, hi: int, right: bool = False) -> int:
    """``bisect.bisect_left`` (``bisect_right``) of offset ``x`` over records lo..hi-1, read one by one."""
    while lo < hi:
        mid = (lo + hi) // 2
        v = _off(fd, mid)
        if v < x or (right and v == x):
            lo = mid + 1
        else:
            hi = mid
    return lo


def open_columns(path: str) -> tuple[Columns | None, str | None]:
    """The sidecar of trace ``path`` when it has one that belongs to it, and a one-line note when
    there is one that does not (another trace's, or one the trace no longer matches)."""
    side = TC.sidecar_path(path)
    if np is None or not os.path.isfile(side):
        return None, None
    tried = 0
    past = False
    try:
        with open(path, "rb") as f, open(side, "rb") as g:
            head = f.readline(MAX_LINE_BYTES + 1)
            size = os.fstat(f.fileno()).st_size
            raw = g.read(TC.HEAD.size)
            if len(raw) < TC.HEAD.size:
                return None, None  # a recorder stopped before its first flush: nothing to read
            magic, hlen, hcrc = TC.HEAD.unpack(raw)
            if magic != TC.MAGIC:
                return None, f"{side}: ignored (not a kvtop token sidecar)"
            if hlen != len(head) or hcrc != zlib.crc32(head):
                return None, f"{side}: ignored (it belongs to another trace)"
            fd = g.fileno()
            nrec = (os.fstat(fd).st_size - TC.HEAD.size) // TC.RECORD.size
            # the last marks within the trace's size (one cut short ends before later ones), a window
            # at a time from there back; the offsets never decrease (where they do, a chunk's check
            # finds it)
            end = _bisect(fd, size, 0, nrec, right=True)
            past = end < nrec
            while end > 0 and tried < MARK_TRIES:
                w0 = max(0, end - OPEN_WINDOW)
                window = _records(fd, w0, end)
                for m in (np.flatnonzero(window["kind"] == TC.MARK)[::-1]).tolist():
                    tried += 1
                    off, crc, k = int(window["off"][m]), int(window["code"][m]), int(window["length"][m])
                    if hlen <= off <= size and k <= off:
                        tail = os.pread(f.fileno(), k, off - k)
                        if tail.endswith(b"\n") and zlib.crc32(tail) == crc:
                            return Columns(path, side, w0 + m, off), None
                    if tried >= MARK_TRIES:
                        break
                end = w0
    except (OSError, ValueError):
        return None, f"{side}: ignored (unreadable)"
    if tried or past:
        return None, f"{side}: ignored (the trace no longer matches it)"
    return None, None


def _names(c: Columns, f: IO[bytes], codes: list[int]) -> list[bytes] | None:
    """The ids of request ``codes``, each read where the sidecar says and checked there (between
    the quotes after ``"id":``); None when one is not."""
    out = []
    names = c.names
    for code in codes:
        raw = names.get(code)
        if raw is None:
            o, n = c.ids.get(code, (0, 0))
            if n <= 0 or o < len(ID_SEP):
                return None
            text = os.pread(f.fileno(), n + len(ID_SEP) + 1, o - len(ID_SEP))
            raw = text[len(ID_SEP):-1]
            if not (text.startswith(ID_SEP) and text.endswith(b'"')) or len(raw) != n or b'"' in raw or b"\\" in raw:
                return None
            names[code] = raw
        out.append(raw)
    return out


def _parse_cols(c: Columns, a: int, b: int) -> tuple[bool, Parsed | None]:
    """``_parse`` of the JSONL's bytes a..b (a chunk the sidecar covers) with the token lines read
    from the sidecar and only the other lines from the JSONL. (False, None) when the two disagree
    anywhere the check looks (the caller reads the chunk from the JSONL)."""
    if b <= a:
        return True, None
    with open(c.side, "rb") as g:
        fd = g.fileno()
        i0 = _bisect(fd, a, 0, c.count)
        i1 = _bisect(fd, b, i0, c.count)
        while c.seen < i0:  # ids of records before the chunk (those of lines read another way)
            part = _records(fd, c.seen, min(i0, c.seen + OPEN_WINDOW))
            if not len(part):
                return False, None
            c.take_ids(part)
        sl = _records(fd, i0, i1)
    if len(sl) != i1 - i0:
        return False, None  # the sidecar is shorter than it was when it was opened
    if i0 <= c.seen < i1:
        c.take_ids(sl[c.seen - i0:])
    o = sl["off"].astype(np.int64)
    kind = sl["kind"]
    tm = (kind == TC.TOKEN) | (kind == TC.FIRST)
    codes_w = sl["code"][tm]
    ts = sl["t"][tm]
    ns = sl["n"][tm].astype(np.int64)
    toff = o[tm]
    tend = toff + sl["length"][tm]  # each token line's newline
    if len(o) > 1 and bool((o[1:] < o[:-1]).any()):
        return False, None
    if len(toff) and (int(tend[-1]) >= b or not bool(((ts >= T_MIN) & (ts <= T_MAX)).all())):
        return False, None  # past the chunk, or a time the JSONL reading would not take as one
    ft = kind[tm] == TC.FIRST
    # the lines between the token lines (first_token lines among them: their bookkeeping reads
    # their dict), each span read with the newline before it and the token line's prefix after it
    plain = np.flatnonzero(~ft)
    gs = np.empty(len(plain) + 1, np.int64)
    ge = np.empty(len(plain) + 1, np.int64)
    gs[0] = a
    gs[1:] = tend[plain] + 1
    ge[:-1] = toff[plain]
    ge[-1] = b
    spans = np.flatnonzero(ge > gs)
    ft_off = toff[ft]
    first_at = set(ft_off.tolist())
    # first_token lines inside each span
    nft = (np.searchsorted(ft_off, ge[spans]) - np.searchsorted(ft_off, gs[spans])).tolist()
    others: list[tuple[bool, dict[str, Any] | None]] = []
    engines: list[tuple[str, Any]] = []
    npre = len(PREFIX)
    last = len(plain)
    found = 0
    with open(c.path, "rb") as f:
        fd = f.fileno()
        for k, s0, e0, n_ft in zip(spans.tolist(), gs[spans].tolist(), ge[spans].tolist(), nft, strict=True):
            tail = npre if k < last else 0
            want = e0 - s0 + 1 + tail
            text = os.pread(fd, want, s0 - 1)
            if len(text) != want or text[0] != 10 or (tail and text[-tail:] != PREFIX):
                return False, None
            body = text[1:want - tail]
            # a token line the sidecar does not hold (the JSONL reading's test, on the span at once;
            # each first_token line the sidecar holds has the word once): the JSONL decides
            if b'"token"' in body or b'"resync"' in body or body.count(b'"first_token"') != n_ft:
                return False, None
            pos = s0
            for line in body.split(b"\n")[:-1]:
                if n_ft and pos in first_at:
                    others.append((True, parse_line(line)))
                    found += 1
                elif line.strip():
                    d = parse_line(line)
                    others.append((False, d))
                    if _names_engine(d, line):  # named before the batch
                        engines.append((str(d["id"]), d.get("engine")))
                pos += len(line) + 1
            if pos != e0:
                return False, None
        if found != len(first_at):
            return False, None  # a first_token record that is not at a line's start
        if not len(codes_w):
            empty = np.zeros(0, dtype=np.int64)
            return True, Parsed(engines, None, False, [], empty, empty.astype(np.float64), empty,
                                empty.astype(bool), others, 0)
        lo, hi = int(codes_w.min()), int(codes_w.max())
        if hi - lo <= 4 * len(codes_w) + (1 << 16):
            # writer codes to 0..k-1 through a table over their range (np.unique would sort them all)
            tab = np.zeros(hi - lo + 1, np.int64)
            rel = codes_w.astype(np.int64) - lo
            tab[rel] = 1
            uc = np.flatnonzero(tab)
            tab[uc] = np.arange(len(uc))
            inv = tab[rel]
            uc += lo
        else:
            uc, inv = np.unique(codes_w, return_inverse=True)
        raw = _names(c, f, uc.tolist())
    if raw is None:
        return False, None
    # the ids sorted by their bytes, as the JSONL reading has them; one id may have had two codes
    names = sorted(set(raw))
    rank = {r: i for i, r in enumerate(names)}
    codes = np.array([rank[r] for r in raw], dtype=np.intp)[inv]
    return True, Parsed(engines, None, False, [r.decode("utf-8", "replace") for r in names], codes,
                        ts.astype(np.float64), ns, ft, others, int(np.count_nonzero(~ft)))
