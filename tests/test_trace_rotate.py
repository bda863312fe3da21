"""The agent's rotating trace: size/age-bounded gzip segments that replay and analyze open."""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import time
import zlib

from conftest import REPO, logged, run_kvtop

from kvtop.feeds.replay import last_record_time
from kvtop.model.records import RequestRecord, to_dict
from kvtop.model.trace import TraceReader, make_header
from kvtop.model.trace_rotate import RotatingTrace, latest_run, segments
from kvtop.model.trace_rotate import log as rotate_log
from kvtop.sim.simulate import Simulation
from kvtop.sim.workload import load_preset


def _records(seconds: float = 20.0) -> list:
    recs: list = []
    Simulation(load_preset("preemption-storm"), 2, seconds, recs.append, scrape_interval_s=1.0).run()
    return [r for r in recs if r.kind != "truth"]


def _write(tmp_path, recs, **kw) -> RotatingTrace:  # noqa: ANN001
    rt = RotatingTrace(tmp_path, lambda: make_header(engine={"adapter": "vllm"}, recorder="kvtop agent"), **kw)
    for r in recs:
        rt.write(r)
    rt.close()
    return rt


def test_size_limit_rotates_into_gzip_segments_that_hold_every_record_once(tmp_path):
    recs = _records()
    rt = _write(tmp_path, recs, max_bytes=256 << 10, max_age_s=1e9)
    segs = segments(tmp_path)
    assert len(segs) >= 3 and rt.rotations == len(segs)
    assert not list(tmp_path.glob("*.jsonl"))  # nothing left uncompressed after close
    assert {p.stat().st_mode & 0o777 for p in segs} == {0o600}  # not readable by other users
    got: list[dict] = []
    for p in segs:
        with open(p, "rb") as f:
            assert f.read(2) == b"\x1f\x8b"
        assert len(gzip.decompress(p.read_bytes())) < (256 << 10) + (64 << 10) + 65536
        reader = TraceReader(p)
        assert reader.header["recorder"] == "kvtop agent"
        got.extend(reader.dicts())
        assert reader.skipped == 0
    want = [json.loads(json.dumps(to_dict(r))) for r in recs]
    assert len(got) == len(want)
    assert [(d["kind"], d["t"]) for d in got] == [(d["kind"], round(d["t"], 6)) for d in want]


def test_age_limit_rotates_even_when_small(tmp_path):
    now = [0.0]
    rt = RotatingTrace(tmp_path, lambda: make_header(), max_bytes=1 << 30, max_age_s=60.0, clock=lambda: now[0])
    for i in range(3):
        for j in range(300):
            rt.write(RequestRecord(t=i * 100 + j * 0.01, id=f"r{i}", event="token", n=1))
        now[0] += 61.0
        rt.flush_if_due()  # an idle agent closes its segment on time too
    rt.close()
    segs = segments(tmp_path)
    assert len(segs) == 3
    assert [sum(1 for _ in TraceReader(p).dicts()) for p in segs] == [300, 300, 300]


def test_retention_keeps_the_newest_segments_within_the_size_budget(tmp_path):
    recs = _records()
    rt = _write(tmp_path, recs, max_bytes=128 << 10, max_age_s=1e9, keep_bytes=30 << 10)
    segs = segments(tmp_path)
    sizes = [p.stat().st_size for p in segs]
    assert rt.rotations >= 6 and 1 <= len(segs) < rt.rotations  # the oldest went
    assert sum(sizes) <= (30 << 10) + max(sizes)
    # the newest segment survives and ends with the run's last record
    last = max(r.t for r in recs)
    assert abs(last_record_time(segs[-1]) - last) < 1e-6


def test_a_segment_left_uncompressed_by_a_crash_is_compressed_on_start(tmp_path):
    crashed = tmp_path / "kvtop-20260101T000000.000000Z.jsonl"
    crashed.write_text(json.dumps(make_header()) + "\n" + '{"kind":"request","t":1.0,"id":"a","event":"arrive"}\n'
                       + '{"kind":"request","t":1.5,"id":"a","ev')  # torn last line
    rt = RotatingTrace(tmp_path, make_header)
    rt.close()
    [seg] = segments(tmp_path)
    reader = TraceReader(seg)
    assert [d["id"] for d in reader.dicts()] == ["a"] and reader.skipped == 1


def test_replay_and_analyze_open_a_compressed_segment(tmp_path):
    recs = _records(15.0)
    _write(tmp_path, recs, max_bytes=1 << 30, max_age_s=1e9)
    [seg] = segments(tmp_path)
    r = run_kvtop("analyze", str(seg), "--format", "json", "--itl-target-ms", "100")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["basis"] == "requests" and rep["causes"]["preemption"]["count"] > 0
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(gzip.decompress(seg.read_bytes()))
    r2 = run_kvtop("analyze", str(plain), "--format", "json", "--itl-target-ms", "100")
    assert json.loads(r2.stdout)["causes"] == rep["causes"]  # compressed or not, the same analysis


def test_a_truncated_gzip_segment_is_read_up_to_the_cut(tmp_path):
    recs = _records(10.0)
    _write(tmp_path, recs, max_bytes=1 << 30, max_age_s=1e9)
    [seg] = segments(tmp_path)
    data = seg.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) * 2 // 3])
    reader = TraceReader(cut)
    n = sum(1 for _ in reader.dicts())
    assert 0 < n < len(recs) and reader.skipped >= 1
    assert os.path.getsize(cut) < len(data)
    # every line whole before the cut is read (gzip.open lost the whole last read, up to 1 MiB: a
    # 15 s trace cut at half its size read as no gaps at all)
    d = zlib.decompressobj(wbits=31)
    before_cut = d.decompress(cut.read_bytes())
    whole = before_cut.count(b"\n") - 1  # less the header
    assert n == whole, (n, whole)
    assert n > len(recs) // 2


def test_the_trace_directory_reads_as_the_latest_run_joined_in_order(tmp_path):
    recs = _records(20.0)
    old_run = RotatingTrace(tmp_path, lambda: make_header(agent_wall_t0=1000.0), max_bytes=1 << 30)
    for r in recs[:500]:  # an earlier agent run, whose clock started over: not joined
        old_run.write(r)
    old_run.close()
    time.sleep(0.01)  # segment names sort by their UTC start
    rt = RotatingTrace(tmp_path, lambda: make_header(agent_wall_t0=2000.0, recorder="kvtop agent"),
                       max_bytes=128 << 10, max_age_s=1e9)
    for r in recs:
        rt.write(r)
    rt.close()
    latest = latest_run(tmp_path)
    assert len(latest) >= 3 and len(segments(tmp_path)) == len(latest) + 1
    reader = TraceReader(tmp_path)
    assert reader.header["agent_wall_t0"] == 2000.0
    got = list(reader.dicts())
    assert reader.skipped == reader.unknown_kinds == 0
    assert [d["t"] for d in got] == [round(r.t, 6) for r in recs]  # every record once, no header in between
    assert abs(last_record_time(tmp_path) - recs[-1].t) < 1e-6
    r = run_kvtop("analyze", str(tmp_path), "--format", "json", "--itl-target-ms", "100")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["causes"]["preemption"]["count"] > 0
    r = run_kvtop("replay", str(tmp_path), "--headless", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["engines"][0]["preemptions_total"] > 0


def test_an_empty_trace_directory_is_a_one_line_error(tmp_path):
    r = run_kvtop("analyze", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no kvtop trace segments" in r.stderr


class _FullDisk(io.RawIOBase):
    """A disk that takes no more bytes (a partition that filled while a segment was open)."""

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # noqa: ANN001
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_disk_that_fills_mid_segment_warns_once_keeps_the_segment_and_resumes(tmp_path):  # noqa: ANN001
    now = [0.0]
    rt = RotatingTrace(tmp_path, lambda: make_header(engine={"adapter": "vllm"}, recorder="kvtop agent"),
                       clock=lambda: now[0])
    for i in range(10):
        rt.write(RequestRecord(t=i * 0.01, id=f"r{i}", event="token", n=1))
    w = rt._writer
    assert w is not None
    w.flush()
    w._f.close()
    # unbuffered: the full disk answers the first record (the buffers would take a few first)
    w._f = io.TextIOWrapper(io.BufferedWriter(_FullDisk(), 1), encoding="ascii", newline="", write_through=True)
    with logged(rotate_log) as seen:
        for i in range(10, 3010):  # 3 s of a probe's tokens on the full disk
            now[0] = i * 0.001
            rt.write(RequestRecord(t=i * 0.01, id=f"r{i}", event="token", n=1))
        # it was one warning per record, on and off with the write buffer: 1,413 lines for 20,000 records
        full = [r for r in seen if "No space left on device" in r.getMessage()]
        assert len(full) == 1 and "kvtop_dropped_records_total" in full[0].getMessage()
        assert rt.dropped == 3000
        now[0] = 10.0  # past the back-off, with room again: a new segment, said once
        rt.write(RequestRecord(t=50.0, id="after", event="token", n=1))
        assert sum("writing again" in r.getMessage() for r in seen) == 1
    rt.close()
    segs = segments(tmp_path)
    assert len(segs) == 2 and sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in segs)
    # every record flushed before the disk filled is kept, and the first one after it
    assert [d["id"] for d in TraceReader(segs[0]).dicts()] == [f"r{i}" for i in range(10)]
    loss, after = TraceReader(segs[1]).dicts()
    assert after["id"] == "after"
    # ... after a record of the gap: 30 s of records the disk refused were in no segment, and analyze
    # read the full disk's torn line as a crash
    assert (loss["kind"], loss["t"], loss["from_t"], loss["records"]) == ("loss", 50.0, 0.09, 3000)
    assert "No space left on device" in loss["reason"]
    import jsonschema

    schema = json.loads((REPO / "kvtop" / "schemas" / "trace.schema.json").read_text())
    jsonschema.validate(loss, schema)
    from kvtop.analysis.scan import analyze_trace

    rep = analyze_trace(str(tmp_path))
    assert any("could not write 3000 record(s) from t=0.1s to t=50.0s" in w for w in rep.warnings), rep.warnings
