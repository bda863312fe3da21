"""URLs and CA files a user mistypes: one line naming the flag, exit 2, before anything connects
(they were tracebacks from the HTTP client, or "unhandled errors in a TaskGroup", exit 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_kvtop


def _one_line(r) -> str:  # noqa: ANN001
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return lines[0]


@pytest.mark.parametrize("args,says", [
    (("proxy", "--upstream", "http://[::1"), "--upstream 'http://[::1' is not a valid URL"),
    (("proxy", "--upstream", "http://127.0.0.1:99999"), "port 99999 is outside 1-65535"),
    (("proxy", "--upstream", "not a url"), "names no valid host"),
    (("load", "--preset", "healthy", "--url", "http://127.0.0.1:99999", "-o", "{tmp}/x.jsonl"), "--url"),
    (("record", "-o", "{tmp}/r.jsonl", "--url", "http://127.0.0.1:99999"), "port 99999 is outside 1-65535"),
    (("snapshot", "--url", "http://127.0.0.1:99999"), "port 99999 is outside 1-65535"),
    (("analyze", "--prometheus", "http://[::1"), "--prometheus 'http://[::1' is not a valid URL"),
    (("snapshot", "--prometheus", "http://[::1"), "--prometheus 'http://[::1' is not a valid URL"),
    # a proxy in front of itself: each request opened another until the descriptors ran out
    (("proxy", "--listen", "127.0.0.1:18123", "--upstream", "http://127.0.0.1:18123"), "forward to itself"),
    (("proxy", "--listen", "0.0.0.0:18123", "--upstream", "localhost:18123"), "forward to itself"),
    (("record", "-o", "{tmp}/r.jsonl", "--url", "http://127.0.0.1:18124", "--proxy-listen", "127.0.0.1:18124"),
     "forward to itself"),
    (("agent", "--url", "localhost:18124", "--proxy-listen", "18124"), "forward to itself"),
    # the same socket spelt another way: every 127.x is answered by 0.0.0.0; 0.0.0.0 connects to loopback
    (("proxy", "--listen", "0.0.0.0:18123", "--upstream", "http://127.0.0.2:18123"), "forward to itself"),
    (("proxy", "--listen", "127.0.0.1:18123", "--upstream", "http://0.0.0.0:18123"), "forward to itself"),
    (("proxy", "--listen", "[::1]:18123", "--upstream", "http://[0:0:0:0:0:0:0:1]:18123"), "forward to itself"),
    (("proxy", "--listen", "127.0.0.1:80", "--upstream", "http://127.0.0.1"), "forward to itself"),
])
def test_a_mistyped_url_is_one_line_and_exit_2(args: tuple[str, ...], says: str, tmp_path: Path) -> None:
    r = run_kvtop(*(a.replace("{tmp}", str(tmp_path)) for a in args), timeout=60)
    assert says in _one_line(r)
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "x.jsonl").exists()


def test_a_ca_file_with_no_certificate_is_one_line_before_any_query(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    for cmd in ("snapshot", "analyze"):
        r = run_kvtop(cmd, "--prometheus", "https://127.0.0.1:9", "--prometheus-ca-file", str(ca), timeout=60)
        assert f"cannot use CA file {ca}" in _one_line(r)


@pytest.mark.parametrize("listen,upstream", [
    ("127.0.0.1:18125", "http://[::1]:18125"),  # another socket: an engine may serve on ::1 alone
])
def test_a_proxy_to_the_other_loopback_family_starts(listen: str, upstream: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "proxy", "--listen", listen, "--upstream", upstream],
                            cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "XDG_CONFIG_HOME": str(REPO / ".cache" / "no-config")})
    try:
        assert proc.stderr is not None
        assert "Ctrl-C to stop" in proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(30)
