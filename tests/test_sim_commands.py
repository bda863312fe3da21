"""`kvtop sim-server` and `kvtop demo` as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

from tests.conftest import REPO, run_kvtop


def test_sim_server_serves_vllm_metrics_on_an_ephemeral_loopback_port():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "kvtop", "sim-server", "--preset", "preemption-storm",
                          "--duration", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert "http://127.0.0.1:" in line, line + p.stderr.read()
        url = line.split(" at ")[1].split(" ")[0]
        assert not url.endswith(":0")
        page = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="sim-llama-3.1-8b"} 0.0' in page
        assert 'num_gpu_blocks="1430"' in page and 'kv_cache_size_tokens="22880"' in page
        assert urllib.request.urlopen(f"{url}/health", timeout=5).status == 200
    finally:
        p.terminate()
        p.wait(timeout=10)
        p.stdout.close()
        p.stderr.close()


def test_demo_headless_prints_a_snapshot_without_importing_textual():
    code = ("import sys; from kvtop.cli import main; rc = main(['demo', '--headless', '--duration', '4', "
            "'--preset', 'healthy']); assert 'textual' not in sys.modules, 'textual imported'; sys.exit(rc)")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t < 30
    out = r.stdout
    assert "127.0.0.1" in out and "sim-llama-3.1-8b" in out


def test_bad_arguments_exit_2_with_one_line():
    for args in (("demo", "--headless"), ("demo", "--preset", "nope", "--headless", "--duration", "1"),
                 ("sim-server", "--speed", "0"), ("sim-server", "--preset", "nope"),
                 ("sim-server", "--port", "70000")):
        r = run_kvtop(*args, timeout=30)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
