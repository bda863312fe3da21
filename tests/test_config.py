"""Configuration precedence: TOML file < KVTOP_* environment < flags; bad input is one line, exit 2."""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import run_kvtop
from page_server import PageServer
from vllm_pages import vllm_page

from kvtop.config import default_path, load_config, parse_seconds, resolve
from kvtop.errors import UsageError


def write(tmp_path, text: str):
    p = tmp_path / "config.toml"
    p.write_text(text)
    return str(p)


def test_default_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert default_path() == tmp_path / "kvtop" / "config.toml"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_path() == tmp_path / ".config" / "kvtop" / "config.toml"


def test_missing_default_file_is_empty_but_missing_named_file_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert load_config(None, env={}) == {}
    with pytest.raises(UsageError, match="config file not found"):
        load_config(str(tmp_path / "nope.toml"), env={})


def test_file_then_env_then_flags(tmp_path):
    path = write(tmp_path, 'url = ["http://a:8000", "http://b:8000"]\ninterval = "2s"\ntoken = "from-file"\n'
                           'itl_target_ms = 80\ntheme = "dark"\ngpu = false\n[proxy]\nlisten = "127.0.0.1:8001"\n')
    cfg = load_config(path, env={})
    assert cfg["url"] == ["http://a:8000", "http://b:8000"]
    assert cfg["interval"] == 2.0 and cfg["token"] == "from-file" and cfg["itl_target_ms"] == 80.0
    assert cfg["gpu"] is False and cfg["theme"] == "dark"
    assert cfg["proxy"] == {"listen": "127.0.0.1:8001"}  # other commands' sections are kept

    env = {"KVTOP_URL": "http://c:1, http://d:2", "KVTOP_INTERVAL": "500ms", "KVTOP_TOKEN": "from-env",
           "KVTOP_ITL_TARGET_MS": "50", "KVTOP_THEME": "light", "KVTOP_GPU": "yes", "KVTOP_ADAPTER": ""}
    cfg = load_config(path, env=env)
    assert cfg["url"] == ["http://c:1", "http://d:2"]  # env beats file
    assert cfg["interval"] == 0.5 and cfg["token"] == "from-env" and cfg["itl_target_ms"] == 50.0
    assert cfg["theme"] == "light" and cfg["gpu"] is True
    assert "adapter" not in cfg  # an empty variable is unset

    args = argparse.Namespace(url=["http://flag:9"], interval=None, token="from-flag", itl_target_ms=None)
    assert resolve(args, cfg, "url") == ["http://flag:9"]  # flag beats env
    assert resolve(args, cfg, "token") == "from-flag"
    assert resolve(args, cfg, "interval", 1.0) == 0.5  # no flag: env
    assert resolve(args, {}, "interval", 1.0) == 1.0  # nothing set: default
    assert resolve(None, {}, "duration", 5.0) == 5.0


@pytest.mark.parametrize(
    ("text", "env", "needle"),
    [
        ("url = [1, 2]\n", {}, "must be a URL or a list of URLs"),
        ('interval = "fast"\n', {}, "must be a number of seconds"),
        ("gpu = 3\n", {}, "must be true or false"),
        ("", {"KVTOP_INTERVAL": "soon"}, "interval (KVTOP_INTERVAL) must be a number of seconds"),
        ("", {"KVTOP_ITL_TARGET_MS": "-5"}, "must be positive"),
        ("", {"KVTOP_GPU": "maybe"}, "must be true or false"),
    ],
)
def test_bad_values_are_usage_errors(tmp_path, text, env, needle):
    with pytest.raises(UsageError) as ei:
        load_config(write(tmp_path, text), env=env)
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_parse_seconds_units():
    assert parse_seconds("30s", "x") == 30.0
    assert parse_seconds("500ms", "x") == 0.5
    assert parse_seconds("2m", "x") == 120.0
    assert parse_seconds(" 1.5 ", "x") == 1.5
    assert parse_seconds(3, "x") == 3.0
    with pytest.raises(UsageError):
        parse_seconds("nan", "x")
    with pytest.raises(UsageError):
        parse_seconds(True, "x")


def test_invalid_toml_is_one_line_exit_2(tmp_path):
    path = write(tmp_path, "url = [\n")
    p = run_kvtop("--config", path, "snapshot", "--duration", "0.1")
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtop: error: invalid TOML in {path}")


def test_snapshot_uses_file_env_and_flags(tmp_path):
    """The snapshot command resolves URL and format from config/env, and flags win."""
    with PageServer() as s:
        s.route("/metrics", vllm_page(running=5))
        xdg = tmp_path / "xdg"
        (xdg / "kvtop").mkdir(parents=True)
        # config file (default XDG path): this URL is unreachable, format json
        (xdg / "kvtop" / "config.toml").write_text('url = "http://127.0.0.1:1"\nformat = "json"\nduration = 0.3\n'
                                                   "interval = 0.1\ngpu = false\n")
        env = {"XDG_CONFIG_HOME": str(xdg)}
        p = run_kvtop("snapshot", env=env)
        assert p.returncode == 1 and "127.0.0.1:1" in p.stderr  # file URL used (unreachable: exit 1)
        env["KVTOP_URL"] = s.url  # env beats the file
        p = run_kvtop("snapshot", env=env)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)  # format from the file
        assert doc["engines"][0]["url"] == s.url and doc["engines"][0]["running"] == 5
        assert doc["gpu_status"] == "disabled (--no-gpu)"  # gpu = false from the file
        p = run_kvtop("snapshot", "--format", "text", env=env)  # flag beats the file
        assert p.returncode == 0 and p.stdout.startswith("kvtop ")
        p = run_kvtop("snapshot", "--url", "http://127.0.0.1:1", env=env)  # flag beats env
        assert p.returncode == 1
