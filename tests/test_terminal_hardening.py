"""A model name or label value carrying terminal control sequences never reaches a terminal raw
(issue 14 item 7): not in snapshot text or JSON, not in replay, not in what the console reads."""

from __future__ import annotations

from conftest import run_kvtop
from replay_server import PROM, replay_server
from vllm_pages import vllm_page

from kvtop.core import Core
from kvtop.model.records import EngineRecord, RequestRecord
from kvtop.model.trace import TraceWriter, make_header

EVIL = "\x1b]0;pwned\x07\x1b[2J\x1b[31mtiny\rllama\x9b"


def _evil_page(**kw) -> str:
    page = vllm_page(**kw)
    assert 'model_name="tiny-llama"' in page
    # the exposition format escapes only \\, " and \n: the control bytes go on the wire raw
    return page.replace('model_name="tiny-llama"', f'model_name="{EVIL}"')


def _clean(text: str) -> bool:
    return not any(c in text for c in "\x1b\x07\r\x9b")


def test_snapshot_text_and_json_carry_no_control_sequences():
    # every vLLM series carries the label whose raw carriage return the parser refuses: nothing is
    # read, so the engine is unreadable (one line, exit 1), and that line quotes the label cleaned
    with replay_server({"/metrics": ([_evil_page(generation=10), _evil_page(generation=90)], PROM)}) as (base, _):
        for fmt in ("text", "json"):
            r = run_kvtop("snapshot", "--url", base, "--duration", "0.4", "--interval", "0.2", "--format", fmt,
                          "--no-gpu", "--no-host")
            assert r.returncode == 1, r.stderr
            assert _clean(r.stdout + r.stderr) and "pwned" in r.stderr and "tiny" in r.stderr
    # where the page reads and one line carries the label, the warning that quotes it is cleaned
    page = vllm_page(generation=10)
    evil_info = f'vllm:cache_config_info{{block_size="16",engine="0",model_name="{EVIL}"}} 1.0\n'
    with replay_server({"/metrics": ([page + evil_info], PROM)}) as (base, _):
        r = run_kvtop("snapshot", "--url", base, "--duration", "0.4", "--interval", "0.2", "--format", "text",
                      "--no-gpu", "--no-host")
        assert r.returncode == 0, r.stderr
        assert _clean(r.stdout + r.stderr)


def test_replay_headless_and_console_data_are_clean(tmp_path):
    p = tmp_path / "evil.jsonl"
    with TraceWriter(p, make_header(engine={"adapter": "vllm", "model": EVIL})) as w:
        for i in range(3):
            w.write(EngineRecord(t=float(i), adapter="vllm", url="http://e:8000", model=EVIL, running=2.0,
                                 warnings=[f"odd {EVIL}"]))
            w.write(RequestRecord(t=float(i), id="r", event="arrive" if i == 0 else "token", n=None if i == 0 else 1,
                                  cls=EVIL if i == 0 else None))
    r = run_kvtop("replay", str(p), "--headless", "--format", "text")
    assert r.returncode == 0, r.stderr
    assert _clean(r.stdout) and "pwned" in r.stdout
    core = Core()
    core.ingest(EngineRecord(t=0.0, adapter="vllm", url="http://e:8000", model=EVIL, engine=EVIL))
    core.ingest(RequestRecord(t=0.0, id="r", event="arrive", cls=EVIL))
    snap = core.snapshot()
    (e,) = snap.engines
    assert _clean(e.model or "") and _clean(e.engine or "") and "pwned" in (e.model or "")
    assert all(_clean(r.cls or "") for r in snap.requests)
