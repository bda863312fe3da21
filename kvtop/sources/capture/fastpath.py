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
from kvtop.sources.capture.packets import decode
from kvtop.sources.capture.tcp import ACK, FIN, HOLE_WAIT_S, RST, SYN, Connection, FastState, Reassembler

# the flags of a plain data segment are ACK and maybe PSH (and URG, which TCP ignores here): none of
# FIN, SYN and RST
_PLAIN_MASK = ACK | FIN | SYN | RST
_SIZE = _Chunked.SIZE
# packets.py's IPv4 and TCP header fields, the addresses and ports read as one bytes object: the key
# of ``Reassembler.fast``
_V4_KEY = struct.Struct("!BxH5xB2x12sIIH")
_PORTS = struct.Struct("!HH")
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


# payload length -> its one-chunk size line and the line's length: a stream's events come in a
# handful of lengths
_size_lines: dict[int, tuple[bytes, int]] = {}
_LINES_CAP = 4096


def _fast_state(conn: Connection) -> FastState | None:
    """What the fast path reads of ``conn`` (``Reassembler.fast``) while its server side is in step
    between two chunks of a chunked response: nothing waiting, no FIN, the decoder at a size line and
    not searching for a boundary, the parser alive; None in any other state. Outside the fast path's
    own updates (the next sequence number, the client's acknowledged bytes, the idle clock) none of
    this changes until the general path reads a segment of the connection, which drops the entry."""
    flow = conn.s
    http = conn.http
    body = http._s_body
    if flow.next is None or flow.ooo or flow.fin_seq is not None or body is None or http.dead:
        return None
    ch = body.chunked
    if ch is None or ch.state != _SIZE or ch.line or ch.resync is not None:
        return None
    peer = conn.c
    pn = None if peer.next is None or peer.closed else peer.next
    pa = peer.acked
    # an acknowledgement already past the client bytes we hold is a hole the general path declares;
    # otherwise the client's highest acknowledgement needs no check against pn when it comes again
    if pn is not None and pa is not None and 0 < ((pa - pn) & 0xFFFFFFFF) < 0x80000000:
        return None
    ex = http._s_ex
    rec = ex.rec if ex is not None else None
    return conn, flow, peer, rec.feed if rec is not None else None, pn


def drain_ring(blocks: Iterable[tuple[mmap.mmap, int, int]], reasm: Reassembler, offset: float) -> tuple[int, int]:
    """Every packet of ``blocks`` (``PacketSocket.ring_blocks``: the ring, where a block's first
    packet starts, how many it holds) through ``reasm``; returns (TCP segments, their bytes) as the
    general path counts them. ``offset`` moves the kernel's times onto the run clock."""
    port = reasm.port
    conns = reasm.conns
    fast = reasm.fast
    seg = reasm.segment
    pkt_unpack = _FRAME.unpack_from
    v4_unpack = _V4_KEY.unpack_from
    ports_unpack = _PORTS.unpack_from
    lines = _size_lines
    wait, plain, ack_only = HOLE_WAIT_S, _PLAIN_MASK, ACK  # locals: read per packet
    swept = reasm._swept  # only this loop's calls move it (the general path's may sweep): re-read after them
    segments = nbytes = 0
    for ring, p, n in blocks:
        for _ in range(n):
            nxt, sec, nsec, snap, net = pkt_unpack(ring, p)
            a = p + net
            p += nxt
            t = sec + nsec * 1e-9 + offset
            if snap >= 40:
                vihl, total, proto, key, seq, ack, hf = v4_unpack(ring, a)
            if snap < 40 or vihl != 0x45:  # not IPv4 without options: the general decoder
                d = decode(ring[a:a + snap])
                if d is not None:
                    segments += 1
                    nbytes += snap
                    seg(t, *d)
                    swept = reasm._swept
                continue
            if proto != 6:
                continue
            segments += 1
            nbytes += snap
            e = a + (total if 0 < total <= snap else snap)
            h = a + 20 + (hf >> 12) * 4
            # ACK set, none of FIN, SYN and RST (they change what the connection does), some
            # payload; an entry's key is a server packet's (its source port is the server's)
            if (hf & plain) == ack_only and e > h:
                f = fast.get(key)
                if f is None:
                    sport, dport = ports_unpack(ring, a + 20)
                    conn = conns.get((key[4:8], dport, key[:4])) if sport == port else None
                    if conn is not None:
                        f = _fast_state(conn)
                        if f is not None:
                            fast[key] = f
                if f is not None:
                    conn, flow, peer, feed, pn = f
                    if flow.next == seq:
                        length = e - h
                        known = lines.get(length)
                        if known is None:
                            line = _size_line(length)
                            known = line, len(line)
                            if len(lines) < _LINES_CAP:
                                lines[length] = known
                        size_line, start = known
                        start += h
                        pa = peer.acked
                        # exactly one whole chunk, its CRLF last; an acknowledgement that reaches
                        # past the client bytes we hold is a hole (the general path declares it)
                        if (start > h and ring[h:start] == size_line and ring[e - 2] == 13 and ring[e - 1] == 10
                                and (ack == pa or pn is None or not 0 < ((ack - pn) & 0xFFFFFFFF) < 0x80000000)):
                            conn.last_t = t
                            if ack != pa and (pa is None or 0 < ((ack - pa) & 0xFFFFFFFF) < 0x80000000):
                                peer.acked = ack
                            flow.next = (seq + length) & 0xFFFFFFFF
                            if feed is not None:
                                feed(ring[start:e - 2], t)
                            if t - swept > wait:
                                reasm.sweep(t)
                                swept = reasm._swept
                            continue
            sport, dport = ports_unpack(ring, a + 20)
            seg(t, key[:4], sport, key[4:8], dport, seq, ack, hf & 0x3F, ring[h:e])
            swept = reasm._swept
    return segments, nbytes
