"""Reaching a Prometheus API behind a gateway (`--prometheus` with basic auth, a CA file, extra headers
such as Mimir's X-Scope-OrgID): a real HTTPS server on loopback, with a certificate from a test CA
(trustme), answers only when every credential arrives as it should and records what it got."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trustme
from conftest import REPO

from kvtop.sources.promapi import PromAuth, PromClient, PromError

USER, PASSWORD, TENANT = "grafana-reader", "s3cr3t-pw:with-colon", "team-a"


def _empty(kind: str) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": kind, "result": []}}).encode()


class _Gateway(BaseHTTPRequestHandler):
    seen: list[dict[str, str]]
    want: dict[str, str]

    def do_GET(self) -> None:  # noqa: N802
        got = {k.lower(): v for k, v in self.headers.items()}
        self.seen.append(got)
        ok = all(got.get(k) == v for k, v in self.want.items())
        body = _empty("matrix" if self.path.startswith("/api/v1/query_range") else "vector") if ok else json.dumps({"status": "error", "error": "unauthorized"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, Path, list[dict[str, str]]]]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    seen: list[dict[str, str]] = []
    basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    handler = type("H", (_Gateway,), {"seen": seen, "want": {"authorization": basic, "x-scope-orgid": TENANT}})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"https://127.0.0.1:{srv.server_address[1]}", ca_file, seen
    finally:
        srv.shutdown()
        srv.server_close()


def test_basic_auth_ca_file_and_tenant_header_reach_the_server(gateway: tuple[str, Path, list[dict[str, str]]]) -> None:
    url, ca_file, seen = gateway
    auth = PromAuth(username=USER, password=PASSWORD, ca_file=str(ca_file), headers=(("X-Scope-OrgID", TENANT),))
    client = PromClient(url, auth=auth)
    try:
        assert client.query("up") == []
    finally:
        client.close()
    [h] = seen
    assert h["x-scope-orgid"] == TENANT
    assert base64.b64decode(h["authorization"].removeprefix("Basic ")).decode() == f"{USER}:{PASSWORD}"


def test_wrong_password_is_one_line_with_a_hint_and_no_secret(gateway: tuple[str, Path, list[dict[str, str]]]) -> None:
    url, ca_file, seen = gateway
    client = PromClient(url, auth=PromAuth(username=USER, password="wrong-pw", ca_file=str(ca_file),
                                           headers=(("X-Scope-OrgID", TENANT),)))
    with pytest.raises(PromError) as e:
        client.query("up")
    client.close()
    msg = str(e.value)
    assert "HTTP 401" in msg and "--prometheus-user" in msg and "\n" not in msg
    assert "wrong-pw" not in msg and "wrong-pw" not in repr(client._headers)
    assert len(seen) == 1


def test_without_the_ca_file_the_certificate_is_refused(gateway: tuple[str, Path, list[dict[str, str]]]) -> None:
    url, _, seen = gateway
    client = PromClient(url, auth=PromAuth(username=USER, password=PASSWORD, headers=(("X-Scope-OrgID", TENANT),)))
    with pytest.raises(PromError) as e:
        client.query("up")
    client.close()
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value) and "--prometheus-ca-file" in str(e.value)
    assert seen == []  # nothing was sent to a server kvtop could not verify


def test_auth_repr_hides_the_secrets() -> None:
    r = repr(PromAuth(token="tok-123", username=USER, password=PASSWORD, headers=(("X-Scope-OrgID", TENANT),)))
    assert "tok-123" not in r and PASSWORD not in r and TENANT not in r and USER in r


def _kvtop(*args: str, env_dir: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTOP_")}
    env.update(PYTHONPATH=str(REPO), XDG_CONFIG_HOME=str(env_dir), **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "kvtop", *args], capture_output=True, text=True, env=env, timeout=60)


def test_command_line_flags_reach_the_server(gateway: tuple[str, Path, list[dict[str, str]]], tmp_path: Path) -> None:
    url, ca_file, seen = gateway
    pw = tmp_path / "pw"
    pw.write_text(PASSWORD + "\n")
    r = _kvtop("analyze", "--prometheus", url, "--start", "now-5m", "--prometheus-user", USER,
               "--prometheus-password-file", str(pw), "--prometheus-ca-file", str(ca_file),
               "--prometheus-header", f"X-Scope-OrgID: {TENANT}", env_dir=tmp_path)
    # the server holds nothing: kvtop says so, having got past the gateway on every query
    assert r.returncode == 1 and "holds no engine metrics" in r.stderr, r.stderr
    assert seen and all(h["x-scope-orgid"] == TENANT and h["authorization"].startswith("Basic ") for h in seen)
    assert PASSWORD not in r.stdout + r.stderr


def test_config_file_and_environment_reach_the_server(gateway: tuple[str, Path, list[dict[str, str]]],
                                                      tmp_path: Path) -> None:
    url, ca_file, seen = gateway
    (tmp_path / "kvtop").mkdir()
    (tmp_path / "kvtop" / "config.toml").write_text(
        f'prometheus_user = "{USER}"\nprometheus_ca_file = "{ca_file}"\n'
        f'prometheus_headers = ["X-Scope-OrgID: {TENANT}"]\n')
    r = _kvtop("snapshot", "--prometheus", url, "--duration", "60", "--format", "json", env_dir=tmp_path,
               extra_env={"KVTOP_PROMETHEUS_PASSWORD": PASSWORD})
    assert seen, r.stderr
    assert all(h["x-scope-orgid"] == TENANT for h in seen)
    assert "HTTP 401" not in r.stdout + r.stderr and PASSWORD not in r.stdout + r.stderr


@pytest.mark.parametrize(("args", "phrase"), [
    (["--prometheus-header", "X-Scope-OrgID team-a"], "'NAME: VALUE'"),
    (["--prometheus-header", "Authorization: Bearer x"], "cannot set Authorization"),
    (["--prometheus-password-file", "{pw}"], "needs --prometheus-user"),
    (["--prometheus-user", USER, "--token", "t"], "not both"),
    (["--prometheus-ca-file", "{missing}"], "cannot read --prometheus-ca-file"),
])
def test_bad_auth_options_are_one_line_and_exit_2(tmp_path: Path, args: list[str], phrase: str) -> None:
    pw = tmp_path / "pw"
    pw.write_text("hunter2\n")
    args = [a.format(pw=pw, missing=tmp_path / "nope.pem") for a in args]
    r = _kvtop("analyze", "--prometheus", "http://127.0.0.1:9", *args, env_dir=tmp_path)
    assert r.returncode == 2 and phrase in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr and "hunter2" not in r.stderr
