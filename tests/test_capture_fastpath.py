"""The capture's streaming fast path (``fastpath.drain_ring``) records what the general path records.

The same packets, laid out as TPACKET_V3 frames in a ring, go once through ``drain_ring`` and once,
packet by packet, through ``decode`` and ``Reassembler.segment``: the records (ids, events, times,
token counts, incompleteness), the capture's counters and the packet and byte counts must be equal.
The traffic is what the fast path must recognise (one whole SSE chunk per segment, in order) mixed
with everything it must leave to the general path: split and merged chunks, size lines in upper
case or with leading zeros or extensions, chunk sizes at a hex digit boundary, lost, repeated and
reordered segments, client bytes lost behind a later acknowledgement, resets, FINs, content-length
and non-recorded responses, IPv4 options, IPv6 and non-TCP packets. The last cases each reach one
way the fast path's per-connection entry (``Reassembler.fast``) must be dropped or never made.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import random
import struct

import pytest

from kvtop.model.records import RequestRecord
from kvtop.sources.capture import tcp
from kvtop.sources.capture.fastpath import drain_ring
from kvtop.sources.capture.opener import RING_BLOCK, RING_BLOCKS
from kvtop.sources.capture.packets import PacketSocket, decode
from kvtop.sources.capture.source import CaptureSource
from kvtop.sources.capture.tcp import ACK, FIN, IDLE_S, RST, SYN, Reassembler

PORT = 8000
SERVER = bytes([10, 0, 0, 1])
PSH = 0x08
NET = 96  # where the kernel puts a SOCK_DGRAM packet in its tpacket3 frame
OFFSET = 12.25  # kernel time -> run clock


def ipv4(src: bytes, sport: int, dst: bytes, dport: int, seq: int, ack: int, flags: int, payload: bytes,
         tcp_options: int = 0, ip_options: int = 0, proto: int = 6) -> bytes:
    tcp = struct.pack("!HHIIHHHH", sport, dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF,
                      ((5 + tcp_options) << 12) | flags, 65535, 0, 0) + b"\x01\x01\x01\x01" * tcp_options
    total = 20 + 4 * ip_options + len(tcp) + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45 + ip_options, 0, total, 1, 0x4000, 64, proto, 0, src, dst)
    return ip + b"\x01\x01\x01\x01" * ip_options + tcp + payload


def ipv6(src: bytes, sport: int, dst: bytes, dport: int, seq: int, ack: int, flags: int, payload: bytes) -> bytes:
    tcp = struct.pack("!HHIIHHHH", sport, dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF, (5 << 12) | flags, 65535, 0, 0)
    return struct.pack("!IHBB16s16s", 6 << 28, len(tcp) + len(payload), 6, 64, src, dst) + tcp + payload


def size_line(rnd: random.Random, n: int) -> bytes:
    r = rnd.random()
    if r < 0.04:
        return b"%X\r\n" % n
    if r < 0.07:
        return b"0%x\r\n" % n
    if r < 0.10:
        return b"%x;ext=1\r\n" % n
    return b"%x\r\n" % n


def event(rnd: random.Random, i: int) -> bytes:
    # texts whose chunk sizes cross the one/two and two/three hex digit boundaries (15/16, 255/256)
    text = "x" * rnd.choice([0, 1, 2, 3, 5, 8, 13, 20, rnd.randrange(200, 240)]) + str(i)
    body = json.dumps({"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": None}]})
    if rnd.random() < 0.05:
        return b"data: " + (b"y" * rnd.randrange(1, 12)) + b"\n\n"  # short and not JSON: 7-17 bytes
    return b"data: " + body.encode() + b"\n\n"


class Conn:
    """One client connection: its packets in the order the capture sees them (with losses,
    repeats and swaps), each with its kernel time."""

    def __init__(self, rnd: random.Random, sport: int, six: bool = False, faults: bool = True):
        self.rnd = rnd
        self.faults = faults  # random losses, repeats, swaps and header options
        self.sport = sport
        self.six = six
        self.client = (bytes(15) + bytes([sport % 250 + 2])) if six else bytes([10, 0, 1, sport % 250])
        self.server = (bytes(15) + b"\x01") if six else SERVER
        self.cseq = rnd.randrange(1 << 32)
        self.sseq = rnd.randrange(1 << 32)
        self.out: list[tuple[float, bytes]] = []

    def _pkt(self, from_client: bool, flags: int, payload: bytes, t: float, seq: int, ack: int) -> bytes:
        make = ipv6 if self.six else ipv4
        if from_client or not self.faults:
            return make(self.client, self.sport, self.server, PORT, seq, ack, flags, payload) if from_client else \
                make(self.server, PORT, self.client, self.sport, seq, ack, flags, payload)
        if make is ipv4 and self.rnd.random() < 0.03:
            return ipv4(self.server, PORT, self.client, self.sport, seq, ack, flags, payload, ip_options=1)
        opts = 3 if self.rnd.random() < 0.5 else 0  # loopback's timestamps option
        if make is ipv4:
            return ipv4(self.server, PORT, self.client, self.sport, seq, ack, flags, payload, tcp_options=opts)
        return make(self.server, PORT, self.client, self.sport, seq, ack, flags, payload)

    def emit(self, from_client: bool, flags: int, payload: bytes, t: float, ack: int | None = None) -> None:
        rnd = self.rnd
        if from_client:
            seq, a = self.cseq, self.sseq if ack is None else ack
            self.cseq = (self.cseq + len(payload) + (1 if flags & (SYN | FIN) else 0)) & 0xFFFFFFFF
        else:
            seq, a = self.sseq, self.cseq if ack is None else ack
            self.sseq = (self.sseq + len(payload) + (1 if flags & (SYN | FIN) else 0)) & 0xFFFFFFFF
        pkt = self._pkt(from_client, flags, payload, t, seq, a)
        r = rnd.random() if self.faults else 1.0
        if payload and r < 0.005:
            return  # the capture lost it
        self.out.append((t, pkt))
        if payload and r < 0.02:
            self.out.append((t, pkt))  # retransmitted
        elif payload and r < 0.035 and len(self.out) >= 2:
            # reordered: the kernel times of the two swapped as well (the capture sees them so)
            (t1, p1), (t2, p2) = self.out[-2], self.out[-1]
            self.out[-2], self.out[-1] = (t1, p2), (t2, p1)

    def run(self, t: float) -> None:
        rnd = self.rnd
        self.emit(True, SYN, b"", t)
        self.emit(False, SYN | ACK, b"", t)
        for k in range(rnd.randrange(1, 4)):
            t += 0.01
            recorded = rnd.random() < 0.85
            path = b"/v1/completions" if recorded else b"/health"
            body = b'{"model":"m","prompt":[1,2,3],"stream":true}'
            req = (b"POST %s HTTP/1.1\r\nHost: x\r\nX-Request-Id: r%d-%d\r\nContent-Length: %d\r\n\r\n"
                   % (path, self.sport, k, len(body)) + body)
            if rnd.random() < 0.03:
                # the request's packet is lost; the server's acknowledgement of it reaches past it
                self.cseq = (self.cseq + len(req)) & 0xFFFFFFFF
            else:
                cut = rnd.randrange(1, len(req)) if rnd.random() < 0.2 else len(req)
                self.emit(True, ACK | PSH, req[:cut], t)
                if cut < len(req):
                    self.emit(True, ACK | PSH, req[cut:], t + 0.001)
            t = self.respond(t + 0.01, recorded)
            if t < 0:
                return
        t += 0.01
        end = rnd.random()
        if end < 0.5:
            self.emit(True, FIN | ACK, b"", t)
            self.emit(False, FIN | ACK, b"", t + 0.001)
        elif end < 0.6:
            self.emit(True, RST, b"", t)

    def respond(self, t: float, recorded: bool) -> float:
        """The server's response; a negative time when the connection ended inside it."""
        rnd = self.rnd
        if rnd.random() < 0.08:
            body = b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":1}}'
            self.emit(False, ACK | PSH, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body, t)
            return t
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        pending = head if rnd.random() < 0.5 else b""
        if not pending:
            self.emit(False, ACK | PSH, head, t)
        for i in range(rnd.randrange(3, 80)):
            t += rnd.choice([0.0, 0.001, 0.02, 0.3])
            ev = event(rnd, i)
            data = size_line(rnd, len(ev)) + ev + b"\r\n"
            r = rnd.random()
            if r < 0.05:
                pending += data  # merged with the next chunk
                continue
            data, pending = pending + data, b""
            if r < 0.10:
                cut = rnd.randrange(1, len(data))
                self.emit(False, ACK | PSH, data[:cut], t)
                self.emit(False, ACK | PSH, data[cut:], t + 0.0005)
            elif r < 0.103:
                self.emit(False, RST | ACK, b"", t)
                return -1.0
            else:
                self.emit(False, ACK | PSH, data, t)
        t += 0.01
        self.emit(False, ACK | PSH, pending + b"7\r\ndata: [\r\n" if rnd.random() < 0.02 else
                  pending + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n", t)
        return t


def traffic(seed: int) -> list[tuple[float, bytes]]:
    """Packets of several interleaved connections, in kernel time order, with a stray UDP packet."""
    rnd = random.Random(seed)
    pkts: list[tuple[float, bytes]] = []
    for c in range(rnd.randrange(2, 7)):
        conn = Conn(rnd, 40000 + c, six=rnd.random() < 0.1)
        conn.run(100.0 + rnd.random() * 2)
        pkts += conn.out
    pkts.sort(key=lambda p: p[0])  # stable: a connection's swaps and repeats keep their order
    pkts.insert(len(pkts) // 2, (pkts[len(pkts) // 2][0],
                                 ipv4(SERVER, PORT, bytes([10, 0, 1, 9]), 5, 0, 0, 0, b"udp", proto=17)))
    return pkts


def ring_of(pkts: list[tuple[float, bytes]], per_block: int) -> tuple[mmap.mmap, list[tuple[mmap.mmap, int, int]]]:
    """The packets as tpacket3 frames (next_offset, sec, nsec, snaplen, len, status, mac, net), in
    blocks of ``per_block`` frames, as ``PacketSocket.ring_blocks`` hands them over."""
    frames = []
    for ts, pkt in pkts:
        sec = int(ts)
        nsec = round((ts - sec) * 1e9)
        size = (NET + len(pkt) + 15) // 16 * 16
        frames.append(struct.pack("@IIIIIIHH", size, sec, nsec, len(pkt), len(pkt), 1, NET, NET).ljust(NET, b"\0")
                      + pkt.ljust(size - NET, b"\0"))
    ring = mmap.mmap(-1, sum(len(f) for f in frames) + 64)
    blocks = []
    pos = 0
    for i in range(0, len(frames), per_block):
        group = frames[i:i + per_block]
        blocks.append((ring, pos, len(group)))
        for f in group:
            ring[pos:pos + len(f)] = f
            pos += len(f)
    return ring, blocks


def kernel_time(ts: float) -> float:
    sec = int(ts)
    return sec + round((ts - sec) * 1e9) * 1e-9 + OFFSET


def state(r: Reassembler) -> dict[tuple[bytes, int, bytes], list[object]]:
    """Each connection's reassembly state: what the next packets are read against."""
    return {key: [conn.last_t] + [getattr(flow, f) for flow in (conn.c, conn.s) for f in flow.__slots__]
            for key, conn in r.conns.items()}


def general_path(pkts: list[tuple[float, bytes]]) -> tuple[list[RequestRecord], Reassembler, int, int]:
    out: list[RequestRecord] = []
    r = Reassembler(PORT, out.append)
    segments = nbytes = 0
    for ts, pkt in pkts:
        d = decode(pkt)
        if d is not None:
            segments += 1
            nbytes += len(pkt)
            r.segment(kernel_time(ts), *d)
    r.state = state(r)  # type: ignore[attr-defined]
    r.sweep(1e9)
    return out, r, segments, nbytes


def fast_path(pkts: list[tuple[float, bytes]], per_block: int) -> tuple[list[RequestRecord], Reassembler, int, int, int]:
    out: list[RequestRecord] = []
    r = Reassembler(PORT, out.append)
    general = 0
    segment = r.segment

    def counted(*args: object) -> None:
        nonlocal general
        general += 1
        segment(*args)  # type: ignore[arg-type]

    r.segment = counted  # type: ignore[method-assign]
    ring, blocks = ring_of(pkts, per_block)
    segments, nbytes = drain_ring(blocks, r, OFFSET)
    r.state = state(r)  # type: ignore[attr-defined]
    r.sweep(1e9)
    ring.close()
    return out, r, segments, nbytes, general


@pytest.mark.parametrize("seed", range(60))
def test_fast_path_records_what_the_general_path_records(seed: int) -> None:
    pkts = traffic(seed)
    want, ref, want_segments, want_bytes = general_path(pkts)
    got, fast, segments, nbytes, general = fast_path(pkts, per_block=1 + seed % 37)
    assert got == want
    assert dataclasses.asdict(fast.stats) == dataclasses.asdict(ref.stats)
    assert (segments, nbytes) == (want_segments, want_bytes)
    # and each connection is left where the general path leaves it: what comes next is read alike
    assert fast.state == ref.state  # type: ignore[attr-defined]


def test_the_fast_path_takes_the_streaming_packets_and_the_general_path_the_rest() -> None:
    # the comparison above proves something only if both paths ran: most packets of these
    # conversations are whole chunks in order (fast), the rest are not
    fast_n = total = 0
    tokens = 0
    for seed in range(60):
        pkts = traffic(seed)
        got, _, segments, _, general = fast_path(pkts, per_block=64)
        fast_n += segments - general
        total += segments
        tokens += sum(r.n or 0 for r in got if r.event in ("first_token", "token", "resync"))
    assert fast_n > 0.4 * total
    assert total - fast_n > 0.2 * total
    assert tokens > 1000


def streaming(sport: int, rid: str) -> Conn:
    """A connection without random faults, up to the head of an SSE response."""
    c = Conn(random.Random(sport), sport, faults=False)
    c.emit(True, SYN, b"", 1.0)
    c.emit(False, SYN | ACK, b"", 1.0)
    body = b'{"prompt":[1,2],"stream":true}'
    c.emit(True, ACK | PSH, b"POST /v1/completions HTTP/1.1\r\nX-Request-Id: %s\r\nContent-Length: %d\r\n\r\n"
           % (rid.encode(), len(body)) + body, 1.0)
    c.emit(False, ACK | PSH, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n", 1.01)
    return c


def token_chunk(i: int) -> bytes:
    ev = b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i
    return b"%x\r\n" % len(ev) + ev + b"\r\n"


def both_ways(pkts: list[tuple[float, bytes]]) -> tuple[list[RequestRecord], Reassembler, int]:
    want, ref, _, _ = general_path(pkts)
    got, fast, _, _, general = fast_path(pkts, per_block=8)
    assert got == want
    assert dataclasses.asdict(fast.stats) == dataclasses.asdict(ref.stats)
    assert fast.state == ref.state  # type: ignore[attr-defined]
    return got, fast, general


def test_a_lost_segment_then_whole_chunks_resynchronises_like_the_general_path() -> None:
    # a whole-chunk segment lost mid-stream: the later ones are out of order (they wait), and the
    # hole is declared after HOLE_WAIT_S; the fast path must not take them as in order
    c = streaming(41000, "lost-1")
    for i in range(30):
        if i == 10:
            c.sseq = (c.sseq + len(token_chunk(i))) & 0xFFFFFFFF  # lost
            continue
        c.emit(False, ACK | PSH, token_chunk(i), 1.02 + i * 0.1)
    c.emit(False, ACK | PSH, b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n", 5.0)
    got, fast, general = both_ways(c.out)
    assert fast.stats.holes == 1
    assert [r.event for r in got if r.event == "resync"] == ["resync"]
    assert got[-1].incomplete
    assert general < len(c.out) - 10  # the chunks before the loss went the fast way


def test_a_whole_chunk_while_the_decoder_searches_for_a_boundary_is_left_to_it() -> None:
    # after a hole the bytes end inside a candidate chunk (size 0x80, "data:" of it seen): the next
    # segment has the shape of a whole chunk but may be that chunk's data, so the decoder keeps it
    # until the candidate is disproved (its end is no CRLF) and reads it then, with the segment after
    c = streaming(41001, "search-1")
    c.emit(False, ACK | PSH, token_chunk(0), 1.1)
    c.sseq = (c.sseq + 20) & 0xFFFFFFFF  # lost
    c.emit(False, ACK | PSH, b"junk\r\n80\r\ndata:", 1.2)
    c.emit(False, ACK | PSH, token_chunk(1), 2.5)  # past HOLE_WAIT_S: the hole is declared
    c.emit(False, ACK | PSH, token_chunk(2), 2.6)
    c.emit(False, ACK | PSH, token_chunk(3), 2.7)
    got, _, _ = both_ways(c.out)
    tokens = [(r.event, r.n, round(r.t - OFFSET, 3)) for r in got if r.n]
    assert tokens == [("first_token", 1, 1.1), ("resync", 2, 2.7)]


def test_a_segment_with_a_chunks_length_but_no_closing_crlf_is_not_a_chunk() -> None:
    c = streaming(41002, "crlf-1")
    c.emit(False, ACK | PSH, token_chunk(0), 1.1)
    ev = token_chunk(1)
    c.emit(False, ACK | PSH, ev[:-2] + b"ab", 1.2)  # the chunk's data is read; the bytes after it
    c.emit(False, ACK | PSH, token_chunk(2), 1.3)  # are no CRLF: the next size line is not one
    got, _, _ = both_ways(c.out)
    assert [r.event for r in got] == ["arrive", "first_token", "token"]


def test_a_size_line_cut_after_its_extension_is_read_whole() -> None:
    # "7;" then a segment with the shape of a whole token chunk: it ends a size line that says 7
    # (then no CRLF where that chunk ends: not chunked framing), so it is no token
    c = streaming(41003, "cut-1")
    c.emit(False, ACK | PSH, token_chunk(0), 1.1)
    c.emit(False, ACK | PSH, b"7;", 1.2)
    c.emit(False, ACK | PSH, token_chunk(1), 1.3)
    c.emit(False, ACK | PSH, token_chunk(2), 1.4)
    got, _, _ = both_ways(c.out)
    assert sum(r.n or 0 for r in got) == 1


def test_a_request_pipelined_mid_stream_is_acknowledged_by_the_next_chunk() -> None:
    c = streaming(41006, "pipe-1")
    c.emit(False, ACK | PSH, token_chunk(0), 1.1)
    c.emit(True, ACK | PSH, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 1.15)
    for i in range(1, 4):
        c.emit(False, ACK | PSH, token_chunk(i), 1.1 + i / 10)  # each acknowledges it
    got, _, general = both_ways(c.out)
    assert sum(r.n or 0 for r in got) == 4
    assert general < len(c.out) - 2


def test_a_fin_seen_before_the_last_chunk_closes_the_stream_after_it() -> None:
    c = streaming(41004, "fin-1")
    c.emit(False, ACK | PSH, token_chunk(0), 1.1)
    last = token_chunk(1)
    seq = c.sseq
    c.sseq = (c.sseq + len(last)) & 0xFFFFFFFF
    c.emit(False, FIN | ACK, b"", 1.2)  # overtook the chunk before it
    c.out.append((1.3, ipv4(c.server, PORT, c.client, c.sport, seq, c.cseq, ACK | PSH, last)))
    got, _, _ = both_ways(c.out)
    assert [(r.event, r.error) for r in got][-1] == ("error", "upstream_disconnected")
    assert sum(r.n or 0 for r in got) == 2


def test_client_bytes_lost_mid_stream_end_it_when_the_next_chunk_acknowledges_them() -> None:
    c = streaming(41005, "ack-1")
    c.emit(False, ACK | PSH, token_chunk(0), 1.1)
    c.cseq = (c.cseq + 200) & 0xFFFFFFFF  # a pipelined request the capture lost
    c.emit(False, ACK | PSH, token_chunk(1), 1.2)  # acknowledges it
    c.emit(False, ACK | PSH, token_chunk(2), 1.3)
    got, _, _ = both_ways(c.out)
    assert [(r.event, r.error) for r in got] == [("arrive", None), ("first_token", None), ("error", "capture_lost")]


def test_a_block_whose_reading_failed_is_not_read_again() -> None:
    # the trace's disk fills while a block is read: the error reaches the caller, and the capture's
    # final poll (CaptureSource.run's) must not record that block's tokens a second time
    c = streaming(41007, "fail-1")
    for i in range(6):
        c.emit(False, ACK | PSH, token_chunk(i), 1.1 + i / 10)
    frames, _ = ring_of(c.out, per_block=len(c.out))
    ring = mmap.mmap(-1, RING_BLOCK * RING_BLOCKS)
    ring[48:48 + len(frames)] = frames[:]  # block 0: its frames from offset 48
    struct.pack_into("@III", ring, 8, 1, len(c.out), 48)  # handed over (TP_STATUS_USER)
    sock = object.__new__(PacketSocket)  # a socket whose ring is this one
    sock._ring, sock._block, sock._queued = ring, 0, []
    out: list[RequestRecord] = []
    failed = []

    def emit(rec: RequestRecord) -> None:
        if len(out) == 3 and not failed:  # once: the disk has room again for the final poll
            failed.append(rec)
            raise OSError(28, "No space left on device")
        out.append(rec)

    cap = CaptureSource(PORT, emit, lambda: -1.0)  # a clock before the first check (no socket to ask)
    cap._sock = sock
    with pytest.raises(OSError):
        cap.poll()
    assert cap.poll() == 0
    assert [r.event for r in out] == ["arrive", "first_token", "token"]
    assert struct.unpack_from("@I", ring, 8)[0] == 0  # back to the kernel


def test_a_connection_forgotten_while_idle_is_not_read_through_its_fast_entry() -> None:
    # a stream silent for IDLE_S ends (capture_lost) when another connection's packet sweeps; a
    # later chunk of it belongs to no connection (joined mid-stream), it is no token of the old one
    a = streaming(41010, "idle-a")
    b = streaming(41011, "idle-b")
    a.emit(False, ACK | PSH, token_chunk(0), 1.1)
    b.emit(False, ACK | PSH, token_chunk(0), 1.1)
    b.emit(False, ACK | PSH, token_chunk(1), 2.0 + IDLE_S)  # its sweep forgets a
    a.emit(False, ACK | PSH, token_chunk(1), 2.1 + IDLE_S)
    got, fast, _ = both_ways(sorted(a.out + b.out, key=lambda p: p[0]))
    assert [(r.event, r.n, r.error) for r in got if r.id == "idle-a"] == [
        ("arrive", None, None), ("first_token", 1, None), ("error", None, "capture_lost")]
    assert fast.stats.joined_mid_stream == 1


def test_a_connection_evicted_for_a_new_one_is_not_read_through_its_fast_entry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # at MAX_CONNECTIONS a new connection evicts the oldest eighth without ending their streams:
    # the evicted one's next chunk is read as a stranger's, not fed to its old recorder
    monkeypatch.setattr(tcp, "MAX_CONNECTIONS", 8)
    conns = [streaming(41020 + i, f"ev-{i}") for i in range(8)]
    for i, c in enumerate(conns):
        c.emit(False, ACK | PSH, token_chunk(0), 1.1 + i / 100)  # ev-0 is the least recently seen
    late = streaming(41030, "ev-8")  # at 1.0, its SYN, ..., so it comes last by time: moved to 1.5
    late.out = [(1.5, p) for _, p in late.out]
    conns[0].emit(False, ACK | PSH, token_chunk(1), 1.6)
    got, fast, _ = both_ways(sorted([p for c in conns + [late] for p in c.out], key=lambda p: p[0]))
    assert [(r.event, r.n) for r in got if r.id == "ev-0"] == [("arrive", None), ("first_token", 1)]
    assert fast.stats.joined_mid_stream == 1


def test_client_bytes_that_end_the_parse_after_a_swept_hole_end_the_fast_path_too() -> None:
    # a pipelined request whose body lost a segment: the rest waits, the server acknowledges only
    # what came in order, and after HOLE_WAIT_S the sweep declares the hole inside that body and
    # delivers what waited, whose bytes after the body are no HTTP: the connection is no longer
    # parsed, so the stream's later chunks are no tokens
    c = streaming(41040, "swept-a")
    c.emit(False, ACK | PSH, token_chunk(0), 1.1)
    c.emit(True, ACK | PSH, b"POST /v1/completions HTTP/1.1\r\nX-Request-Id: swept-b\r\n"
           b"Content-Length: 40\r\n\r\n", 1.2)
    acked = c.cseq
    c.cseq = (c.cseq + 20) & 0xFFFFFFFF  # lost
    c.emit(True, ACK | PSH, b"x" * 20 + b"\x16\x03\x01 not a request line\r\n\r\n", 1.3)
    for i in range(1, 40):
        c.emit(False, ACK | PSH, token_chunk(i), 1.3 + i / 10, ack=acked)
    got, fast, general = both_ways(c.out)
    assert fast.stats.holes == 1
    assert [r.event for r in got if r.id == "swept-b"] == ["arrive"]
    tokens = sum(r.n or 0 for r in got if r.id == "swept-a")
    assert 10 < tokens < 30  # up to the sweep after HOLE_WAIT_S, none after
    assert general < len(c.out) - 10


def test_an_acknowledgement_past_two_client_losses_declares_both_holes() -> None:
    # a pipelined request body of 60 bytes: 20 lost, 20 seen, 20 lost; the server's next chunk
    # acknowledges all of it. The first hole is declared up to the bytes seen; the acknowledgement,
    # already the client's highest when the next chunk repeats it, still reaches past the second
    # loss, which is exactly the rest of the body: the framing holds (it ended the connection's
    # parse there), so the second request arrives and the first streams on
    c = streaming(41050, "twice-a")
    c.emit(False, ACK | PSH, token_chunk(0), 1.1)
    c.emit(True, ACK | PSH, b"POST /v1/completions HTTP/1.1\r\nX-Request-Id: twice-b\r\n"
           b"Content-Length: 60\r\n\r\n", 1.2)
    c.cseq = (c.cseq + 20) & 0xFFFFFFFF  # lost
    c.emit(True, ACK | PSH, b"y" * 20, 1.3)
    c.cseq = (c.cseq + 20) & 0xFFFFFFFF  # lost
    for i in range(1, 6):
        c.emit(False, ACK | PSH, token_chunk(i), 1.3 + i / 10)
    got, fast, _ = both_ways(c.out)
    assert fast.stats.holes == 2
    assert [(r.event, r.n, r.error) for r in got if r.id == "twice-a"] == [
        ("arrive", None, None), ("first_token", 1, None), *[("token", 1, None)] * 5,
        ("error", None, "capture_lost")]  # the capture ends before its stream does
    assert [(r.event, r.prompt_tokens) for r in got if r.id == "twice-b"][0] == ("arrive", None)
