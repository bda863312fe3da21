"""`kvtop analyze trace.jsonl`: token-gap spikes, their causes, and the verdict."""

from __future__ import annotations

import argparse
import json

from kvtop.errors import UsageError
from kvtop.model.sanitize import finite_json

NAME = "analyze"
HELP = "attribute token-gap spikes in a trace and give the swap/recompute/admission verdict"
DESCRIPTION = ("Read a kvtop trace (streaming), find inter-token gaps above the ITL target, attribute each to "
               "preemption, prefill interference, slow decode or unknown, measure the cost-model inputs and "
               "print the verdict.")
ORDER = 40


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file (JSON Lines) written by kvtop record / simulate")
    p.add_argument("--itl-target-ms", type=float, metavar="N",
                   help="ITL target; default: the trace header's, else 4 x the median of the first 2000 gaps")
    p.add_argument("--model-config", metavar="FILE", help="Hugging Face config.json of the served model")
    p.add_argument("--kv-bytes-per-token", type=float, metavar="N", help="KV bytes per token per rank (overrides)")
    p.add_argument("--kv-dtype", default="bf16", help="KV cache dtype for --model-config (bf16, fp8, ...)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks for --model-config")
    p.add_argument("--format", choices=("json", "text"), default="text")


def run(args: argparse.Namespace) -> int:
    from kvtop.analysis.kvbytes import ModelConfigError, load_config_file
    from kvtop.analysis.report import render_report_text
    from kvtop.analysis.scan import analyze_trace
    from kvtop.model.trace import TraceError

    if args.itl_target_ms is not None and args.itl_target_ms <= 0:
        raise UsageError("--itl-target-ms must be positive")
    if args.kv_bytes_per_token is not None and args.kv_bytes_per_token <= 0:
        raise UsageError("--kv-bytes-per-token must be positive")
    if args.tp < 1:
        raise UsageError("--tp must be >= 1")
    cfg = None
    if args.model_config:
        try:
            cfg = load_config_file(args.model_config)
        except ModelConfigError as e:
            raise UsageError(str(e)) from None
    try:
        rep = analyze_trace(args.trace, None if args.itl_target_ms is None else args.itl_target_ms / 1e3,
                            cfg, args.kv_bytes_per_token, args.kv_dtype, args.tp)
    except TraceError as e:
        raise UsageError(str(e)) from None
    except ModelConfigError as e:
        raise UsageError(str(e)) from None
    rep = finite_json(rep)  # NaN/Infinity: not JSON, and "nan ms" in text helps nobody
    if args.format == "json":
        print(json.dumps(rep, indent=1, allow_nan=False))
    else:
        print(render_report_text(rep))
    return 0
