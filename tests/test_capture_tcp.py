"""Passive capture's TCP/HTTP state machine on crafted packet sequences: what a user reads in the
trace (one timeline per request, token counts, times, cancels, incompleteness) survives
retransmits, reordering, split framing, keep-alive, resets, large bodies and lost packets."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kvtop.model.records import RequestRecord, to_dict
from kvtop.sources.capture.packets import decode, filter_code
from kvtop.sources.capture.tcp import ACK, FIN, RST, SYN, Reassembler

PORT = 8000
CLIENT = bytes([10, 0, 0, 2])
SERVER = bytes([10, 0, 0, 1])
SECRET = "the quick secret prompt"


def ip_tcp(src: bytes, sport: int, dst: bytes, dport: int, seq: int, ack: int, flags: int, payload: bytes) -> bytes:
    tcp = struct.pack("!HHIIHHHH", sport, dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF, (5 << 12) | flags, 65535, 0, 0)
    total = 20 + len(tcp) + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, total, 1, 0x4000, 64, 6, 0, src, dst)
    return ip + tcp + payload


class Wire:
    """One client connection to the server port; packets go through ``decode`` like captured ones."""

    def __init__(self, r: Reassembler, sport: int = 40000, handshake: bool = True):
        self.r = r
        self.sport = sport
        self.cseq = 1000
        self.sseq = 5000
        if handshake:
            self.pkt(True, SYN, b"", t=0.0, seq=self.cseq - 1)
            self.pkt(False, SYN | ACK, b"", t=0.0, seq=self.sseq - 1)

    def pkt(self, from_client: bool, flags: int, payload: bytes, t: float, seq: int | None = None,
            ack: int | None = None) -> None:
        if from_client:
            s = self.cseq if seq is None else seq
            a = self.sseq if ack is None else ack
            raw = ip_tcp(CLIENT, self.sport, SERVER, PORT, s, a, flags, payload)
        else:
            s = self.sseq if seq is None else seq
            a = self.cseq if ack is None else ack
            raw = ip_tcp(SERVER, PORT, CLIENT, self.sport, s, a, flags, payload)
        d = decode(raw)
        assert d is not None
        self.r.segment(t, *d)

    def send(self, payload: bytes, t: float, flags: int = ACK | 0x08) -> int:
        """Client bytes, in order; returns their first sequence number."""
        seq = self.cseq
        self.pkt(True, flags, payload, t)
        self.cseq += len(payload)
        return seq

    def reply(self, payload: bytes, t: float, deliver: bool = True) -> int:
        """Server bytes; ``deliver=False`` skips the packet (the capture lost it) but advances seq."""
        seq = self.sseq
        if deliver:
            self.pkt(False, ACK | 0x08, payload, t)
        self.sseq += len(payload)
        return seq

    def client_ack(self, t: float) -> None:
        self.pkt(True, ACK, b"", t)


def request(rid: str | None = "req-1", path: str = "/v1/completions", body: dict | None = None) -> bytes:
    b = json.dumps(body if body is not None else {"model": "m", "prompt": SECRET, "stream": True}).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(b)}\r\n"
    if rid:
        head += f"X-Request-Id: {rid}\r\n"
    return head.encode() + b"\r\n" + b


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def event(text: str = "tok") -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]}).encode() + b"\n\n"


def usage_event(n: int) -> bytes:
    return (b"data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                                    "usage": {"prompt_tokens": 7, "completion_tokens": n}}).encode() + b"\n\n")


DONE = b"data: [DONE]\n\n"
LAST = b"0\r\n\r\n"


def capture() -> tuple[Reassembler, list[RequestRecord]]:
    out: list[RequestRecord] = []
    return Reassembler(PORT, out.append), out


def events(out: list[RequestRecord], rid: str = "req-1") -> list[tuple[str, float, int | None]]:
    return [(r.event, r.t, r.n) for r in out if r.id == rid]


def test_one_stream_becomes_the_proxy_record_sequence_with_packet_times():
    r, out = capture()
    w = Wire(r)
    w.send(request(body={"model": "m", "prompt": [1, 2, 3, 4], "stream": True}), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.5)
    w.reply(chunk(event()), 1.52)
    w.reply(chunk(event()) + chunk(usage_event(3)), 1.54)
    w.reply(chunk(DONE) + LAST, 1.56)
    assert events(out) == [("arrive", 1.0, None), ("first_token", 1.5, 1), ("token", 1.52, 1), ("token", 1.54, 1),
                           ("finish", 1.56, None)]
    arrive, fin = out[0], out[-1]
    assert arrive.source == "capture" and arrive.prompt_tokens == 4
    assert fin.completion_tokens == 3 and fin.finish_reason == "length" and fin.incomplete is None
    assert r.stats.requests == 1 and r.stats.holes == 0


def test_no_text_headers_or_bodies_in_records():
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD + chunk(event("SECRET-COMPLETION")) + chunk(DONE) + LAST, 1.1)
    dumped = json.dumps([to_dict(x) for x in out])
    assert SECRET not in dumped and "SECRET-COMPLETION" not in dumped and "Host" not in dumped
    assert [x.event for x in out] == ["arrive", "first_token", "finish"]


def test_retransmitted_and_overlapping_segments_count_once():
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    seq = w.reply(SSE_HEAD + chunk(event()), 1.1)
    w.pkt(False, ACK, SSE_HEAD + chunk(event()), 1.3, seq=seq)  # a full retransmission
    seq2 = w.reply(chunk(event()), 1.4)
    both = chunk(event()) + chunk(event())
    w.pkt(False, ACK, both, 1.5, seq=seq2)  # overlaps the last segment and carries one new chunk
    w.sseq = seq2 + len(both)
    w.reply(chunk(DONE) + LAST, 1.6)
    toks = [e for e in events(out) if e[0] in ("first_token", "token")]
    assert toks == [("first_token", 1.1, 1), ("token", 1.4, 1), ("token", 1.5, 1)]
    assert r.stats.retransmits == 2


def test_a_segment_seen_again_at_once_is_a_copy_not_a_retransmission():
    """A bridge and its veth both hand over each packet, microseconds apart: each token and each
    connection once, and the copies are not counted as retransmissions (the capture's health)."""
    r, out = capture()
    w = Wire(r)
    w.pkt(True, SYN, b"", t=0.0002, seq=w.cseq - 1)  # the SYN's copy
    w.send(request(), 1.0)
    w.pkt(True, ACK | 0x08, request(), 1.0003, seq=w.cseq - len(request()))
    seq = w.reply(SSE_HEAD + chunk(event()), 1.1)
    w.pkt(False, ACK | 0x08, SSE_HEAD + chunk(event()), 1.1002, seq=seq)
    seq = w.reply(chunk(event()), 1.2)
    w.pkt(False, ACK | 0x08, chunk(event()), 1.5, seq=seq)  # 300 ms later: a real retransmission
    w.reply(chunk(DONE) + LAST, 1.6)
    toks = [e for e in events(out) if e[0] in ("first_token", "token")]
    assert toks == [("first_token", 1.1, 1), ("token", 1.2, 1)]
    assert (r.stats.connections, r.stats.copies, r.stats.retransmits) == (1, 3, 1)


def test_reordered_segments_are_delivered_in_order_when_the_gap_fills():
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.1)
    a = chunk(event())
    b = chunk(event())
    sa = w.sseq
    w.pkt(False, ACK, b, 1.2, seq=sa + len(a))  # b first
    assert len(events(out)) == 2  # held: nothing emitted out of order
    w.pkt(False, ACK, a, 1.25, seq=sa)
    w.sseq = sa + len(a) + len(b)
    w.reply(chunk(DONE) + LAST, 1.3)
    toks = [e for e in events(out) if e[0] in ("first_token", "token")]
    # b became readable only when a arrived: both at 1.25, one record of 2 tokens
    assert toks == [("first_token", 1.1, 1), ("token", 1.25, 2)]
    assert r.stats.out_of_order == 1 and r.stats.holes == 0


def test_split_inside_a_chunk_size_line_and_inside_an_event():
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    ev = event("a" * 40)
    c = chunk(ev)
    assert c[:2] == b"%x" % len(ev)
    w.reply(SSE_HEAD + c[:1], 1.1)  # the first hex digit alone
    w.reply(c[1:10], 1.2)  # the rest of the size line and a piece of the event
    assert len(events(out)) == 1
    w.reply(c[10:] + chunk(event()), 1.3)
    w.reply(chunk(DONE)[:3], 1.4)
    w.reply(chunk(DONE)[3:] + LAST[:2], 1.5)
    w.reply(LAST[2:], 1.6)
    assert events(out)[1:] == [("first_token", 1.3, 2), ("finish", 1.5, None)]


def test_pipelined_keep_alive_requests_pair_with_their_responses():
    r, out = capture()
    w = Wire(r)
    w.send(request("a") + request("b", path="/v1/chat/completions") + b"GET /metrics HTTP/1.1\r\n\r\n", 1.0)
    body = json.dumps({"choices": [{"text": "x", "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 9}}).encode()
    w.reply(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body,
            1.2)
    w.reply(SSE_HEAD + chunk(event()) + chunk(event()), 1.3)
    w.reply(chunk(DONE) + LAST + b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", 1.4)
    w.send(request("c"), 2.0)
    w.reply(SSE_HEAD + chunk(event()) + chunk(DONE) + LAST, 2.1)
    assert [(x.id, x.event) for x in out] == [
        ("a", "arrive"), ("b", "arrive"), ("a", "finish"), ("b", "first_token"), ("b", "finish"),
        ("c", "arrive"), ("c", "first_token"), ("c", "finish")]
    fin_a = out[2]
    assert fin_a.completion_tokens == 9 and fin_a.finish_reason == "stop" and fin_a.t == 1.2
    assert out[3].n == 2
    assert r.stats.requests == 3


def test_client_reset_mid_stream_is_a_cancel_server_reset_an_error():
    r, out = capture()
    w = Wire(r)
    w.send(request("x"), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.1)
    w.pkt(True, RST | ACK, b"", 1.7)
    assert [(x.event, x.t) for x in out] == [("arrive", 1.0), ("first_token", 1.1), ("cancel", 1.7)]
    w2 = Wire(r, sport=40001)
    w2.send(request("y"), 2.0)
    w2.reply(SSE_HEAD + chunk(event()), 2.1)
    w2.pkt(False, RST | ACK, b"", 2.4)
    last = out[-1]
    assert (last.id, last.event, last.error, last.t) == ("y", "error", "upstream_disconnected", 2.4)
    assert not r.conns


def test_client_fin_before_done_is_a_cancel_and_after_done_nothing():
    r, out = capture()
    w = Wire(r)
    w.send(request("x"), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.1)
    w.pkt(True, FIN | ACK, b"", 1.9)
    assert out[-1].event == "cancel" and out[-1].t == 1.9
    w2 = Wire(r, sport=40002)
    w2.send(request("y"), 2.0)
    w2.reply(SSE_HEAD + chunk(event()) + chunk(DONE) + LAST, 2.1)
    w2.pkt(True, FIN | ACK, b"", 2.5)
    assert [x.event for x in out if x.id == "y"] == ["arrive", "first_token", "finish"]


def test_ten_megabyte_request_body_is_skipped_not_kept():
    r, out = capture()
    w = Wire(r)
    big = 10 << 20
    head = (b"POST /v1/completions HTTP/1.1\r\ncontent-length: %d\r\nx-request-id: big\r\n\r\n" % big)
    w.send(head, 1.0)
    piece = b"1," * 30000  # 60 KB segments
    sent = 0
    while sent < big:
        part = piece[: min(len(piece), big - sent)]
        w.send(part, 1.0 + sent / big)
        sent += len(part)
    conn = next(iter(r.conns.values()))
    assert len(conn.http._c_head) == 0
    w.send(request("after"), 2.5)
    w.reply(SSE_HEAD + chunk(event()) + chunk(DONE) + LAST, 2.6)
    w.reply(SSE_HEAD + chunk(event()) + chunk(event()) + chunk(DONE) + LAST, 2.7)
    arrives = [x for x in out if x.event == "arrive"]
    assert [(a.id, a.prompt_tokens) for a in arrives] == [("big", None), ("after", None)]
    assert [(x.id, x.event, x.n) for x in out if x.event in ("first_token", "finish")] == [
        ("big", "first_token", 1), ("big", "finish", None), ("after", "first_token", 2), ("after", "finish", None)]


def test_ten_megabyte_streamed_response_keeps_counting():
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD, 1.0)
    ev = chunk(event("x" * 900))
    per_packet = ev * 60  # ~57 KiB per segment
    n = 0
    t = 1.0
    while n * len(ev) < (10 << 20):
        t += 0.001
        w.reply(per_packet, t)
        n += 60
    w.reply(chunk(DONE) + LAST, t + 0.01)
    toks = [x for x in out if x.event in ("first_token", "token")]
    assert sum(x.n or 0 for x in toks) == n and out[-1].event == "finish"
    conn_bytes = sum(len(c.http._s_head) for c in r.conns.values())
    assert conn_bytes == 0


def test_a_lost_packet_inside_a_chunk_is_a_hole_not_a_stall():
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.1)
    w.reply(chunk(event()), 1.12)
    big = chunk(event("y" * 3000))
    w.reply(big[:1000], 1.14)
    w.reply(big[1000:2000], 1.16, deliver=False)  # the kernel dropped it
    w.reply(big[2000:] + chunk(event()), 5.0)
    w.client_ack(5.0)  # the client has bytes the capture never saw
    w.reply(chunk(event()) + chunk(usage_event(6)), 5.02)
    w.reply(chunk(DONE) + LAST, 5.04)
    ev = [(e, t, n) for e, t, n in events(out) if e != "arrive"]
    # tokens after the hole are counted; the one in the lost bytes is missing; the first record
    # after the hole is a resync (its 3.8 s since the previous token is not an inter-token gap)
    assert ev[:3] == [("first_token", 1.1, 1), ("token", 1.12, 1), ("resync", 5.0, 1)]
    assert ev[3] == ("token", 5.02, 1)
    fin = out[-1]
    assert fin.event == "finish" and fin.incomplete is True and fin.completion_tokens == 6
    assert r.stats.holes == 1 and r.stats.hole_bytes == 1000


def test_captured_records_including_holes_validate_against_the_trace_schema(tmp_path):
    import jsonschema

    from kvtop.model.trace import TraceWriter, make_header

    schema = json.loads((Path(__file__).resolve().parents[1] / "kvtop" / "schemas" / "trace.schema.json").read_text())
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.1)
    w.reply(chunk(event()), 1.2, deliver=False)
    w.reply(chunk(event()), 1.3)
    w.client_ack(1.3)
    w.reply(chunk(DONE) + LAST, 1.4)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, make_header(clock_t0_unix=1.7e9)) as tw:
        for rec in out:
            tw.write(rec)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    v = jsonschema.Draft202012Validator(schema)
    for d in lines:
        assert not [e.message for e in v.iter_errors(d)], d
    assert {d.get("event") for d in lines[1:]} == {"arrive", "first_token", "resync", "finish"}


def test_a_lost_chunk_size_line_resynchronises_at_the_next_event():
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.1)
    w.reply(chunk(event()), 1.2, deliver=False)  # size line and event lost
    w.reply(chunk(event()), 1.3)
    w.client_ack(1.3)
    w.reply(chunk(event()) + chunk(DONE) + LAST, 1.4)
    ev = [(e, n) for e, t, n in events(out)]
    assert ev == [("arrive", None), ("first_token", 1), ("resync", 1), ("token", 1), ("finish", None)]
    assert out[-1].incomplete is True


def test_tls_and_http2_are_reported_not_parsed():
    r, out = capture()
    w = Wire(r)
    w.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, 1.0)
    w2 = Wire(r, sport=40010)
    w2.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x12\x04\x00\x00\x00\x00\x00", 1.0)
    w2.reply(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00", 1.1)
    assert out == []
    assert r.stats.tls_connections == 1 and r.stats.http2_connections == 1


def test_joining_a_connection_mid_stream_starts_at_the_next_request():
    r, out = capture()
    w = Wire(r, handshake=False)
    w.reply(chunk(event()) + chunk(event()), 1.0)  # a response we did not see start
    assert out == [] and r.stats.joined_mid_stream == 1
    w.send(request("next"), 2.0)
    w.reply(SSE_HEAD + chunk(event()) + chunk(DONE) + LAST, 2.1)
    assert [x.event for x in out] == ["arrive", "first_token", "finish"]


def test_non_recorded_paths_and_methods_emit_nothing():
    r, out = capture()
    w = Wire(r)
    w.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 1.0)
    w.reply(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", 1.1)
    w.send(request(path="/v1/embeddings"), 1.2)
    w.reply(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", 1.3)
    w.send(request("z"), 1.4)
    w.reply(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 45\r\n\r\n"
            b'{"error":{"type":"BadRequestError","msg":""}}', 1.5)
    assert [(x.id, x.event, x.status, x.error) for x in out] == [
        ("z", "arrive", None, None), ("z", "error", 400, "BadRequestError")]


def test_generated_id_when_the_client_sends_none():
    r, out = capture()
    w = Wire(r)
    w.send(request(rid=None), 1.0)
    w.reply(SSE_HEAD + chunk(event()) + chunk(DONE) + LAST, 1.1)
    ids = {x.id for x in out}
    assert len(ids) == 1 and len(ids.pop()) == 32


def test_ipv6_packets_decode_to_the_same_segments():
    payload = b"HTTP/1.1 200 OK\r\n"
    tcp = struct.pack("!HHIIHHHH", PORT, 40000, 77, 88, (5 << 12) | ACK, 65535, 0, 0)
    src, dst = bytes(15) + b"\x01", bytes(15) + b"\x02"
    ip6 = struct.pack("!IHBB16s16s", 6 << 28, len(tcp) + len(payload), 6, 64, src, dst)
    assert decode(ip6 + tcp + payload + b"\x00\x00") == (src, PORT, dst, 40000, 77, 88, ACK, payload)
    assert decode(ip6[:6] + b"\x11" + ip6[7:] + tcp) is None  # UDP: not ours
    # a BIG TCP super-packet (GRO) says payload length 0 (its length is in a jumbo option): the
    # packet's own length, as IPv4's 0 total length is read (its data was dropped and read as a hole)
    big = payload * 4000
    jumbo = struct.pack("!IHBB16s16s", 6 << 28, 0, 6, 64, src, dst)
    assert decode(jumbo + tcp + big) == (src, PORT, dst, 40000, 77, 88, ACK, big)


def test_filter_program_is_a_valid_classic_bpf_program():
    code = filter_code(8000, 1)
    n = len(code) // 8
    ins = [struct.unpack("HBBI", code[i * 8:i * 8 + 8]) for i in range(n)]
    # every jump lands inside the program and the last two instructions are accept / drop
    for i, (op, jt, jf, _k) in enumerate(ins):
        if op & 0x07 == 0x05:
            assert i + 1 + jt < n and i + 1 + jf < n
    assert ins[-2][0] == 0x06 and ins[-2][3] > 0 and ins[-1] == (0x06, 0, 0, 0)
    assert sum(1 for op, _a, _b, k in ins if op == 0x15 and k == 8000) == 4  # v4/v6 x src/dst


def test_a_stream_whose_end_was_lost_ends_incomplete_when_the_connection_goes_idle():
    from kvtop.sources.capture.tcp import IDLE_S

    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.1)
    w.reply(chunk(DONE) + LAST, 1.2, deliver=False)  # the end is lost and nothing follows
    Wire(r, sport=40100).send(request("other"), 1.0 + IDLE_S + 5)  # any later packet drives the sweep
    ends = [(x.event, x.error, x.incomplete) for x in out if x.id == "req-1" and x.event in ("finish", "error")]
    assert ends == [("error", "capture_lost", True)]
    assert r.stats.lost_connections == 1


def test_a_lost_request_body_that_ends_the_request_keeps_the_connection_read():
    # the body sent in its own segment, which the capture lost: the hole is exactly the rest of the
    # body, the framing holds; it was taken for a hole past the body: nothing on this connection
    # was recorded again
    r, out = capture()
    w = Wire(r)
    raw = request()
    head, body = raw.split(b"\r\n\r\n", 1)
    w.send(head + b"\r\n\r\n", 1.0)
    w.cseq += len(body)  # lost
    w.reply(SSE_HEAD + chunk(event()) + chunk(DONE) + LAST, 1.2)  # acknowledges the body
    w.send(request(rid="req-2"), 2.0)
    w.reply(SSE_HEAD + chunk(event()) + chunk(event()) + chunk(DONE) + LAST, 2.1)
    assert [e for e, _t, _n in events(out)] == ["arrive", "first_token", "finish"]
    arrive = next(x for x in out if x.id == "req-1" and x.event == "arrive")
    assert arrive.prompt_tokens is None  # only its prompt length was lost
    assert [(e, n) for e, _t, n in events(out, "req-2")][:2] == [("arrive", None), ("first_token", 2)]


def test_a_lost_end_of_a_json_response_ends_it_and_the_connection_reads_on():
    r, out = capture()
    w = Wire(r)
    w.send(request(body={"model": "m", "prompt": SECRET, "stream": False}), 1.0)
    body = json.dumps({"choices": [{"text": "x"}], "usage": {"completion_tokens": 3}}).encode()
    w.reply(f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body[:10], 1.1)
    w.reply(body[10:], 1.2, deliver=False)  # the rest of the body, lost
    w.send(request(rid="req-2"), 2.0)  # the client acknowledges it and asks again
    w.reply(SSE_HEAD + chunk(event()) + chunk(DONE) + LAST, 2.1)
    first = [x for x in out if x.id == "req-1"]
    assert first[-1].event == "finish" and first[-1].incomplete is True, first  # was an error, capture_lost
    assert [e for e, _t, _n in events(out, "req-2")] == ["arrive", "first_token", "finish"]  # was unrecorded


@pytest.mark.parametrize("lost", ["tail", "last_chunk"])
def test_a_lost_end_of_a_chunked_response_never_gives_the_next_ones_to_it(lost):
    # three streams on one keep-alive connection; the end of the first is lost. The resync found a
    # chunk boundary in the second response's body: the first got the second's tokens, the second
    # the third's, and the third was recorded as a cancel
    r, out = capture()
    w = Wire(r)
    w.send(request(rid="s1"), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.1)
    w.reply(chunk(event()), 1.2)
    end = chunk(DONE) + LAST
    if lost == "tail":
        w.reply(end, 1.3, deliver=False)
    else:  # only the last chunk after [DONE]
        w.reply(chunk(DONE), 1.3)
        w.reply(LAST, 1.31, deliver=False)
    for k, rid in enumerate(("s2", "s3"), start=2):
        w.send(request(rid=rid), float(k))  # acknowledges what the capture lost
        w.reply(SSE_HEAD + chunk(event()), k + 0.02)
        w.reply(chunk(event()), k + 0.04)
        w.reply(chunk(event()), k + 0.06)
        w.reply(chunk(DONE) + LAST, k + 0.08)
    w.client_ack(4.0)
    first = [x for x in out if x.id == "s1"]
    assert [x.event for x in first] == ["arrive", "first_token", "token", "finish"], first
    # its [DONE] lost with the tail: it ends incomplete; only the last chunk lost: its stream had ended
    assert first[-1].incomplete is (True if lost == "tail" else None)
    for k, rid in enumerate(("s2", "s3"), start=2):
        ev = events(out, rid)
        assert [e for e, _t, _n in ev] == ["arrive", "first_token", "token", "token", "finish"], (rid, ev)
        assert ev[1][1] == pytest.approx(k + 0.02)  # its own first token, not the next response's


def test_a_stream_the_server_closed_after_lost_bytes_is_no_client_cancel():
    # a Connection: close SSE response without a length: its last event and [DONE] lost, then the
    # server's FIN. The hole was declared one byte past the FIN, so that side never closed: the
    # client's FIN then recorded the stream the server had ended as the client's cancel
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + event(), 1.1)
    lost = event() + DONE
    w.reply(lost, 1.2, deliver=False)
    w.pkt(False, ACK | FIN, b"", 1.3)  # the server closes
    w.pkt(True, ACK | FIN, b"", 1.31, ack=(w.sseq + 1) & 0xFFFFFFFF)  # the client acknowledges the FIN
    end = [x for x in out if x.id == "req-1"][-1]
    assert end.event == "finish" and end.incomplete is True, end  # was "cancel"
    assert r.stats.hole_bytes == len(lost)  # was one more: the FIN's sequence number


def test_a_media_type_in_other_letters_is_still_a_stream():
    # media types are case-insensitive (RFC 9110 §8.3.1): "Text/Event-Stream" was read as a JSON body,
    # the stream recorded as a finish with no token
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD.replace(b"content-type: text/event-stream", b"Content-Type: Text/Event-Stream") + chunk(event()),
            1.1)
    w.reply(chunk(event()), 1.2)
    w.reply(chunk(DONE) + LAST, 1.3)
    assert [e for e, _t, _n in events(out)] == ["arrive", "first_token", "token", "finish"]


def test_a_compressed_stream_ends_incomplete_with_no_token_and_is_said():
    # a proxy in front of the engine that gzips event streams: the bytes are no SSE, and the stream
    # was recorded as a finish with no token, as if the engine had answered nothing
    import gzip
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    body = gzip.compress(event() * 5 + DONE)
    w.reply(SSE_HEAD.replace(b"content-type: text/event-stream", b"content-type: text/event-stream\r\n"
                                                                  b"Content-Encoding: gzip") + chunk(body), 1.1)
    w.reply(LAST, 1.3)
    assert [e for e, _t, _n in events(out)] == ["arrive", "finish"]
    assert out[-1].incomplete is True and out[-1].completion_tokens is None
    assert r.stats.encoded_responses == 1
    # an identity encoding is read as any stream
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD.replace(b"content-type: text/event-stream", b"content-type: text/event-stream\r\n"
                                                                  b"Content-Encoding: identity") + chunk(event()), 1.1)
    w.reply(chunk(DONE) + LAST, 1.3)
    assert [e for e, _t, _n in events(out)] == ["arrive", "first_token", "finish"]
    assert r.stats.encoded_responses == 0


def test_a_stream_whose_first_token_was_lost_has_no_first_token_time(tmp_path):
    # the first event's bytes were lost: the next token seen is no first token (the TTFT taken from
    # it was 2.9 s where the engine answered in 0.1 s), and compare counts no TTFT for it
    from kvtop.analysis.compare import run_figures
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD, 1.05)
    w.reply(chunk(event()), 1.1, deliver=False)  # the kernel dropped it
    w.reply(chunk(event()), 3.9)
    w.client_ack(3.9)
    w.reply(chunk(event()), 3.92)
    w.reply(chunk(DONE) + LAST, 3.95)
    ev = [(e, t, n) for e, t, n in events(out) if e != "arrive"]
    assert ev[:2] == [("resync", 3.9, 1), ("token", 3.92, 1)]
    assert out[-1].event == "finish" and out[-1].incomplete is True
    from kvtop.model.trace import TraceWriter, make_header
    p = tmp_path / "t.jsonl"
    with TraceWriter(p, make_header()) as tw:
        for rec in out:
            tw.write(rec)
    fig = run_figures(str(p), 0.5, 0.1)
    assert fig.completed == 1 and fig.ttft_p99_s is None and fig.goodput == 0 and fig.output_tokens == 2
