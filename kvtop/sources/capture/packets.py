"""The packet socket: an ``AF_PACKET`` socket with an in-kernel BPF filter for one TCP port.

Why a raw packet socket and not a library: the only capture libraries for Python (scapy, pypcap,
pcapy) either parse every packet into heavyweight objects (scapy: tens of microseconds per packet)
or need libpcap headers and a C build; what capture needs is a socket, a 20-instruction filter
and header offsets, all of which the standard library reaches on Linux.

The socket is ``SOCK_DGRAM`` (link headers stripped: loopback, Ethernet and tunnels all start at
the IP header), bound to no interface (every interface, loopback included). The filter keeps TCP
over IPv4/IPv6 to or from the port and drops loopback's outgoing copy of each packet (loopback
shows every packet twice). Timestamps are the kernel's receive times (``SO_TIMESTAMPNS``).

Who opens it: this process when it may (root, or ``CAP_NET_RAW``); otherwise ``kvtop-capture-python``
(a copy of the interpreter that holds the capability) runs ``opener.py``, which opens the filtered
socket and passes the descriptor back, so the parser never runs with the capability.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator

from kvtop.sources.capture.opener import (
    HANDED_ENV,
    RING_BLOCK,
    RING_BLOCKS,
    SNAPLEN,
    filter_code,
    make_ring,
    open_filtered,
)

__all__ = ["CaptureUnavailable", "PacketSocket", "decode", "filter_code"]

SOL_PACKET = 263
PACKET_STATISTICS = 6
SO_TIMESTAMPNS = 35
SO_RCVBUFFORCE = 33
RCVBUF = 64 << 20
TP_STATUS_USER = 1

HOW_TO_GRANT = (
    "passive capture needs CAP_NET_RAW: run as root, or give it to a copy of the interpreter that kvtop "
    "runs only to open the capture socket (`sudo cp $(readlink -f {python}) /usr/local/bin/kvtop-capture-python "
    "&& sudo setcap cap_net_raw+ep /usr/local/bin/kvtop-capture-python`; kvtop finds it on PATH and parses "
    "without the capability), or use --proxy-listen / --probe instead"
)
# the privileged interpreter copy kvtop runs the opener with (looked up on PATH)
CAPTURE_PYTHON = "kvtop-capture-python"
OPENER_TIMEOUT_S = 20.0


class CaptureUnavailable(Exception):
    """Capture cannot run here; the message is one line that says what to do."""


def decode(pkt: bytes) -> tuple[bytes, int, bytes, int, int, int, int, bytes] | None:
    """(src, sport, dst, dport, seq, ack, flags, payload) of a TCP packet from its IP header on."""
    if not pkt:
        return None
    b0 = pkt[0]
    if b0 == 0x45 and len(pkt) >= 40:
        # IPv4 without options, the usual packet: the IP and TCP headers in one unpack
        _, total, proto, src, dst, sport, dport, seq, ack, hf = _V4.unpack_from(pkt)
        if proto != 6:
            return None
        end = total if 0 < total <= len(pkt) else len(pkt)
        return src, sport, dst, dport, seq, ack, hf & 0x3F, pkt[20 + (hf >> 12) * 4:end]
    v = b0 >> 4
    if v == 4:
        ihl = (pkt[0] & 15) * 4
        if pkt[9] != 6 or len(pkt) < ihl + 20:
            return None
        total = (pkt[2] << 8) | pkt[3]
        end = total if 0 < total <= len(pkt) else len(pkt)  # 0: a TSO super-packet; > len: trailing padding
        src, dst, off = pkt[12:16], pkt[16:20], ihl
    elif v == 6:
        if pkt[6] != 6 or len(pkt) < 60:
            return None
        plen = (pkt[4] << 8) | pkt[5]
        # as IPv4's total length: 0 is a BIG TCP super-packet (its length in a jumbo option), past
        # the packet is padding lost: the packet's own length (it read 0 bytes of a 0 payload length)
        end = 40 + plen if 0 < plen and 40 + plen <= len(pkt) else len(pkt)
        src, dst, off = pkt[8:24], pkt[24:40], 40
    else:
        return None
    sport, dport, seq, ack, hf = _TCP.unpack_from(pkt, off)
    doff = (hf >> 12) * 4
    return src, sport, dst, dport, seq, ack, hf & 0x3F, pkt[off + doff:end]


_TCP = struct.Struct("!HHIIH")
_V4 = struct.Struct("!BxH5xBxx4s4sHHIIH")  # version/IHL, total length, protocol, addresses; TCP ports, seq, ack, offset+flags
_TS = struct.Struct("@qq")
_STATS = struct.Struct("@II")
_BLOCK = struct.Struct("@III")  # block_status, num_pkts, offset_to_first_pkt (at offset 8)
_PKT = struct.Struct("@IIIIIIHH")  # next_offset, sec, nsec, snaplen, len, status, mac, net
Segment = tuple[float, int, bytes, int, bytes, int, int, int, int, bytes]


_handed: dict[int, int] = {}


def _handed_socket(port: int) -> socket.socket | None:
    """A copy of the socket an ``opener.py --exec`` left open for ``port`` (``KVTOP_CAPTURE_FD``).
    Taken out of the environment and made non-inheritable at first use: kvtop's own children get
    neither; each ``PacketSocket`` gets its own descriptor of it, so closing one keeps it."""
    handed = os.environ.pop(HANDED_ENV, None)
    if handed is not None:
        p, _, f = handed.partition(":")
        if p.isdigit() and f.isdigit():
            try:
                os.set_inheritable(int(f), False)
                _handed[int(p)] = int(f)
            except OSError:
                pass
    fd = _handed.get(port)
    if fd is None:
        return None
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    if sock.family != socket.AF_PACKET:
        sock.close()
        return None
    return sock


def _from_opener(port: int, ring: bool) -> socket.socket:
    """The packet socket opened by ``kvtop-capture-python`` running ``opener.py`` and passed back
    over a Unix socket pair (``SCM_RIGHTS``): this process never holds the capability."""
    how = CaptureUnavailable(HOW_TO_GRANT.format(python=sys.executable))
    exe = shutil.which(CAPTURE_PYTHON)
    if exe is None:
        raise how
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours:
        try:
            with theirs:
                # -I: the privileged interpreter ignores PYTHON* variables, the user's site and the
                # script's folder; it runs one standard-library file
                subprocess.run([exe, "-I", os.path.join(os.path.dirname(__file__), "opener.py"), str(port),
                                str(theirs.fileno()), *(["ring"] if ring else [])], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=OPENER_TIMEOUT_S,
                               check=False)
            ours.setblocking(False)
            msg, fds, _flags, _addr = socket.recv_fds(ours, 512, 1)
        except (OSError, subprocess.SubprocessError):  # not runnable here (no NET_RAW to bound it), hung, no reply
            raise how from None
    if not fds:
        raise how
    sock = socket.socket(fileno=fds[0])
    for extra in fds[1:]:
        os.close(extra)
    if msg != b"ok" or sock.family != socket.AF_PACKET:
        sock.close()
        raise how
    return sock


class PacketSocket:
    """A non-blocking capture socket for one TCP port on every interface."""

    def __init__(self, port: int, rcvbuf: int = RCVBUF, ring: bool = True):
        af = getattr(socket, "AF_PACKET", None)
        if af is None or not sys.platform.startswith("linux"):
            raise CaptureUnavailable("passive capture needs Linux (AF_PACKET); use --proxy-listen or --probe instead")
        try:
            handed = _handed_socket(port)
            if handed is not None:
                sock, self.opened_by = handed, "opener --exec"
            else:
                sock, self.opened_by = open_filtered(port, ring=ring), "self"
        except PermissionError:
            if _handed:  # started by opener --exec, for another port: say so rather than how to grant
                opened = ", ".join(str(p) for p in sorted(_handed))
                raise CaptureUnavailable(f"the capture opener (--exec) opened port {opened}, not {port}: give "
                                         "--exec and --capture the same port") from None
            sock = _from_opener(port, ring)
            self.opened_by = CAPTURE_PYTHON
        except OSError as e:
            raise CaptureUnavailable(f"cannot open a packet socket: {e.strerror or e}") from None
        self.sock = sock
        self.port = port
        self.kernel_drops = 0
        self._anc = socket.CMSG_SPACE(_TS.size)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            # a handed-over socket may hold traffic queued while kvtop started: never shrink its queue
            if self.opened_by == "self" or rcvbuf >= RCVBUF:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
                except OSError:  # CAP_NET_ADMIN only: the ring below holds the bursts anyway
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            self._ring: mmap.mmap | None = None
            self._block = 0
            # a socket opened by someone else holds what arrived since (an exec'd kvtop starts in
            # seconds), and setting up the ring purges that queue: it is read out first
            self._queued: list[tuple[float, bytes]] = []
            if ring and self.opened_by != "self":
                while batch := self.read(512):
                    self._queued.extend(batch)
            if ring:
                self._open_ring()
            # the socket receives only once its filter holds (``open_filtered``): its counts since then,
            # whoever opened it, are this capture's losses, which the first check reads
        except BaseException:
            sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def _open_ring(self) -> None:
        """A TPACKET_V3 ring: the kernel writes packets into shared memory in blocks, so a drain costs
        no system call per packet. Without it (old kernels, locked memory limits) ``recvmsg`` serves."""
        try:
            try:
                make_ring(self.sock)
            except OSError as e:
                # EBUSY: whoever opened the socket made the ring already (same geometry): map it
                if e.errno != errno.EBUSY:
                    raise
            self._ring = mmap.mmap(self.sock.fileno(), RING_BLOCK * RING_BLOCKS, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            self._ring = None

    @property
    def uses_ring(self) -> bool:
        return self._ring is not None

    @property
    def has_queued(self) -> bool:
        """Frames read out of the socket's queue before the ring was set up, not yet decoded."""
        return bool(self._queued)

    def read(self, limit: int = 512) -> list[tuple[float, bytes]]:
        """Up to ``limit`` packets from the socket's queue as (kernel wall-clock time, bytes from the
        IP header): the way in without a ring (a ring is read by ``read_segments``)."""
        out = []
        recvmsg = self.sock.recvmsg
        anc = self._anc
        unpack = _TS.unpack
        for _ in range(limit):
            try:
                data, ancdata, _flags, _addr = recvmsg(SNAPLEN, anc)
            except BlockingIOError:
                break
            ts = 0.0
            for _lvl, typ, cdata in ancdata:
                if typ == SO_TIMESTAMPNS and len(cdata) >= 16:
                    sec, nsec = unpack(cdata[:16])
                    ts = sec + nsec * 1e-9
            out.append((ts, data))
        return out

    def read_segments(self) -> list[Segment]:
        """Queued TCP segments, decoded: (time, IP packet bytes, src, sport, dst, dport, seq, ack,
        flags, payload). From the ring, an IPv4 packet's headers are read in place and only its
        payload is copied out (the capture's commonest packet, one copy instead of two)."""
        ring = self._ring
        if ring is not None and not self._queued:
            return self._read_ring_segments()
        frames = self.read(512) if ring is None else self._queued
        self._queued = []
        out: list[Segment] = []
        for ts, data in frames:
            d = decode(data)
            if d is not None:
                out.append((ts, len(data), *d))
        if ring is not None:
            out += self._read_ring_segments()
        return out

    def ring_blocks(self) -> Iterator[tuple[mmap.mmap, int, int]]:
        """Each block the kernel has handed over, oldest first: (the ring, the offset of its first
        packet, its packet count). A block goes back to the kernel when the next one is asked for
        (or the walk ends or is abandoned), so its packets are read in place."""
        ring = self._ring
        if ring is None:
            return
        block_unpack = _BLOCK.unpack_from
        for _ in range(RING_BLOCKS):
            base = self._block * RING_BLOCK
            status, n, off = block_unpack(ring, base + 8)
            if not status & TP_STATUS_USER:
                break
            try:
                yield ring, base + off, n
            finally:
                # handed back to the kernel even when reading it failed: never read twice
                ring[base + 8:base + 12] = b"\0\0\0\0"
                self._block = (self._block + 1) % RING_BLOCKS

    def _read_ring_segments(self) -> list[Segment]:
        out: list[Segment] = []
        append = out.append
        pkt_unpack = _PKT.unpack_from
        v4_unpack = _V4.unpack_from
        for ring, p, n in self.ring_blocks():
            for _ in range(n):
                nxt, sec, nsec, snap, _len, _st, _mac, net = pkt_unpack(ring, p)
                a = p + net
                if snap >= 40 and ring[a] == 0x45:
                    _, total, proto, src, dst, sport, dport, seq, ack, hf = v4_unpack(ring, a)
                    if proto == 6:
                        end = total if 0 < total <= snap else snap
                        append((sec + nsec * 1e-9, snap, src, sport, dst, dport, seq, ack, hf & 0x3F,
                                ring[a + 20 + (hf >> 12) * 4:a + end]))
                else:
                    d = decode(ring[a:a + snap])
                    if d is not None:
                        append((sec + nsec * 1e-9, snap, *d))
                p += nxt
        return out

    def stats(self) -> tuple[int, int]:
        """(packets, drops) since the last call (the kernel resets its counters when read)."""
        raw = self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 12)  # tpacket_stats(_v3)
        packets, drops = _STATS.unpack_from(raw)
        self.kernel_drops += drops
        return packets, drops

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        self.sock.close()
