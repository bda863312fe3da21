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
import yaml
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
                          pcie_rx_bytes_per_s=1.0, pcie_source="field_counters", pcie_tx_bytes_total=10,
                          pcie_rx_bytes_total=10, pcie_link_gen=4, pcie_link_gen_max=4, pcie_link_width=16,
                          pcie_link_width_max=16, pcie_replay_count=0))
    core.ingest(HostRecord(t=10.0, mem_available_bytes=1, pinned_signals={"Mlocked (excludes CUDA pinned)": 1,
                                                                         "cgroup shmem": 5},
                           pinned_signal="cgroup shmem", pinned_bytes=5))
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
    out.extend(v["definition"] for v in dash["templating"]["list"] if v["type"] == "query")
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


def _dash() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "kvtop-fleet.json").read_text())


def test_dashboard_structure():
    dash = _dash()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"])
        assert len(p.get("description", "")) >= 40, f"panel {p['title']!r} has no description"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance", "model_name", "engine"]
    # each variable narrows the next: job -> instance -> model_name -> engine
    assert '$job' in variables["instance"]["definition"] and "$model_name" in variables["engine"]["definition"]
    assert all(v["includeAll"] and v["allValue"] == ".*" for k, v in variables.items() if k != "datasource")
    # every panel honours $job and $instance; every panel on engine series honours $engine and $model_name
    for p in dash["panels"]:
        for t in p.get("targets", []):
            e = t["expr"]
            assert 'job=~"$job"' in e and 'instance=~"$instance"' in e, (p["title"], e)
            engine_series = re.search(r"kvtop_(engine_|token_gap|stall|verdict|itl_target|preemptions_attr|stream_)", e)
            if engine_series:
                assert 'engine=~"$engine"' in e, (p["title"], e)
                if "kvtop_streams_observed" not in e:
                    assert 'model_name=~"$model_name"' in e, (p["title"], e)


def test_the_engines_table_names_its_columns():
    dash = _dash()
    [table] = [p for p in dash["panels"] if p["type"] == "table"]
    refs = [t["refId"] for t in table["targets"]]
    org = next(t["options"] for t in table["transformations"] if t["id"] == "organize")
    # every "Value #X" Grafana would show is renamed or hidden
    for r in refs:
        col = f"Value #{r}"
        assert col in org["renameByName"] or org["excludeByName"].get(col), col
    shown = [v for k, v in org["renameByName"].items() if not org["excludeByName"].get(k)]
    assert not any("Value" in v for v in shown)
    assert {"KV cache usage", "Preemptions/s", "Verdict", "Mechanism", "Model"} <= set(shown)


def test_dashboard_links_to_the_engine_and_gpu_dashboards_and_provisioning_is_not_default():
    tags = {tuple(lk.get("tags", [])) for lk in _dash()["links"] if lk["type"] == "dashboards"}
    assert {("vllm",), ("dcgm",)} <= tags
    ds = (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    assert "isDefault: false" in ds and "isDefault: true" not in ds


def _alerts() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "kvtop-alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _anchors(md: str) -> set[str]:
    """GitHub's heading anchors: lower case, spaces to '-', punctuation other than '-' and '_' dropped."""
    out = set()
    for ln in md.splitlines():
        m = re.match(r"#{1,6} (.+)", ln)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_every_alert_has_a_description_and_a_runbook_that_exists():
    alerts = _alerts()
    assert {"KvtopPreemptionCausedItlMisses", "KvtopNoObservedStreams", "KvtopAgentStale",
            "KvtopEngineUnreachableFromAgent"} <= {a["alert"] for a in alerts}
    for a in alerts:
        ann = a["annotations"]
        assert ann.get("summary") and len(ann.get("description", "")) > 40, a["alert"]
        url = ann["runbook_url"]
        m = re.fullmatch(r"https://github\.com/example/kvtop/blob/main/(docs/[\w.-]+\.md)#([\w-]+)", url)
        assert m, url
        doc = REPO / m.group(1)
        assert doc.exists() and m.group(2) in _anchors(doc.read_text()), url
        assert m.group(2) == a["alert"].lower()


def test_promtool_unit_tests_fire_every_alert():
    tests = yaml.safe_load((DEPLOY / "prometheus" / "kvtop-alerts.test.yml").read_text())
    fired = {c["alertname"] for t in tests["tests"] for c in t["alert_rule_test"] if c["exp_alerts"]}
    silent = {c["alertname"] for t in tests["tests"] for c in t["alert_rule_test"] if not c["exp_alerts"]}
    names = {a["alert"] for a in _alerts()}
    assert fired == names and silent == names  # each alert both fires and stays silent somewhere
    for t in tests["tests"]:
        for c in t["alert_rule_test"]:
            for exp in c["exp_alerts"]:
                assert exp["exp_annotations"]["runbook_url"].endswith("#" + c["alertname"].lower())


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
        # the capability opens the socket and is dropped before kvtop parses a byte
        assert shlex.split(exec_start)[:8] == ["/opt/kvtop/bin/python", "-I", "-m", "kvtop.sources.capture.opener",
                                               "--exec", "8000", "--", "/opt/kvtop/bin/kvtop"]
    else:
        assert args.probe > 0 and args.capture is None
        assert u["CapabilityBoundingSet"] == [""] and "AmbientCapabilities" not in u and "AF_PACKET" not in families
    # NVML opens /dev/nvidia*: nothing may turn on systemd's device allow-list (ProtectClock= implies one)
    assert not {"PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock"} & set(u)
    # the unit says how to read the engine's /proc, and never advises setcap on the interpreter
    text = (DEPLOY / "systemd" / name).read_text()
    assert "RssShmem" in text and "User=" in text and "setcap cap_net_raw" not in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verify_accepts_the_units(tmp_path: Path) -> None:
    """systemd's own parser: an unknown key or a misspelt address family is a warning it prints."""
    kvtop = Path(sys.executable).with_name("kvtop")
    for name in UNITS:
        text = (DEPLOY / "systemd" / name).read_text().replace("/opt/kvtop/bin/kvtop", str(kvtop))
        text = text.replace("/opt/kvtop/bin/python", sys.executable)
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
