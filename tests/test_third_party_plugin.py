"""A third-party adapter, packaged out of tree with its own ``kvtop.engines`` entry point, is listed
and used by kvtop with no change to kvtop; so is a single-file adapter passed with ``--plugin``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, run_kvtop
from replay_server import PROM, replay_server

ADAPTER_SRC = '''
from kvtop.model.records import EngineRecord
from kvtop.plugin import EngineAdapter
from kvtop.sources.prom import parse_page


class ToyAdapter(EngineAdapter):
    name = "{name}"
    description = "toy engine for the plugin test"
    fields = frozenset({{"running", "waiting", "kv_usage"}})
    preempts = False

    @classmethod
    def detect(cls, metric_names):
        return 0.9 if any(m.startswith("toy:") for m in metric_names) else 0.0

    def parse(self, text, t):
        page = parse_page(text)
        return [EngineRecord(t=t, adapter=self.name, running=page.value("toy:active"),
                             waiting=page.value("toy:queued"), kv_usage=page.value("toy:kv_fraction"))]
'''
# Written against the public SDK alone (kvtop.adapters + kvtop.model): two engines by label, a
# histogram, a capacity converted with as_int, settings named with the Setting enum.
SDK_ADAPTER_SRC = '''
from kvtop.adapters import EngineAdapter, Setting, as_int, prefix_score, read_page
from kvtop.model.records import EngineRecord


class SdkToyAdapter(EngineAdapter):
    name = "sdktoy"
    description = "toy engine using only the adapter SDK"
    fields = frozenset({"running", "kv_capacity_tokens", "itl"})
    settings = {Setting.MAX_SEQS: "--toy-max-seqs"}

    @classmethod
    def detect(cls, metric_names):
        return prefix_score(metric_names, "sdktoy_", ("sdktoy_running",))

    def parse(self, text, t):
        page = read_page(text, ("sdktoy_running",))
        out = []
        for eng in page.label_values("engine", ["sdktoy_running"]):
            m = {"engine": eng}
            out.append(EngineRecord(
                t=t, adapter=self.name, engine=eng, warnings=list(page.warnings),
                running=page.value("sdktoy_running", m),
                kv_capacity_tokens=as_int(page.value("sdktoy_kv_blocks", m)),
                itl=page.histogram("sdktoy_itl_seconds", m)))
        return out
'''
SDK_PAGE = (
    "# TYPE sdktoy_running gauge\nsdktoy_running{engine=\"0\"} 3\nsdktoy_running{engine=\"1\"} 5\n"
    "sdktoy_kv_blocks{engine=\"0\"} 1024\nsdktoy_kv_blocks{engine=\"1\"} +Inf\n"
    "# TYPE sdktoy_itl_seconds histogram\n"
    "sdktoy_itl_seconds_bucket{engine=\"0\",le=\"0.05\"} 90\nsdktoy_itl_seconds_bucket{engine=\"0\",le=\"+Inf\"} 100\n"
    "sdktoy_itl_seconds_count{engine=\"0\"} 100\nsdktoy_itl_seconds_sum{engine=\"0\"} 3.0\n"
)
TOY_PAGE = "# TYPE toy:active gauge\ntoy:active 4\n# TYPE toy:queued gauge\ntoy:queued 9\ntoy:kv_fraction 0.625\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Build and install the out-of-tree package with pip (no network, no build isolation)."""
    root = tmp_path_factory.mktemp("toyplugin")
    pkg = root / "src"
    (pkg / "toy_kvtop").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "toy-kvtop-adapter"
        version = "0.3.1"

        [project.entry-points."kvtop.engines"]
        toyengine = "toy_kvtop:ToyAdapter"
        brokenengine = "toy_kvtop.broken:Nope"
        sdktoy = "toy_kvtop.sdk:SdkToyAdapter"
    """))
    (pkg / "toy_kvtop" / "sdk.py").write_text(SDK_ADAPTER_SRC)
    (pkg / "toy_kvtop" / "__init__.py").write_text(ADAPTER_SRC.format(name="toyengine"))
    (pkg / "toy_kvtop" / "broken.py").write_text("raise ImportError('missing dependency of a broken plugin')\n")
    target = root / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--no-index",
         "--target", str(target), str(pkg)],
        capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (target / "toy_kvtop" / "__init__.py").is_file()
    return target


def _env(site: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{REPO}{os.pathsep}{site}"}


def test_listed_by_kvtop_plugins_without_importing(site):
    r = run_kvtop("plugins", env=_env(site))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("toyengine"))
    assert "toy_kvtop:ToyAdapter" in line and "toy-kvtop-adapter 0.3.1" in line
    # the broken plugin is listed too: listing never imports (its import would raise)
    assert any(ln.startswith("brokenengine") for ln in r.stdout.splitlines())
    j = json.loads(run_kvtop("plugins", "--format", "json", env=_env(site)).stdout)
    names = {a["name"] for a in j}
    assert {"toyengine", "vllm", "sglang", "tgi", "llamacpp", "triton"} <= names


def test_registry_detects_and_parses_with_the_plugin(site, tmp_path):
    page = tmp_path / "toy.prom"
    page.write_text(TOY_PAGE)
    vllm_page = FIXTURES / "vllm-0.32.0-cpu-live-idle.prom"
    code = textwrap.dedent(f"""
        import json, sys
        from kvtop.plugin import detect_adapter
        from kvtop.sources.prom import parse_page
        out = {{}}
        text = open({str(page)!r}).read()
        cls = detect_adapter(parse_page(text).names)
        (rec,) = cls().parse(text, 1.0)
        out["toy"] = [cls.name, rec.running, rec.waiting, rec.kv_usage, cls.preempts]
        # the broken plugin does not break detection for the others
        out["vllm"] = detect_adapter(parse_page(open({str(vllm_page)!r}).read()).names).name
        print(json.dumps(out))
    """)
    e = dict(os.environ, **_env(site))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=e)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["toy"] == ["toyengine", 4, 9, 0.625, False]
    assert out["vllm"] == "vllm"


def test_kvtop_snapshot_uses_the_installed_plugin(site):
    with replay_server({"/metrics": (TOY_PAGE, PROM)}) as (base, hits):
        r = run_kvtop("snapshot", "--url", base, "--duration", "0.5", "--interval", "0.25", "--format", "json",
                      "--no-gpu", "--no-host", env=_env(site), timeout=120)
    assert r.returncode == 0, r.stderr
    (e,) = json.loads(r.stdout)["engines"]
    assert (e["adapter"], e["up"], e["running"], e["waiting"], e["kv_usage"]) == ("toyengine", True, 4, 9, 0.625)
    assert e["preempts"] is False
    assert hits["/metrics"] >= 2


def test_single_file_plugin_with_dash_dash_plugin(tmp_path):
    f = tmp_path / "filetoy.py"
    f.write_text(ADAPTER_SRC.format(name="filetoy"))
    r = run_kvtop("--plugin", str(f), "plugins")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("filetoy"))
    assert "--plugin" in line
    with replay_server({"/metrics": (TOY_PAGE, PROM)}) as (base, _):
        r = run_kvtop("--plugin", str(f), "snapshot", "--url", base, "--duration", "0.3", "--interval", "0.15",
                      "--format", "json", "--no-gpu", "--no-host", timeout=120)
    assert r.returncode == 0, r.stderr
    (e,) = json.loads(r.stdout)["engines"]
    assert (e["adapter"], e["running"], e["waiting"]) == ("filetoy", 4, 9)
    bad = run_kvtop("--plugin", str(tmp_path / "missing.py"), "plugins")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not found" in bad.stderr


def test_sdk_only_adapter_needs_nothing_but_the_sdk(site):
    """The out-of-tree SDK adapter imports only kvtop.adapters and kvtop.model, and kvtop runs it:
    per-engine records, a histogram, a non-finite capacity degraded to n/a rather than a crash."""
    imported = {ln.split()[1] for ln in SDK_ADAPTER_SRC.splitlines() if ln.startswith(("from ", "import "))}
    assert imported == {"kvtop.adapters", "kvtop.model.records"}
    with replay_server({"/metrics": (SDK_PAGE, PROM)}) as (base, _):
        r = run_kvtop("snapshot", "--url", base, "--duration", "0.5", "--interval", "0.25", "--format", "json",
                      "--no-gpu", "--no-host", env=_env(site), timeout=120)
    assert r.returncode == 0, r.stderr
    engines = {e["engine"]: e for e in json.loads(r.stdout)["engines"]}
    assert set(engines) == {"0", "1"}
    assert engines["0"]["adapter"] == "sdktoy" and engines["0"]["running"] == 3 and engines["1"]["running"] == 5
    assert engines["0"]["kv_capacity_tokens"] == 1024 and engines["1"]["kv_capacity_tokens"] is None
    assert engines["0"]["preempts"] is True
