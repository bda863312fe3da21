"""The token sidecar: a trace's token lines as fixed-size binary records, written beside the JSONL.

``kvtop record`` writes ``<trace>.tokens`` next to ``<trace>`` (``TraceWriter(columns=True)``).
The JSONL stays the record of truth; the sidecar only saves ``kvtop analyze``'s fast path from
parsing the token lines (about 99 % of a trace): it reads their times, ids and token counts as
columns, a chunk's records at a time (``kvtop.analysis.fastscan``), and parses only the other lines.

Layout (little-endian): a 64-byte head (``MAGIC``, the JSONL header line's length and CRC-32: a
sidecar of another trace is recognised and ignored), then 24-byte records (``RECORD``) in the order
the writer wrote them:
  * TOKEN / FIRST: a token line at JSONL byte ``off``, ``length`` bytes long (without its newline),
    its time ``t``, its request's ``code`` and ``n``;
  * ID: request ``code`` is the ``length`` bytes at JSONL offset ``off`` (the id inside the first line
    that names it: the id's text comes from the trace itself);
  * MARK, at every flush: the JSONL held ``off`` bytes, the last ``length`` of them (the last line, or its end) with CRC-32
    ``code`` (``t``: lines written). A reader trusts the records before the last mark that matches
    the JSONL it has, and reads the JSONL after it as a trace without sidecar.
A line goes in only where the fast path's own byte rule (``token_entry``, the mirror of
``fastscan._parse``) would read it the same way, so either way the analysis gets the same columns.
"""

from __future__ import annotations

import re
import struct
import zlib

SUFFIX = ".tokens"
MAGIC = b"KVTOKC01"
HEAD = struct.Struct("<8sQI44x")  # magic, header line bytes (newline included), CRC-32 of them
RECORD = struct.Struct("<QdIHBB")  # off, t, code, length, n, kind
TOKEN, FIRST, ID, MARK = 1, 2, 3, 4
TAIL_BYTES = 1024  # a mark checks the last line before it, up to this many bytes of it

# the fast path's byte layout (kvtop.analysis.fastscan reads lines by the same constants)
PREFIX = '{"kind":"request","t":'
ID_SEP = ',"id":"'
EV_TOK = '","event":"token"'
EV_FT = '","event":"first_token"'
T_WIDTH = 24  # the fast path finds a time's end within this many bytes, an id's within ID_WIDTH
ID_WIDTH = 48
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def sidecar_path(trace: str) -> str:
    return trace + SUFFIX


def head_bytes(header_line: bytes) -> bytes:
    return HEAD.pack(MAGIC, len(header_line), zlib.crc32(header_line))


def token_entry(line: str, t_min: float, t_max: float) -> tuple[float, int, int, int, bool] | None:
    """(time, the id's offset in the line, its length, n, first_token?) of a token line the fast path
    reads as one (``line`` without its newline); None for any other line."""
    p = len(PREFIX)
    if len(line) <= p + 16 or not line.startswith(PREFIX) or not line.endswith("}"):
        return None
    te = line.find(",", p, p + T_WIDTH)
    if te <= p or not line.startswith(ID_SEP, te):
        return None
    ids = te + len(ID_SEP)
    ie = line.find('"', ids, ids + ID_WIDTH)
    if ie <= ids or "\\" in line[ids:ie]:
        return None
    if line.startswith(EV_TOK, ie):
        ft, after = False, ie + len(EV_TOK)
    elif line.startswith(EV_FT, ie):
        ft, after = True, ie + len(EV_FT)
    else:
        return None
    rest = line[after:after + 8]
    if rest.startswith(',"n":'):
        digits = rest[5:7] if rest[5:7].isdigit() else rest[5:6]
        # one or two ASCII digits, then the next key or the end of the object
        if not digits.isascii() or not digits.isdigit() or rest[5 + len(digits):6 + len(digits)] not in (",", "}"):
            return None
        n = int(digits)
    elif rest[:1] in (",", "}"):
        n = 1
    else:
        return None
    text = line[p:te]
    if not _JSON_NUMBER.fullmatch(text):
        return None
    t = float(text)
    if not t_min <= t <= t_max:
        return None
    return t, ids, ie - ids, n, ft


def tail_crc(tail: bytes) -> int:
    return zlib.crc32(tail)
