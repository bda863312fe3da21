"""`kvtop tui` argument handling and local engine discovery (no Textual needed for these paths)."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from pathlib import Path

from conftest import FIXTURES, REPO, run_kvtop

from kvtop.sources.discover import discover, looks_like_metrics


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _config(tmp_path: Path, body: str) -> dict[str, str]:
    (tmp_path / "kvtop").mkdir()
    (tmp_path / "kvtop" / "config.toml").write_text(body)
    return {"XDG_CONFIG_HOME": str(tmp_path)}


def test_no_engine_found_explains_how_to_point_it(tmp_path):
    port = _closed_port()
    r = run_kvtop(env=_config(tmp_path, f"probe_ports = [{port}]\n"))  # bare `kvtop`
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"no engine found on 127.0.0.1 ports {port}" in lines[0]
    assert "--url http://HOST:PORT" in lines[0] and "kvtop demo" in lines[0]
    assert lines[0].startswith("kvtop: error: ") and "kvtop snapshot" in lines[0]  # as every other error
    assert "Traceback" not in r.stderr


def test_bad_arguments_are_one_line_exit_2(tmp_path):
    for args, expect in (
        (("tui", "--interval", "0"), "--interval must be between 0.05 and 3600"),
        (("tui", "--theme", "nope", "--url", "http://127.0.0.1:1"), "unknown theme 'nope'; choose one of: kvtop, kvtop-low"),
        (("tui", "--replay", str(tmp_path / "missing.jsonl")), "trace file not found"),
        (("tui", "--itl-target-ms", "-1"), "--itl-target-ms must be a positive number"),
    ):
        r = run_kvtop(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and expect in r.stderr, r.stderr


def test_bad_config_is_reported(tmp_path):
    r = run_kvtop("tui", env=_config(tmp_path, "probe_ports = ['x']\n"))
    assert r.returncode == 2 and "probe_ports must be a list of port numbers" in r.stderr


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        body = self.body if self.path == "/metrics" else b"not here"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _serve(body: bytes) -> tuple[http.server.HTTPServer, int]:
    handler = type("H", (_Handler,), {"body": body})
    srv = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def test_discover_finds_a_metrics_page_and_skips_other_servers():
    page = (FIXTURES / "vllm-0.32.0-cpu-live-idle.prom").read_bytes()
    good, gport = _serve(page)
    html, hport = _serve(b"<html>hello</html>")
    closed = _closed_port()
    try:
        assert discover([closed, hport, gport]) == [f"http://127.0.0.1:{gport}"]
    finally:
        good.shutdown()
        html.shutdown()
    assert looks_like_metrics(page.decode())
    assert not looks_like_metrics("<html><body>metrics</body></html>")


def test_headless_paths_do_not_import_textual():
    code = (
        "import sys; import kvtop.cli as c; c.build_parser(); "
        "import kvtop.commands.tui, kvtop.views.tui.fmt, kvtop.feeds.sample; "
        "from kvtop.feeds.sample import sample; sample(requests=3, seconds=3).core.snapshot(); "
        "print('textual' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_bare_kvtop_takes_global_and_console_options(tmp_path):
    port = _closed_port()
    cfg = tmp_path / "other.toml"
    cfg.write_text(f"probe_ports = [{port}]\n")
    r = run_kvtop("--config", str(cfg))  # global option, then the console
    assert r.returncode == 2 and f"no engine found on 127.0.0.1 ports {port}" in r.stderr
    r = run_kvtop("--interval", "0")  # a console option without `tui`
    assert r.returncode == 2 and "--interval must be between 0.05 and 3600" in r.stderr
    r = run_kvtop("--help")
    assert r.returncode == 0 and "COMMAND" in r.stdout  # still the top-level help


def test_compare_without_a_terminal_names_the_headless_command_with_its_contract(tmp_path):
    a = tmp_path / "a.jsonl"
    r = run_kvtop("simulate", "--preset", "healthy", "--duration", "2", "-o", str(a))
    assert r.returncode == 0, r.stderr
    r = run_kvtop("tui", "--replay", str(a), "--compare", str(a), "--ttft-target-ms", "2000", input="")
    assert r.returncode == 2
    # without the TTFT contract the headless command judges another thing (improved vs trade-off)
    assert f"kvtop compare {a} {a} --ttft-target-ms 2000" in r.stderr, r.stderr
