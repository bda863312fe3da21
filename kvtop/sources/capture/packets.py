"""The packet socket: an ``AF_PACKET`` socket with an in-kernel BPF filter for one TCP port.

Why a raw packet socket and not a library: the only capture libraries for Python (scapy, pypcap,
pcapy) either parse every packet into heavyweight objects (scapy: tens of microseconds per packet)
or need libpcap headers and a C build; what capture needs is a socket, a 20-instruction filter
and header offsets, all of which the standard library reaches on Linux.

The socket is ``SOCK_DGRAM`` (link headers stripped: loopback, Ethernet and tunnels all start at
the IP header), bound to no interface (every interface, loopback included). The filter keeps TCP
over IPv4/IPv6 to or from the port and drops loopback's outgoing copy of each packet (loopback
shows every packet twice). Timestamps are the kernel's receive times (``SO_TIMESTAMPNS``).
"""

from __future__ import annotations

import ctypes
import mmap
import socket
import struct
import sys

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_STATISTICS = 6
SO_ATTACH_FILTER = 26
SO_TIMESTAMPNS = 35
SO_RCVBUFFORCE = 33
PACKET_OUTGOING = 4
SKF_AD_OFF = -0x1000
SKF_AD_PROTOCOL, SKF_AD_PKTTYPE, SKF_AD_IFINDEX = 0, 4, 8
RCVBUF = 64 << 20
SNAPLEN = 262144
PACKET_RX_RING, PACKET_VERSION, TPACKET_V3 = 5, 10, 2
TP_STATUS_USER = 1
RING_BLOCK = 256 << 10
RING_BLOCKS = 256  # 64 MiB: seconds of a busy engine's traffic if the reader is starved of CPU
# A partly filled block is handed over after this long. Each handed-over block takes a whole slot
# of the ring however few packets it holds, so a short timeout fills the ring with near-empty
# blocks when the reader falls behind (10 ms dropped packets at 15K chunks/s on a busy 2-core box).
RING_RETIRE_MS = 50

HOW_TO_GRANT = (
    "passive capture needs CAP_NET_RAW: run as root, or give it to a copy of the interpreter that only "
    "kvtop runs (`sudo cp $(readlink -f {python}) /usr/local/bin/kvtop-capture-python && sudo setcap "
    "cap_net_raw+ep /usr/local/bin/kvtop-capture-python`, then `kvtop-capture-python -m kvtop ...`), "
    "or use --proxy-listen / --probe instead"
)


class CaptureUnavailable(Exception):
    """Capture cannot run here; the message is one line that says what to do."""


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


# classic BPF opcodes
_LD_W_ABS, _LD_H_ABS, _LD_B_ABS = 0x20, 0x28, 0x30
_LD_H_IND, _LD_B_IND = 0x48, 0x50
_LDX_MSH, _LDX_MEM, _ST = 0xB1, 0x61, 0x02
_RSH_K, _AND_K, _ADD_X, _SUB_X, _TAX = 0x74, 0x54, 0x0C, 0x1C, 0x07
_JEQ, _JGT, _JSET = 0x15, 0x25, 0x45
_RET = 0x06
_SYN_FIN_RST = 0x07


def filter_code(port: int, lo_ifindex: int) -> bytes:
    """The classic BPF program (an array of ``struct sock_filter``): TCP to or from ``port`` over
    IPv4 (unfragmented) or IPv6 (no extension headers) that carries data or SYN/FIN/RST. Pure ACKs
    are dropped in the kernel (half the packets of a stream, nothing a record needs; a lost
    segment is then found by the segments after it). Loopback's outgoing copies are dropped too.
    Offsets are from the IP header (a SOCK_DGRAM socket)."""
    L = "label"
    code: list[tuple[object, ...]] = [
        (_LD_W_ABS, 0, 0, SKF_AD_OFF + SKF_AD_PKTTYPE),
        (_JEQ, 0, ("proto",), PACKET_OUTGOING),
        (_LD_W_ABS, 0, 0, SKF_AD_OFF + SKF_AD_IFINDEX),
        (_JEQ, ("drop",), 0, lo_ifindex),
        (L, "proto"),
        (_LD_W_ABS, 0, 0, SKF_AD_OFF + SKF_AD_PROTOCOL),
        (_JEQ, 0, ("v6",), 0x0800),
        # IPv4
        (_LD_B_ABS, 0, 0, 9),
        (_JEQ, 0, ("drop",), 6),
        (_LD_H_ABS, 0, 0, 6),
        (_JSET, ("drop",), 0, 0x1FFF),  # a later fragment
        (_LDX_MSH, 0, 0, 0),  # X = IPv4 header length
        (_LD_H_IND, 0, 0, 0),
        (_JEQ, ("v4port",), 0, port),
        (_LD_H_IND, 0, 0, 2),
        (_JEQ, 0, ("drop",), port),
        (L, "v4port"),
        (_LD_B_IND, 0, 0, 13),
        (_JSET, ("accept",), 0, _SYN_FIN_RST),
        (_LD_B_IND, 0, 0, 12),
        (_RSH_K, 0, 0, 2),
        (_AND_K, 0, 0, 0x3C),  # TCP header length
        (_ADD_X, 0, 0, 0),
        (_ST, 0, 0, 0),
        (_LD_H_ABS, 0, 0, 2),  # IPv4 total length
        (_LDX_MEM, 0, 0, 0),
        (_SUB_X, 0, 0, 0),  # payload bytes (a TSO packet's zero length wraps: kept)
        (_JGT, ("accept",), ("drop",), 0),
        # IPv6
        (L, "v6"),
        (_JEQ, 0, ("drop",), 0x86DD),
        (_LD_B_ABS, 0, 0, 6),
        (_JEQ, 0, ("drop",), 6),
        (_LD_H_ABS, 0, 0, 40),
        (_JEQ, ("v6port",), 0, port),
        (_LD_H_ABS, 0, 0, 42),
        (_JEQ, 0, ("drop",), port),
        (L, "v6port"),
        (_LD_B_ABS, 0, 0, 53),
        (_JSET, ("accept",), 0, _SYN_FIN_RST),
        (_LD_B_ABS, 0, 0, 52),
        (_RSH_K, 0, 0, 2),
        (_AND_K, 0, 0, 0x3C),
        (_TAX, 0, 0, 0),
        (_LD_H_ABS, 0, 0, 4),  # IPv6 payload length (TCP header included)
        (_SUB_X, 0, 0, 0),
        (_JGT, ("accept",), ("drop",), 0),
        (L, "accept"),
        (_RET, 0, 0, SNAPLEN),
        (L, "drop"),
        (_RET, 0, 0, 0),
    ]
    labels: dict[str, int] = {}
    flat: list[tuple[object, ...]] = []
    for ins in code:
        if ins[0] == L:
            labels[str(ins[1])] = len(flat)
        else:
            flat.append(ins)

    def jump(target: object, at: int) -> int:
        # classic BPF jumps count instructions after the current one; a 1-tuple names a label
        return labels[str(target[0])] - at - 1 if isinstance(target, tuple) else int(str(target))

    return b"".join(_ins(int(str(op)), jump(jt, i), jump(jf, i), int(str(k))) for i, (op, jt, jf, k) in enumerate(flat))


def decode(pkt: bytes) -> tuple[bytes, int, bytes, int, int, int, int, bytes] | None:
    """(src, sport, dst, dport, seq, ack, flags, payload) of a TCP packet from its IP header on."""
    if not pkt:
        return None
    v = pkt[0] >> 4
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
        end = min(len(pkt), 40 + ((pkt[4] << 8) | pkt[5])) or len(pkt)
        src, dst, off = pkt[8:24], pkt[24:40], 40
    else:
        return None
    sport, dport, seq, ack, hf = _TCP.unpack_from(pkt, off)
    doff = (hf >> 12) * 4
    return src, sport, dst, dport, seq, ack, hf & 0x3F, pkt[off + doff:end]


_TCP = struct.Struct("!HHIIH")
_TS = struct.Struct("@qq")
_STATS = struct.Struct("@II")
_BLOCK = struct.Struct("@III")  # block_status, num_pkts, offset_to_first_pkt (at offset 8)
_PKT = struct.Struct("@IIIIIIHH")  # next_offset, sec, nsec, snaplen, len, status, mac, net


class PacketSocket:
    """A non-blocking capture socket for one TCP port on every interface."""

    def __init__(self, port: int, rcvbuf: int = RCVBUF, ring: bool = True):
        af = getattr(socket, "AF_PACKET", None)
        if af is None or not sys.platform.startswith("linux"):
            raise CaptureUnavailable("passive capture needs Linux (AF_PACKET); use --proxy-listen or --probe instead")
        try:
            sock = socket.socket(af, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
        except PermissionError:
            raise CaptureUnavailable(HOW_TO_GRANT.format(python=sys.executable)) from None
        except OSError as e:
            raise CaptureUnavailable(f"cannot open a packet socket: {e.strerror or e}") from None
        self.sock = sock
        self.port = port
        self.kernel_drops = 0
        self._anc = socket.CMSG_SPACE(_TS.size)
        try:
            try:
                lo = socket.if_nametoindex("lo")
            except OSError:
                lo = 0
            prog = filter_code(port, lo)
            buf = ctypes.create_string_buffer(prog)
            fprog = struct.pack("HL", len(prog) // 8, ctypes.addressof(buf))
            sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            # Packets queued before the filter was attached are unfiltered: drop them.
            while True:
                try:
                    sock.recv(SNAPLEN)
                except BlockingIOError:
                    break
            self._ring: mmap.mmap | None = None
            self._block = 0
            if ring:
                self._open_ring()
            self.stats()
            self.kernel_drops = 0
        except BaseException:
            sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def _open_ring(self) -> None:
        """A TPACKET_V3 ring: the kernel writes packets into shared memory in blocks, so a drain costs
        no system call per packet. Without it (old kernels, locked memory limits) ``recvmsg`` serves."""
        try:
            self.sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3)
            req = struct.pack("@7I", RING_BLOCK, RING_BLOCKS, 2048, RING_BLOCK * RING_BLOCKS // 2048,
                              RING_RETIRE_MS, 0, 0)
            self.sock.setsockopt(SOL_PACKET, PACKET_RX_RING, req)
            self._ring = mmap.mmap(self.sock.fileno(), RING_BLOCK * RING_BLOCKS, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            self._ring = None

    @property
    def uses_ring(self) -> bool:
        return self._ring is not None

    def read(self, limit: int = 512) -> list[tuple[float, bytes]]:
        """Queued packets as (kernel wall-clock time, bytes from the IP header): every filled ring
        block, or up to ``limit`` from the socket queue."""
        ring = self._ring
        if ring is not None:
            return self._read_ring(ring)
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

    def _read_ring(self, ring: mmap.mmap) -> list[tuple[float, bytes]]:
        out = []
        block_unpack = _BLOCK.unpack_from
        pkt_unpack = _PKT.unpack_from
        for _ in range(RING_BLOCKS):
            base = self._block * RING_BLOCK
            status, n, off = block_unpack(ring, base + 8)
            if not status & TP_STATUS_USER:
                break
            p = base + off
            for _ in range(n):
                nxt, sec, nsec, snap, _len, _st, _mac, net = pkt_unpack(ring, p)
                out.append((sec + nsec * 1e-9, ring[p + net:p + net + snap]))
                p += nxt
            ring[base + 8:base + 12] = b"\0\0\0\0"  # hand the block back to the kernel
            self._block = (self._block + 1) % RING_BLOCKS
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
