"""kvtop.witness.vllm's glue around vLLM's scheduler, against a stand-in ``vllm`` package with the same
hook points (the real vLLM runs it in tests/integration/test_real_vllm_witness.py)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from testkit import fake_vllm as fake


@pytest.fixture
def fake_vllm():
    with fake.installed() as mod:
        yield mod


_cfg = fake.config
_so = fake.scheduler_output
_FakeScheduler = fake.FakeScheduler
_FakeAsync = fake.FakeAsyncScheduler


def test_witnessed_scheduler_logs_each_step_without_changing_it(fake_vllm, tmp_path, monkeypatch):
    from kvtop.witness.vllm import WitnessScheduler

    path = tmp_path / "w.jsonl"
    monkeypatch.setenv("KVTOP_WITNESS_FILE", str(path))
    s = WitnessScheduler(vllm_config=_cfg(True, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=1024))
    assert isinstance(s, _FakeAsync)  # vLLM's own async scheduler underneath
    s.requests["a"] = SimpleNamespace(request_id="a", num_computed_tokens=0, num_prompt_tokens=30)
    s.requests["b"] = SimpleNamespace(request_id="b", num_computed_tokens=0, num_prompt_tokens=5)
    so1 = _so({"a": 30, "b": 5})
    s._update_after_schedule(so1)
    assert s.requests["a"].num_computed_tokens == 30  # vLLM's own bookkeeping ran
    s.update_from_output(so1, {"made": {"a": 1, "b": 1}})
    so2 = _so({"a": 1}, preempted=["b"])
    s._update_after_schedule(so2)
    s.update_from_output(so2, {"made": {"a": 1}})
    s.requests["b"].num_computed_tokens = 0
    # b lost its 5 prompt positions: 5 are recomputed, the 6th feeds its first token (decode)
    so3 = _so({"a": 1, "b": 6}, resumed=["b"])
    s._update_after_schedule(so3)
    s.update_from_output(so3, {"made": {"a": 1, "b": 1}, "fin": {"a": "length"}})
    s.finish_requests(["b"], "aborted")
    s.shutdown()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["format"] == "kvtop-witness" and lines[0]["engine_version"] == "0.32.0"
    assert lines[0]["block_size"] == 16
    # the limits the engine runs under (after vLLM's defaults): what a prescription must stay consistent with
    assert lines[0]["limits"] == {"max_num_seqs": 16, "max_num_batched_tokens": 64, "max_model_len": 1024}
    steps = lines[1:]
    assert steps[0]["n"] == {"1": "a", "2": "b"}  # requests by number in the file
    assert steps[0]["r"] == [[1, 30, 30, 0, 1], [2, 5, 5, 0, 1]]
    assert steps[1]["d"] == [1] and "r" not in steps[1] and steps[1]["pre"] == [2]
    assert steps[2]["d"] == [1] and steps[2]["r"] == [[2, 6, 0, 5, 1]] and steps[2]["res"] == [2]
    assert steps[2]["rst"] == [[2, 0]]  # nothing of b's was found again: every lost position recomputed
    assert steps[2]["fin"] == [[1, "length"]]
    assert all(st["t0"] <= st["t1"] for st in steps)
    assert steps[1]["t0"] >= steps[0]["t1"]  # a step starts when the one before it ended, at the earliest


def test_sync_scheduling_gets_the_plain_scheduler_underneath(fake_vllm, tmp_path, monkeypatch):
    from kvtop.witness.vllm import WitnessScheduler

    monkeypatch.setenv("KVTOP_WITNESS_FILE", str(tmp_path / "w.jsonl"))
    s = WitnessScheduler(vllm_config=_cfg(False))
    assert isinstance(s, _FakeScheduler) and not isinstance(s, _FakeAsync)


def test_an_unknown_vllm_version_runs_unwitnessed_with_one_line(fake_vllm, tmp_path, monkeypatch, caplog):
    from kvtop.witness.vllm import WitnessScheduler

    fake_vllm.__version__ = "0.33.0"
    monkeypatch.setenv("KVTOP_WITNESS_FILE", str(tmp_path / "w.jsonl"))
    with caplog.at_level(logging.WARNING, logger="vllm.kvtop_witness"):
        s = WitnessScheduler(vllm_config=_cfg(True))
    assert type(s) is _FakeAsync  # vLLM's own class, nothing mixed in
    assert not (tmp_path / "w.jsonl").exists()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "vLLM 0.33.0 is not supported" in msgs[0] and "0.32.x" in msgs[0]


def test_a_witness_failure_turns_the_witness_off_never_the_engine(fake_vllm, tmp_path, monkeypatch, caplog):
    from kvtop.witness.vllm import WitnessScheduler

    monkeypatch.setenv("KVTOP_WITNESS_FILE", str(tmp_path / "w.jsonl"))
    s = WitnessScheduler(vllm_config=_cfg(True))
    s.requests["a"] = SimpleNamespace(request_id="a", num_computed_tokens=0, num_prompt_tokens=3)
    so = _so({"a": 3, "ghost": 1})  # a request the scheduler does not hold: the witness's lookup fails
    s.requests["ghost"] = None  # vLLM's own hook must still run for "a"
    with caplog.at_level(logging.WARNING, logger="vllm.kvtop_witness"):
        try:
            s._update_after_schedule(so)
        except AttributeError:
            pass  # the stand-in's own bookkeeping trips on the ghost after the witness let go
    assert s._kvw is None and "stopped after an error" in caplog.text
    assert s.requests["a"].num_computed_tokens == 3
    # an unwritable file: the engine starts unwitnessed
    monkeypatch.setenv("KVTOP_WITNESS_FILE", str(tmp_path / "no-such-dir" / "x" / "w.jsonl"))
    (tmp_path / "no-such-dir").write_text("a file where a folder should be")
    s2 = WitnessScheduler(vllm_config=_cfg(True))
    assert isinstance(s2, _FakeAsync) and s2._kvw is None


def test_a_resumed_request_found_in_the_prefix_cache_is_written_as_restored(fake_vllm, tmp_path, monkeypatch):
    """vLLM sets a resumed request's computed positions to what its prefix cache (or a KV connector)
    still held before scheduling it: those 32 are restored, the 8 after them recomputed."""
    from kvtop.witness.vllm import WitnessScheduler

    path = tmp_path / "w.jsonl"
    monkeypatch.setenv("KVTOP_WITNESS_FILE", str(path))
    s = WitnessScheduler(vllm_config=_cfg(True))
    s.requests["v"] = SimpleNamespace(request_id="v", num_computed_tokens=0, num_prompt_tokens=40)
    so1 = _so({"v": 40})
    s._update_after_schedule(so1)
    s.update_from_output(so1, {"made": {"v": 1}})
    so2 = _so({}, preempted=["v"])
    s._update_after_schedule(so2)
    s.update_from_output(so2, {"made": {}})
    s.requests["v"].num_computed_tokens = 32  # one full block found again
    so3 = _so({"v": 9}, resumed=["v"])
    s._update_after_schedule(so3)
    s.update_from_output(so3, {"made": {"v": 1}})
    s.shutdown()
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["res"] == [1] and last["rst"] == [[1, 32]]
    assert last["r"] == [[1, 9, 0, 8, 1]]
