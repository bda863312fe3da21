"""`kvtop analyze` throughput on a large synthetic trace, side by side with the tools a user would
pick instead.

Writes a trace through ``TraceWriter`` as ``kvtop record`` does, token sidecar included (by
default 8,000 requests and 2 million token records, plus arrive/finish records and 1 s engine
scrapes: about 2.0 M records, 141 MB, and a 48 MB ``.tokens`` sidecar), then runs each of these in
its own process (peak memory is its own), timed from after its imports, ``--repeat`` rounds with the
tools interleaved (a busy box slows them alike), and prints the median and the best of each:
  * kvtop (sidecar): the full analysis (gaps, spikes, attribution, inputs, verdict), fast path,
    the token lines read from the sidecar, the other lines parsed from the JSONL;
  * kvtop (JSONL only): the same analysis with the sidecar ignored: every line parsed from the
    JSONL (with parse workers, one per core, on a trace this large);
  * kvtop --stream: the same analysis through the per-record streaming path (each line read,
    checked and fed one at a time);
  * kvtop live path: the live console's analysis (``LiveAnalyzer.feed``) on the same records,
    decoded beforehand in batches (untimed): the time of feeding them and of one report;
  * pandas: read the token records (read_json, chunked) and compute gaps with groupby/diff (once);
  * Polars: scan_ndjson + filter + diff().over(id) (gaps only), when installed;
  * DuckDB: read_ndjson + lag() over (partition by id) (gaps only), when installed.
The peers read the JSONL (they know no sidecar). Prints seconds, records/s, CPU seconds (the whole
process: imports, threads and worker processes; the fairer figure on a busy box), peak RSS and each
one's median time as a ratio of kvtop's (sidecar, then JSONL only). Polars and DuckDB come with the
``bench`` extra (``pip install -e '.[bench]'``); they use every core.

    python -m bench.analyze_speed [--requests 8000] [--tokens 2000000] [--repeat 5] [--keep FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvtop.model.records import EngineRecord, RequestRecord
from kvtop.model.trace import TraceWriter, make_header


def write_trace(path: str, n_req: int, n_tok: int, seed: int = 1, columns: bool = True) -> int:
    """The trace through ``TraceWriter``, as ``kvtop record`` writes one (its token sidecar too,
    unless ``columns`` is False): the records a proxy and a scraper would emit."""
    rnd = random.Random(seed)
    per = n_tok // n_req
    concurrency = 256
    step = 0.025
    header = make_header(engine={"adapter": "vllm", "url": "http://127.0.0.1:8000",
                                 "model": "meta-llama/Llama-3.1-8B-Instruct", "version": None},
                         kv={"bytes_per_token": 131072, "block_size": 16, "capacity_tokens": 400000},
                         recorder="kvtop record", interval_s=1.0)
    w = TraceWriter(path, header, flush_interval_s=1.0, columns=columns)
    write = w.write
    # slots of `concurrency` streams decode in lockstep; a request occupies a slot for `per` steps
    active: list[list[Any]] = []
    next_req = 0
    t = 0.0
    emitted = 0
    next_scrape = 0.0
    gen = 0
    while emitted < n_tok:
        while len(active) < concurrency and next_req < n_req:
            rid = f"req-{next_req:06d}"
            write(RequestRecord(t, rid, "arrive", prompt_tokens=rnd.randint(100, 3000), source="proxy",
                                engine="http://127.0.0.1:8000"))
            active.append([rid, 0, rnd.random() < 0.002])
            next_req += 1
        t += step
        if t >= next_scrape:
            write(EngineRecord(t, "vllm", url="http://127.0.0.1:8000", engine="0", kv_usage=0.7,
                               running=float(len(active)), waiting=0.0, preemptions_total=0.0,
                               prompt_tokens_total=gen * 10.0, generation_tokens_total=float(gen)))
            next_scrape += 1.0
        keep = []
        for a in active:
            rid, k, stall = a[0], a[1], a[2]
            if stall and k == per // 2:
                a[2] = False
                a.append(t + 1.0)  # a lone 1 s stall somewhere mid-stream
            if len(a) == 4 and t < a[3]:
                keep.append(a)
                continue
            write(RequestRecord(t, rid, "first_token" if k == 0 else "token", 1))
            emitted += 1
            gen += 1
            a[1] = k + 1
            if a[1] >= per:
                write(RequestRecord(t, rid, "finish", source="proxy", completion_tokens=per))
            else:
                keep.append(a)
        active = keep
        if not active and next_req >= n_req:
            break
    w.close()
    return w.count


# CPU: user + system seconds of the process and its threads, and of the fast path's worker processes
# (their peak RSS is added to the main process's, once per worker: an upper bound, as forked
# workers share pages with it)
CHILD_KVTOP = r"""
import json, resource, sys, time
from kvtop.analysis import fastscan
from kvtop.analysis.scan import analyze_trace
mode = sys.argv[2]
cols = mode == "sidecar" and fastscan.open_columns(sys.argv[1])[0] is not None
workers = fastscan._workers(sys.argv[1], fastscan.CHUNK, cols) if mode != "stream" else 0
t0 = time.perf_counter()
rep = analyze_trace(sys.argv[1], fast=mode != "stream", columns=mode == "sidecar")
dt = time.perf_counter() - t0
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": dt, "records": rep.records, "gaps": rep.gaps, "spikes": rep.spikes_total,
                  "verdict": rep.verdict.action, "workers": workers, "sidecar": cols,
                  "cpu": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                  "peak_rss_mb": (me.ru_maxrss + workers * kids.ru_maxrss) / 1024}))
"""

# the live console's analysis: records as the sources hand them over (decoded from the trace in
# batches, untimed), each through LiveAnalyzer.feed, then one report
CHILD_LIVE = r"""
import itertools, json, resource, sys, time
from kvtop.analysis.live import LiveAnalyzer
from kvtop.model.trace import TraceReader
reader = TraceReader(sys.argv[1])
live = LiveAnalyzer(adapter=(reader.header.get("engine") or {}).get("adapter"))
recs = reader.records()
dt, n, last = 0.0, 0, 0.0
feed = live.feed
while True:
    batch = list(itertools.islice(recs, 20_000))
    if not batch:
        break
    t0 = time.perf_counter()
    for r in batch:
        feed(r)
    dt += time.perf_counter() - t0
    n += len(batch)
    last = batch[-1].t
t0 = time.perf_counter()
rep = live.report(last + 60.0)
dt += time.perf_counter() - t0
me = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": dt, "records": n, "gaps": rep.gaps, "spikes": rep.spikes_total,
                  "verdict": rep.verdict.action, "cpu": me.ru_utime + me.ru_stime, "peak_rss_mb": me.ru_maxrss / 1024}))
"""

CHILD_PANDAS = r"""
import json, resource, sys, time
import pandas as pd
t0 = time.perf_counter()
parts = []
n = 0
for chunk in pd.read_json(sys.argv[1], lines=True, chunksize=500_000):
    n += len(chunk)
    tok = chunk[(chunk["kind"] == "request") & chunk["event"].isin(["token", "first_token"])]
    parts.append(tok[["id", "t"]])
df = pd.concat(parts, ignore_index=True)
df["gap"] = df.groupby("id")["t"].diff()
gaps = int(df["gap"].notna().sum())
dt = time.perf_counter() - t0
me = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": dt, "records": n, "gaps": gaps, "cpu": me.ru_utime + me.ru_stime,
                  "peak_rss_mb": me.ru_maxrss / 1024}))
"""


CHILD_POLARS = r"""
import json, resource, sys, time
import polars as pl
t0 = time.perf_counter()
lf = pl.scan_ndjson(sys.argv[1], infer_schema_length=1000)
tok = lf.filter((pl.col("kind") == "request") & pl.col("event").is_in(["token", "first_token"]))
out = pl.concat([
    tok.select(pl.col("t").diff().over("id").is_not_null().sum().alias("gaps")),
], how="horizontal").collect()
n = lf.select(pl.len()).collect().item()
dt = time.perf_counter() - t0
me = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": dt, "records": n, "gaps": int(out["gaps"][0]), "cpu": me.ru_utime + me.ru_stime,
                  "peak_rss_mb": me.ru_maxrss / 1024}))
"""

CHILD_DUCKDB = r"""
import json, resource, sys, time
import duckdb
t0 = time.perf_counter()
con = duckdb.connect()
p = sys.argv[1].replace("'", "''")
q = ("with recs as (select kind, event, id, t from read_ndjson('" + p + "', sample_size=2000, ignore_errors=true)), "
     "tok as (select t - lag(t) over (partition by id order by t) as gap from recs "
     "where kind = 'request' and event in ('token', 'first_token')) "
     "select (select count(*) from recs), count(gap) from tok")
n, gaps = con.execute(q).fetchone()
dt = time.perf_counter() - t0
me = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": dt, "records": n, "gaps": gaps, "cpu": me.ru_utime + me.ru_stime,
                  "peak_rss_mb": me.ru_maxrss / 1024}))
"""


def installed(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def child(code: str, *args: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8_000)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=5, help="rounds, the tools interleaved in each (default 5)")
    ap.add_argument("--keep", metavar="FILE", help="write the trace here and keep it (and its sidecar)")
    ap.add_argument("--no-pandas", action="store_true")
    ap.add_argument("--no-stream", action="store_true")
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    path = args.keep or os.path.join(d, "bench.jsonl")
    t0 = time.perf_counter()
    if not (args.keep and os.path.exists(path)):
        lines = write_trace(path, args.requests, args.tokens)
        side = os.path.getsize(path + ".tokens") / 1e6
        print(f"wrote {lines:,} records ({os.path.getsize(path) / 1e6:.0f} MB, token sidecar {side:.0f} MB) "
              f"through TraceWriter in {time.perf_counter() - t0:.1f}s")
    tools: list[tuple[str, str, tuple[str, ...]]] = [
        ("kvtop analyze, fast path (sidecar)", CHILD_KVTOP, (path, "sidecar")),
        ("kvtop analyze, fast path (JSONL only)", CHILD_KVTOP, (path, "jsonl"))]
    if not args.no_stream:
        tools.append(("kvtop analyze (streaming)", CHILD_KVTOP, (path, "stream")))
        tools.append(("kvtop live path (LiveAnalyzer.feed)**", CHILD_LIVE, (path,)))
    for module, name, code in (("polars", "Polars scan_ndjson + diff.over", CHILD_POLARS),
                               ("duckdb", "DuckDB read_ndjson + lag() over", CHILD_DUCKDB)):
        if installed(module):
            tools.append((name + " (gaps only)", code, (path,)))
        else:
            print(f"{module}: not installed (pip install -e '.[bench]')")
    loads = [os.getloadavg()[0]]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in tools}
    for _ in range(args.repeat):
        for name, code, cargs in tools:
            runs[name].append(child(code, *cargs))
        loads.append(os.getloadavg()[0])
    if not args.no_pandas:
        runs["pandas read_json + groupby/diff (gaps only)"] = [child(CHILD_PANDAS, path)]
    print(f"cpus={os.cpu_count()} load average {min(loads):.1f}-{max(loads):.1f} over the run; {args.repeat} rounds, "
          "tools interleaved; seconds: median (best)")
    med = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
    ref_cols, ref_jsonl = med[tools[0][0]], med[tools[1][0]]
    print(f"{'':<46}{'records':>11}{'gaps':>11}{'seconds':>15}{'records/s':>12}{'CPU s':>7}{'peak RSS':>10}"
          f"{'vs sidecar':>11}{'vs JSONL':>9}")
    for name, rs in runs.items():
        r = min(rs, key=lambda x: x["seconds"])
        m = med[name]
        print(f"{name:<46}{r['records']:>11,}{r['gaps']:>11,}{m:>8.2f} ({r['seconds']:.2f}){r['records'] / m:>12,.0f}"
              f"{statistics.median(x['cpu'] for x in rs):>7.2f}{max(x['peak_rss_mb'] for x in rs):>7.0f} MB"
              f"{m / ref_cols:>10.2f}x{m / ref_jsonl:>8.2f}x"
              + (f"   spikes {r['spikes']}, verdict {r['verdict']}" if "spikes" in r else "")
              + (", sidecar read" if r.get("sidecar") else "")
              + (f", {r['workers']} parse workers" if r.get("workers") else ""))
    for label, (kvname, _, _) in (("sidecar", tools[0]), ("JSONL only", tools[1])):
        kv = [r["seconds"] for r in runs[kvname]]
        for name, rs in runs.items():
            if not name.startswith("kvtop") and len(rs) == len(kv):
                ahead = sum(a < b["seconds"] for a, b in zip(kv, rs, strict=True))
                print(f"kvtop ({label}) ahead of {name.split(' ')[0]} in {ahead} of {len(kv)} rounds")
    print("kvtop: the whole analysis; peers: the gaps alone, from the JSONL. The sidecar figure includes reading the\n"
          "sidecar and parsing every non-token line of the JSONL; 'JSONL only' ignores the sidecar. Streaming: every\n"
          "line read, checked and fed one at a time.")
    if not args.no_stream:
        print("** the live console's analysis on the same records, as the sources hand them over: the time of feeding\n"
              "   them and of one report (not of reading the trace: a live source has no JSON to parse); its CPU\n"
              "   seconds and memory are the whole process's, reading included")
    if not args.keep:
        os.remove(path)
        os.remove(path + ".tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
