"""Seeded mutators and invariant checks shared by the fuzz tests (tests/test_fuzz.py) and the long
profile (``python -m bench.fuzz``).

Inputs start from the engine captures in tests/fixtures/engines, a small synthetic trace and the
shipped scenarios, and are mutated the way a broken or hostile engine, a torn file or a careless
operator would. Every case must end in data or a clean refusal (``ScrapeError``, ``TraceError``,
``ScenarioError``), never another exception; every snapshot JSON must be schema-valid, finite and
non-negative.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema

from kvtop.analysis.advice import scenario as scenario_mod
from kvtop.analysis.advice.kvbytes import ModelConfigError
from kvtop.analysis.scan import analyze_trace
from kvtop.core import Core
from kvtop.feeds.replay import ReplayFeed
from kvtop.model.records import EngineRecord, Histogram, RequestRecord
from kvtop.model.sanitize import finite_json
from kvtop.model.trace import TraceError, TraceWriter, make_header
from kvtop.plugin import detect_adapter
from kvtop.sources.prom import parse_page
from kvtop.sources.scrape import EngineScraper, ScrapeError

REPO = Path(__file__).resolve().parents[1]
CAPTURES = sorted((REPO / "tests" / "fixtures" / "engines").glob("*.prom"))
SCENARIOS = sorted((REPO / "tests" / "scenarios").glob("*.json"))
ADAPTERS = ("vllm", "sglang", "tgi", "llamacpp", "triton")
SNAPSHOT_SCHEMA = jsonschema.Draft202012Validator(
    json.loads((REPO / "kvtop" / "schemas" / "snapshot.schema.json").read_text()))
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})? (\S+)(.*)$")
EVIL_VALUES = ("NaN", "+Inf", "-Inf", "-1", "-1e9", "1e308", "1e400", "0", "18446744073709551616", "-0")
EVIL_LABELS = ("\x1b]0;pwned\x07", "\x1b[2J", "a\\nb", 'q\\"q', "x" * 5000, "\u202e", "", "None", "nan", "inf")


class Stats(Counter):
    """Counts of cases, refusals and failures by kind (a failure is a crash or a broken invariant)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        self["failures"] += 1
        if len(self.failures) < 20:
            self.failures.append(what)


# ---- page mutations ------------------------------------------------------------------------------
def _lines(text: str) -> list[str]:
    return text.splitlines()


def _samples(lines: list[str]) -> list[int]:
    return [i for i, ln in enumerate(lines) if ln and not ln.startswith("#")]


def mut_value(rnd: random.Random, lines: list[str]) -> None:
    for _ in range(rnd.randint(1, 6)):
        idx = _samples(lines)
        if not idx:
            return
        i = rnd.choice(idx)
        m = _SAMPLE.match(lines[i])
        if m:
            lines[i] = f"{m.group(1)}{m.group(2) or ''} {rnd.choice(EVIL_VALUES)}{m.group(4)}"


def mut_label(rnd: random.Random, lines: list[str]) -> None:
    for _ in range(rnd.randint(1, 4)):
        idx = [i for i in _samples(lines) if '="' in lines[i]]
        if not idx:
            return
        i = rnd.choice(idx)
        lines[i] = re.sub(r'="[^"]*"', f'="{rnd.choice(EVIL_LABELS)}"', lines[i], count=1)


def mut_type(rnd: random.Random, lines: list[str]) -> None:
    idx = [i for i, ln in enumerate(lines) if ln.startswith("# TYPE ")]
    for i in rnd.sample(idx, min(len(idx), rnd.randint(1, 3))):
        parts = lines[i].split(" ")
        lines[i] = " ".join(parts[:3] + [rnd.choice(("counter", "gauge", "histogram", "summary", "untyped", "bogus"))])


def mut_duplicate(rnd: random.Random, lines: list[str]) -> None:
    idx = _samples(lines)
    for i in rnd.sample(idx, min(len(idx), rnd.randint(1, 10))):
        lines.insert(i, lines[i])


def mut_delete(rnd: random.Random, lines: list[str]) -> None:
    for _ in range(rnd.randint(1, 20)):
        if lines:
            del lines[rnd.randrange(len(lines))]


def mut_huge(rnd: random.Random, lines: list[str]) -> None:
    idx = _samples(lines)
    if idx:
        ln = lines[rnd.choice(idx)]
        n = rnd.choice((300, 1000, 3000))
        lines.extend(re.sub(r"\}", f',fz="{k}"}}', ln, count=1) if "{" in ln else ln for k in range(n))


PAGE_MUTATORS: tuple[Callable[[random.Random, list[str]], None], ...] = (
    mut_value, mut_label, mut_type, mut_duplicate, mut_delete, mut_huge,
)


def mutate_page(rnd: random.Random, text: str) -> str:
    lines = _lines(text)
    for m in rnd.sample(PAGE_MUTATORS, rnd.randint(1, 3)):
        m(rnd, lines)
    out = "\n".join(lines) + "\n"
    r = rnd.random()
    if r < 0.15:  # truncated mid-page
        out = out[: rnd.randrange(len(out) + 1)]
    elif r < 0.3:  # flipped bytes
        b = bytearray(out.encode())
        for _ in range(rnd.randint(1, 8)):
            if b:
                b[rnd.randrange(len(b))] = rnd.randrange(256)
        out = b.decode("utf-8", errors="replace")
    return out


def backwards(rnd: random.Random, text: str) -> str:
    """The same page with every counter-looking value scaled down (a counter stepping back)."""
    f = rnd.choice((0.0, 0.5, -1.0))

    def scale(m: re.Match[str]) -> str:
        try:
            v = float(m.group(3))
        except ValueError:
            return m.group(0)
        return f"{m.group(1)}{m.group(2) or ''} {v * f!r}{m.group(4)}"

    return "\n".join(_SAMPLE.sub(scale, ln) if "_total" in ln or "_count" in ln or "_bucket" in ln else ln
                     for ln in _lines(text)) + "\n"


# ---- invariants --------------------------------------------------------------------------------
def _numbers(obj: Any, path: str = "") -> list[tuple[str, float]]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _numbers(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [x for i, v in enumerate(obj) for x in _numbers(v, f"{path}[{i}]")]
    return []


def check_snapshot(core: Core, stats: Stats, where: str) -> None:
    doc = core.snapshot().to_json()
    try:
        json.dumps(doc, allow_nan=False)
    except ValueError:
        stats.fail(f"{where}: non-finite number in snapshot JSON")
        return
    errs = list(SNAPSHOT_SCHEMA.iter_errors(doc))
    if errs:
        stats.fail(f"{where}: snapshot schema: {errs[0].message[:160]} at {list(errs[0].absolute_path)}")
    for path, v in _numbers({"engines": doc.get("engines"), "gpus": doc.get("gpus"), "host": doc.get("host"),
                             "requests": doc.get("requests")}):
        if v < 0:
            stats.fail(f"{where}: negative {path} = {v}")
            break


def check_record(r: EngineRecord, stats: Stats, where: str) -> None:
    for name in ("kv_usage", "running", "waiting", "preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "kv_capacity_tokens", "block_size", "offload_capacity_bytes"):
        v = getattr(r, name)
        if v is not None and (not math.isfinite(v) or v < 0):
            stats.fail(f"{where}: record {name} = {v!r}")
    for s in (r.model, r.engine, *(r.warnings or ())):
        if isinstance(s, str) and ("\x1b" in s or "\x07" in s):
            stats.fail(f"{where}: control characters in {s[:40]!r}")


# ---- page cases --------------------------------------------------------------------------------
_CLEAN: dict[tuple[str, str], list[EngineRecord] | None] = {}


def _clean_records(capture: Path, adapter: str) -> list[EngineRecord]:
    """The unmutated capture through ``adapter`` (cached): the baseline scrape before a bad one."""
    key = (capture.name, adapter)
    if key not in _CLEAN:
        try:
            _, recs = EngineScraper("http://fuzz:1", adapter=adapter).normalize(capture.read_text("utf-8"), 0.0)
            _CLEAN[key] = recs
        except ScrapeError:
            _CLEAN[key] = None
    return [dataclasses.replace(r, warnings=list(r.warnings), extra=dict(r.extra)) for r in _CLEAN[key] or ()]


def page_case(rnd: random.Random, stats: Stats, all_adapters: bool, capture: Path | None = None) -> None:
    """One mutated page of a capture: detection, then the detected adapter (every adapter with
    ``all_adapters``, else the detected one and one other), the scraper's normalisation, and a Core
    fed clean scrape -> mutated scrape -> clean scrape, whose snapshot JSON is checked."""
    capture = capture or rnd.choice(CAPTURES)
    clean = capture.read_text(encoding="utf-8")
    page = backwards(rnd, clean) if rnd.random() < 0.2 else mutate_page(rnd, clean)
    where = f"page {capture.name}"
    stats["pages"] += 1
    try:
        cls = detect_adapter(parse_page(page).names)
    except Exception as e:  # detection must never raise
        stats.fail(f"{where}: detection raised {type(e).__name__}: {e}")
        return
    detected = cls.name if cls else "vllm"
    names = list(ADAPTERS) if all_adapters else [detected] + ([rnd.choice(ADAPTERS)] if rnd.random() < 0.25 else [])
    for name in dict.fromkeys(names):
        core = Core(window_s=60)
        scraper = EngineScraper("http://fuzz:1", adapter=name)
        stats["adapter_parses"] += 1
        try:
            _, recs = scraper.normalize(page, 1.0)
        except ScrapeError:
            stats["refused_pages"] += 1
            recs = []
        except Exception as e:
            stats.fail(f"{where} via {name}: {type(e).__name__}: {e}")
            continue
        for r in recs:
            check_record(r, stats, f"{where} via {name}")
        try:
            for t, batch in ((0.0, _clean_records(capture, name)), (1.0, recs), (2.0, _clean_records(capture, name))):
                for r in batch:
                    r.t, r.url = t, scraper.shown_url
                    core.ingest(r)
            check_snapshot(core, stats, f"{where} via {name}")
            stats["snapshots"] += 1
        except Exception as e:
            stats.fail(f"{where} via {name}: Core/snapshot raised {type(e).__name__}: {e}")


# ---- trace cases -------------------------------------------------------------------------------
def base_trace(path: Path, rnd: random.Random) -> None:
    """A small plausible trace: 6 streams with one long stall, engine scrapes each second."""
    with TraceWriter(path, make_header(engine={"adapter": "vllm", "model": "m"}, kv={"block_size": 16},
                                       itl_target_s=0.1)) as w:
        cum = 0.0
        for sec in range(12):
            cum += 40
            w.write(EngineRecord(t=float(sec), adapter="vllm", url="http://e:1", engine="0", kv_usage=0.5 + sec / 30,
                                 running=6, waiting=sec % 3, preemptions_total=float(sec // 4),
                                 prompt_tokens_total=500.0 * sec, generation_tokens_total=cum,
                                 itl=Histogram([(0.05, cum * 0.9), (0.5, cum * 0.98), (math.inf, cum)], cum, cum * 0.03)))
        for k in range(6):
            rid = f"r{k}"
            t = 0.2 * k
            w.write(RequestRecord(t=t, id=rid, event="arrive", prompt_tokens=100 + k))
            t += 0.1
            w.write(RequestRecord(t=t, id=rid, event="first_token", n=1))
            for i in range(40):
                t += 0.02 if not (k == 2 and i == 20) else 1.5 + rnd.random()
                w.write(RequestRecord(t=t, id=rid, event="token", n=1))
            w.write(RequestRecord(t=t, id=rid, event="finish", finish_reason="stop"))


EVIL_JSON = ("NaN", "Infinity", "-Infinity", "-1", "1e400", '"x"', "null", "{}", "[]", "true", '"\\u001b]0;t\\u0007"',
             "[" * 5000 + "]" * 5000, "-1e308")


def mutate_trace(rnd: random.Random, text: str) -> str:
    lines = text.splitlines()
    for _ in range(rnd.randint(1, 8)):
        i = rnd.randrange(len(lines))
        op = rnd.random()
        if op < 0.55:
            keys = re.findall(r'"(\w+)":', lines[i])
            if keys:
                k = rnd.choice(keys)
                new = f'"{k}":{rnd.choice(EVIL_JSON)}'
                lines[i] = re.sub(rf'"{k}":("[^"]*"|[^,}}]+|\{{[^}}]*\}})', lambda _m, new=new: new, lines[i], count=1)
        elif op < 0.65:
            del lines[i]
        elif op < 0.75:
            lines.insert(i, lines[i])
        elif op < 0.85:
            j = rnd.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        else:
            b = bytearray(lines[i].encode())
            if b:
                b[rnd.randrange(len(b))] = rnd.randrange(256)
            lines[i] = b.decode("utf-8", errors="replace")
    out = "\n".join(lines) + "\n"
    if rnd.random() < 0.15:
        out = out[: rnd.randrange(len(out) + 1)]
    return out


def trace_case(rnd: random.Random, stats: Stats, base: str, path: Path) -> None:
    path.write_text(mutate_trace(rnd, base), encoding="utf-8")
    stats["traces"] += 1
    for fast in (True, False):
        try:
            rep = analyze_trace(str(path), fast=fast)
            json.dumps(rep.finite().to_dict(), allow_nan=False)  # what `kvtop analyze --format json` prints
            stats["analyses"] += 1
        except TraceError:
            stats["refused_traces"] += 1
            return
        except Exception as e:
            stats.fail(f"analyze(fast={fast}): {type(e).__name__}: {e}")
    try:
        feed = ReplayFeed(path, Core(source_label="replay"), speed=0.0)
        feed.seek(math.inf)
        check_snapshot(feed.core, stats, "replay")
        feed.close()
        stats["replays"] += 1
    except TraceError:
        stats["refused_traces"] += 1
    except Exception as e:
        stats.fail(f"replay: {type(e).__name__}: {e}")


# ---- scenario cases ----------------------------------------------------------------------------
def _mutate_doc(rnd: random.Random, obj: Any) -> Any:
    if isinstance(obj, dict) and obj:
        k = rnd.choice(list(obj))
        if rnd.random() < 0.15:
            return {kk: v for kk, v in obj.items() if kk != k}
        return {**obj, k: _mutate_doc(rnd, obj[k])}
    if isinstance(obj, list) and obj:
        i = rnd.randrange(len(obj))
        return [*obj[:i], _mutate_doc(rnd, obj[i]), *obj[i + 1:]]
    return rnd.choice((float("nan"), float("inf"), -1, -1e300, 0, 1e300, "x", None, [], {}, True, 10**30))


def scenario_case(rnd: random.Random, stats: Stats, path: Path) -> None:
    doc = json.loads(rnd.choice(SCENARIOS).read_text())
    for _ in range(rnd.randint(1, 4)):
        doc = _mutate_doc(rnd, doc)
    path.write_text(json.dumps(doc))  # NaN/Infinity written as the bare words a careless tool emits
    stats["scenarios"] += 1
    try:
        out = scenario_mod.evaluate(scenario_mod.load(path))
        json.dumps(finite_json(out), allow_nan=False)
        stats["advised"] += 1
    except (scenario_mod.ScenarioError, ModelConfigError):  # what `kvtop advise` reports as exit 2
        stats["refused_scenarios"] += 1
    except Exception as e:
        stats.fail(f"advise: {type(e).__name__}: {e}")


def run(cases: int, seed: int, tmp: Path, all_adapters: bool = False) -> Stats:
    """``cases`` fuzz cases: half pages (detection, adapters, scraper, Core, snapshot JSON), a third
    traces (analyze on both paths, replay), the rest scenarios (advise)."""
    rnd = random.Random(seed)
    stats = Stats()
    base_path = tmp / "base.jsonl"
    base_trace(base_path, random.Random(seed))
    base = base_path.read_text()
    for i in range(cases):
        r = i % 6
        if r < 3:
            page_case(rnd, stats, all_adapters)
        elif r < 5:
            trace_case(rnd, stats, base, tmp / "case.jsonl")
        else:
            scenario_case(rnd, stats, tmp / "case.json")
        stats["cases"] += 1
    return stats
