"""The shipped integration files (deploy/) agree with what `kvtop agent` really exports and accepts.
(tests/test_prometheus_real.py runs the dashboard's queries and promtool on the rules.)"""

from __future__ import annotations

import json
import re
import shlex

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


def test_the_systemd_unit_and_kubernetes_args_are_valid_agent_command_lines():
    unit = (DEPLOY / "systemd" / "kvtop-agent.service").read_text()
    [exec_start] = [ln.split("=", 1)[1] for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    k8s = (DEPLOY / "kubernetes" / "kvtop-agent.yaml").read_text()
    block = k8s[k8s.index("args:"):k8s.index("env:")]
    k8s_args = [ln.strip()[2:] for ln in block.splitlines()[1:] if ln.strip().startswith("- ")]
    for argv in (_agent_args(exec_start.replace("%H", "gpu-node-1")), k8s_args):
        args = build_parser().parse_args(argv)
        assert args.command == "agent" and args.url and args.listen == "0.0.0.0:9470"
    # the stale-agent alert keys on job="kvtop": both ways of scraping the agent produce it
    assert "replacement: kvtop" in k8s
    assert "job_name: kvtop" in (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    assert 'up{job="kvtop"}' in (DEPLOY / "prometheus" / "kvtop-alerts.yml").read_text()
