"""kvtop.witness.vllm's glue around vLLM's scheduler, against a stand-in ``vllm`` package with the same
hook points (the real vLLM runs it in tests/integration/test_real_vllm_witness.py)."""

from __future__ import annotations

import json
import logging
import sys
import types
from types import SimpleNamespace

import pytest


class _FakeScheduler:
    """What the witness relies on: ``requests``, ``_update_after_schedule`` advancing computed tokens,
    ``update_from_output`` returning EngineCoreOutputs per client, ``finish_requests``, ``shutdown``."""

    def __init__(self, **kw):
        self.kw = kw
        self.requests: dict[str, SimpleNamespace] = {}

    def _update_after_schedule(self, so):
        for rid, n in so.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n

    def update_from_output(self, so, mro):
        outs = [SimpleNamespace(request_id=rid, new_token_ids=[7] * k, finish_reason=mro.get("fin", {}).get(rid))
                for rid, k in mro["made"].items()]
        return {0: SimpleNamespace(outputs=outs)}

    def finish_requests(self, ids, status):
        return [self.requests[i] for i in ids]

    def shutdown(self):
        self.shut = True


class _FakeAsync(_FakeScheduler):
    pass


@pytest.fixture
def fake_vllm(monkeypatch):
    mods = {}
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched", "vllm.v1.core.sched.scheduler",
                 "vllm.v1.core.sched.async_scheduler"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["vllm"].__version__ = "0.32.0"
    mods["vllm.v1.core.sched.scheduler"].Scheduler = _FakeScheduler
    mods["vllm.v1.core.sched.async_scheduler"].AsyncScheduler = _FakeAsync
    return mods["vllm"]


def _cfg(async_on: bool):
    return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_on),
                           cache_config=SimpleNamespace(block_size=16))


def _so(sched: dict[str, int], preempted=(), resumed=()):
    return SimpleNamespace(num_scheduled_tokens=sched, preempted_req_ids=set(preempted),
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))


def test_witnessed_scheduler_logs_each_step_without_changing_it(fake_vllm, tmp_path, monkeypatch):
    from kvtop.witness.vllm import WitnessScheduler

    path = tmp_path / "w.jsonl"
    monkeypatch.setenv("KVTOP_WITNESS_FILE", str(path))
    s = WitnessScheduler(vllm_config=_cfg(True))
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
    steps = lines[1:]
    assert steps[0]["r"] == [["a", 30, 30, 0, 1], ["b", 5, 5, 0, 1]]
    assert steps[1]["r"] == [["a", 1, 0, 0, 1]] and steps[1]["pre"] == ["b"]
    assert steps[2]["r"] == [["a", 1, 0, 0, 1], ["b", 6, 0, 5, 1]] and steps[2]["res"] == ["b"]
    assert steps[2]["fin"] == [["a", "length"]]
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
    with caplog.at_level(logging.WARNING, logger="kvtop.witness"):
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
    with caplog.at_level(logging.WARNING, logger="kvtop.witness"):
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
