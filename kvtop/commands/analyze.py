"""`kvtop analyze trace.jsonl`: token-gap spikes, their causes, and the verdict."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvtop import __version__
from kvtop.commands._longrun import Interrupt, Progress, interrupted_note
from kvtop.commands._options import add_prometheus_auth_options, itl_target_s, prometheus_auth, timeout_s
from kvtop.config import load_config, parse_seconds
from kvtop.errors import RunFailure, UsageError

if TYPE_CHECKING:
    from kvtop.model.analysis import AnalysisReport
    from kvtop.picture import Picture

NAME = "analyze"
HELP = "attribute token-gap spikes in a trace and give the swap/recompute/admission verdict"
DESCRIPTION = ("Read a kvtop trace (streaming), find inter-token gaps above the ITL target, attribute each to "
               "preemption, prefill interference, slow decode or unknown, measure the cost-model inputs and "
               "print the verdict.")
ORDER = 40


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", default=None,
                   help="trace file (JSON Lines, or a .jsonl.gz agent segment) written by kvtop record / simulate / agent")
    p.add_argument("--prometheus", metavar="URL", default=None,
                   help="analyze the engines a Prometheus server holds instead of a trace (aggregate basis)")
    # None (not the defaults) until --prometheus reads them: given with a trace file they are refused
    p.add_argument("--start", default=None, metavar="TIME",
                   help="with --prometheus: start (now-1h, unix seconds or RFC 3339; default now-1h)")
    p.add_argument("--end", default=None, metavar="TIME", help="with --prometheus: end (default now)")
    p.add_argument("--step", default=None, metavar="SECONDS", help="with --prometheus: evaluation step (default 15s)")
    p.add_argument("--selector", default=None, metavar="MATCHERS",
                   help='with --prometheus: extra label matchers, e.g. job="vllm",cluster="eu1"')
    p.add_argument("--timeout", default="30s", metavar="SECONDS", help="with --prometheus: per-query timeout")
    p.add_argument("--token", default=None, help="with --prometheus: bearer token (visible in the process list: "
                   "prefer --token-file or KVTOP_TOKEN)")
    p.add_argument("--token-file", default=None, metavar="FILE", help="with --prometheus: read the bearer token from FILE")
    add_prometheus_auth_options(p)
    p.add_argument("--itl-target-ms", type=float, metavar="N",
                   help="ITL target; default: the trace header's, else 4 x the median of the first 2000 gaps")
    p.add_argument("--model-config", metavar="FILE", help="Hugging Face config.json of the served model")
    p.add_argument("--kv-bytes-per-token", type=float, metavar="N", help="KV bytes per token per rank (overrides)")
    p.add_argument("--kv-dtype", default="bf16", help="KV cache dtype for --model-config (bf16, fp8, ...)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks for --model-config")
    p.add_argument("--format", choices=("json", "text"), default="text")
    p.add_argument("--html", metavar="FILE",
                   help="also write a self-contained HTML report (verdict, history charts, per-request timelines; "
                        "no network needed to view it)")
    p.add_argument("--otlp-endpoint", metavar="URL",
                   help="also export one OpenTelemetry span per request, a stall event per spike, over OTLP/HTTP "
                        "(e.g. http://127.0.0.1:4318; needs the otlp extra)")
    p.add_argument("--save-scenario", metavar="FILE",
                   help="also write the measured inputs as a `kvtop advise` scenario (a what-if from this trace)")


def run(args: argparse.Namespace) -> int:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.analysis.advice.kvbytes import ModelConfigError, dtype_bytes, load_config_file
    from kvtop.analysis.report import render_report_text
    from kvtop.analysis.scan import analyze_trace, picture_trace
    from kvtop.model.trace import TraceError

    target = itl_target_s(args, {})
    kvb = args.kv_bytes_per_token
    if kvb is not None and not (math.isfinite(kvb) and kvb > 0):
        raise UsageError(f"--kv-bytes-per-token must be a positive number, not {kvb:g}")
    if args.tp < 1:
        raise UsageError("--tp must be >= 1")
    if args.otlp_endpoint:
        from kvtop import otlp

        try:
            args.otlp_endpoint = otlp.endpoint(args.otlp_endpoint)
            otlp.require_proto()
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.prometheus:
        if args.otlp_endpoint:
            raise UsageError("--otlp-endpoint exports a trace file's requests; with --prometheus there are none")
        if args.html:
            raise UsageError("--html draws a trace file (per-request timelines); with --prometheus there is none")
        return _prometheus(args, target)
    if args.trace is None:
        raise UsageError("give a trace file, or --prometheus URL to analyze what Prometheus holds")
    given = [f for f, v in (("--start", args.start), ("--end", args.end), ("--step", args.step),
                            ("--selector", args.selector)) if v is not None]
    if given:
        raise UsageError(f"{given[0]} applies to --prometheus; a trace file is analysed whole")
    cfg = None
    try:
        dtype_bytes(args.kv_dtype)  # a typo is said even where no --model-config reads it
        if args.model_config:
            cfg = load_config_file(args.model_config)
    except ModelConfigError as e:
        raise UsageError(str(e)) from None
    size = _size(args.trace)
    progress = Progress(f"kvtop analyze: {args.trace}")
    pic = None

    with Interrupt() as stop:
        def tick(done: int | None) -> bool:
            if done is not None:
                progress.update(done, size, f"{done / 1e6:.0f} MB" + (f" of {size / 1e6:.0f} MB" if size else ""))
            return stop.requested

        try:
            if args.html or args.otlp_endpoint:
                # one pass gives the report and what the page and the spans draw beside it
                pic = picture_trace(args.trace, target, cfg, args.kv_bytes_per_token, args.kv_dtype, args.tp,
                                    tick=tick)
                rep = pic.report
            else:
                rep = analyze_trace(args.trace, target, cfg, args.kv_bytes_per_token, args.kv_dtype, args.tp,
                                    tick=tick)
        except TraceError as e:
            raise UsageError(str(e)) from None
        except ModelConfigError as e:
            raise UsageError(str(e)) from None
        finally:
            progress.close()
    if stop.requested:
        interrupted_note("analyze", "the report below covers the part of the trace read so far")
    rep = rep.finite()  # NaN/Infinity: not JSON, and "nan ms" in text helps nobody
    if args.save_scenario:
        _save_scenario(args, rep)
    if pic is not None and args.html:
        _write_html(args.html, pic)
    if args.format == "json":
        print(json.dumps(rep.to_json(__version__), indent=1, allow_nan=False))
    else:
        print(render_report_text(rep))
    if pic is not None and args.otlp_endpoint:
        return _export(args.otlp_endpoint, pic)
    return 0


def _size(path: str) -> int | None:
    """The bytes a scan will read, for its progress; None for a compressed segment (or no file)."""
    if path.endswith(".gz"):
        return None
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _export(url: str, pic: Picture) -> int:
    """The trace's requests as spans (their stalls as events) to an OTLP/HTTP receiver; 1 when it fails."""
    from kvtop import otlp

    try:
        n_spans, n_events = otlp.export_picture(url, pic)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except otlp.OtlpError as e:
        sys.stderr.write(f"kvtop: error: {e}\n")
        return 1
    left = pic.report.spikes_total - len(pic.report.spikes)
    sys.stderr.write(f"kvtop: exported {n_spans} span(s) with {n_events} stall event(s) to {url}"
                     + (f" (the {left} oldest spikes are not listed in the report, so not exported)" if left else "")
                     + "\n")
    return 0


def _write_html(path: str, pic: Picture) -> None:
    from kvtop.views.html import render_html

    try:
        Path(path).write_text(render_html(pic), encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
    sys.stderr.write(f"kvtop: wrote {path}\n")


def _save_scenario(args: argparse.Namespace, rep: AnalysisReport) -> None:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.analysis.advice import scenario
    from kvtop.model.trace import TraceReader

    reader = TraceReader(args.trace)
    engine = (reader.header.get("engine") or {}).get("adapter")
    reader.close()
    try:
        doc = scenario.from_report(rep, f"from {Path(args.trace).name}", engine, args.tp)
    except scenario.ScenarioError as e:
        raise UsageError(str(e)) from None
    try:
        Path(args.save_scenario).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write {args.save_scenario}: {e.strerror or e}") from None


def _prometheus(args: argparse.Namespace, target: float | None) -> int:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.analysis.report import render_report_text
    from kvtop.sources.promapi import PromClient, PromError
    from kvtop.sources.promfleet import analyze_history, parse_selector, parse_time

    if args.trace is not None:
        raise UsageError("give either a trace file or --prometheus, not both")
    now = time.time()
    try:
        start, end = parse_time(args.start or "now-1h", now), parse_time(args.end or "now", now)
        parse_selector(args.selector)
    except ValueError as e:
        raise UsageError(str(e)) from None
    step = parse_seconds(args.step or "15s", "--step")
    timeout = timeout_s(args, {}, 30.0)
    if not (math.isfinite(start) and math.isfinite(end)):
        raise UsageError("--start and --end must be finite times")
    if not end > start:
        raise UsageError("--end must be after --start")
    if not 0 < step <= 3600:
        raise UsageError("--step must be > 0 and at most 3600 seconds")
    if (end - start) / step > 11000:
        raise UsageError(f"{(end - start) / step:.0f} steps: Prometheus answers at most 11000 per query; raise --step")
    client = PromClient(args.prometheus, timeout_s=timeout, auth=prometheus_auth(args, load_config(getattr(args, "config", None))))
    try:
        rep = analyze_history(client, start, end, step, args.selector, target)
    except PromError as e:
        raise RunFailure(str(e)) from None
    finally:
        client.close()
    if not rep.instances:
        raise RunFailure(f"Prometheus at {client.url} holds no engine metrics between --start and --end"
                         + (f" matching {args.selector}" if args.selector else ""))
    if args.format == "json":
        print(json.dumps(rep.to_json(__version__), indent=1, allow_nan=False, default=str))
        return 0
    print(f"note: {rep.note}")
    for inst in rep.instances:
        print()
        print(f"== {inst.instance} (job {inst.job}, {inst.adapter or 'unknown engine'}, "
              f"{inst.samples} samples)")
        if inst.report is None:
            print(f"no usable samples{': ' + inst.error if inst.error else ''}")
        else:
            print(render_report_text(inst.report))
    return 0
