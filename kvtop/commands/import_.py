"""`kvtop import vllm-bench RESULT -o TRACE`: a benchmark's per-request timings as a kvtop trace."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtop.commands._options import check_output, replace_output, same_file
from kvtop.errors import UsageError

NAME = "import"
HELP = "turn a benchmark result into a kvtop trace (vllm bench serve --save-detailed), for analyze"
DESCRIPTION = ("Read the per-request timings a benchmark saved (start, time to first token, every inter-token "
               "latency, prompt and output lengths) and write a kvtop trace that `kvtop analyze` reads. What the "
               "result cannot give (engine scrapes: KV usage, preemptions) is named in the trace header, and "
               "the analysis says so. See docs/interop.md.")
ORDER = 45
FORMATS = ("vllm-bench",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("format", choices=FORMATS,
                   help="vllm-bench: the JSON of `vllm bench serve --save-result --save-detailed`")
    p.add_argument("file", help="the benchmark's result file")
    p.add_argument("-o", "--output", required=True, metavar="TRACE", help="trace file to write (JSON Lines)")
    p.add_argument("--force", action="store_true", help="overwrite TRACE if it already exists")


def run(args: argparse.Namespace) -> int:
    # loaded only when the command runs: the parser imports every command module
    from kvtop.importers import vllm_bench
    from kvtop.model.trace import TraceWriter

    src, out = Path(args.file), Path(args.output)
    if same_file(src, out):
        raise UsageError("-o names the result file itself: choose another trace file")
    try:
        doc = vllm_bench.read(src)
    except vllm_bench.BenchFileError as e:
        raise UsageError(str(e)) from None
    check_output(args.output, args.force)  # an older trace under this name was replaced without a word
    header = vllm_bench.header(doc, src.name)
    n = 0
    try:
        replace_output(args.output)  # the writer appends
        with TraceWriter(out, header) as w:
            for rec in vllm_bench.records(doc):
                w.write(rec)
                n += 1
    except OSError as e:
        raise UsageError(f"cannot write {out}: {e.strerror or e}") from None
    reqs = len(doc["ttfts"])
    sys.stderr.write(f"kvtop: {out}: {n} record(s) from {reqs} request(s) of {src.name}; no engine scrapes in a "
                     f"benchmark result (see the trace header's \"missing\")\n")
    return 0
