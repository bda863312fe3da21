"""bench/calibrate.py: a rule's base is the share of its plain calls that were right, a discount the
share right among the calls it touches over what the bases predicted."""

from __future__ import annotations

import pytest

from bench.calibrate import Call, fit, reliability


def test_fit_reads_accuracy_per_rule_and_per_weakness():
    calls = [Call("preemption/counter", (), i < 40) for i in range(50)]  # 80 % right
    calls += [Call("preemption/counter", ("coarse",), i < 20) for i in range(40)]  # 50 % right when coarse
    calls += [Call("slow/onset", (), True) for _ in range(5)]  # too few to fit: keeps its value
    conf, disc, how = fit(calls)
    assert conf["preemption/counter"] == pytest.approx(0.8)
    assert disc["coarse"] == pytest.approx(0.5 / 0.8, rel=0.01)
    assert how["slow/onset"] == "set"
    lines, worst = reliability(calls, conf, disc)
    assert worst == pytest.approx(0.0, abs=0.01)  # fitted on these very calls


def test_a_rule_right_every_time_is_still_not_certain():
    conf, _, _ = fit([Call("slow/lifted", (), True) for _ in range(100)])
    assert conf["slow/lifted"] == pytest.approx(0.99)
