"""Prove a structural change changes no output: run the same commands on two trees, compare bytes.

    python bench/same_outputs.py                  # this tree against HEAD
    python bench/same_outputs.py --base main~3    # against any commit
    python bench/same_outputs.py --quick          # two presets, one tracegen situation

For a refactor that must not move a single byte (issue: "the analysis wing as typed stages"), this
runs, with the *base* commit checked out in a temporary git worktree and with this working tree:

* ``kvtop simulate`` of every preset (seeded) and the independent trace generator's situations:
  the trace bytes themselves;
* on each trace: ``kvtop analyze`` text and JSON at the trace's target and at a tight target,
  the analysis on the streaming path (``analyze_trace(fast=False)``), ``--save-scenario``, and
  ``kvtop replay --headless`` text and JSON (the Snapshot JSON through the live core);
* ``kvtop advise`` text and JSON on every scenario in ``tests/scenarios``;
* ``kvtop snapshot --format json --no-host --no-gpu`` against every captured real-engine page in
  ``tests/fixtures/engines`` (served from loopback), with the wall-clock fields (and the number of
  scrapes that fit in its second) blanked.

Both trees run under the same interpreter; each is put first on ``PYTHONPATH`` (``kvtop`` and
``kvtop_plugins``), and the traces every command reads are the ones the *base* tree wrote, so a
difference points at the command that changed. Prints one line per differing output (with the first
differing line) and a total; exit 1 when anything differs. The console's screens are compared by
the SVG snapshot tests (tests/test_tui_snapshots.py), which already fail on a changed byte.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = ["preemption-storm", "prefill-interference", "healthy", "cancel-heavy", "shared-prefix",
           "slow-decode", "swap-vs-recompute"]
SITUATIONS = ["base", "prefill", "slow-onset", "multitoken", "delivery", "sparse", "sglang",
              "nopreempt", "priority", "mixed"]
# the streaming (live) analysis path, the one `kvtop analyze` uses without numpy
STREAMING = ("import json, sys\n"
             "from kvtop.analysis.scan import analyze_trace\n"
             "from kvtop.analysis.report import render_report_text\n"
             "rep = analyze_trace(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else None, fast=False).finite()\n"
             "print(render_report_text(rep))\n"
             "print(json.dumps(rep.to_dict(), indent=1, allow_nan=False))\n")
# fields of a live snapshot that are wall-clock or this machine's, not the code's
WALL_KEYS = {"taken_at", "stale_s", "host", "gpus", "gpu_status"}
STAMP = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")


def _unwall(got: bytes, extra: frozenset[str] = frozenset()) -> bytes:
    """A JSON document on stdout with the wall-clock and this-machine fields blanked."""
    head, _, rest = got.partition(b"\n")
    body, sep, err = rest.partition(b"\n--stderr--\n")

    def strip(x: object) -> object:
        if isinstance(x, dict):
            return {k: ("-" if k in WALL_KEYS or k in extra else strip(v)) for k, v in x.items()}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    try:
        body = json.dumps(strip(json.loads(body)), indent=1).encode()
    except ValueError:
        pass
    return head + b"\n" + body + sep + err


def _pythonpath(tree: Path, into: Path) -> str:
    """A folder holding `kvtop`, `kvtop_plugins` and `eval` (where the tree has it) from `tree`, ahead
    of the editable install."""
    into.mkdir(parents=True, exist_ok=True)
    for name, src in (("kvtop", tree / "kvtop"), ("kvtop_plugins", tree / "plugins"), ("eval", tree / "eval")):
        link = into / name
        if src.exists() and not link.exists():
            link.symlink_to(src)
    return str(into)


class Tree:
    def __init__(self, name: str, root: Path, work: Path) -> None:
        self.name, self.root = name, root
        self.env = dict(os.environ, PYTHONPATH=_pythonpath(root, work / f"path-{name}"),
                        NO_COLOR="1", COLUMNS="120", TZ="UTC", KVTOP_CONFIG="/nonexistent")
        self.env.pop("XDG_CONFIG_HOME", None)

    def run(self, args: list[str], cwd: Path) -> bytes:
        p = subprocess.run([sys.executable, *args], cwd=cwd, env=self.env, capture_output=True, timeout=600)
        return b"rc=%d\n" % p.returncode + p.stdout + b"\n--stderr--\n" + p.stderr

    def kvtop(self, args: list[str], cwd: Path) -> bytes:
        return self.run(["-m", "kvtop", *args], cwd)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a: object) -> None:
        pass


def _serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    handler = functools.partial(_Quiet, directory=str(folder))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def _first_diff(a: bytes, b: bytes) -> str:
    la, lb = a.decode(errors="replace").splitlines(), b.decode(errors="replace").splitlines()
    for i, (x, y) in enumerate(zip(la, lb, strict=False)):
        if x != y:
            return f"line {i + 1}: base {x[:100]!r} / this {y[:100]!r}"
    return f"base {len(la)} lines / this {len(lb)} lines"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="commit to compare this working tree against (default HEAD)")
    ap.add_argument("--quick", action="store_true", help="two presets and one tracegen situation")
    ap.add_argument("--keep", metavar="DIR", help="keep every output under DIR (base/ and this/)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="kvtop-same-"))
    wt = work / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(wt), args.base], check=True)
    try:
        return _compare(args, work, Tree("base", wt, work), Tree("this", REPO, work))
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], check=False)
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _compare(args: argparse.Namespace, work: Path, base: Tree, this: Tree) -> int:
    presets = PRESETS[:2] if args.quick else PRESETS
    situations = SITUATIONS[-1:] if args.quick else SITUATIONS
    traces = work / "traces"
    traces.mkdir()
    out: dict[str, dict[str, bytes]] = {"base": {}, "this": {}}

    # 1. the traces: each tree writes its own, the base tree's are what every later command reads
    jobs: list[tuple[str, list[str], str]] = []  # (key, argv, kind)
    for p in presets:
        jobs.append((f"simulate/{p}", ["simulate", "--preset", p, "--seed", "1", "--duration", "60", "-o", "{out}"], "kvtop"))
    for s in situations:
        jobs.append((f"tracegen/{s}", ["--situation", s, "--seed", "1", "-o", "{out}"], "tracegen"))

    def make(tree: Tree, key: str, argv: list[str], kind: str) -> None:
        dest = work / tree.name / (key.replace("/", "-") + ".jsonl")
        dest.parent.mkdir(parents=True, exist_ok=True)
        argv = [a.format(out=dest, root=tree.root) for a in argv]
        if kind == "tracegen":  # the generator is the module eval.tracegen.cli (a script under bench/ before)
            old = tree.root / "bench" / "tracegen" / "cli.py"
            cli = [str(old)] if old.exists() else ["-m", "eval.tracegen.cli"]
            log = tree.run([*cli, *argv], work)
        else:
            log = tree.kvtop(argv, work)
        out[tree.name][key + " (log)"] = STAMP.sub(b"<time>", log.replace(str(dest).encode(), b"<out>"))
        out[tree.name][key + " (trace bytes)"] = STAMP.sub(b"<time>", dest.read_bytes()) if dest.exists() else b"<none>"
        if tree is base:
            shutil.copy(dest, traces / dest.name)

    with cf.ThreadPoolExecutor(args.jobs) as ex:
        list(ex.map(lambda j: make(*j), [(t, *job) for job in jobs for t in (base, this)]))

    # 2. what each tree makes of the same traces and scenarios
    cmds: list[tuple[str, list[str], str]] = []
    for tr in sorted(traces.glob("*.jsonl")):
        k = tr.stem
        cmds += [
            (f"{k}: analyze", ["analyze", str(tr)], "kvtop"),
            (f"{k}: analyze json", ["analyze", str(tr), "--format", "json"], "kvtop"),
            (f"{k}: analyze tight", ["analyze", str(tr), "--itl-target-ms", "25", "--format", "json"], "kvtop"),
            (f"{k}: analyze scenario", ["analyze", str(tr), "--save-scenario", "{tmp}/scen.json"], "kvtop+scen"),
            (f"{k}: streaming", ["-c", STREAMING, str(tr)], "python"),
            (f"{k}: streaming tight", ["-c", STREAMING, str(tr), "0.025"], "python"),
            (f"{k}: replay", ["replay", "--headless", str(tr)], "kvtop"),
            (f"{k}: replay json", ["replay", "--headless", "--format", "json", str(tr)], "kvtop+wall"),
        ]
    for sc in sorted((REPO / "tests" / "scenarios").glob("*.json")):
        cmds += [(f"advise {sc.stem}", ["advise", "--scenario", str(sc)], "kvtop"),
                 (f"advise {sc.stem} json", ["advise", "--scenario", str(sc), "--format", "json"], "kvtop")]

    def one(tree: Tree, key: str, argv: list[str], kind: str) -> None:
        tmp = Path(tempfile.mkdtemp(dir=work))
        argv = [a.format(tmp=tmp) for a in argv]
        got = tree.run(argv, work) if kind == "python" else tree.kvtop(argv, work)
        if kind == "kvtop+wall":
            got = _unwall(got)
        if kind == "kvtop+scen":
            scen = tmp / "scen.json"
            got += b"\n--scenario--\n" + (scen.read_bytes() if scen.exists() else b"<none>")
        out[tree.name][key] = STAMP.sub(b"<time>", got.replace(str(tmp).encode(), b"<tmp>"))

    with cf.ThreadPoolExecutor(args.jobs) as ex:
        list(ex.map(lambda j: one(*j), [(t, *c) for c in cmds for t in (base, this)]))

    # 3. the Snapshot JSON on every captured real-engine page
    pages = work / "pages"
    pages.mkdir()
    for f in sorted((REPO / "tests" / "fixtures" / "engines").glob("*.prom")):
        (pages / f.stem).mkdir()
        shutil.copy(f, pages / f.stem / "metrics")
    srv, port = _serve(pages)
    try:
        for d in sorted(pages.iterdir()):
            for tree in (base, this):
                got = tree.kvtop(["snapshot", "--url", f"http://127.0.0.1:{port}/{d.name}/metrics", "--duration", "1",
                                  "--interval", "0.5", "--no-host", "--no-gpu", "--format", "json"], work)
                out[tree.name][f"snapshot {d.name}"] = STAMP.sub(b"<time>", _unwall(got, frozenset({"window_s", "records"})))
    finally:
        srv.shutdown()

    if args.keep:
        for name, d in out.items():
            for key, data in d.items():
                p = Path(args.keep) / name / re.sub(r"[^A-Za-z0-9._-]+", "_", key)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
    # an output that is an error on both sides proves nothing: say so
    failed = [k for k, v in out["base"].items() if not k.endswith("(trace bytes)") and not v.startswith(b"rc=0\n")]
    for k in failed:
        print(f"FAILED ON BASE  {k}: {out['base'][k].splitlines()[-1][:120]!r}")
    differ = [k for k in out["base"] if out["base"][k] != out["this"].get(k)]
    for k in differ:
        print(f"DIFFERS  {k}: {_first_diff(out['base'][k], out['this'].get(k, b''))}")
    total = len(out["base"])
    print(f"{total - len(differ)} of {total} outputs byte-identical against {args.base}"
          f" ({len(presets)} presets, {len(situations)} tracegen situations, "
          f"{len(list((REPO / 'tests' / 'scenarios').glob('*.json')))} scenarios, {len(list(pages.iterdir()))} engine pages)")
    return 1 if differ or failed else 0


if __name__ == "__main__":
    sys.exit(main())
