"""The shipped integration files (deploy/) agree with what `kvtop agent` really exports and accepts.
(tests/test_prometheus_real.py runs the dashboard's queries and promtool on the rules.)"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from kvtop.analysis.live import LiveAnalyzer
from kvtop.cli import build_parser
from kvtop.core import Core
from kvtop.model.records import GpuRecord, HostRecord
from kvtop.sim.simulate import Simulation
from kvtop.sim.workload import load_preset
from kvtop.views.exporter import AgentMetrics

DEPLOY = REPO / "deploy"
_NAME = re.compile(r"\b(kvtop_[a-z0-9_]+)")


def _exported() -> set[str]:
    core = Core(itl_target_s=0.1, analysis=LiveAnalyzer(itl_target_s=0.1))
    m = AgentMetrics(request_engine="10.0.0.5:8000")

    def emit(r) -> None:  # noqa: ANN001
        core.ingest(r)
        m.sink(r)

    Simulation(load_preset("preemption-storm"), 1, 10.0, emit, scrape_interval_s=1.0).run()
    core.ingest(GpuRecord(t=10.0, index=0, uuid="GPU-0", mem_used_bytes=1, mem_total_bytes=2, pcie_tx_bytes_per_s=1.0,
                          pcie_rx_bytes_per_s=1.0, pcie_link_gen=4, pcie_link_gen_max=4, pcie_link_width=16,
                          pcie_link_width_max=16, pcie_replay_count=0))
    core.ingest(HostRecord(t=10.0, mem_available_bytes=1, pinned_signals={"Mlocked": 1}))
    m.update(core.snapshot(), core.analysis.counters() if core.analysis else None)
    names = set()
    for line in m.render().decode().splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "kvtop-fleet.json").read_text())
    out: list[str] = []
    for p in dash["panels"]:
        out.extend(t["expr"] for t in p.get("targets", []))
    return out


def test_every_kvtop_series_the_dashboard_and_alerts_use_is_exported():
    exported = _exported()
    used = set()
    for e in _dashboard_exprs():
        used |= set(_NAME.findall(e))
    rules = (DEPLOY / "prometheus" / "kvtop-alerts.yml").read_text()
    used |= set(_NAME.findall(rules))
    tests = (DEPLOY / "prometheus" / "kvtop-alerts.test.yml").read_text()
    used |= set(_NAME.findall(tests))
    assert len(used) >= 15
    assert sorted(used - exported) == []


def test_dashboard_structure():
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "kvtop-fleet.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"])
    engine = next(v for v in dash["templating"]["list"] if v["name"] == "engine")
    assert "kvtop_engine_up" in engine["definition"]
    # every drill-down panel filters on the chosen engine(s)
    drill = False
    for p in dash["panels"]:
        if p["type"] == "row":
            drill = "$engine" in p["title"]
            continue
        if drill:
            assert all('engine=~"$engine"' in t["expr"] for t in p["targets"]), p["title"]


def _agent_args(cmdline: str) -> list[str]:
    argv = shlex.split(cmdline)
    return argv[argv.index("agent"):]


def _unit(name: str) -> dict[str, list[str]]:
    """key -> values (systemd keys may repeat) of a unit file's [Service] and [Unit] sections."""
    out: dict[str, list[str]] = {}
    for ln in (DEPLOY / "systemd" / name).read_text().splitlines():
        if ln and not ln.startswith(("#", ";", "[")):
            k, _, v = ln.partition("=")
            out.setdefault(k.strip(), []).append(v.strip())
    return out


UNITS = ("kvtop-agent.service", "kvtop-agent-capture.service")


@pytest.mark.parametrize("name", UNITS)
def test_systemd_units_run_an_agent_that_sees_streams_with_the_least_privilege(name: str) -> None:
    u = _unit(name)
    [exec_start] = u["ExecStart"]
    args = build_parser().parse_args(_agent_args(exec_start))
    assert args.command == "agent" and args.url == ["http://127.0.0.1:8000"] and args.listen == "0.0.0.0:9470"
    assert u["NoNewPrivileges"] == ["yes"] and u["DynamicUser"] == ["yes"] and u["ProtectSystem"] == ["strict"]
    families = u["RestrictAddressFamilies"][0].split()
    if name == "kvtop-agent-capture.service":
        assert args.capture == 8000 and not args.probe
        assert u["AmbientCapabilities"] == ["CAP_NET_RAW"] and u["CapabilityBoundingSet"] == ["CAP_NET_RAW"]
        assert families == ["AF_INET", "AF_INET6", "AF_UNIX", "AF_PACKET", "AF_NETLINK"]
    else:
        assert args.probe > 0 and args.capture is None
        assert u["CapabilityBoundingSet"] == [""] and "AmbientCapabilities" not in u and "AF_PACKET" not in families
    # the unit says how to read the engine's /proc, and never advises setcap on the interpreter
    text = (DEPLOY / "systemd" / name).read_text()
    assert "RssShmem" in text and "User=" in text and "setcap cap_net_raw" not in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verify_accepts_the_units(tmp_path: Path) -> None:
    """systemd's own parser: an unknown key or a misspelt address family is a warning it prints."""
    kvtop = Path(sys.executable).with_name("kvtop")
    for name in UNITS:
        text = (DEPLOY / "systemd" / name).read_text().replace("/opt/kvtop/bin/kvtop", str(kvtop))
        (tmp_path / name).write_text(text)
    bad = (tmp_path / UNITS[1]).read_text().replace("AF_PACKET", "AF_PAKET")
    (tmp_path / "kvtop-broken.service").write_text(bad)
    out = subprocess.run(["systemd-analyze", "verify", *(str(tmp_path / n) for n in UNITS)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout + out.stderr == ""
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "kvtop-broken.service")],
                         capture_output=True, text=True, timeout=60)
    assert "AF_PAKET" in out.stderr  # the check above would have seen a mistake


def test_both_ways_of_scraping_the_agent_give_job_kvtop() -> None:
    # the stale-agent alert keys on job="kvtop": both ways of scraping the agent produce it
    assert "replacement: kvtop" in (DEPLOY / "kubernetes" / "kvtop-podmonitor.yaml").read_text()
    assert "job_name: kvtop" in (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    assert 'up{job="kvtop"}' in (DEPLOY / "prometheus" / "kvtop-alerts.yml").read_text()
