"""`kvtop load`: replay a recorded trace's traffic (or a workload's) against an engine, recording it."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import sys
from typing import TYPE_CHECKING

from kvtop.commands._longrun import STOP_SIGNALS
from kvtop.commands._options import (
    MAX_DURATION_S,
    add_engine_options,
    add_host_options,
    check_output,
    same_file,
    source_options,
)
from kvtop.config import load_config, parse_seconds
from kvtop.errors import UsageError
from kvtop.model.sanitize import redact_url
from kvtop.pipeline import SourceOptions, live_feed

if TYPE_CHECKING:
    from kvtop.commands._longrun import GuardedTrace
    from kvtop.load.client import LoadClient
    from kvtop.load.plan import Plan
    from kvtop.model.records import Record

NAME = "load"
HELP = "replay a trace's arrivals, lengths, cancels and slow readers (or a workload) against an engine, recording it"
DESCRIPTION = (
    "Sends the requests of a recorded trace (--from) or of a simulator workload (--workload / --preset) to an "
    "OpenAI-compatible /v1/completions at the same times (or --rate-scale times faster), with synthetic token-id "
    "prompts of the recorded lengths, max_tokens = the recorded output length with ignore_eos, the same client "
    "cancels and read pauses. Everything goes through kvtop's recording proxy, so -o is a trace like `kvtop record "
    "--proxy-listen` writes (its header names the source and the target), ready for `kvtop analyze` and "
    "`kvtop compare`. Loopback targets only unless --allow-remote."
)
ORDER = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="source", metavar="TRACE", help="replay this recorded trace's requests")
    src.add_argument("--workload", metavar="FILE", help="send a simulator workload's traffic (docs/simulator.md)")
    src.add_argument("--preset", metavar="NAME", help="send a built-in simulator preset's traffic")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="trace file to write")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it already exists")
    add_engine_options(p, url_help="the engine to load (base URL, e.g. http://127.0.0.1:8000)")
    p.add_argument("--allow-remote", action="store_true", help="allow a target that is not on loopback")
    p.add_argument("--rate-scale", type=float, default=1.0, metavar="X",
                   help="X times the recorded rate: every time (arrivals, timed cancels, read pauses) divided by X")
    p.add_argument("--max-requests", type=int, default=None, metavar="N", help="send at most the first N requests")
    p.add_argument("--duration", default=None, metavar="SECONDS",
                   help="stop after this long, cutting off what is still streaming (default: when every request ended; "
                        "with --workload/--preset: the traffic to generate, default 60)")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts' token ids and of a workload's draws")
    p.add_argument("--model", default=None, help="model name to send (default: the engine's first /v1/models)")
    p.add_argument("--prompt", dest="prompt_mode", choices=("ids", "text"), default="ids",
                   help="token-id prompts (exact lengths; vLLM, SGLang) or filler words (about one token a word)")
    p.add_argument("--proxy-workers", type=int, default=2, metavar="N",
                   help="run the recording proxy as N processes, off the client's event loop (default 2; "
                        "1: in-process, arrival times then carry the client's event-loop lag)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for engines that refuse it; outputs may then end early)")
    add_host_options(p)


def _loopback(url: str) -> bool:
    from yarl import URL

    host = URL(url).host or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from kvtop.load.plan import PlanError, plan_from_trace, plan_from_workload
    from kvtop.sim.workload import load_preset, load_workload_file

    cfg = load_config(getattr(args, "config", None))
    opts = source_options(args, cfg)
    if len(opts.urls) != 1:
        raise UsageError("give one engine to load: --url URL")
    target = opts.urls[0]
    if not _loopback(target) and not args.allow_remote:
        raise UsageError(f"{redact_url(target)} is not on loopback: load a remote engine only with --allow-remote")
    if not (args.rate_scale > 0 and args.rate_scale <= 1000):
        raise UsageError("--rate-scale must be > 0 and <= 1000")
    if args.max_requests is not None and args.max_requests < 1:
        raise UsageError("--max-requests must be at least 1")
    duration = None if args.duration is None else parse_seconds(args.duration, "--duration")
    if duration is not None and not 0 < duration <= MAX_DURATION_S:
        # as simulate's: the plan's arrivals are drawn in memory before the first is sent
        raise UsageError(f"--duration must be positive and at most {MAX_DURATION_S:g} s, not {duration:g}")
    if not 1 <= args.proxy_workers <= 64:
        raise UsageError("--proxy-workers must be between 1 and 64")
    if args.source and same_file(args.source, args.output):
        raise UsageError(f"-o {args.output} is the trace being replayed: write the new run to another file")
    check_output(args.output, args.force)
    try:
        if args.source:
            plan = plan_from_trace(args.source)
        else:
            wl = load_workload_file(args.workload) if args.workload else load_preset(args.preset)
            plan = plan_from_workload(wl, args.seed, (duration or 60.0) * args.rate_scale)
    except PlanError as e:
        raise UsageError(str(e)) from None
    plan = plan.limited(args.max_requests).scaled(args.rate_scale)
    # the recording proxy on an ephemeral loopback port in front of the target: the load goes through it
    opts = dataclasses.replace(opts, proxy_listen=("127.0.0.1", 0), proxy_workers=args.proxy_workers)
    return asyncio.run(_load(args, opts, plan, duration))


async def _load(args: argparse.Namespace, opts: SourceOptions, plan: Plan, duration: float | None) -> int:
    import aiohttp

    from kvtop.commands.record import open_trace
    from kvtop.feeds.sources import ProxyRecorder
    from kvtop.load.client import LoadClient, model_name, schedule_line
    from kvtop.model.records import RequestRecord

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    runner = live_feed(opts, label="load", analysis=False)
    classes = {r.id: r.cls for r in plan.requests if r.cls}

    def label(rec: Record) -> None:
        # the proxy records one class for every request; the plan knows each request's own
        if isinstance(rec, RequestRecord) and rec.event == "arrive" and rec.cls is None:
            rec.cls = classes.get(rec.id)

    runner.sinks.append(label)
    cache = _PrefixCounters(plan.shared_share())
    runner.sinks.append(cache)
    header_load = {"source": plan.source, "source_kind": plan.kind, "target": redact_url(opts.urls[0]),
                   "rate_scale": args.rate_scale, "requests_planned": len(plan.requests), "seed": args.seed,
                   "prompt": args.prompt_mode,
                   # the source's requests with no prompt length anywhere (a text prompt cancelled before its
                   # usage block): not replayed, so a compare of two replays says what they both lack
                   "requests_left_out": plan.skipped_no_prompt}
    writer, _ = await open_trace(runner, opts, args.output, args.force, "kvtop load", stop=stop, load=header_load)
    tty = sys.stderr.isatty()
    client: LoadClient | None = None
    timer: asyncio.TimerHandle | None = None
    try:
        try:
            await runner.start()
        except OSError as e:
            await runner.aclose()
            raise UsageError(f"cannot listen on 127.0.0.1 for the recording proxy: {e.strerror or e}") from None
        proxy = runner.source("proxy")
        assert isinstance(proxy, ProxyRecorder) and proxy.url is not None
        # a last scrape once the client is done: the trace's engine counters (and the prefix-cache line)
        # then cover the whole run, not all but its last scrape interval
        # --duration ends the run through `stop`, as Ctrl-C does: the client then knows the streams the
        # proxy cuts when it stops were cut off by the run's end, not failed
        if duration is not None:
            timer = loop.call_later(duration, stop.set)
        run_task = asyncio.create_task(runner.run(duration_s=None, stop=stop, final_poll=True))
        tasks = [asyncio.create_task(_flush_loop(writer, stop))]
        headers = {"Authorization": f"Bearer {opts.token}"} if opts.token else None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout, headers=headers,
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            model = args.model or await model_name(session, proxy.url)
            if model is None and stop.is_set():  # Ctrl-C while starting: nothing sent, the trace is whole
                await run_task
                print("kvtop load: stopped before sending any request", file=sys.stderr)
                return 0
            if model is None:
                stop.set()
                await run_task
                print(f"kvtop load: {redact_url(opts.urls[0])} does not answer /v1/models (give --model, or "
                      "check the URL)", file=sys.stderr)
                return 1
            client = LoadClient(proxy.url, plan, model=model, seed=args.seed, prompt_mode=args.prompt_mode,
                                ignore_eos=args.ignore_eos)
            print(f"kvtop load: {len(plan.requests)} request(s) from {plan.source} -> {redact_url(opts.urls[0])} "
                  f"(rate x{args.rate_scale:g}), recording to {args.output} (Ctrl-C to stop)", file=sys.stderr,
                  flush=True)
            for note in plan.notes:
                print(f"kvtop load: {note}", file=sys.stderr)
            if tty:
                tasks.append(asyncio.create_task(_progress(client, stop, duration)))
            # the run's --duration (or Ctrl-C) sets nothing on the client: the runner ending does
            run_task.add_done_callback(lambda _t: stop.set())
            try:
                await client.run(session, stop)
                stop.set()
                await run_task  # the proxy stops first: what still streams is recorded as cut off (proxy_stopped)
            finally:
                await client.close()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if timer is not None:
            timer.cancel()
        stop.set()
        writer.close()
    writer.finish()  # the disk refused records: exit 1, saying how many
    if tty:
        print(file=sys.stderr)
    st = client.stats if client else None
    if st is not None:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(st.error_kinds.items()))
        cut = f", cut off by the stop {st.cut_off}" if st.cut_off else ""
        print(f"kvtop load: sent {st.sent}/{st.planned}, finished {st.finished}, cancelled as recorded {st.cancelled}, "
              f"errors {st.errors}{f' ({kinds})' if kinds else ''}{cut}; {writer.count} record(s) written to "
              f"{args.output}", file=sys.stderr)
        late = schedule_line(st, plan, client.max_concurrency) if client is not None else None
        if late:
            print(f"kvtop load: {late}", file=sys.stderr)
        if st.sent and st.errors == st.sent:
            print(f"kvtop load: every request failed: is {redact_url(opts.urls[0])} serving?", file=sys.stderr)
            return 1
        line = cache.line()
        if line:
            print(f"kvtop load: {line}", file=sys.stderr)
    return 0


class _PrefixCounters:
    """Each engine's first and last prefix-cache counters over the run (a sink of the run's records);
    ``planned``: the share of the plan's prompt tokens its shared prefixes repeat."""

    def __init__(self, planned: float = 0.0) -> None:
        self.planned = planned
        self.firsts: dict[tuple[str | None, str | None], dict[str, float]] = {}
        self.lasts: dict[tuple[str | None, str | None], dict[str, float]] = {}

    def __call__(self, rec: Record) -> None:
        from kvtop.model.records import EngineRecord

        if not isinstance(rec, EngineRecord) or rec.prefix_hits_total is None or rec.prefix_queries_total is None:
            return
        key = (rec.url, rec.engine)
        c = {"prefix_hits_total": rec.prefix_hits_total, "prefix_queries_total": rec.prefix_queries_total}
        self.firsts.setdefault(key, c)
        self.lasts[key] = c

    def line(self) -> str | None:
        from kvtop.analysis.compare import Tolerance
        from kvtop.analysis.inputs import prefix_served

        served = prefix_served(self.firsts, self.lasts)
        if served is None:
            return None
        share = served[0] / served[1]
        text = f"the engine's prefix cache served {share:.0%} of the {served[1]:,.0f} prompt tokens it was asked for"
        if self.planned:
            text += f"; the plan's shared prefixes repeat {self.planned:.0%}"
        # The prompts are a function of --seed: a second run of one plan with the same seed on the same
        # engine finds them in its prefix cache, and its prefills (and their stalls) go unmeasured. Beyond
        # what the plan's own shared prefixes account for by `compare`'s bound on runs it may pool, say so.
        if share - self.planned > Tolerance().prefix_share:
            text += (" (a repeat of a run with the same --seed on this engine finds its prompts cached: give each "
                     "replay its own --seed to measure its prefills)")
        return text


async def _flush_loop(writer: GuardedTrace, stop: asyncio.Event) -> None:
    while not stop.is_set():  # an idle stretch of the plan still gets its records onto disk
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.25)
        except asyncio.TimeoutError:
            pass
        writer.flush_if_due()


async def _progress(client: LoadClient, stop: asyncio.Event, duration: float | None) -> None:
    from kvtop.load.client import progress_line

    while not stop.is_set():
        sys.stderr.write("\r" + progress_line(client.stats, client.elapsed(), duration) + "\x1b[K")
        sys.stderr.flush()
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
