"""Engines as a Prometheus server holds them (`--prometheus URL`): discovery and engine records.

Discovery asks Prometheus which (job, instance) pairs expose an engine's metric families (vLLM,
SGLang, llama.cpp, TGI, Triton) and which run a kvtop agent (``kvtop_agent_info``). For each
engine instance, its raw series are read back over a time range and rebuilt, per evaluation step,
into the exposition the engine itself served, which the same adapter the direct scrape uses turns
into ``EngineRecord``s: one engine record per instance and step, fed to the same Core. Rates and
quantiles are therefore computed exactly like a direct scrape's (from counter and bucket deltas
over the window), which is what lets a test hold the two paths to the same numbers.

Remote-write and relabelling can rewrite names that contain a colon (``sglang:num_running_reqs``
arrives as ``sglang_num_running_reqs``): names are put back to the engine's own spelling before
the adapter sees them.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvtop.model.analysis import AnalysisReport
from kvtop.model.records import EngineRecord
from kvtop.model.sanitize import output_json
from kvtop.plugin import EngineAdapter, detect_adapter, load_adapter
from kvtop.sources.promapi import Labels, PromClient, PromError

# Engines whose metric names carry a colon after the prefix (rewritten to "_" by some pipelines).
_COLON_PREFIXES = ("vllm", "sglang", "llamacpp")
ENGINE_NAMES = r"(vllm|sglang|llamacpp)[:_].+|tgi_.+|nv_.+"
# how far back an instance Prometheus can no longer scrape still counts as an engine that is down
DOWN_LOOKBACK = "1h"
_DROP_LABELS = frozenset({"__name__", "job", "instance"})
CAUSES = ("preemption", "prefill_interference", "slow_decode", "unknown")


# What Prometheus itself computes for the fleet screen (instant queries): preemption rate and ITL p99,
# per engine family, each spelled both ways (with the colon and as remote-write rewrites it). The
# first ITL histogram an instance has wins (`or`): vLLM can expose both names for one distribution.
_PREEMPT_NAMES = r"(vllm|sglang)[:_](num_preemptions_total|num_retracted_requests_total)"
_ITL_BUCKETS = (r"(vllm|sglang)[:_]inter_token_latency_seconds_bucket",
                r"(vllm|sglang)[:_]time_per_output_token_seconds_bucket")


def canonical_name(name: str) -> str:
    """The engine's own metric name (``sglang_num_running_reqs`` -> ``sglang:num_running_reqs``)."""
    for p in _COLON_PREFIXES:
        if name.startswith(p + "_"):
            return p + ":" + name[len(p) + 1:]
    return name


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(samples: list[tuple[Labels, float]]) -> str:
    """Prometheus text exposition of (labels incl. __name__, value) samples, names canonicalised."""
    lines = []
    for lb, v in samples:
        name = canonical_name(lb.get("__name__", ""))
        if not name:
            continue
        inner = ",".join(f'{k}="{_escape(str(x))}"' for k, x in sorted(lb.items()) if k not in _DROP_LABELS)
        val = "NaN" if math.isnan(v) else ("+Inf" if v == math.inf else ("-Inf" if v == -math.inf else repr(v)))
        lines.append(f"{name}{{{inner}}} {val}" if inner else f"{name} {val}")
    return "\n".join(lines) + "\n"


def parse_selector(text: str | None) -> str:
    """``--selector``: extra label matchers (``job="vllm",region=~"eu.*"``), with or without braces."""
    if not text:
        return ""
    s = text.strip()
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1].strip()
    if not s:
        return ""
    if any(c in s for c in "{}") or "=" not in s:
        raise ValueError(f"--selector must be label matchers like job=\"vllm\", not {text!r}")
    return s


@dataclass
class Target:
    job: str
    instance: str
    adapter: str | None = None
    up: bool = True
    error: str | None = None

    @property
    def url(self) -> str:
        return self.instance


@dataclass
class AgentView:
    """What a kvtop agent publishes about one engine (read back from Prometheus)."""

    instance: str  # the agent's own scrape target
    action: str | None = None
    mechanism: str | None = None
    confidence: float | None = None
    itl_target_s: float | None = None
    spikes: dict[str, float] = field(default_factory=dict)  # cause -> spikes in the window


class PromFleet:
    """Discovers engine instances in Prometheus and turns their history into EngineRecords."""

    def __init__(self, client: PromClient, selector: str | None = None, step_s: float = 5.0,
                 window_s: float = 120.0, clock: Callable[[], float] | None = None):
        self.client = client
        self.selector = parse_selector(selector)
        self.step_s = step_s
        self.window_s = window_s
        self._epoch0: float = time.time() - (clock() if clock else 0.0)
        self._clock = clock or (lambda: time.time() - self._epoch0)
        self.targets: dict[tuple[str, str], Target] = {}
        # (engine label, agent instance) -> what that agent says: sidecars on every node watch
        # their engine as the same "127.0.0.1:8000", told apart only by the agent's own target
        self.agents: dict[tuple[str, str], AgentView] = {}
        # Prometheus's clock less this host's (seconds), from the last instant query: range queries
        # end at Prometheus's now and its timestamps map onto the run's clock with it
        self.skew_s = 0.0
        # instance -> (preemptions/s, ITL p99) computed by Prometheus over rate_window_s
        self.computed: dict[str, tuple[float | None, float | None]] = {}
        self.rate_window_s = 60.0
        self._last_ts: dict[tuple[str, str], float] = {}
        self.error: str | None = None

    def _sel(self, *extra: str) -> str:
        parts = [p for p in (self.selector, *extra) if p]
        return "{" + ",".join(parts) + "}"

    def to_run_clock(self, unix_t: float) -> float:
        """A Prometheus timestamp on this run's clock (its skew against this host taken out)."""
        return unix_t - self.skew_s - self._epoch0

    # -- discovery ------------------------------------------------------------------------------
    def discover(self) -> list[Target]:
        names = self._sel(f'__name__=~"{ENGINE_NAMES}"')
        asked = time.time()
        up_rows = self.client.query(f"up{self._sel()}")
        # an instant query is evaluated at Prometheus's now: its samples carry that time
        if up_rows:
            self.skew_s = max(t for _, t, _ in up_rows) - asked
        ups = {(lb.get("job", ""), lb.get("instance", "")): v for lb, _, v in up_rows}
        keys = [(lb.get("job", ""), lb.get("instance", "")) for lb, _, _ in
                self.client.query(f"count by (job, instance) ({names})")]
        # a target Prometheus cannot scrape has no engine series now: one that had them within the
        # lookback is an engine that is down, not one that was never there
        down = sorted({inst for (_, inst), v in ups.items() if v < 1} - {inst for _, inst in keys})
        if down:
            inst_re = "|".join(re.escape(i) for i in down)
            sel = self._sel(f'__name__=~"{ENGINE_NAMES}"', f'instance=~"{_escape(inst_re)}"')
            keys += [(lb.get("job", ""), lb.get("instance", "")) for lb, _, _ in
                     self.client.query(f"count by (job, instance) (last_over_time({sel}[{DOWN_LOOKBACK}]))")]
        seen = set()
        for key in keys:
            seen.add(key)
            tg = self.targets.get(key)
            if tg is None:
                tg = self.targets[key] = Target(*key)
            up = ups.get(key)
            tg.up = up is None or up >= 1
            tg.error = None if tg.up else "Prometheus cannot scrape it (up == 0)"
        for key, tg in self.targets.items():
            if key not in seen:
                tg.up = False
                tg.error = "Prometheus cannot scrape it (up == 0)" if ups.get(key, 1) < 1 else "no longer in Prometheus"
        return sorted(self.targets.values(), key=lambda t: (t.instance, t.job))

    # -- engine records -------------------------------------------------------------------------
    def _adapter_for(self, tg: Target, names: set[str]) -> EngineAdapter | None:
        if tg.adapter is None:
            cls = detect_adapter({canonical_name(n) for n in names})
            if cls is None:
                return None
            tg.adapter = cls.name
        return load_adapter(tg.adapter)()

    def history(self, tg: Target, start: float, end: float, step: float) -> list[EngineRecord]:
        """One record per engine rank per evaluation step in [start, end] (unix seconds)."""
        sel = self._sel(f'job="{_escape(tg.job)}"', f'instance="{_escape(tg.instance)}"',
                        f'__name__=~"{ENGINE_NAMES}"')
        series = self.client.query_range(sel, start, end, step)
        by_t: dict[float, list[tuple[Labels, float]]] = defaultdict(list)
        for lb, values in series:
            for t, v in values:
                by_t[t].append((lb, v))
        if not by_t:
            return []
        adapter = self._adapter_for(tg, {lb.get("__name__", "") for lb, _ in series})
        if adapter is None:
            tg.error = "no installed adapter recognises its metrics"
            return []
        out: list[EngineRecord] = []
        for t in sorted(by_t):
            try:
                recs = adapter.parse(exposition(by_t[t]), self.to_run_clock(t))
            except Exception as e:  # one odd step must not lose the instance's other steps
                tg.error = f"adapter {adapter.name} failed on a step: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
                continue
            for r in recs:
                r.url = tg.url
                r.adapter = r.adapter or adapter.name
                r.extra = {**r.extra, "prometheus_job": tg.job}
            out.extend(recs)
        return out

    def prom_rates(self, window_s: float) -> dict[str, tuple[float | None, float | None]]:
        """instance -> (preemptions/s, ITL p99 s) as Prometheus computes them over ``window_s``."""
        w = f"{max(1, int(round(window_s)))}s"
        out: dict[str, list[float | None]] = {}
        pre = self._sel(f'__name__=~"{_PREEMPT_NAMES}"')
        for lb, _, v in self.client.query(f"sum by (job, instance) (rate({pre}[{w}]))"):
            out.setdefault(lb.get("instance", ""), [None, None])[0] = None if math.isnan(v) else v
        parts = []
        for n in _ITL_BUCKETS:
            sel = self._sel(f'__name__=~"{n}"')
            parts.append(f"sum by (job, instance, le) (rate({sel}[{w}]))")
        itl = " or ".join(parts)
        for lb, _, v in self.client.query(f"histogram_quantile(0.99, {itl})"):
            out.setdefault(lb.get("instance", ""), [None, None])[1] = None if math.isnan(v) else v
        return {k: (a, b) for k, (a, b) in out.items()}

    def poll(self) -> list[EngineRecord]:
        """Discover, then read every instance's new evaluation steps since the last poll.

        Raises PromError only when Prometheus itself cannot be asked; one instance's failure is a
        down record for that instance."""
        self.discover()
        now_unix = self._epoch0 + self._clock() + self.skew_s  # Prometheus's now
        out: list[EngineRecord] = []
        for key, tg in sorted(self.targets.items()):
            last = self._last_ts.get(key)
            start = now_unix - self.window_s if last is None else last + self.step_s
            start = math.floor(start / self.step_s) * self.step_s
            if last is not None and start <= last:
                start += self.step_s
            if start > now_unix:
                continue
            if not tg.up:
                out.append(EngineRecord(t=self._clock(), adapter=tg.adapter or "unknown", url=tg.url, up=False,
                                        warnings=[tg.error or "down"]))
                continue
            try:
                recs = self.history(tg, start, now_unix, self.step_s)
            except PromError as e:
                out.append(EngineRecord(t=self._clock(), adapter=tg.adapter or "unknown", url=tg.url, up=False,
                                        warnings=[str(e)]))
                continue
            if recs:
                self._last_ts[key] = max(r.t for r in recs) + self._epoch0 + self.skew_s
            out.extend(recs)
        self.poll_agents()
        try:
            self.computed = self.prom_rates(self.rate_window_s)
        except PromError as e:
            self.error = str(e)
        return out

    # -- kvtop agents ---------------------------------------------------------------------------
    def poll_agents(self) -> dict[tuple[str, str], AgentView]:
        """Verdict and spikes by cause from every kvtop agent Prometheus scrapes, by (engine label, the
        agent's own instance)."""
        agents: dict[tuple[str, str], AgentView] = {}

        def view(lb: Labels) -> AgentView:
            inst = lb.get("instance", "")
            return agents.setdefault((lb.get("engine", "?"), inst), AgentView(inst))

        w = f"{max(int(self.window_s), 60)}s"
        try:
            # state-sets: every action (mechanism) is a series, the current one has the value 1
            for lb, _, _ in self.client.query(f"kvtop_verdict{self._sel()} == 1"):
                view(lb).action = lb.get("action")
            for lb, _, _ in self.client.query(f"kvtop_verdict_mechanism{self._sel()} == 1"):
                view(lb).mechanism = lb.get("mechanism")
            for lb, _, v in self.client.query(f"kvtop_verdict_confidence{self._sel()}"):
                view(lb).confidence = v
            for lb, _, v in self.client.query(f"kvtop_itl_target_seconds{self._sel()}"):
                view(lb).itl_target_s = v
            q = f"sum by (engine, instance, cause) (increase(kvtop_token_gap_spikes_total{self._sel()}[{w}]))"
            for lb, _, v in self.client.query(q):
                a = view(lb)
                if not math.isnan(v):
                    a.spikes[lb.get("cause", "unknown")] = v
        except PromError as e:
            self.error = str(e)
            return self.agents
        self.agents = agents
        return agents


def parse_time(text: str, now: float | None = None) -> float:
    """Unix seconds from ``now``, ``-1h`` / ``-30m`` (relative to now), unix seconds or RFC 3339."""
    now = time.time() if now is None else now
    s = text.strip()
    if s == "now":
        return now
    if s.startswith("now-"):  # `--start now-1h` (argparse takes a bare -1h for an option)
        s = s[3:]
    if s.startswith("-"):
        return now - _seconds(s[1:], text)
    try:
        return float(s)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a time: {text!r} (use now, now-1h, unix seconds or 2026-01-31T12:00:00Z)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _seconds(s: str, text: str) -> float:
    mult = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
    for suffix in ("ms", "s", "m", "h", "d", "w"):
        if s.endswith(suffix):
            try:
                return float(s[: -len(suffix)]) * mult[suffix]
            except ValueError:
                break
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"not a time: {text!r} (use now, now-1h, unix seconds or 2026-01-31T12:00:00Z)") from None


AGENT_NOTE = ("aggregate analysis from the engines' own counters and histograms in Prometheus: per-request "
              "causality (which stream stalled, and why) needs a kvtop agent observing the streams")


@dataclass(frozen=True, slots=True)
class InstanceAnalysis:
    """One engine instance of `kvtop analyze --prometheus`: its labels and its aggregate report."""

    job: str
    instance: str
    adapter: str | None
    samples: int
    error: str | None
    report: AnalysisReport | None

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "instance": self.instance, "adapter": self.adapter, "samples": self.samples,
                "error": self.error, "report": self.report.to_dict() if self.report is not None else None}


# The shape `kvtop analyze --prometheus --format json` prints; the number changes when a field
# changes meaning or goes away, not when one is added.
FLEET_ANALYSIS_SCHEMA = "kvtop-fleet-analysis/1"


@dataclass(frozen=True, slots=True)
class FleetAnalysis:
    prometheus: str
    start: float
    end: float
    step_s: float
    note: str
    instances: tuple[InstanceAnalysis, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"prometheus": self.prometheus, "start": self.start, "end": self.end, "step_s": self.step_s,
                "note": self.note, "instances": [i.to_dict() for i in self.instances]}

    def to_json(self, version: str) -> dict[str, Any]:
        """What `kvtop analyze --prometheus --format json` prints (schemas/fleet-analysis.schema.json)."""
        out: dict[str, Any] = output_json({"kvtop_version": version, "schema": FLEET_ANALYSIS_SCHEMA, **self.to_dict()})
        return out


def analyze_history(client: PromClient, start: float, end: float, step: float, selector: str | None = None,
                    itl_target_s: float | None = None) -> FleetAnalysis:
    """`kvtop analyze --prometheus`: the aggregate analysis of every engine instance over [start, end]."""
    # the analysis (numpy) only for `kvtop analyze --prometheus`: the console's fleet feed never needs it
    from kvtop.analysis.live import LiveAnalyzer

    fleet = PromFleet(client, selector=selector, step_s=step, window_s=end - start)
    # discover over the whole range, not just what is scraped now
    names = fleet._sel(f'__name__=~"{ENGINE_NAMES}"')
    # a coarse range query: instances that existed at any point of [start, end], not just at its end
    rows = client.query_range(f"count by (job, instance) ({names})", start, end, max(step, (end - start) / 60))
    out = []
    for lb, _ in sorted(rows, key=lambda r: (r[0].get("instance", ""), r[0].get("job", ""))):
        tg = Target(lb.get("job", ""), lb.get("instance", ""))
        recs = fleet.history(tg, start, end, step)
        an = LiveAnalyzer(itl_target_s=itl_target_s, report_every_s=0.0)
        for r in recs:
            an.feed(r)
        rep = an.report(max((r.t for r in recs), default=0.0)) if recs else None
        out.append(InstanceAnalysis(tg.job, tg.instance, tg.adapter, len(recs), tg.error, rep))
    return FleetAnalysis(client.url, start, end, step, AGENT_NOTE, tuple(out))
