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

HOW_TO_GRANT = (
    "passive capture needs CAP_NET_RAW: run as root, or grant it with "
    "`sudo setcap cap_net_raw+ep $(readlink -f {python})`, or use --proxy-listen / --probe instead"
)


class CaptureUnavailable(Exception):
    """Capture cannot run here; the message is one line that says what to do."""


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


# classic BPF opcodes
_LD_W_ABS, _LD_H_ABS, _LD_B_ABS = 0x20, 0x28, 0x30
_LDX_MSH = 0xB1
_LD_H_IND = 0x48
_JEQ, _JSET = 0x15, 0x45
_RET = 0x06


def filter_code(port: int, lo_ifindex: int) -> bytes:
    """The classic BPF program as the kernel reads it (an array of ``struct sock_filter``)."""
    L = "label"
    code: list[tuple[object, ...]] = [
        # 0-3: drop loopback's outgoing copy
        (_LD_W_ABS, 0, 0, SKF_AD_OFF + SKF_AD_PKTTYPE),
        (_JEQ, 0, 2, PACKET_OUTGOING),  # -> 2 : 4
        (_LD_W_ABS, 0, 0, SKF_AD_OFF + SKF_AD_IFINDEX),
        (_JEQ, ("drop",), 0, lo_ifindex),
        # 4-5: which IP version
        (_LD_W_ABS, 0, 0, SKF_AD_OFF + SKF_AD_PROTOCOL),
        (_JEQ, 0, ("v6",), 0x0800),
        # 6-14: IPv4
        (_LD_B_ABS, 0, 0, 9),
        (_JEQ, 0, ("drop",), 6),
        (_LD_H_ABS, 0, 0, 6),
        (_JSET, ("drop",), 0, 0x1FFF),
        (_LDX_MSH, 0, 0, 0),
        (_LD_H_IND, 0, 0, 0),
        (_JEQ, ("accept",), 0, port),
        (_LD_H_IND, 0, 0, 2),
        (_JEQ, ("accept",), ("drop",), port),
        # v6: 15-21
        (L, "v6"),
        (_JEQ, 0, ("drop",), 0x86DD),
        (_LD_B_ABS, 0, 0, 6),
        (_JEQ, 0, ("drop",), 6),
        (_LD_H_ABS, 0, 0, 40),
        (_JEQ, ("accept",), 0, port),
        (_LD_H_ABS, 0, 0, 42),
        (_JEQ, ("accept",), ("drop",), port),
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


class PacketSocket:
    """A non-blocking capture socket for one TCP port on every interface."""

    def __init__(self, port: int, rcvbuf: int = RCVBUF):
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
            self.stats()
            self.kernel_drops = 0
        except BaseException:
            sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self, limit: int = 512) -> list[tuple[float, bytes]]:
        """Up to ``limit`` queued packets as (kernel wall-clock time, bytes from the IP header)."""
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

    def stats(self) -> tuple[int, int]:
        """(packets, drops) since the last call (the kernel resets its counters when read)."""
        raw = self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, _STATS.size)
        packets, drops = _STATS.unpack(raw)
        self.kernel_drops += drops
        return packets, drops

    def close(self) -> None:
        self.sock.close()
