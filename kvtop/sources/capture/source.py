"""The capture source: packets from the socket, through reassembly and HTTP parsing, to records.

Runs on the caller's event loop: every ``POLL_S`` it drains the socket queue, so records reach
``emit`` on the loop thread like the proxy's. Record times are the kernel's packet
times moved onto the run clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvtop.model.records import Record, RequestRecord
from kvtop.sources.capture.fastpath import drain_ring
from kvtop.sources.capture.http import CaptureStats
from kvtop.sources.capture.packets import PacketSocket
from kvtop.sources.capture.tcp import Reassembler
from kvtop.sources.sse import Clock, Emit

STATS_INTERVAL_S = 1.0
POLL_S = 0.02


class CaptureSource:
    """Passive observer of the OpenAI-compatible traffic on one TCP port (``source: "capture"``).

    ``open()`` raises ``CaptureUnavailable`` (one line saying how to grant the privilege) when the
    socket cannot be opened; ``notice`` receives one line the first time something cannot be
    observed (TLS, HTTP/2, kernel drops, holes), so the operator sees the capture's limits.
    """

    def __init__(self, port: int, emit: Emit, clock: Clock, cls: str | None = None,
                 notice: Callable[[str], None] | None = None,
                 on_check: Callable[[CaptureStats], None] | None = None):
        if not 0 < port < 65536:
            raise ValueError(f"capture port must be 1-65535, not {port}")
        self.port = port
        self.emit = emit
        self.clock = clock
        self.notice = notice
        self.on_check = on_check
        self.stats = CaptureStats()
        self.reassembler = Reassembler(port, emit, self.stats, cls=cls)
        self._sock: PacketSocket | None = None
        self._offset = 0.0
        self._told: set[str] = set()
        self._next_stats = 0.0

    def open(self) -> None:
        if self._sock is None:
            self._sock = PacketSocket(self.port)
            self._sync_clock()

    def _sync_clock(self) -> None:
        # kernel packet times are wall-clock: keep the offset onto the run clock from the tightest
        # of a few samples (a step of the wall clock moves it at the next stats interval)
        best = None
        for _ in range(3):
            a = time.time()
            c = self.clock()
            b = time.time()
            if best is None or b - a < best[0]:
                best = (b - a, c - (a + b) / 2)
        assert best is not None
        self._offset = best[1]

    def poll(self) -> int:
        """Process every queued packet; returns how many."""
        sock = self._sock
        if sock is None:
            return 0
        seg = self.reassembler.segment
        off = self._offset
        st = self.stats
        if sock.uses_ring and not sock.has_queued:
            total, nbytes = drain_ring(sock.ring_blocks(), self.reassembler, off)
            st.packets += total
            st.bytes += nbytes
        else:
            total = 0
            while True:
                segs = sock.read_segments()
                if not segs:
                    break
                total += len(segs)
                nbytes = 0
                for ts, size, src, sport, dst, dport, seq, ack, flags, payload in segs:
                    nbytes += size
                    seg(ts + off, src, sport, dst, dport, seq, ack, flags, payload)
                st.packets += len(segs)
                st.bytes += nbytes
                if len(segs) < 512 or sock.uses_ring:
                    break
        now = self.clock()
        if now >= self._next_stats:
            self._next_stats = now + STATS_INTERVAL_S
            self.check(now)
        return total

    def check(self, now: float) -> None:
        """Kernel drops, stale holes and what could not be observed (called about once a second)."""
        sock = self._sock
        if sock is not None:
            sock.stats()
            self.stats.kernel_drops = sock.kernel_drops
            self._sync_clock()
        self.reassembler.sweep(now)
        st = self.stats
        if self.on_check is not None:
            self.on_check(st)
        if st.tls_connections:
            self._tell("tls", f"capture: TLS on port {self.port}: cannot observe encrypted streams "
                              "(capture the plain-HTTP port behind the TLS terminator, or use --probe)")
        if st.http2_connections:
            self._tell("http2", f"capture: HTTP/2 (gRPC) on port {self.port}: cannot observe; "
                                "only HTTP/1.1 streams are parsed")
        if st.encoded_responses:
            self._tell("encoded", f"capture: compressed responses (Content-Encoding) on port {self.port}: their tokens "
                                  "cannot be read; those streams end incomplete (capture the port before the "
                                  "compressing proxy, or use --probe)")
        if st.kernel_drops:
            self._tell("drops", f"capture: the kernel dropped {st.kernel_drops} packet(s); streams that lost "
                                "bytes are marked incomplete and their gaps across the loss are not counted")
        if st.holes:
            self._tell("holes", f"capture: {st.holes} sequence hole(s); the streams affected are marked incomplete")

    def _tell(self, what: str, msg: str) -> None:
        if what not in self._told:
            self._told.add(what)
            if self.notice is not None:
                self.notice(msg)

    async def run(self, stop: asyncio.Event) -> None:
        """Observe until ``stop`` is set (opens the socket first if ``open`` was not called).

        With the ring, the loop wakes when the kernel hands over a block (full, or partly filled
        after ``RING_RETIRE_MS``) and at least once a second for the checks: an idle engine costs
        one wake-up a second, a busy one a wake-up per block of hundreds of packets. Without it the
        socket is drained every ``POLL_S`` rather than on every packet. Record times are the
        kernel's either way, so batching the reads costs no accuracy.
        """
        self.open()
        sock = self._sock
        loop = asyncio.get_running_loop()
        woke = asyncio.Event()
        fd = None
        if sock is not None and sock.uses_ring:
            try:
                loop.add_reader(sock.fileno(), woke.set)
                fd = sock.fileno()
            except (NotImplementedError, OSError, ValueError):  # a loop without readers: poll
                fd = None
        stopped = asyncio.ensure_future(stop.wait())
        try:
            self.poll()  # what a socket opened by someone else holds already
            while not stop.is_set():
                if fd is None:
                    await asyncio.sleep(POLL_S)
                else:
                    waiter = asyncio.ensure_future(woke.wait())
                    await asyncio.wait((waiter, stopped), timeout=STATS_INTERVAL_S,
                                       return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    woke.clear()
                self.poll()
        finally:
            if fd is not None:
                loop.remove_reader(fd)
            stopped.cancel()
            self.poll()
            self.check(self.clock())
            self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class RequestOwners:
    """One request observed by two sources (capture and the proxy or probe) is recorded once.

    The first source to record a request's ``arrive`` owns it; the other source's records for that
    id are dropped. (The proxy and probe name their upstream requests with ``X-Request-Id``, so the
    capture sees the same id; the proxy records its arrive before it forwards, so it wins.)
    """

    CAP = 200_000

    def __init__(self, emit: Callable[[Record], None]):
        self._emit = emit
        self._owner: dict[str, str] = {}
        self.dropped = 0

    def sink(self, source: str) -> Callable[[Record], None]:
        """What ``source`` emits through: its request records (others pass straight through)."""
        owner = self._owner
        emit = self._emit

        def put(rec: Record) -> None:
            if not isinstance(rec, RequestRecord):
                emit(rec)
                return
            o = owner.get(rec.id)
            if o is None:
                if rec.event != "arrive":
                    emit(rec)  # not a request we saw start (e.g. a stream the capture joined late)
                    return
                if len(owner) >= self.CAP:
                    for k in list(owner)[: self.CAP // 4]:
                        del owner[k]
                owner[rec.id] = source
                emit(rec)
            elif o == source:
                emit(rec)
            else:
                self.dropped += 1

        return put
