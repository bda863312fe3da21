"""Run `kvtop snapshot` on this machine (real GPU/NVML if present) against a loopback replay of the
real vLLM 0.32.0 capture, and print what it reported: gpu_status, every GPU field, host, engine.

For a machine with a GPU (the fake-NVML tests cover the failure modes); it needs no engine.
Exit status is kvtop's. Usage: python bench/snapshot_check.py [--duration S] [--fixture PATH]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "tests" / "fixtures" / "engines" / "vllm-0.32.0-cpu-live-idle.prom"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", default="3")
    ap.add_argument("--fixture", default=str(DEFAULT))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "metrics").write_bytes(Path(a.fixture).read_bytes())
        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

        handler = functools.partial(Quiet, directory=d)
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "kvtop", "snapshot", "--url", url, "--duration", a.duration,
                            "--interval", "0.5", "--format", "json"], capture_output=True, text=True, timeout=120)
        wall = time.monotonic() - t0
        srv.shutdown()
    print(f"kvtop snapshot exit {p.returncode} in {wall:.2f} s wall (duration {a.duration} s)")
    if p.returncode != 0:
        print(p.stderr.strip())
        return p.returncode
    doc = json.loads(p.stdout)
    print(f"gpu_status: {doc['gpu_status']}")
    for g in doc["gpus"]:
        print(f"GPU {g['index']}:")
        for k, v in g.items():
            print(f"  {k:28} {v!r}")
    print("host:", json.dumps(doc["host"], indent=2))
    for e in doc["engines"]:
        print("engine:", json.dumps(e, indent=2))
    try:
        import jsonschema

        schema = json.loads((REPO / "kvtop" / "schemas" / "snapshot.schema.json").read_text())
        jsonschema.validate(doc, schema)
        print("schema: valid")
    except ImportError:
        print("schema: not checked (jsonschema not installed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
