"""The fast path with worker processes parsing ahead gives the serial fast path's results exactly
(same chunks, same order into the analyzer), progress and interruption included (issue 23 item 4)."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from conftest import run_kvtop

from kvtop.analysis import fastscan
from kvtop.analysis.analyzer import Analyzer
from kvtop.model.trace import TraceReader

CHUNK = 64 << 10  # small chunks: dozens of them, and stalls that straddle their boundaries


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    p = tmp_path_factory.mktemp("par") / "storm.jsonl"
    r = run_kvtop("simulate", "--preset", "preemption-storm", "--seed", "3", "--duration", "40", "-o", str(p))
    assert r.returncode == 0, r.stderr
    with open(p, "a") as f:
        # a line longer than three chunks: blocks without a newline (empty chunks)
        f.write(json.dumps({"kind": "host", "t": 40.2, "note": "x" * (3 * CHUNK)}) + "\n")
        # lines the batch cannot take: each sends its chunk through the streaming path
        f.write(json.dumps({"kind": "request", "t": 40.5, "id": 'we"ird', "event": "token", "n": 3}) + "\n")
        f.write('{"kind":"request","t":null,"id":"x","event":"token","n":1}\n')
        f.write("not json\n\n")
        f.write('{"kind":"request","t":41.0,"id":"x","event":"token","n":')  # torn last line
    return str(p)


def _run(path: str, workers: int, stop_at: int | None = None) -> tuple[object, ...]:
    an = Analyzer()
    an.set_header(TraceReader(path).header)
    ticks: list[int] = []

    def tick(done: int) -> bool:
        ticks.append(done)
        return stop_at is not None and len(ticks) >= stop_at

    skipped = fastscan.scan(path, an, chunk_bytes=CHUNK, tick=tick, workers=workers)
    an.finish()
    spikes = [(s.candidate.request_id, s.candidate.t_start, s.candidate.t_end, s.candidate.gap, s.finding.cause, s.finding.confidence)
              for s in an.spikes]
    streams = [(r.id, r.tokens, r.events, r.max_gap, r.first_t, r.end_t, r.spikes) for r in an.reqs.values()]
    return (skipped, an.records, an.token_records, an.n_gaps, an.median_gap(), an.itl_target_s, spikes, streams,
            ticks)


def test_workers_change_nothing(trace):
    serial = _run(trace, workers=0)
    assert serial[6], "the storm has spikes to compare"
    assert serial[0] == 3  # null time, "not json", the torn last line
    assert len(serial[8]) > 20  # many chunks
    assert _run(trace, workers=2) == serial


@pytest.mark.parametrize("stop_at", [1, 3, 12])
def test_interrupted_scan_covers_the_same_records(trace, stop_at):
    serial = _run(trace, workers=0, stop_at=stop_at)
    assert serial[1] < _run(trace, workers=0)[1]
    assert _run(trace, workers=2, stop_at=stop_at) == serial


def test_large_plain_traces_get_workers_and_others_do_not(trace, tmp_path, monkeypatch):
    monkeypatch.setattr(fastscan, "PARALLEL_MIN_CHUNKS", 4)
    assert fastscan._workers(trace, CHUNK) >= (1 if len(os.sched_getaffinity(0)) > 1 else 0)
    assert fastscan._workers(trace, 1 << 30) == 0  # fewer chunks than are worth a process
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(open(trace, "rb").read()))
    assert fastscan._workers(str(gz), 1024) == 0  # a gzip segment reads as one stream


def test_ids_read_in_place_group_as_numpy_unique_does():
    """Ids of every length around the 8-byte words they are read in, sharing prefixes: the same
    distinct ids and codes as np.unique."""
    import random

    import numpy as np

    rnd = random.Random(5)
    pool = [("r" * k + str(i)).encode() for k in (0, 6, 7, 8, 15, 16, 30) for i in range(12)] + [b"a", b"ab", b"a" * 9]
    ids = [rnd.choice(pool) for _ in range(3000)]
    buf = b"".join(b'"' + i + b'"\n' for i in ids)
    arr = np.frombuffer(buf + bytes(fastscan.PAD), np.uint8)
    starts = np.array([m + 1 for m in range(len(buf)) if buf[m:m + 1] == b'"' and (m == 0 or buf[m - 1:m] == b"\n")])
    ends = starts + np.array([len(i) for i in ids])
    uniq, codes = fastscan._unique_at(arr, starts, ends)
    want, inv = np.unique(np.array(ids, dtype=f"S{max(map(len, ids))}"), return_inverse=True)
    assert uniq.tolist() == want.tolist() and codes.tolist() == inv.ravel().tolist()


def test_ids_group_as_numpy_unique_does_when_their_hashes_collide(monkeypatch):
    """Ids are grouped by 32 bits of a hash: ids whose hashes collide (here all of them, the mixing
    constant zeroed) still get np.unique's distinct ids and codes."""
    import random

    import numpy as np

    rnd = random.Random(9)
    ids = [(f"r{rnd.randrange(300)}" * rnd.randint(1, 3)).encode() for _ in range(4000)]
    buf = b"".join(b'"' + i + b'"\n' for i in ids)
    arr = np.frombuffer(buf + bytes(fastscan.PAD), np.uint8)
    starts = np.cumsum([0] + [len(i) + 3 for i in ids[:-1]]) + 1
    ends = starts + np.array([len(i) for i in ids])
    want, inv = np.unique(np.array(ids, dtype=f"S{max(map(len, ids))}"), return_inverse=True)
    for mix in (fastscan._MIX, np.uint64(0)):
        monkeypatch.setattr(fastscan, "_MIX", mix)
        uniq, codes = fastscan._unique_at(arr, starts, ends)
        assert uniq.tolist() == want.tolist() and codes.tolist() == inv.ravel().tolist()


@pytest.mark.parametrize("width", [8, 16])
def test_times_read_in_words_equal_float_of_their_text(width):
    """Times of up to 16 bytes parsed inside 8-byte integers (one where every time of the chunk
    fits in 8): float(text) for every number the writer makes (milli- to microseconds, up to the
    largest time a trace holds) and for the odd ones (leading zeros, no digit after the dot, signs,
    exponents), NaN for what is no number, bit for bit what the byte-row reading gives."""
    import math
    import random

    import numpy as np

    rnd = random.Random(width)
    fields = [b"0", b"0.5", b"5.", b".5", b"1.2.3", b"", b"007.5", b"99999999", b"1234.567", b"-1.5", b"1e3",
              b"null", b"12345678", b"9.999999", b"0.000001", b"1 2", b"inf", b"1000000000", b"999999999.999999",
              b"12345678.1234567", b"1234567890123456", b"0.123456789012345", b"12345678.", b"123456789.5.5"]
    for _ in range(20000):
        r = rnd.random()
        if r < 0.6:
            fields.append(repr(round(rnd.uniform(0, 10 ** rnd.randint(0, 9)), rnd.randint(0, 6))).encode())
        else:
            fields.append(bytes(rnd.choice(b"0123456789....-e+ x:/") for _ in range(rnd.randint(1, width))))
    fields = [f[:width] for f in fields]
    buf = b"".join(f + b",\n" for f in fields)
    arr = np.frombuffer(buf + bytes(fastscan.PAD), np.uint8)
    starts = np.cumsum([0] + [len(f) + 2 for f in fields[:-1]])
    lens = np.array([len(f) for f in fields])
    got = fastscan._times_swar(arr, starts, lens)
    rows = fastscan._times(fastscan._field(arr, starts, starts + lens), lens)
    assert got.view(np.uint64).tolist() == rows.view(np.uint64).tolist()
    for f, v in zip(fields, got.tolist(), strict=True):
        want = fastscan._float_or_nan(f)
        assert v == want or (math.isnan(v) and math.isnan(want)), f
    assert sum(math.isnan(v) for v in got.tolist()) > 100  # junk was tried
    assert max(map(len, fields)) == width


def test_field_ends_are_found_as_bytes_find_finds_them():
    """The 8-bytes-at-a-time search gives str.find's answer within the window, -1 and a cleared
    row where the byte is absent."""
    import random

    import numpy as np

    rnd = random.Random(1)
    b = bytes(rnd.choice(b'ab,"x') for _ in range(5000))
    arr = np.frombuffer(b + bytes(fastscan.PAD), np.uint8)
    starts = np.array(sorted(rnd.sample(range(4900), 800)))
    seen: set[int] = set()
    for byte, width in ((44, 24), (34, 48), (44, 16), (34, 5), (120, 3)):
        ok = np.ones(len(starts), bool)
        got = fastscan._find(arr, starts, byte, width, ok)
        want = [b.find(bytes([byte]), s, s + width) for s in starts.tolist()]
        want = [w - s if w >= 0 else -1 for w, s in zip(want, starts.tolist(), strict=True)]
        assert got.tolist() == want and ok.tolist() == [w >= 0 for w in want]
        seen.update(want)
    assert -1 in seen and max(seen) >= 16  # absent bytes, and bytes found in a third word


@pytest.mark.parametrize("fast", [True, False])
def test_analysis_leaves_the_cycle_collector_as_it_found_it(trace, fast):
    """The scan turns Python's cycle collector off while it runs (``scan._no_cycle_collection``):
    on again after it, after a failed one too, and left off where the caller had turned it off."""
    import gc

    from kvtop.analysis.scan import analyze_trace
    from kvtop.model.trace import TraceError

    assert gc.isenabled()
    assert analyze_trace(trace, fast=fast).records > 1000
    assert gc.isenabled()
    with pytest.raises(TraceError):
        analyze_trace(trace + ".missing", fast=fast)
    assert gc.isenabled()
    gc.disable()
    try:
        analyze_trace(trace, fast=fast)
        assert not gc.isenabled()
    finally:
        gc.enable()
