"""`--probe RATE` on `kvtop snapshot`: kvtop's own canary streams give per-request timings with no proxy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO, run_kvtop


def test_snapshot_probe_streams_are_timed_and_rate_bounded():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    srv = subprocess.Popen([sys.executable, "-m", "kvtop", "sim-server", "--preset", "healthy", "--duration", "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = srv.stdout.readline()
        url = line.split(" at ")[1].split(" ")[0]
        r = run_kvtop("snapshot", "--url", url, "--duration", "4", "--interval", "0.5", "--probe", "1",
                      "--no-gpu", "--format", "json", timeout=90)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        probes = [q for q in d.get("requests", []) if q["class"] == "probe"]
        # 1 stream/s for 4 s: at least one started, never more than the rate allows (+1 for the first)
        assert 1 <= len(probes) <= 5, probes
        assert all(q["source"] == "probe" for q in probes)
        # each finished canary streamed real tokens, so the analysis had per-request gaps to look at
        done = [q for q in probes if q["state"] == "finished"]
        assert done and all(q["tokens"] > 1 for q in done)
        assert d["analysis"]["basis"] != "aggregate"
    finally:
        srv.terminate()
        srv.wait(timeout=10)
        srv.stdout.close()
        srv.stderr.close()


def test_bad_probe_rate_is_one_line_exit_2():
    for bad in ("0", "-1", "500", "fast"):
        r = run_kvtop("snapshot", "--url", "http://127.0.0.1:9", "--probe", bad)
        assert r.returncode == 2
        assert len(r.stderr.strip().splitlines()) == 1 and "--probe" in r.stderr, r.stderr
