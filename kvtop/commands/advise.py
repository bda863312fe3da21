"""`kvtop advise --scenario FILE.json`: evaluate the KV cost model on given inputs (a what-if calculator)."""

from __future__ import annotations

import argparse
import json

from kvtop.errors import UsageError

NAME = "advise"
HELP = "evaluate the swap/recompute/admission cost model on a scenario file"
DESCRIPTION = ("Evaluate the KV cost model (docs/kv-science.md §5-§11) on the inputs in a scenario file and print the "
               "verdict. The scenario format is the JSON Schema kvtop/schemas/scenario.schema.json.")
ORDER = 45


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", required=True, metavar="FILE", help="scenario JSON file")
    p.add_argument("--format", choices=("json", "text"), default="text")


def run(args: argparse.Namespace) -> int:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.analysis.advice import scenario
    from kvtop.analysis.advice.kvbytes import ModelConfigError
    from kvtop.analysis.report import render_verdict_text

    try:
        doc = scenario.load(args.scenario)
        cause, verdict = scenario.judge(doc)
    except (scenario.ScenarioError, ModelConfigError) as e:  # e.g. an unknown kv_dtype
        raise UsageError(str(e)) from None
    verdict = verdict.finite()  # NaN/Infinity: not JSON, and "nan ms" in text helps nobody
    if args.format == "json":
        print(json.dumps(scenario.result_json(doc, cause, verdict), indent=2, allow_nan=False))
    else:
        print(f"scenario: {doc.get('name') or args.scenario}")
        print(f"cause: {(cause or 'none').replace('_', ' ')}")
        print(render_verdict_text(verdict))
    return 0
