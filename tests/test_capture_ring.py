"""The ring reader that decodes IPv4 headers in place gives the segments that reading each packet
out and decoding it gives, on the same loopback traffic (IPv4 and IPv6, data, SYN, FIN)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvtop.sources.capture.packets import PacketSocket, decode
from testkit.privileges import can_capture

pytestmark = pytest.mark.skipif(not can_capture(), reason="no packet capture here (needs root or CAP_NET_RAW)")


def _serve(family: int, host: str) -> tuple[socket.socket, int]:
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, 0))
    srv.listen(8)
    return srv, srv.getsockname()[1]


def _talk(family: int, host: str, srv: socket.socket, port: int) -> None:
    def echo() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + data[:300])

    t = threading.Thread(target=echo)
    t.start()
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.connect((host, port))
        for i in range(40):
            c.sendall(b"POST /v1/completions HTTP/1.1\r\n\r\n" + bytes([i]) * (i * 37))
            c.recv(65536)
    t.join(10)


def test_ring_segments_equal_packets_decoded_one_by_one() -> None:
    srv, port = _serve(socket.AF_INET, "127.0.0.1")
    try:
        srv6, port6 = _serve(socket.AF_INET6, "::1")
    except OSError:
        srv6 = None
    ring = PacketSocket(port)
    plain = PacketSocket(port, ring=False)
    assert ring.uses_ring and not plain.uses_ring
    try:
        _talk(socket.AF_INET, "127.0.0.1", srv, port)
        if srv6 is not None:
            # the filter is per port: the IPv6 server listens on another one, so capture that too
            ring6 = PacketSocket(port6)
            plain6 = PacketSocket(port6, ring=False)
            _talk(socket.AF_INET6, "::1", srv6, port6)
        time.sleep(0.3)  # past the ring's block timeout: every block handed over
        got = ring.read_segments()
        want = [(ts, len(d), *x) for ts, d in plain.read(100000) if (x := decode(d)) is not None]
        if srv6 is not None:
            got += ring6.read_segments()
            want += [(ts, len(d), *x) for ts, d in plain6.read(100000) if (x := decode(d)) is not None]
            ring6.close()
            plain6.close()
    finally:
        ring.close()
        plain.close()
        srv.close()
        if srv6 is not None:
            srv6.close()
    assert len(want) >= 80 and any(s[9] for s in want) and any(s[8] & 0x02 for s in want)  # data and SYNs
    assert [s[1:] for s in got] == [s[1:] for s in want]
    assert all(abs(a[0] - b[0]) < 0.01 for a, b in zip(got, want, strict=True))
    if srv6 is not None:
        assert any(len(s[2]) == 16 for s in got)  # IPv6 went through the generic decoder


def _receiving(sock: socket.socket) -> bool:
    """Whether the kernel delivers packets to ``sock`` (its row's R column in /proc/net/packet)."""
    inode = str(os.fstat(sock.fileno()).st_ino)
    rows = [ln.split() for ln in open("/proc/net/packet").read().splitlines()[1:]]
    return any(r[-1] == inode and r[5] == "1" for r in rows if len(r) >= 9)


def test_the_capture_receives_only_once_its_ring_holds_what_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting up the ring purges what the socket queued before it, and the kernel takes 10-180 ms
    to allocate the 64 MiB ring: a socket already receiving then lost a request's headers that an
    operator sent once the capture showed as open (the stream was counted as joined mid-way)."""
    from kvtop.sources.capture import opener

    seen: list[bool] = []
    make_ring = opener.make_ring

    def watched(sock: socket.socket) -> None:
        seen.append(_receiving(sock))
        make_ring(sock)

    monkeypatch.setattr(opener, "make_ring", watched)
    srv, port = _serve(socket.AF_INET, "127.0.0.1")
    cap = PacketSocket(port)
    try:
        assert seen == [False], "the socket received before its ring was in place"
        assert cap.uses_ring and _receiving(cap.sock)
        _talk(socket.AF_INET, "127.0.0.1", srv, port)
        time.sleep(0.3)  # past the ring's block timeout
        segs = cap.read_segments()
        # the whole exchange from its SYN: 40 requests and 40 answers with data
        assert segs[0][8] & 0x02 and sum(1 for s in segs if s[9]) == 80, [s[8] for s in segs[:4]]
    finally:
        cap.close()
        srv.close()
