"""deploy/kubernetes/*.yaml, validated offline: built-in kinds against the Kubernetes JSON schemas
that the kubernetes-validate wheel ships (strict: an unknown or misspelt field fails), the
PodMonitor against the prometheus-operator models of cloudcoil-models-prometheus-operator; then what
the files promise (least privilege, agent command lines kvtop accepts, the scrape label)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import PodMonitor, PrometheusRule
from conftest import REPO

from kvtop.cli import build_parser

K8S = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.30"  # the oldest release still commonly run; newer schemas accept the same fields


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _all() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in _docs(p.name)]


def _validate(doc: dict[str, Any]) -> None:
    if doc["kind"] in ("PodMonitor", "PrometheusRule"):
        model = (PodMonitor if doc["kind"] == "PodMonitor" else PrometheusRule).model_validate(doc)
        # the models ignore unknown fields: what they keep must be all there was
        assert model.model_dump(mode="json", by_alias=True, exclude_unset=True) == doc
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("name", "doc"), _all(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_manifest_validates_against_its_schema(name: str, doc: dict[str, Any]) -> None:
    _validate(doc)


def test_the_validators_reject_what_they_should() -> None:
    """The two validators above would fail a broken file (so a pass means something)."""
    [dep] = _docs("kvtop-sidecar.yaml")
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][1]["securityContext"]["capabilites"] = {"drop": ["ALL"]}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][1]["securityContext"]["capabilities"]["drop"] = "ALL"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    [pm] = _docs("kvtop-podmonitor.yaml")
    typo = yaml.safe_load(yaml.safe_dump(pm))
    typo["spec"]["podMetricEndpoints"] = typo["spec"].pop("podMetricsEndpoints")
    with pytest.raises(AssertionError):
        _validate(typo)
    wrong = yaml.safe_load(yaml.safe_dump(pm))
    wrong["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(ValueError):
        _validate(wrong)


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]  # type: ignore[no-any-return]


def _agent(pod: dict[str, Any]) -> dict[str, Any]:
    [c] = [c for c in pod["spec"]["containers"] if c["name"] == "kvtop-agent"]
    return c  # type: ignore[no-any-return]


def _security(pod: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    return {**pod["spec"].get("securityContext", {}), **c.get("securityContext", {})}


def test_the_sidecar_captures_on_loopback_with_net_raw_only() -> None:
    [dep] = _docs("kvtop-sidecar.yaml")
    pod = _pod(dep)
    c = _agent(pod)
    sec = _security(pod, c)
    assert sec["capabilities"] == {"drop": ["ALL"], "add": ["NET_RAW"]}
    assert sec["allowPrivilegeEscalation"] is False and sec["runAsNonRoot"] is True and sec["runAsUser"] != 0
    assert sec["readOnlyRootFilesystem"] is True
    assert pod["spec"]["automountServiceAccountToken"] is False
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod["spec"].get(key)
    # the file-capability interpreter (a non-root process gets NET_RAW no other way) only opens the
    # packet socket, drops the capability and becomes kvtop, which parses without it
    assert c["command"] == ["kvtop-capture-python", "-I", "-m", "kvtop.sources.capture.opener", "--exec", "8000", "--",
                            "kvtop"]
    args = build_parser().parse_args(c["args"])
    assert args.command == "agent" and args.url == ["http://127.0.0.1:8000"] and args.capture == 8000
    # the engine container listens on the port the sidecar captures
    ports = {p["containerPort"] for k in pod["spec"]["containers"] if k["name"] != "kvtop-agent" for p in k["ports"]}
    assert 8000 in ports


def test_the_daemonset_probes_without_any_capability_or_host_namespace() -> None:
    svc, ds = _docs("kvtop-daemonset.yaml")
    pod = _pod(ds)
    c = _agent(pod)
    sec = _security(pod, c)
    assert sec["capabilities"] == {"drop": ["ALL"]} and sec["allowPrivilegeEscalation"] is False
    assert sec["runAsNonRoot"] is True and pod["spec"]["automountServiceAccountToken"] is False
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod["spec"].get(key)
    assert "command" not in c  # the image's plain entrypoint: no file capability
    args = build_parser().parse_args(c["args"])
    assert args.command == "agent" and args.probe > 0 and args.capture is None
    assert not any("$(NODE_IP)" in a or "status.hostIP" in str(c) for a in c["args"])
    # the URL is the node-local Service, not the node's IP: engine pods are not on the host network
    [url] = args.url
    assert url.startswith(f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:")
    assert svc["spec"]["internalTrafficPolicy"] == "Local"


def test_the_podmonitor_scrapes_both_variants_as_job_kvtop() -> None:
    [pm] = _docs("kvtop-podmonitor.yaml")
    want = pm["spec"]["selector"]["matchLabels"]
    [ep] = pm["spec"]["podMetricsEndpoints"]
    assert {"targetLabel": "job", "replacement": "kvtop"} in ep["relabelings"]
    for name, doc in _all():
        if doc["kind"] not in ("Deployment", "DaemonSet"):
            continue
        pod = _pod(doc)
        assert want.items() <= pod["metadata"]["labels"].items(), name
        assert ep["port"] in {p["name"] for p in _agent(pod)["ports"]}, name
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in _agent(pod)["env"]}
        assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace", name


def test_the_image_placeholder_names_the_right_distribution() -> None:
    for p in sorted(K8S.glob("*.yaml")):
        text = p.read_text()
        if "kvtop-agent" in text and "image:" in text:
            assert "pip install kvtop-console" in text, p.name
            assert "`pip install kvtop`" not in text.replace("`pip install kvtop` is another project", ""), p.name



def test_the_prometheusrule_carries_exactly_the_tested_alert_rules() -> None:
    """promtool tests deploy/prometheus/kvtop-alerts.yml; the operator's copy must be the same rules."""
    [rule] = _docs("kvtop-prometheusrule.yaml")
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "kvtop-alerts.yml").read_text())
    assert rule["spec"] == alerts
