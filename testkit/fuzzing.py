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
import gzip
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
             "[" * 5000 + "]" * 5000, "-1e308", "1" + "0" * 400, "9" * 5000, "[" * 900 + "]" * 900)


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
    text = mutate_trace(rnd, base)
    if rnd.random() < 0.2:  # an agent segment (.jsonl.gz), sometimes cut or with a flipped byte
        data = bytearray(gzip.compress(text.encode("utf-8")))
        if rnd.random() < 0.5 and data:
            if rnd.random() < 0.5:
                del data[rnd.randrange(len(data)):]
            else:
                data[rnd.randrange(len(data))] ^= 1 << rnd.randrange(8)
        path.write_bytes(bytes(data))
    else:
        path.write_text(text, encoding="utf-8")
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


# ---- file-level mutations (scenarios, workloads, model configs, the TOML config) -------------------
# What reaches the reader before any field is looked at: nesting past the reader's depth (and past
# the interpreter's recursion limit), integers past Python's int-from-text limit and past a double,
# numbers JSON does not allow, bytes that are not UTF-8, a file cut short.
EVIL_JSON_VALUES = ("[" * 100_000 + "]" * 100_000, '{"a":' * 3000 + "1" + "}" * 3000, "[" * 65 + "]" * 65,
                    "9" * 5000, "1" + "0" * 400, "-1e999", "1e999", "NaN", "-Infinity", '"\u0000"', '"\ud800"',
                    '"' + "x" * 100_000 + '"', "[]", "{}", "null", "true", "-0", "1.5", '"1e3"')
EVIL_TOML_VALUES = ("[" * 100_000 + "]" * 100_000, "{a=" * 3000 + "1" + "}" * 3000, "9" * 5000, "1" + "0" * 400,
                    "9223372036854775808", "-9223372036854775809", "inf", "-inf", "nan", "1979-05-27",
                    "07:32:00", '"' + "x" * 100_000 + '"', "[1, 2]", "{}", "true", '"\u0000"', "-1", "0", '""')


def _json_values(text: str) -> list[tuple[int, int]]:
    """Spans of the scalar values after a key (``"key": VALUE``) in compact or indented JSON."""
    return [m.span(1) for m in re.finditer(r'":\s*("(?:[^"\\]|\\.)*"|-?[\d.eE+-]+|true|false|null)', text)]


def mutate_bytes(rnd: random.Random, data: bytes) -> bytes:
    """Encoding and framing damage: latin-1 bytes, UTF-16, BOMs, NUL bytes, flipped bytes, a cut."""
    r = rnd.random()
    if r < 0.15:
        return data.decode("utf-8", "replace").encode(rnd.choice(("utf-16", "utf-16-be", "utf-32")))
    if r < 0.25:
        return rnd.choice((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")) + data
    b = bytearray(data)
    for _ in range(rnd.randint(1, 6)):
        if not b:
            break
        i = rnd.randrange(len(b))
        op = rnd.random()
        if op < 0.3:
            b[i] = rnd.choice((0x00, 0xE9, 0xFF, 0xC3, 0x80, 0x1B))  # NUL, latin-1 é, lone UTF-8 lead/continuation
        elif op < 0.6:
            b[i] = rnd.randrange(256)
        elif op < 0.8:
            b.insert(i, rnd.choice(b"[{]}\",:\x00\n"))
        else:
            del b[i:]
    return bytes(b)


def mutate_json_text(rnd: random.Random, text: str) -> bytes:
    spans = _json_values(text)
    for _ in range(rnd.randint(1, 3)):
        if spans and rnd.random() < 0.8:
            a, z = spans.pop(rnd.randrange(len(spans)))
            text = text[:a] + rnd.choice(EVIL_JSON_VALUES) + text[z:]
            spans = _json_values(text) if len(text) < 200_000 else []
    data = text.encode("utf-8", "surrogatepass")
    return mutate_bytes(rnd, data) if rnd.random() < 0.35 else data


def write_mutated_json(rnd: random.Random, doc: Any, path: Path) -> None:
    """A document mutated at one of three levels: values of the wrong type (``_mutate_doc``, written
    with NaN/Infinity as the bare words a careless tool emits), evil text spliced over a value, or bytes."""
    r = rnd.random()
    if r < 0.4:
        for _ in range(rnd.randint(1, 4)):
            doc = _mutate_doc(rnd, doc)
        path.write_text(json.dumps(doc))
    else:
        path.write_bytes(mutate_json_text(rnd, json.dumps(doc, indent=rnd.choice((None, 2)))))


def scenario_case(rnd: random.Random, stats: Stats, path: Path) -> None:
    write_mutated_json(rnd, json.loads(rnd.choice(SCENARIOS).read_text()), path)
    stats["scenarios"] += 1
    try:
        out = scenario_mod.evaluate(scenario_mod.load(path))
        json.dumps(finite_json(out), allow_nan=False)
        stats["advised"] += 1
    except (scenario_mod.ScenarioError, ModelConfigError):  # what `kvtop advise` reports as exit 2
        stats["refused_scenarios"] += 1
    except Exception as e:
        stats.fail(f"advise: {type(e).__name__}: {e}")


# ---- workload, model config and TOML config cases ---------------------------------------------------
WORKLOADS = sorted((REPO / "kvtop" / "sim" / "presets").glob("*.json"))


def workload_case(rnd: random.Random, stats: Stats, path: Path) -> None:
    """A mutated preset through ``kvtop simulate --workload``'s loader: a Workload or WorkloadError."""
    from kvtop.sim.workload import WorkloadError, load_workload_file

    write_mutated_json(rnd, json.loads(rnd.choice(WORKLOADS).read_text()), path)
    stats["workloads"] += 1
    try:
        wl = load_workload_file(path)
        for tc in wl.classes:  # the loader promised finite, typed numbers: the draws must work
            tc.prompt.sample(rnd)
            tc.output.sample(rnd)
        stats["loaded_workloads"] += 1
    except WorkloadError:
        stats["refused_workloads"] += 1
    except Exception as e:
        stats.fail(f"workload: {type(e).__name__}: {str(e)[:200]}")


def model_config_case(rnd: random.Random, stats: Stats, path: Path) -> None:
    """A mutated Hugging Face config through ``--model-config``'s loader, then the KV size it implies."""
    from kvtop.analysis.advice.kvbytes import BUILTIN, geometry_from_config, kv_size, load_config_file

    write_mutated_json(rnd, dict(BUILTIN[rnd.choice(sorted(BUILTIN))]), path)
    stats["model_configs"] += 1
    try:
        cfg = load_config_file(path)
        kv_size(geometry_from_config(cfg), "bf16", 1)
        stats["loaded_model_configs"] += 1
    except ModelConfigError:
        stats["refused_model_configs"] += 1
    except Exception as e:
        stats.fail(f"model config: {type(e).__name__}: {str(e)[:200]}")


BASE_CONFIG = """# kvtop config
url = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
interval = "2s"
duration = 10
timeout = 1.5
token_file = "/run/secrets/kvtop"
adapter = "vllm"
itl_target_ms = 80
theme = "dark"
format = "json"
gpu = true
host = false

[proxy]
listen = "127.0.0.1:9000"
"""


def config_case(rnd: random.Random, stats: Stats, path: Path) -> None:
    """A mutated config.toml (and KVTOP_* variables) through ``load_config``: a dict or a one-line UsageError."""
    from kvtop.config import KEYS, load_config, resolve, resolve_token
    from kvtop.errors import UsageError

    lines = BASE_CONFIG.splitlines()
    for _ in range(rnd.randint(1, 3)):
        i = rnd.randrange(len(lines))
        if " = " in lines[i]:
            lines[i] = lines[i].split(" = ")[0] + " = " + rnd.choice(EVIL_TOML_VALUES)
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(mutate_bytes(rnd, data) if rnd.random() < 0.35 else data)
    env = {}
    if rnd.random() < 0.3:
        key = rnd.choice(sorted(KEYS))
        env[KEYS[key][1]] = rnd.choice(("", "1e999", "nan", "-5", "9" * 400, "x" * 10_000, "0", "true", "5ms", "\x1b[2J"))
    stats["configs"] += 1
    try:
        cfg = load_config(str(path), env=env)
        for key in KEYS:
            resolve(None, cfg, key)
        stats["loaded_configs"] += 1
    except UsageError as e:
        msg = str(e)
        if "\n" in msg or len(msg) > 1000:
            stats.fail(f"config: refusal is not one short line: {msg[:200]!r}")
        stats["refused_configs"] += 1
        return
    except Exception as e:
        stats.fail(f"config: {type(e).__name__}: {str(e)[:200]}")
        return
    try:
        resolve_token(None, cfg)  # reads token_file (a path from the file: missing, a NUL in it, ...)
    except UsageError as e:
        msg = str(e)
        if "\n" in msg or len(msg) > 1000:
            stats.fail(f"token file: refusal is not one short line: {msg[:200]!r}")
        stats["refused_tokens"] += 1
    except Exception as e:
        stats.fail(f"token file: {type(e).__name__}: {str(e)[:200]}")


KINDS = ("page", "trace", "scenario", "workload", "model_config", "config")


def run(cases: int, seed: int, tmp: Path, all_adapters: bool = False, kinds: tuple[str, ...] | None = None) -> Stats:
    """``cases`` fuzz cases: by default a third pages (detection, adapters, scraper, Core, snapshot
    JSON), a quarter traces (analyze on both paths, replay), the rest files a user writes (scenarios
    through advise, workloads, model configs, config.toml); ``kinds`` runs only those."""
    rnd = random.Random(seed)
    stats = Stats()
    base_path = tmp / "base.jsonl"
    base_trace(base_path, random.Random(seed))
    base = base_path.read_text()
    cycle = list(kinds) if kinds else ["page"] * 4 + ["trace"] * 3 + ["scenario", "scenario", "workload",
                                                                        "model_config", "config"]
    for i in range(cases):
        kind = cycle[i % len(cycle)]
        if kind == "page":
            page_case(rnd, stats, all_adapters)
        elif kind == "trace":
            trace_case(rnd, stats, base, tmp / "case.jsonl")
        elif kind == "scenario":
            scenario_case(rnd, stats, tmp / "case.json")
        elif kind == "workload":
            workload_case(rnd, stats, tmp / "workload.json")
        elif kind == "model_config":
            model_config_case(rnd, stats, tmp / "config.json")
        elif kind == "config":
            config_case(rnd, stats, tmp / "config.toml")
        else:
            raise ValueError(f"unknown fuzz kind {kind!r} (known: {', '.join(KINDS)})")
        stats["cases"] += 1
    return stats
