"""The capture's streaming fast path: a ring block's packets read, reassembled and parsed in one loop.

Nearly every packet a busy engine's port carries is the same thing: the server sending the next
whole chunk (one SSE event) of a chunked response, in order, on a connection already in step.
The general path takes each packet through ``PacketSocket`` (a decoded segment tuple),
``Reassembler.segment`` and ``HttpConnection.server_data`` before the response's
``StreamRecorder`` sees the event: three calls, a tuple and a copy of the payload per packet (with
the chunk's size line read by a regular expression, 0.8 of the 4.8 µs a packet cost on a 2-core
box, ``bench/capture_cost.py --replay``). Here that one case is recognised in the ring itself, its few state updates
done in line (the peer's acknowledgement, the next sequence number, the idle clock) and only the
event's bytes copied out to the recorder. Every other packet, and every case a condition below
does not prove to be that one, goes through ``Reassembler.segment`` as it always did, in ring
order, so the records are the general path's (``tests/test_capture_fastpath.py`` replays the
same packets both ways).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable

from kvtop.sources.capture.http import _Chunked
from kvtop.sources.capture.packets import _V4, decode
from kvtop.sources.capture.tcp import FIN, HOLE_WAIT_S, RST, SYN, Reassembler

# the flags of a plain data segment may include PSH (and URG, which TCP ignores here); any of these
# changes what the connection does
_NOT_PLAIN = FIN | SYN | RST
_SIZE = _Chunked.SIZE
# a tpacket3_hdr's next_offset, sec, nsec, snaplen and (past len, status and mac) net
_FRAME = struct.Struct("@IIII10xH")


def _size_line(payload: int) -> bytes:
    """The size line (lower-case hex digits, no leading zero, CRLF) of the one chunk that fills a
    payload of ``payload`` bytes with its line and closing CRLF; b"" when no chunk of at least one
    byte does (21 bytes: 16 needs two digits, 15 leaves one byte over)."""
    for digits in range(1, 17):
        size = payload - digits - 4
        if size > 0 and len(b"%x" % size) == digits:
            return b"%x\r\n" % size
    return b""


# payload length -> its one-chunk size line: a stream's events come in a handful of lengths
_size_lines: dict[int, bytes] = {}
_LINES_CAP = 4096


def drain_ring(blocks: Iterable[tuple[mmap.mmap, int, int]], reasm: Reassembler, offset: float) -> tuple[int, int]:
    """Every packet of ``blocks`` (``PacketSocket.ring_blocks``: the ring, where a block's first
    packet starts, how many it holds) through ``reasm``; returns (TCP segments, their bytes) as the
    general path counts them. ``offset`` moves the kernel's times onto the run clock."""
    port = reasm.port
    conns = reasm.conns
    seg = reasm.segment
    pkt_unpack = _FRAME.unpack_from
    v4_unpack = _V4.unpack_from
    lines = _size_lines
    state_size, not_plain, wait = _SIZE, _NOT_PLAIN, HOLE_WAIT_S  # locals: read per packet
    segments = nbytes = 0
    for ring, p, n in blocks:
        for _ in range(n):
            nxt, sec, nsec, snap, net = pkt_unpack(ring, p)
            a = p + net
            p += nxt
            t = sec + nsec * 1e-9 + offset
            if snap < 40 or ring[a] != 0x45:  # not IPv4 without options: the general decoder
                d = decode(ring[a:a + snap])
                if d is not None:
                    segments += 1
                    nbytes += snap
                    seg(t, *d)
                continue
            _, total, proto, src, dst, sport, dport, seq, ack, hf = v4_unpack(ring, a)
            if proto != 6:
                continue
            segments += 1
            nbytes += snap
            e = a + (total if 0 < total <= snap else snap)
            h = a + 20 + (hf >> 12) * 4
            flags = hf & 0x3F
            if sport == port and flags & 0x10 and not flags & not_plain and e > h:  # 0x10: ACK
                conn = conns.get((dst, dport, src))
                if conn is not None:
                    flow = conn.s
                    peer = conn.c
                    pn = peer.next
                    http = conn.http
                    body = http._s_body
                    # in order with nothing waiting and no FIN seen; an ack that reaches past the
                    # client bytes we hold is a hole (the general path declares it)
                    if (flow.next == seq and not flow.ooo and flow.fin_seq is None and body is not None
                            and (ack == pn or pn is None or peer.closed
                                 or not 0 < ((ack - pn) & 0xFFFFFFFF) < 0x80000000)
                            and not http.dead):
                        ch = body.chunked
                        # between chunks, no size line begun, not searching for a boundary
                        if ch is not None and ch.state == state_size and not ch.line and ch.resync is None:
                            length = e - h
                            size_line = lines.get(length)
                            if size_line is None:
                                size_line = _size_line(length)
                                if len(lines) < _LINES_CAP:
                                    lines[length] = size_line
                            start = h + len(size_line)
                            # exactly one whole chunk, its CRLF last
                            if size_line and ring[h:start] == size_line and ring[e - 2] == 13 and ring[e - 1] == 10:
                                conn.last_t = t
                                pa = peer.acked
                                if ack != pa and (pa is None or 0 < ((ack - pa) & 0xFFFFFFFF) < 0x80000000):
                                    peer.acked = ack
                                flow.next = (seq + length) & 0xFFFFFFFF
                                ex = http._s_ex
                                if ex is not None:
                                    rec = ex.rec
                                    if rec is not None:
                                        rec.feed(ring[start:e - 2], t)
                                if t - reasm._swept > wait:
                                    reasm.sweep(t)
                                continue
            seg(t, src, sport, dst, dport, seq, ack, flags, ring[h:e])
    return segments, nbytes
