"""TCP reassembly of the connections to one server port, for passive capture.

Each direction of a connection delivers its bytes to the HTTP parser in sequence order, exactly
once: retransmitted bytes are dropped, out-of-order segments wait (bounded) until the gap before
them fills. A gap that will never fill is a *hole*: bytes the receiver got but the capture lost (a
kernel drop). It is declared when a packet from the peer acknowledges bytes we never saw (pure ACKs
are filtered out in the kernel, so this is the ACK field of the peer's data, FIN or RST), when the
waiting segments pass a byte bound, when they have waited ``HOLE_WAIT_S``, or at the connection's
end; the parser is told how many bytes were lost so it can skip them or mark the stream incomplete.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from kvtop.sources.capture.http import CaptureStats, HttpConnection
from kvtop.sources.sse import Emit

FIN, SYN, RST, ACK = 0x01, 0x02, 0x04, 0x10
OOO_CAP = 8 << 20  # bytes held out of order per direction before the gap is declared a hole
HOLE_WAIT_S = 1.0  # a real retransmission comes well within this; a capture drop never does
# A bridged interface and its member each hand the packet socket the same packet, microseconds apart
COPY_S = 0.001
IDLE_S = 600.0  # a connection with no packet for this long is forgotten
MAX_CONNECTIONS = 65536
_PORTS = struct.Struct("!HH")
_METHOD_STARTS = (b"POST ", b"GET ", b"PUT ", b"DELETE ", b"HEAD ", b"OPTIONS ", b"PATCH ")


def _diff(a: int, b: int) -> int:
    """``a - b`` in 32-bit sequence space (RFC 1982): negative when a is before b."""
    d = (a - b) & 0xFFFFFFFF
    return d - 0x100000000 if d & 0x80000000 else d


class _Flow:
    """One direction: the next sequence number we expect and what arrived ahead of it."""

    __slots__ = ("next", "ooo", "ooo_bytes", "ooo_since", "fin_seq", "closed", "acked")

    def __init__(self) -> None:
        self.next: int | None = None
        self.ooo: dict[int, tuple[bytes, float]] = {}
        self.ooo_bytes = 0
        self.ooo_since = 0.0
        self.fin_seq: int | None = None
        self.closed = False
        self.acked: int | None = None  # highest ack the peer sent for this direction


class Connection:
    __slots__ = ("http", "c", "s", "last_t")

    def __init__(self, http: HttpConnection, t: float):
        self.http = http
        self.c = _Flow()  # client -> server
        self.s = _Flow()  # server -> client
        self.last_t = t


FastState = tuple[Connection, _Flow, _Flow, Callable[[bytes, float], None] | None, int | None]


def fast_key(key: tuple[bytes, int, bytes], port: int) -> bytes:
    """A connection's ``Reassembler.fast`` key: its server's packets' source and destination
    addresses and ports, as they lie in the IPv4 and TCP headers."""
    client, cport, server = key
    return server + client + _PORTS.pack(port, cport)


def server_address(addr: bytes, port: int) -> str | None:
    """``host:port`` of the server end (the engine the captured requests went to)."""
    try:
        if len(addr) == 4:
            return f"{socket.inet_ntop(socket.AF_INET, addr)}:{port}"
        if len(addr) == 16:
            return f"[{socket.inet_ntop(socket.AF_INET6, addr)}]:{port}"
    except (OSError, ValueError):
        pass
    return None


class Reassembler:
    """Feeds decoded TCP segments of connections to ``port`` to one ``HttpConnection`` each."""

    def __init__(self, port: int, emit: Emit, stats: CaptureStats | None = None, cls: str | None = None):
        self.port = port
        self.emit = emit
        self.stats = stats if stats is not None else CaptureStats()
        self.cls = cls
        self.conns: dict[tuple[bytes, int, bytes], Connection] = {}
        # What the streaming fast path (fastpath.py) reads of an IPv4 connection whose server side
        # is in step between chunks: (connection, server flow, client flow, its recorder's ``feed``,
        # the client's next sequence number or None when any acknowledgement will do), keyed by the
        # server's packets' address and port bytes (``fast_key``). Entries are made there and
        # dropped here before anything else touches the connection (every segment the general path
        # reads, a hole declared or a connection forgotten by ``sweep``, eviction), so an entry is
        # never read stale.
        self.fast: dict[bytes, FastState] = {}
        self._swept = 0.0

    def segment(self, t: float, src: bytes, sport: int, dst: bytes, dport: int, seq: int, ack: int, flags: int,
                payload: bytes) -> None:
        if dport == self.port:
            key = (src, sport, dst)
            from_client = True
        elif sport == self.port:
            key = (dst, dport, src)
            from_client = False
        else:
            return
        self._unfast(key)
        conn = self.conns.get(key)
        if flags & SYN:
            if from_client and not flags & ACK:
                if conn is not None and conn.c.next == (seq + 1) & 0xFFFFFFFF:
                    self.stats.copies += 1  # the same connection attempt again (a copy or a SYN resent)
                    return
                if conn is not None:
                    self._close(key, conn, t, reset=True)
                conn = self._new(key, t)
                conn.c.next = (seq + 1) & 0xFFFFFFFF
            elif conn is not None and not from_client:
                conn.s.next = (seq + 1) & 0xFFFFFFFF
            return
        if conn is None:
            if not payload or flags & RST:
                return
            conn = self._new(key, t)
        prev_t, conn.last_t = conn.last_t, t
        flow, peer = (conn.c, conn.s) if from_client else (conn.s, conn.c)
        if flags & ACK:
            # _diff(a, b) > 0 written out: this runs for every packet
            pa = peer.acked
            if pa is None or 0 < ((ack - pa) & 0xFFFFFFFF) < 0x80000000:
                peer.acked = ack
            pn = peer.next
            if pn is not None and 0 < ((ack - pn) & 0xFFFFFFFF) < 0x80000000 and not peer.closed:
                self._ack_beyond(conn, peer, not from_client, ack, t)
                if peer.fin_seq is not None and peer.next == peer.fin_seq and not peer.closed:
                    # the hole ran up to the peer's FIN: that side has closed (it waited for the
                    # idle sweep, and a stream the server ended was recorded as the client's cancel)
                    self._side_closed(key, conn, not from_client, t)
        if flags & RST:
            self._close(key, conn, t, reset=True, by_client=from_client)
            return
        if payload:
            nxt = flow.next
            if nxt == seq and not flow.ooo:
                # the streaming case, in order with nothing waiting: what _data would do
                flow.next = (seq + len(payload)) & 0xFFFFFFFF
                if from_client:
                    conn.http.client_data(payload, t)
                else:
                    conn.http.server_data(payload, t)
            else:
                if nxt is None and not self._sync(conn, flow, from_client, seq, payload):
                    self.stats.joined_mid_stream += 1
                    return
                self._data(conn, flow, from_client, seq, payload, t, prev_t)
        if flags & FIN:
            flow.fin_seq = (seq + len(payload)) & 0xFFFFFFFF
        if flow.fin_seq is not None and flow.next is not None and flow.next == flow.fin_seq and not flow.closed:
            self._side_closed(key, conn, from_client, t)
        if t - self._swept > HOLE_WAIT_S:
            self.sweep(t)

    def _unfast(self, key: tuple[bytes, int, bytes]) -> None:
        if len(key[0]) == 4:
            self.fast.pop(fast_key(key, self.port), None)

    # -- one direction --------------------------------------------------------------------------
    def _sync(self, conn: Connection, flow: _Flow, from_client: bool, seq: int, payload: bytes) -> bool:
        """Joining a connection mid-way: start at a message boundary or not at all."""
        if from_client:
            ok = payload.startswith(_METHOD_STARTS)
        else:
            ok = payload.startswith(b"HTTP/1.") and bool(conn.http.pending)
        if ok:
            flow.next = seq
        return ok

    def _data(self, conn: Connection, flow: _Flow, from_client: bool, seq: int, payload: bytes, t: float,
              prev_t: float) -> None:
        assert flow.next is not None
        d = _diff(seq, flow.next)
        if d < 0:
            if d + len(payload) == 0 and t - prev_t < COPY_S:
                # the segment just delivered, again at once: one packet seen on a second interface
                # (a retransmission comes after a timeout or the peer's duplicate acks, never this soon)
                self.stats.copies += 1
                return
            self.stats.retransmits += 1
            if d + len(payload) <= 0:
                return
            payload = payload[-d:]
        elif d > 0:
            self.stats.out_of_order += 1
            old = flow.ooo.get(seq)
            if old is None or len(old[0]) < len(payload):
                if not flow.ooo:
                    flow.ooo_since = t
                flow.ooo_bytes += len(payload) - (len(old[0]) if old else 0)
                flow.ooo[seq] = (payload, t)
            if flow.ooo_bytes > OOO_CAP:
                self._hole_to(conn, flow, from_client, self._first_ooo(flow), t)
            elif flow.acked is not None and _diff(flow.acked, flow.next) > 0:
                self._ack_beyond(conn, flow, from_client, flow.acked, t)
            return
        flow.next = (flow.next + len(payload)) & 0xFFFFFFFF
        if flow.ooo:
            # segments that waited become readable together with this one: at ``t``, as one read
            payload = b"".join([payload, *self._collect(flow)])
        self._deliver(conn, from_client, payload, t)

    def _deliver(self, conn: Connection, from_client: bool, data: bytes, t: float) -> None:
        if from_client:
            conn.http.client_data(data, t)
        else:
            conn.http.server_data(data, t)

    @staticmethod
    def _first_ooo(flow: _Flow) -> int:
        nxt = flow.next or 0
        return min(flow.ooo, key=lambda s: _diff(s, nxt))

    @staticmethod
    def _collect(flow: _Flow) -> list[bytes]:
        """Waiting segments that now continue the stream (advances ``next`` past them)."""
        parts = []
        while flow.ooo:
            nxt = flow.next
            assert nxt is not None
            hit = next((s for s in flow.ooo if _diff(s, nxt) <= 0), None)
            if hit is None:
                break
            payload, _ = flow.ooo.pop(hit)
            flow.ooo_bytes -= len(payload)
            d = _diff(hit, nxt)
            if d + len(payload) > 0:
                part = payload[-d:] if d else payload
                parts.append(part)
                flow.next = (nxt + len(part)) & 0xFFFFFFFF
        if not flow.ooo:
            flow.ooo_bytes = 0
        return parts

    def _ack_beyond(self, conn: Connection, flow: _Flow, from_client: bool, ack: int, t: float) -> None:
        """The receiver has bytes up to ``ack`` that the capture did not deliver."""
        assert flow.next is not None
        if flow.fin_seq is not None and ack == ((flow.fin_seq + 1) & 0xFFFFFFFF) and flow.next == flow.fin_seq:
            return  # the ack of a FIN (it takes one sequence number, carries no byte)
        if flow.fin_seq is not None and _diff(ack, flow.fin_seq) > 0:
            ack = flow.fin_seq  # ... so the bytes lost end at the FIN, not one past it
        if flow.ooo:
            first = self._first_ooo(flow)
            if _diff(first, ack) < 0:
                ack = first
        self._hole_to(conn, flow, from_client, ack, t)

    def _hole_to(self, conn: Connection, flow: _Flow, from_client: bool, to: int, t: float) -> None:
        assert flow.next is not None
        lost = _diff(to, flow.next)
        if lost <= 0:
            return
        self.stats.holes += 1
        self.stats.hole_bytes += lost
        flow.next = to
        if from_client:
            conn.http.client_hole(lost, t)
        else:
            conn.http.server_hole(lost, t)
        parts = self._collect(flow)
        if parts:
            self._deliver(conn, from_client, b"".join(parts), t)

    # -- connection ends ----------------------------------------------------------------------
    def _side_closed(self, key: tuple[bytes, int, bytes], conn: Connection, from_client: bool, t: float) -> None:
        flow = conn.c if from_client else conn.s
        flow.closed = True
        if from_client:
            conn.http.client_closed(t, reset=False)
        else:
            conn.http.server_closed(t, reset=False)
        if conn.c.closed and conn.s.closed:
            self.conns.pop(key, None)

    def _close(self, key: tuple[bytes, int, bytes], conn: Connection, t: float, reset: bool,
               by_client: bool = True) -> None:
        for flow, client in ((conn.c, True), (conn.s, False)):
            if flow.ooo and flow.next is not None:
                self._hole_to(conn, flow, client, self._first_ooo(flow), t)
        if by_client:
            conn.http.client_closed(t, reset)
        else:
            conn.http.server_closed(t, reset)
        self.conns.pop(key, None)

    def _new(self, key: tuple[bytes, int, bytes], t: float) -> Connection:
        if len(self.conns) >= MAX_CONNECTIONS:
            oldest = sorted(self.conns, key=lambda k: self.conns[k].last_t)[: MAX_CONNECTIONS // 8]
            for k in oldest:
                del self.conns[k]
                self._unfast(k)
        conn = Connection(HttpConnection(self.emit, self.stats, self.cls, server_address(key[2], self.port)), t)
        self.conns[key] = conn
        self.stats.connections += 1
        return conn

    def sweep(self, t: float, idle_s: float = IDLE_S) -> None:
        """Declare holes that waited too long; forget idle connections (oldest first when full)."""
        self._swept = t
        stale = []
        for key, conn in self.conns.items():
            for flow, client in ((conn.c, True), (conn.s, False)):
                if flow.ooo and flow.next is not None and t - flow.ooo_since >= HOLE_WAIT_S:
                    self._unfast(key)
                    self._hole_to(conn, flow, client, self._first_ooo(flow), t)
            if t - conn.last_t > idle_s:
                stale.append(key)
        for key in stale:
            self._unfast(key)
            conn = self.conns.pop(key)
            if conn.http.pending:
                # silent for IDLE_S with a stream open: its end was lost, so it ends here, incomplete
                conn.http.lose(t)
