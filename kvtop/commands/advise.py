"""`kvtop advise --scenario FILE.json`: evaluate the KV cost model on given inputs (a what-if calculator)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import TYPE_CHECKING

from kvtop.errors import UsageError

if TYPE_CHECKING:
    from kvtop.model.analysis import Verdict

NAME = "advise"
HELP = "evaluate the swap/recompute/admission cost model on a scenario file (or a trace); --emit-flags for a launcher"
DESCRIPTION = ("Evaluate the KV cost model (docs/kv-science.md §5-§11) on the inputs in a scenario file and print the "
               "verdict. The scenario format is the JSON Schema kvtop/schemas/scenario.schema.json. --trace judges a "
               "recorded trace instead (the verdict `kvtop analyze` gives); --emit-flags prints only the verdict's "
               "engine flags, one shell-quoted line to append to the engine's command line.")
ORDER = 45


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenario", metavar="FILE", help="scenario JSON file")
    src.add_argument("--trace", metavar="FILE", help="a recorded trace: the verdict its analysis gives")
    p.add_argument("--itl-target-ms", type=float, default=None, metavar="MS",
                   help="with --trace: the ITL target (default: derived from the trace, as analyze does)")
    p.add_argument("--format", choices=("json", "text"), default="text")
    p.add_argument("--emit-flags", action="store_true",
                   help="print only the verdict's engine flags, one shell-quoted line; an empty line (exit 0, the verdict "
                        "named on stderr) when no flag is prescribed, e.g. scale_out: no flag helps at this load")


def run(args: argparse.Namespace) -> int:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.analysis.advice import scenario
    from kvtop.analysis.advice.kvbytes import ModelConfigError
    from kvtop.analysis.report import render_verdict_text

    if args.trace:
        return _from_trace(args)
    if args.itl_target_ms is not None:  # the scenario states its own target; the flag changed nothing
        raise UsageError("--itl-target-ms judges a --trace; a scenario file sets its own ITL target")
    try:
        doc = scenario.load(args.scenario)
        cause, verdict = scenario.judge(doc)
    except (scenario.ScenarioError, ModelConfigError) as e:  # e.g. an unknown kv_dtype
        raise UsageError(str(e)) from None
    verdict = verdict.finite()  # NaN/Infinity: not JSON, and "nan ms" in text helps nobody
    if args.emit_flags:
        return _emit(verdict)
    if args.format == "json":
        print(json.dumps(scenario.result_json(doc, cause, verdict), indent=2, allow_nan=False))
    else:
        print(f"scenario: {doc.get('name') or args.scenario}")
        print(f"cause: {(cause or 'none').replace('_', ' ')}")
        print(render_verdict_text(verdict))
    return 0


def _from_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtop.analysis.report import render_verdict_text
    from kvtop.analysis.scan import analyze_trace
    from kvtop.model.trace import TraceError

    if not Path(args.trace).exists():  # a file, or an agent's --trace-dir of segments (as analyze reads)
        raise UsageError(f"{args.trace}: no such trace file")
    if args.itl_target_ms is not None and not 0 < args.itl_target_ms <= 3_600_000:
        raise UsageError("--itl-target-ms must be > 0 and at most 3600000")
    try:
        report = analyze_trace(args.trace, itl_target_s=None if args.itl_target_ms is None else args.itl_target_ms / 1e3)
    except TraceError as e:
        raise UsageError(str(e)) from None
    verdict = report.finite().verdict
    if verdict is None:
        raise UsageError(f"{args.trace}: no verdict (the trace has no request timings or engine histograms)")
    # what analyze prints under its report (skipped lines, a cut .gz...): the verdict rests on what
    # was read, so say what was not; on stderr, where --emit-flags and --format json leave stdout clean
    for w in report.warnings:
        print(f"kvtop: warning: {w}", file=sys.stderr)
    if args.emit_flags:
        return _emit(verdict)
    if args.format == "json":
        print(json.dumps(verdict.to_dict(), indent=2, allow_nan=False))
    else:
        print(render_verdict_text(verdict))
    return 0


def _emit(verdict: Verdict) -> int:
    """The settings that name an engine flag, as one shell-quoted line; the rest on stderr."""
    from kvtop.model.analysis import flag_value

    words: list[str] = []
    for s in verdict.settings:
        if not s.flag:
            print(f"kvtop advise: {s.setting} = {s.value}: no flag for this engine (unknown adapter); not emitted",
                  file=sys.stderr)
            continue
        if not s.launcher:
            # a setting the engine reads elsewhere (Triton's config.pbtxt, a build option): not a launcher word
            print(f"kvtop advise: {s.flag} = {flag_value(s.value)}: not a flag of the engine's launcher (set it where "
                  "it says); not emitted", file=sys.stderr)
            continue
        words += s.words()
    if not words:
        # an empty line and exit 0, as for any verdict without a flag; the line on stderr says which
        # verdict, so a script tells "no flag helps" (scale_out) from "nothing to change" and from an
        # error (exit 1 or 2, nothing on stdout)
        print(f"kvtop advise: no flag to emit: verdict {verdict.action}: {_NO_FLAG.get(verdict.action, 'no setting')}",
              file=sys.stderr)
    print(shlex.join(words))
    return 0


_NO_FLAG = {
    "scale_out": "no engine flag meets the ITL target at this load on this engine: add replicas or a faster step "
                 "(the verdict's reasons give the arithmetic)",
    "no_action": "nothing to change",
    "insufficient_data": "not enough evidence to prescribe a change",
}

