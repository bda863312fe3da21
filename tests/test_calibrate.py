"""eval/calibrate.py: a rule's base is the share of its plain calls that were right, a discount the
share right among the calls it touches over what the bases predicted."""

from __future__ import annotations

import pytest

from eval.calibrate import Call, fit, reliability


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


def test_a_rule_the_fitting_generator_rarely_exercises_is_fit_on_the_spare_traces():
    # slow/pace fires 5 times on the fitting generator (all right) and 60 times on the spare seeds,
    # where 45 of them (75 %) are right: the spare calls decide, and the fit says where it came from
    calls = [Call("slow/pace", (), True) for _ in range(5)] + [Call("slow/lifted", (), True) for _ in range(50)]
    spare = [Call("slow/pace", (), i < 45) for i in range(60)] + [Call("slow/lifted", (), False) for _ in range(50)]
    conf, _, how = fit(calls, spare, "tracegen seeds 3-4")
    assert conf["slow/pace"] == pytest.approx(0.75)
    assert "tracegen seeds 3-4" in how["slow/pace"]
    # a rule with enough calls of its own ignores the spare ones
    assert conf["slow/lifted"] == pytest.approx(0.99) and "tracegen" not in how["slow/lifted"]


def test_reliability_table_weighs_only_bins_with_enough_calls():
    from eval.scoring import reliability_table

    calls = [(0.9, i < 70) for i in range(100)]  # stated 0.90, 70 % right
    calls += [(0.55, False) for _ in range(10)]  # a thin bin, all wrong: shown, not weighed
    lines, worst = reliability_table(calls, min_bin=50)
    assert worst == pytest.approx(0.2)
    assert lines[1].split()[:5] == ["0.5-0.6", "10", "0.55", "0.00", "0.55"] and lines[1].endswith("(< 50 spikes)")
    assert lines[2].split() == ["0.9-1.0", "100", "0.90", "0.70", "0.20"]


def test_the_shipped_fitted_file_is_what_calibrate_writes_for_the_confidences_the_analysis_loads():
    import json
    from importlib import resources

    from eval.calibrate import fitted_json
    from kvtop.analysis.attribution import thresholds

    shipped = resources.files("kvtop.analysis.attribution").joinpath("fitted.json").read_text(encoding="utf-8")
    how = json.loads(shipped)["how"]
    assert fitted_json(thresholds.CONFIDENCE, thresholds.DISCOUNT, how) == shipped
    assert thresholds.CONFIDENCE["prefill/recompute-long"] == pytest.approx(0.113)
    assert thresholds.DISCOUNT == {"coarse": 0.99, "sparse": 0.99, "chunked": 0.99}
    assert set(how) == set(thresholds.CONFIDENCE) and how["preemption/unread"] == "set"
