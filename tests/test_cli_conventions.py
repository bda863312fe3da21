"""CLI conventions a script relies on: exit codes (0 ok, 1 the run failed, 2 usage), no full-screen
console without a terminal, a dead engine found at the first scrape."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import socket
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
from conftest import REPO, run_kvtop
from page_server import PageServer
from pty_reader import PtyReader
from vllm_pages import vllm_page


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtop: error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    return lines[0]


def test_record_against_a_dead_port_writes_no_trace_and_exits_1(tmp_path: Path) -> None:
    port = _closed_port()
    out = tmp_path / "t.jsonl"
    # an hour's --duration: the dead engine must end the run at the first scrape
    r = run_kvtop("record", "-o", str(out), "--url", f"http://127.0.0.1:{port}", "--duration", "1h",
                  "--no-gpu", "--no-host", timeout=60)
    assert r.returncode == 1, r.stderr
    line = _one_line(r)
    assert f"could not read the engine at http://127.0.0.1:{port}" in line and "cannot connect" in line
    assert "record(s) written" not in r.stderr
    assert not out.exists()  # no trace that `analyze` would call INSUFFICIENT DATA


def test_record_waits_for_an_engine_still_loading_then_records_it(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    with PageServer() as s:
        route = s.route("/metrics", vllm_page(running=2), status=503)  # a server up, its engine not yet
        threading.Timer(1.5, setattr, (route, "status", 200)).start()
        r = run_kvtop("record", "-o", str(out), "--url", s.url, "--duration", "0.6", "--interval", "0.2",
                      "--wait-for-engine", "20s", "--no-gpu", "--no-host", timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"kvtop record: warning: waiting up to 20 s for the engine: could not read the engine at {s.url}" in r.stderr
    assert len(route.hits) >= 5  # it kept asking, a poll interval apart, until the engine answered
    header = json.loads(out.read_text().splitlines()[0])
    assert header["engine"]["adapter"] == "vllm"  # the header names the engine that answered at last
    assert '"running":2' in out.read_text()
    # time up with no answer: the same one line and exit 1 as without the wait, and no trace
    port = _closed_port()
    r = run_kvtop("record", "-o", str(tmp_path / "u.jsonl"), "--url", f"http://127.0.0.1:{port}", "--interval", "0.2",
                  "--wait-for-engine", "1s", "--no-gpu", "--no-host", timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        f"kvtop: error: could not read the engine at http://127.0.0.1:{port}"), r.stderr
    assert not (tmp_path / "u.jsonl").exists()


def test_record_with_one_engine_down_records_the_other_and_warns(tmp_path: Path) -> None:
    port = _closed_port()
    out = tmp_path / "t.jsonl"
    with PageServer() as s:
        s.route("/metrics", vllm_page(running=3))
        r = run_kvtop("record", "-o", str(out), "--url", s.url, "--url", f"http://127.0.0.1:{port}",
                      "--duration", "0.5", "--interval", "0.2", "--no-gpu", "--no-host", timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"kvtop record: warning: engine http://127.0.0.1:{port} does not answer: cannot connect" in r.stderr
    assert out.stat().st_size > 0 and '"running":3' in out.read_text()


def test_usage_errors_stay_exit_2() -> None:
    r = run_kvtop("record", "--url", "http://127.0.0.1:1", timeout=60)  # -o missing
    assert r.returncode == 2 and "-o/--output" in r.stderr
    r = run_kvtop("snapshot", "--url", "ftp://x", timeout=60)
    assert r.returncode == 2 and "only http:// and https://" in _one_line(r)


@pytest.mark.parametrize("args", [
    ("tui", "--url", "http://127.0.0.1:1"),
    ("--url", "http://127.0.0.1:1"),  # bare `kvtop` with console options
    ("demo",),
    ("tui", "--replay", "{trace}"),
    ("tui", "--prometheus", "http://127.0.0.1:1"),
])
def test_no_full_screen_console_without_a_terminal(args: tuple[str, ...], tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    if "{trace}" in args:
        sim = run_kvtop("simulate", "--preset", "preemption-storm", "--duration", "2", "-o", str(trace), timeout=60)
        assert sim.returncode == 0, sim.stderr
    # stdin and stdout are pipes (a CI job): one line and exit 2, never escape codes until killed
    r = run_kvtop(*(a.replace("{trace}", str(trace)) for a in args), timeout=60, input="")
    assert r.returncode == 2, r.stderr
    line = _one_line(r)
    assert "the console needs a terminal" in line and "\x1b[" not in r.stderr
    assert "kvtop snapshot" in line or "--headless" in line  # names the headless way


def test_no_console_without_a_terminal_even_when_an_engine_is_found(tmp_path: Path) -> None:
    with PageServer() as s:
        s.route("/metrics", vllm_page(running=1))
        port = s.url.rsplit(":", 1)[1]
        (tmp_path / "kvtop").mkdir()
        (tmp_path / "kvtop" / "config.toml").write_text(f"probe_ports = [{port}]\n")
        r = run_kvtop(env={"XDG_CONFIG_HOME": str(tmp_path)}, timeout=60, input="")
    assert r.returncode == 2 and "the console needs a terminal" in _one_line(r)


def _on_a_terminal(args: list[str], timeout: float = 60) -> tuple[int, str]:
    """Run kvtop on a pseudo-terminal (stdin, stdout, stderr); its exit code and what it printed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=str(REPO),
               XDG_CONFIG_HOME=str(REPO / ".cache" / "no-config"))
    p = subprocess.Popen([sys.executable, "-m", "kvtop", *args], stdin=slave, stdout=slave, stderr=slave,
                         env=env, start_new_session=True)
    os.close(slave)
    reader = PtyReader(master)
    try:
        rc = p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return rc, reader.text()


def test_console_with_a_dead_url_says_so_and_exits_1_on_a_terminal() -> None:
    port = _closed_port()
    rc, out = _on_a_terminal(["tui", "--url", f"http://127.0.0.1:{port}", "--no-gpu"])
    assert rc == 1, out[-2000:]
    assert f"could not read the engine at http://127.0.0.1:{port}" in out
    assert "\x1b[?1049h" not in out  # the full-screen app never opened


def test_console_waits_for_a_dead_url_when_asked_then_exits_1_without_opening() -> None:
    port = _closed_port()
    rc, out = _on_a_terminal(["tui", "--url", f"http://127.0.0.1:{port}", "--no-gpu", "--interval", "0.2",
                              "--wait-for-engine", "1s"])
    assert rc == 1, out[-2000:]
    assert "waiting up to 1 s for the engine" in out
    assert f"could not read the engine at http://127.0.0.1:{port}" in out
    assert "\x1b[?1049h" not in out


def test_console_opens_once_the_engine_it_waits_for_answers() -> None:
    with PageServer() as s:
        route = s.route("/metrics", vllm_page(running=2), status=503)
        threading.Timer(1.0, setattr, (route, "status", 200)).start()
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=str(REPO),
                   XDG_CONFIG_HOME=str(REPO / ".cache" / "no-config"))
        p = subprocess.Popen([sys.executable, "-m", "kvtop", "tui", "--url", s.url, "--no-gpu", "--no-host",
                              "--interval", "0.2", "--wait-for-engine", "30s"],
                             stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        reader = PtyReader(master)
        try:
            opened = reader.wait_for("\x1b[?1049h", 60)  # the full-screen app took the terminal
        finally:
            p.kill()
            p.wait()
    assert opened, reader.text()[-2000:]
    assert "waiting up to 30 s for the engine" in reader.text()


@pytest.mark.parametrize(("args", "expect"), [
    (("snapsht",), "unknown command 'snapsht'; did you mean 'snapshot'?"),
    (("--config", "{cfg}", "anlyze", "t.jsonl"), "unknown command 'anlyze'; did you mean 'analyze'?"),
    (("snapshot", "--duraton", "3"), "unrecognized arguments: --duraton 3; did you mean '--duration'?"),
    (("record", "-o", "x", "--url", "http://h", "--proxy-listn=127.0.0.1:1"), "did you mean '--proxy-listen'?"),
    (("analyze", "t.jsonl", "--format", "jsn"), "invalid choice: 'jsn' (choose from 'json', 'text'); did you mean 'json'?"),
])
def test_a_mistyped_command_flag_or_choice_names_the_closest(args: tuple[str, ...], expect: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    r = run_kvtop(*(a.replace("{cfg}", str(cfg)) for a in args), timeout=60)
    assert r.returncode == 2
    assert expect in _one_line(r)


def test_a_word_nothing_like_a_command_lists_the_commands() -> None:
    r = run_kvtop("zzz", timeout=60)
    line = _one_line(r)
    assert r.returncode == 2 and "unknown command 'zzz'" in line and "did you mean" not in line
    assert "snapshot" in line and "analyze" in line


def test_config_works_anywhere_on_the_line_and_typos_in_it_are_named(tmp_path: Path) -> None:
    port = _closed_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'url = "http://127.0.0.1:{port}"\nintervl = 2\ngpu = false\n')
    for args in (("--config", str(cfg), "snapshot"), ("snapshot", "--config", str(cfg)),
                 ("snapshot", f"--config={cfg}", "--no-host")):
        r = run_kvtop(*args, timeout=60)
        lines = r.stderr.strip().splitlines()
        # the file was read (its URL is the one that failed), and the typo named with the key it meant
        assert r.returncode == 1, (args, r.stderr)
        assert lines[0] == f"kvtop: warning: {cfg}: unknown key 'intervl'; did you mean 'interval'?", lines
        assert f"could not read the engine at http://127.0.0.1:{port}" in lines[1]
    # keys kvtop reads itself draw no warning
    cfg.write_text(f'url = "http://127.0.0.1:{port}"\nprobe_ports = [8000]\ninterval = 0.5\n')
    r = run_kvtop("snapshot", "--no-gpu", "--config", str(cfg), timeout=60)
    assert "warning" not in r.stderr and r.returncode == 1


def test_one_duration_syntax_for_every_command(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    r = run_kvtop("simulate", "--preset", "preemption-storm", "--duration", "3s", "--scrape-interval", "500ms",
                  "-o", str(trace), timeout=60)
    assert r.returncode == 0 and "over 3 simulated s" in r.stdout, r.stderr
    engine_times = [line for line in trace.read_text().splitlines() if '"kind":"engine"' in line]
    assert len(engine_times) >= 6  # a scrape every 0.5 simulated s
    r = run_kvtop("replay", str(trace), "--headless", "--until", "2s", "--format", "json", timeout=60)
    assert r.returncode == 0, r.stderr
    r = run_kvtop("demo", "--headless", "--duration", "1.5s", "--interval", "500ms", "--speed", "10", timeout=60)
    assert r.returncode == 0 and "engine" in r.stdout.lower(), r.stderr
    # the window it reports is the one it sampled (it said "window 10.0 s" after 1.5 s)
    m = re.search(r"window ([\d.]+) s", r.stdout)
    assert m and 0 < float(m.group(1)) <= 1.5, r.stdout[:200]
    r = run_kvtop("sim-server", "--duration", "500ms", timeout=60)
    assert r.returncode == 0, r.stderr
    for args in (("demo", "--headless", "--duration", "10x"), ("simulate", "--preset", "x", "-o", "t", "--duration", "soon")):
        r = run_kvtop(*args, timeout=60)
        assert r.returncode == 2 and "must be a number of seconds (e.g. 10, 10s, 500ms, 2m)" in _one_line(r)


def test_snapshot_without_a_url_looks_on_the_usual_ports_like_the_console(tmp_path: Path) -> None:
    with PageServer() as s:
        s.route("/metrics", vllm_page(running=4))
        port = s.url.rsplit(":", 1)[1]
        (tmp_path / "kvtop").mkdir()
        cfg = tmp_path / "kvtop" / "config.toml"
        cfg.write_text(f"probe_ports = [{_closed_port()}, {port}]\n")
        r = run_kvtop("snapshot", "--duration", "0.3", "--interval", "0.1", "--no-gpu", "--format", "json",
                      env={"XDG_CONFIG_HOME": str(tmp_path)}, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(e["url"], e["running"]) for e in doc["engines"]] == [(s.url, 4)]
    # nothing on those ports: it says where it looked, and still reports the host
    closed = _closed_port()
    cfg.write_text(f"probe_ports = [{closed}]\n")
    r = run_kvtop("snapshot", "--duration", "0.2", "--no-gpu", env={"XDG_CONFIG_HOME": str(tmp_path)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == (f"kvtop snapshot: no engine found on 127.0.0.1 ports {closed}; host only "
                        "(point it at one with --url http://HOST:PORT)\n")  # --no-gpu: not "GPU and host"
    assert "host" in r.stdout.lower()
    # with the host off too: says so, and its row says why there is nothing
    r = run_kvtop("snapshot", "--duration", "0.2", "--no-gpu", "--no-host", env={"XDG_CONFIG_HOME": str(tmp_path)},
                  timeout=60)
    assert "nothing else to read (--no-gpu, --no-host)" in r.stderr


def test_a_host_row_turned_off_says_why() -> None:
    with PageServer() as s:
        s.route("/metrics", vllm_page(running=1))
        r = run_kvtop("snapshot", "--url", s.url, "--duration", "0.3", "--interval", "0.1", "--no-gpu", "--no-host",
                      timeout=60)
        j = run_kvtop("snapshot", "--url", s.url, "--duration", "0.3", "--interval", "0.1", "--no-gpu", "--no-host",
                      "--format", "json", timeout=60)
    assert r.returncode == 0 and "host  n/a (off (--no-host))" in r.stdout, r.stdout
    assert json.loads(j.stdout)["host_status"] == "off (--no-host)"


@pytest.mark.parametrize("args", [
    ("analyze", "{trace}", "--kv-bytes-per-token", "nan"),
    ("analyze", "{trace}", "--kv-bytes-per-token", "inf"),
    ("replay", "{trace}", "--headless", "--speed", "nan"),
    ("demo", "--headless", "--duration", "2", "--speed", "inf"),  # it never reached its duration
    ("demo", "--headless", "--duration", "2", "--speed", "1000"),  # the generator fell behind the clock
    ("analyze", "{trace}", "--itl-target-ms", "inf"),  # "ITL target: unknown", nothing judged
    ("replay", "{trace}", "--headless", "--until", "-1"),
    ("sim-server", "--speed", "inf"),
    ("sim-server", "--duration", "0"),  # it started and exited at once
    ("sim-server", "--host", ""),  # an empty host bound every interface
])
def test_numbers_that_are_not_finite_or_out_of_reach_are_refused(args: tuple[str, ...], tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    if "{trace}" in args:
        sim = run_kvtop("simulate", "--preset", "healthy", "--duration", "2", "-o", str(trace), timeout=60)
        assert sim.returncode == 0, sim.stderr
    r = run_kvtop(*(a.replace("{trace}", str(trace)) for a in args), timeout=60)
    assert r.returncode == 2, r.stderr
    flag = [a for a in args if a.startswith("--") and a != "--headless"][-1]  # the bad value's own flag
    assert flag in _one_line(r)


@pytest.mark.parametrize("args,says", [
    # a Prometheus window given with a trace file was ignored without a word
    (("analyze", "{trace}", "--start", "now-1h"), "--start applies to --prometheus"),
    (("analyze", "{trace}", "--selector", 'job="vllm"'), "--selector applies to --prometheus"),
    (("analyze", "--prometheus", "http://127.0.0.1:9", "--start", "nan"), "must be finite"),
    (("tui", "--replay", "{trace}", "--url", "http://127.0.0.1:9"), "--replay shows a recorded trace"),
    (("agent", "--url", "http://127.0.0.1:9", "--trace-max-size", "1M"), "give --trace-dir DIR too"),
    (("record", "-o", "{missing}.jsonl", "--url", "http://127.0.0.1:9", "--proxy-workers", "2"),
     "give --proxy-listen HOST:PORT too"),
    (("snapshot", "--url", "http://127.0.0.1:9", "--selector", 'job="x"'), "--selector picks the series"),
    (("advise", "--scenario", "{missing}.json", "--itl-target-ms", "50"), "a scenario file sets its own"),
    # a config file named on the command line that is not there, for a command that reads none of it
    (("--config", "{missing}", "plugins"), "config file not found"),
    (("analyze", "{trace}", "--config", "{missing}"), "config file not found"),
])
def test_flags_that_would_be_ignored_are_refused(args: tuple[str, ...], says: str, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    if "{trace}" in args:
        sim = run_kvtop("simulate", "--preset", "healthy", "--duration", "2", "-o", str(trace), timeout=60)
        assert sim.returncode == 0, sim.stderr
    r = run_kvtop(*(a.replace("{trace}", str(trace)).replace("{missing}", str(tmp_path / "nope.toml"))
                    for a in args), timeout=60)
    assert r.returncode == 2, r.stderr
    assert says in _one_line(r)


def test_snapshot_keeps_its_samples_when_the_engine_dies_in_the_window() -> None:
    # the engine answers the first scrapes, then goes away: the report covers what was sampled and
    # shows the engine down (it was "could not read any engine", exit 1, and no report at all)
    s = PageServer().start()
    s.route("/metrics", [vllm_page(running=2, preemptions=0), vllm_page(running=3, preemptions=4)])
    timer = threading.Timer(1.5, s.stop)
    timer.start()
    try:
        r = run_kvtop("snapshot", "--url", s.url, "--duration", "3", "--interval", "0.25", "--timeout", "0.5",
                      "--format", "json", "--no-gpu", "--no-host", timeout=60)
    finally:
        timer.cancel()
        timer.join()
    assert r.returncode == 0, r.stderr
    eng = json.loads(r.stdout)["engines"][0]
    assert eng["up"] is False and eng["error"], eng
    # what it said while up is kept, marked stale
    assert eng["preemptions_total"] == 4 and eng["running"] == 3 and eng["stale_s"] > 0.5, eng
    assert len(s.routes["/metrics"].hits) >= 3  # it was read before it went away


def test_compare_and_advise_read_what_analyze_reads_and_refuse_the_rest_in_one_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    sim = run_kvtop("simulate", "--preset", "preemption-storm", "--duration", "20", "-o", str(trace), timeout=60)
    assert sim.returncode == 0, sim.stderr
    # an agent's --trace-dir (one segment of its run here): analyze read it, compare and advise said
    # "no such trace file"
    seg_dir = tmp_path / "segments"
    seg_dir.mkdir()
    (seg_dir / "kvtop-20261205T120000.000000Z.jsonl").write_bytes(trace.read_bytes())
    verdict = run_kvtop("advise", "--trace", str(trace), timeout=60)
    r = run_kvtop("advise", "--trace", str(seg_dir), timeout=60)
    assert r.returncode == 0 and r.stdout == verdict.stdout and "verdict:" in r.stdout, r.stderr
    r = run_kvtop("compare", str(trace), str(seg_dir), "--format", "json", timeout=60)
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)
    assert c["outcome"] == "no_change" and c["a"]["completed"] == c["b"]["completed"] > 0, c["summary"]
    # a file that is not a trace: one line, exit 2 (it was a 28-line traceback, exit 1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = run_kvtop("compare", str(trace), str(empty), timeout=60)
    assert r.returncode == 2 and "is not a kvtop trace" in _one_line(r)


def test_ctrl_c_while_the_commands_load_is_exit_130_without_a_traceback(monkeypatch, capsys) -> None:
    # the parser imports every command module (0.1-0.17 s): a Ctrl-C then printed a traceback
    from kvtop import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["snapshot", "--url", "http://127.0.0.1:9"]) == 130
    assert capsys.readouterr().err == ""
