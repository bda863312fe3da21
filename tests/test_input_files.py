"""Every file a user hands kvtop goes through kvtop.model.jsonio: deep nesting, huge numbers, wrong
types and wrong encodings end in one line on stderr and exit 2, never a traceback (issue 23)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvtop import cli
from kvtop.config import load_config
from kvtop.errors import UsageError
from kvtop.model import jsonio
from kvtop.model.trace import TraceReader

REPO = Path(__file__).resolve().parents[1]
SCENARIO = (REPO / "tests" / "scenarios" / "S1.json").read_text(encoding="utf-8")
WORKLOAD = (REPO / "kvtop" / "sim" / "presets" / "healthy.json").read_text(encoding="utf-8")

BAD_JSON = {
    "deep array": b"[" * 100_000 + b"]" * 100_000,  # RecursionError inside json.loads
    "deep object": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "deep but parseable": b"[" * 900 + b"]" * 900,  # parses; would exhaust jsonschema's recursion
    "5000-digit integer": b'{"a": ' + b"9" * 5000 + b"}",  # Python's int-from-text limit
    "400-digit integer": b'{"a": 1' + b"0" * 400 + b"}",  # OverflowError at the first float()
    "1e999": b'{"a": 1e999}',
    "NaN": b'{"a": NaN}',
    "latin-1": b'{"name": "caf\xe9"}',
    "UTF-16": '{"a": 1}'.encode("utf-16"),
    "NUL byte": b'{"a":\x001}',
    "truncated": b'{"a": [1, 2',
    "empty": b"",
    "a list": b"[1, 2]",
    "a string": b'"x"',
}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    return rc, [ln for ln in err.splitlines() if ln.strip()]


def _field(doc: str, key: str, raw: bytes) -> bytes:
    d = json.loads(doc)
    d.pop(key, None)
    return json.dumps(d)[:-1].encode() + b', "' + key.encode() + b'": ' + raw + b"}"


@pytest.mark.parametrize("name", list(BAD_JSON))
@pytest.mark.parametrize("kind", ["scenario", "scenario-json", "workload", "model-config"])
def test_bad_json_file_is_one_line_and_exit_2(kind, name, tmp_path, capsys):
    f = tmp_path / "in.json"
    f.write_bytes(BAD_JSON[name])
    argv = {
        "scenario": ["advise", "--scenario", str(f)],
        "scenario-json": ["advise", "--scenario", str(f), "--format", "json"],
        "workload": ["simulate", "--workload", str(f), "--duration", "1", "-o", str(tmp_path / "o.jsonl")],
        "model-config": ["analyze", str(tmp_path / "none.jsonl"), "--model-config", str(f)],
    }[kind]
    rc, lines = _run(argv, capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("kvtop: error: "), lines
    assert f.name in lines[0]


@pytest.mark.parametrize("raw", [b"[" * 60 + b"]" * 60, b"1" + b"0" * 400, b"1e999", b"NaN", b'"x"', b"[1]", b"null"])
@pytest.mark.parametrize("key", ["gpu_bytes", "model_config", "kv_bytes_per_token", "name"])
def test_scenario_fields_of_every_wrong_kind(key, raw, tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_bytes(_field(SCENARIO, key, raw))
    rc, lines = _run(["advise", "--scenario", str(f), "--format", "json"], capsys)
    assert rc in (0, 2) and len(lines) <= 1, lines


def test_a_scenario_without_a_kv_size_says_what_to_add(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text('{"prefill": {"tokens_per_s": 1000}}')
    rc, lines = _run(["advise", "--scenario", str(f)], capsys)
    # it quoted the whole document "is not valid under any of the given schemas"
    assert rc == 2 and len(lines) == 1 and "the KV cache's size per token is not given" in lines[0], lines
    assert '"kv_bytes_per_token"' in lines[0] and "not valid under any" not in lines[0]


@pytest.mark.parametrize("raw", [b"[1]", b'"x"', b"-1", b"1e999", b"{}"])
def test_workload_engine_of_the_wrong_type(raw, tmp_path, capsys):
    f = tmp_path / "w.json"
    f.write_bytes(_field(WORKLOAD, "engine", raw))
    rc, lines = _run(["simulate", "--workload", str(f), "--duration", "1", "-o", str(tmp_path / "o.jsonl")], capsys)
    assert rc in (0, 2) and len(lines) <= 1, lines
    if raw != b"{}":
        assert rc == 2


@pytest.mark.parametrize("raw", [b"1e999", b"Infinity", b"0", b"[]", b'"x"', b"1" + b"0" * 400])
def test_model_config_geometry_of_the_wrong_value(raw, tmp_path, capsys):
    f = tmp_path / "config.json"
    f.write_bytes(b'{"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": '
                  + raw + b"}")
    rc, lines = _run(["analyze", str(tmp_path / "none.jsonl"), "--model-config", str(f)], capsys)
    assert rc == 2 and len(lines) == 1 and "model config" in lines[0], lines


def test_an_unknown_kv_dtype_is_refused_with_or_without_a_model_config(tmp_path, capsys):
    """--kv-dtype foo was ignored (exit 0) unless --model-config read it; an operator who mistyped fp8
    would take the report's KV figures for fp8's."""
    t = tmp_path / "t.jsonl"
    t.write_text('{"kind":"header","format":"kvtop-trace","version":1}\n')
    rc, lines = _run(["analyze", str(t), "--kv-dtype", "foo"], capsys)
    assert rc == 2 and len(lines) == 1 and "unknown KV dtype 'foo'" in lines[0], lines
    rc, lines = _run(["analyze", str(t), "--kv-dtype", "FP8", "--format", "json"], capsys)
    assert rc == 0, lines


BAD_TOML = {
    "deep array": b"a = " + b"[" * 100_000 + b"]" * 100_000,
    "deep inline table": b"a = " + b"{b=" * 5000 + b"1" + b"}" * 5000,
    "5000-digit integer": b"interval = " + b"9" * 5000,
    "400-digit integer": b"interval = 1" + b"0" * 400,
    "past 64 bits": b"itl_target_ms = 9223372036854775808",
    "latin-1": b'adapter = "caf\xe9"',
    "UTF-16": 'adapter = "x"'.encode("utf-16"),
    "NUL byte": b'adapter = "x\x00"',
    "infinite target": b"itl_target_ms = inf",
    "a table for a number": b"[interval]\na = 1",
    "a date for a number": b"interval = 1979-05-27",
    "a huge string": b'interval = "' + b"x" * 100_000 + b'"',
}


@pytest.mark.parametrize("name", list(BAD_TOML))
def test_bad_config_file_is_one_line(name, tmp_path):
    f = tmp_path / "config.toml"
    f.write_bytes(BAD_TOML[name])
    with pytest.raises(UsageError) as e:
        load_config(str(f), env={})
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400 and str(f) in msg, msg


def test_utf8_bom_and_good_files_read_as_before(tmp_path):
    f = tmp_path / "config.toml"
    f.write_bytes(b'\xef\xbb\xbfadapter = "vllm"\ninterval = "2s"\n')
    assert load_config(str(f), env={}) == {"adapter": "vllm", "interval": 2.0}
    s = tmp_path / "s.json"
    s.write_bytes(b"\xef\xbb\xbf" + SCENARIO.encode())
    assert jsonio.read_json(s, "scenario") == json.loads(SCENARIO)


def test_reader_bounds():
    assert jsonio.loads("[" * 64 + "]" * 64, "x", "p") is not None
    with pytest.raises(jsonio.InputError, match="nested more than 64"):
        jsonio.loads("[" * 65 + "]" * 65, "x", "p")
    assert jsonio.loads("[1e308, -" + "9" * 309 + "]", "x", "p")[0] == 1e308
    with pytest.raises(jsonio.InputError, match="1e999 is out of a double's range"):
        jsonio.loads("[1e999]", "x", "p")
    assert jsonio.loads("[NaN]", "x", "p", allow_nan=True)[0] != 0  # kept for callers that check


def _trace(tmp_path: Path) -> bytes:
    head = {"kind": "header", "format": "kvtop-trace", "version": 1, "engine": {"adapter": "vllm"}}
    lines = [json.dumps(head)] + [
        json.dumps({"kind": "request", "t": 0.01 * i, "id": "r1", "event": "token", "n": 1}) for i in range(2000)]
    return ("\n".join(lines) + "\n").encode()


@pytest.mark.parametrize("damage", ["cut", "flipped byte"])
def test_damaged_gzip_trace_keeps_what_was_read(damage, tmp_path, capsys):
    raw = gzip.compress(_trace(tmp_path))
    if damage == "cut":
        raw = raw[:-200]
    else:
        b = bytearray(raw)
        b[len(b) // 2] ^= 0xFF
        raw = bytes(b)
    f = tmp_path / "t.jsonl.gz"
    f.write_bytes(raw)
    r = TraceReader(f)
    n = sum(1 for _ in r)
    assert 0 < n < 2000 and r.skipped >= 1  # what decompressed before the damage, and a warning
    for fmt in ("json", "text"):
        rc, lines = _run(["analyze", str(f), "--format", fmt], capsys)
        assert rc == 0, lines


def test_trace_header_with_huge_numbers_or_deep_nesting(tmp_path, capsys):
    good = _trace(tmp_path).split(b"\n", 1)[1]
    for extra in (b'"kv": {"block_size": 1' + b"0" * 400 + b"}", b'"engine": ' + b"[" * 900 + b"]" * 900):
        f = tmp_path / "t.jsonl"
        f.write_bytes(b'{"kind": "header", "format": "kvtop-trace", "version": 1, ' + extra + b"}\n" + good)
        rc, lines = _run(["analyze", str(f), "--format", "json"], capsys)
        assert rc in (0, 2) and len(lines) <= 1, lines


def test_fuzz_findings_are_one_line_refusals(tmp_path, capsys):
    """What the 20k-case fuzz run found past the reader: a string number in a scenario's model_config,
    a model config with a 10**30-wide hidden size, a workload sigma whose draw overflows a float."""
    s = json.loads(SCENARIO)
    s.pop("model", None)
    s["model_config"] = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": "1e3",
                         "hidden_size": 4096}
    cases = []
    f = tmp_path / "s.json"
    f.write_text(json.dumps(s))
    cases.append(["advise", "--scenario", str(f)])
    m = tmp_path / "config.json"
    m.write_text('{"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 1' + "0" * 30 + "}")
    cases.append(["analyze", str(tmp_path / "none.jsonl"), "--model-config", str(m)])
    w = json.loads(WORKLOAD)
    w["classes"][0]["prompt"] = {"median": 100, "sigma": 1e6}
    wf = tmp_path / "w.json"
    wf.write_text(json.dumps(w))
    cases.append(["simulate", "--workload", str(wf), "--duration", "1", "-o", str(tmp_path / "o.jsonl")])
    for argv in cases:
        rc, lines = _run(argv, capsys)
        assert rc == 2 and len(lines) == 1, (argv[0], lines)


def test_a_token_file_path_with_a_nul_byte_is_a_usage_error(tmp_path):
    from kvtop.config import resolve_token

    f = tmp_path / "config.toml"
    f.write_text('token_file = "/run/secrets/a\\u0000b"\n')
    cfg = load_config(str(f), env={})
    with pytest.raises(UsageError, match="cannot read token file"):
        resolve_token(None, cfg)  # open() raises ValueError for a NUL in a path
