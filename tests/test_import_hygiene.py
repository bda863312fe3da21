"""Headless paths never import Textual; kvtop/ never imports the built-in adapters directly."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from page_server import PageServer
from vllm_pages import vllm_page

HEADLESS_MODULES = [
    "kvtop.core", "kvtop.snapshot", "kvtop.feeds.live", "kvtop.config", "kvtop.views.text",
    "kvtop.sources.scrape", "kvtop.sources.prom", "kvtop.model.series", "kvtop.plugin",
    "kvtop.commands.snapshot", "kvtop.cli", "kvtop.adapters", "kvtop.model.sanitize", "kvtop.model.validate",
]


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(REPO / ".cache" / "no-config"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, env=env)


def test_headless_modules_do_not_import_textual():
    code = (
        "import importlib, json, sys\n"
        f"for m in {HEADLESS_MODULES!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(k for k in sys.modules if k == 'textual' or k.startswith(('textual.', 'kvtop.views.tui')))))\n"
    )
    p = _python(code)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_snapshot_run_does_not_import_textual():
    """A whole `kvtop snapshot` (scrape, adapter, core, JSON and text output) without Textual."""
    code = (
        "import json, sys, io, contextlib\n"
        "from kvtop.cli import main\n"
        "rcs = []\n"
        "for fmt in ('json', 'text'):\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        rcs.append(main(['snapshot', '--url', sys.argv[1], '--duration', '0.3', '--interval', '0.1',\n"
        "                         '--format', fmt]))\n"
        "print(json.dumps({'rcs': rcs, 'textual': sorted(k for k in sys.modules if k.split('.')[0] == 'textual'),\n"
        "                  'vllm_loaded': 'kvtop_plugins.vllm' in sys.modules}))\n"
    )
    with PageServer() as s:
        s.route("/metrics", vllm_page())
        p = _python(code, s.url)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["rcs"] == [0, 0]
    assert out["vllm_loaded"] is True  # it really scraped through the adapter
    assert out["textual"] == []


def test_kvtop_package_never_imports_builtin_plugins_directly():
    offenders = []
    for f in (REPO / "kvtop").rglob("*.py"):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.split(".")[0] in ("kvtop_plugins", "plugins") for n in names):
                offenders.append(str(Path(f).relative_to(REPO)))
    assert offenders == []
