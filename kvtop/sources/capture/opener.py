"""The capture's privileged half: open the packet socket, hand it over, exit.

    kvtop-capture-python -I .../kvtop/sources/capture/opener.py PORT FD [ring]
    kvtop-capture-python -I -m kvtop.sources.capture.opener --exec PORT -- kvtop agent ...

kvtop runs this file (not the module: ``-I`` and a path import nothing of kvtop and honour no
``PYTHON*`` variable) with the one interpreter that holds ``CAP_NET_RAW`` when kvtop itself cannot
open an ``AF_PACKET`` socket. It creates the socket, attaches the port's BPF filter and locks it
(``SO_LOCK_FILTER``: the unprivileged holder of the descriptor cannot widen it to the rest of the
host's traffic), with ``ring`` also gives it its receive ring, only then starts it receiving, sends
the descriptor back over the Unix socket ``FD`` (``SCM_RIGHTS``) and exits. The HTTP parser then
reads untrusted bytes in a process without the capability. Standard library only (an import-linter contract keeps it so).

Replies on ``FD``: ``ok`` with the descriptor, or ``error <reason>`` without one; exit 0 or 1.

``--exec`` (containers and systemd units, whose ``no_new_privs`` keeps a child of an unprivileged
kvtop from gaining the capability): open the socket, drop every capability, and execute the
command (kvtop) with the socket inherited; kvtop finds it through ``KVTOP_CAPTURE_FD``.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys

ETH_P_ALL = 0x0003
SO_ATTACH_FILTER = 26
SO_LOCK_FILTER = 44
SO_TIMESTAMPNS = 35
PACKET_OUTGOING = 4
SKF_AD_OFF = -0x1000
SKF_AD_PROTOCOL, SKF_AD_PKTTYPE, SKF_AD_IFINDEX = 0, 4, 8
SNAPLEN = 262144


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


def open_filtered(port: int, ring: bool = False) -> socket.socket:
    """A packet socket on every interface that sees only ``port``'s TCP (filter attached and locked)
    and, with ``ring``, holds its receive ring where the kernel grants one. ``PermissionError``
    without ``CAP_NET_RAW``.

    It is created listening to no protocol and starts receiving only when everything is in place:
    a socket opened on ``ETH_P_ALL`` queues the host's unfiltered traffic until the filter holds,
    and setting up a ring afterwards purges its queue, which lost the first 10-180 ms of the port's
    traffic (a request's headers: its stream then counted as joined mid-way)."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, 0)
    try:
        try:
            lo = socket.if_nametoindex("lo")
        except OSError:
            lo = 0
        prog = filter_code(port, lo)
        buf = ctypes.create_string_buffer(prog)
        fprog = struct.pack("HL", len(prog) // 8, ctypes.addressof(buf))
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_LOCK_FILTER, 1)
        except OSError:
            pass  # kernels before 3.9: the filter holds, only unlocked
        # from now on every packet carries its receive time, also those queued before kvtop reads
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        # the queue that holds the port's traffic until kvtop reads it (up to the host's rmem_max)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        sock.setblocking(False)
        if ring:
            try:
                make_ring(sock)
            except OSError:
                pass  # the queue serves instead
        _receive_everywhere(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def _receive_everywhere(sock: socket.socket) -> None:
    """Bind ``sock`` to every interface's traffic (``ETH_P_ALL``, interface index 0): Python's
    ``bind`` for ``AF_PACKET`` needs one interface's name."""
    addr = struct.pack("=HHiHBB8s", socket.AF_PACKET, socket.htons(ETH_P_ALL), 0, 0, 0, 0, b"")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.bind(sock.fileno(), ctypes.c_char_p(addr), len(addr)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


SOL_PACKET, PACKET_RX_RING, PACKET_VERSION, TPACKET_V3 = 263, 5, 10, 2
RING_BLOCK = 256 << 10
RING_BLOCKS = 256  # 64 MiB: seconds of a busy engine's traffic if the reader is starved of CPU
# A partly filled block is handed over after this long. Each handed-over block takes a whole slot
# of the ring however few packets it holds, so a short timeout fills the ring with near-empty
# blocks when the reader falls behind (10 ms dropped packets at 15K chunks/s on a busy 2-core box).
RING_RETIRE_MS = 50


def make_ring(sock: socket.socket) -> None:
    """Give ``sock`` a TPACKET_V3 receive ring of ``RING_BLOCKS`` x ``RING_BLOCK`` (``OSError`` where
    the kernel refuses); it is mapped with ``mmap`` by whoever reads it."""
    sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3)
    req = struct.pack("@7I", RING_BLOCK, RING_BLOCKS, 2048, RING_BLOCK * RING_BLOCKS // 2048, RING_RETIRE_MS, 0, 0)
    sock.setsockopt(SOL_PACKET, PACKET_RX_RING, req)


HANDED_ENV = "KVTOP_CAPTURE_FD"  # "PORT:FD" of the socket an --exec opener left open for the command
_CAP_VERSION_3 = 0x20080522
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


def drop_capabilities() -> None:
    """Clear every capability of this (single-threaded) process: effective, permitted, inheritable
    and ambient, so the command it executes next starts with none. ``OSError`` if any is left."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = ctypes.create_string_buffer(struct.pack("Ii", _CAP_VERSION_3, 0), 8)
    data = ctypes.create_string_buffer(24)  # two struct __user_cap_data_struct, all zero
    if libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 and ctypes.get_errno() != 22:
        raise OSError(ctypes.get_errno(), "cannot clear the ambient capabilities")
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "cannot drop the capabilities")
    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, _, v in (ln.partition(":") for ln in f) if k.startswith("Cap")}
    if any(int(caps.get(k, "0"), 16) for k in ("CapEff", "CapPrm", "CapInh", "CapAmb")):
        raise OSError(1, f"capabilities left after dropping them: {caps}")


def exec_with_socket(port: int, command: list[str]) -> int:
    """``--exec``: open the socket, drop every capability, then become ``command`` (kvtop) with the
    socket inherited and named in ``KVTOP_CAPTURE_FD``. For a container or unit that starts with
    ``CAP_NET_RAW`` (a file capability, or systemd's ambient set) and where the child a plain
    kvtop would spawn could not gain it (``no_new_privs``)."""
    try:
        # the ring now, not when kvtop has started: it holds seconds of traffic where the socket's
        # queue (rmem_max without CAP_NET_ADMIN) holds a few hundred packets
        sock = open_filtered(port, ring=True)
        fd = sock.detach()
        os.set_inheritable(fd, True)
        drop_capabilities()
    except OSError as e:
        print(f"kvtop capture opener: cannot open the packet socket for port {port}: {e.strerror or e} "
              "(needs CAP_NET_RAW: a file capability on this interpreter, or the unit's AmbientCapabilities)",
              file=sys.stderr)
        return 1
    if os.geteuid() == 0:
        # root regains every capability at exec: the separation needs a non-root user
        print("kvtop capture opener: running as root, so the command runs with root's capabilities",
              file=sys.stderr)
    os.environ[HANDED_ENV] = f"{port}:{fd}"
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"kvtop capture opener: cannot run {command[0]}: {e.strerror or e}", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "--exec":
        rest = argv[2:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        if not argv[1].isdigit() or not 0 < int(argv[1]) < 65536 or not rest:
            print("usage: opener.py --exec PORT [--] COMMAND [ARG...]  (PORT 1-65535)", file=sys.stderr)
            return 2
        return exec_with_socket(int(argv[1]), rest)
    ring = argv[2:] == ["ring"]
    if ring:
        argv = argv[:2]
    if len(argv) != 2 or not all(a.isdigit() for a in argv):
        print("usage: opener.py PORT FD [ring] | opener.py --exec PORT [--] COMMAND [ARG...]", file=sys.stderr)
        return 2
    port, fd = int(argv[0]), int(argv[1])
    if not 0 < port < 65536:
        print(f"port must be 1-65535, not {port}", file=sys.stderr)
        return 2
    chan = socket.socket(fileno=fd)
    try:
        try:
            sock = open_filtered(port, ring=ring)
        except OSError as e:
            chan.sendall(f"error {e.strerror or e}".encode())
            return 1
        socket.send_fds(chan, [b"ok"], [sock.fileno()])
        sock.close()
        return 0
    finally:
        chan.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
