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
    doc = json.loads(shipped)
    how, how_tight = doc["how"], doc["how_tight"]
    assert fitted_json(thresholds.CONFIDENCE, thresholds.DISCOUNT, how, thresholds.CONFIDENCE_TIGHT, how_tight) == shipped
    # the engine-cause rules the witnessed rounds judged often enough carry the real engine's fit, at
    # tight targets apart: a shared-stall prefill call checked by the measured rate was right about
    # half the time there, nearly always at 100 ms (where the simulator's many such calls fit it)
    assert "real vLLM's step log (witness rounds odd (every other round, from A), at tight targets" in how_tight["prefill/shared-checked"]
    assert thresholds.CONFIDENCE_TIGHT["prefill/shared-checked"] == pytest.approx(0.563)
    assert thresholds.CONFIDENCE["prefill/shared-checked"] == pytest.approx(0.99)
    assert "real vLLM's step log (witness rounds odd (every other round, from A), at loose targets" in how["preemption/queued"]
    assert thresholds.DISCOUNT == {"coarse": 0.99, "sparse": 0.99, "chunked": 0.967}
    assert set(how) == set(thresholds.CONFIDENCE) and how["preemption/unread"] == "set"
    assert set(how_tight) == set(thresholds.CONFIDENCE_TIGHT) <= set(thresholds.CONFIDENCE)


def test_the_real_engine_refits_only_the_engine_cause_rules_it_judged_often_enough():
    from eval.calibrate import MIN_FIT, fit_witness

    conf = {"prefill/shared": 0.86, "prefill/recompute": 0.66, "preemption/unread": 0.5, "slow/pace": 0.9}
    disc = {"coarse": 0.8}
    how = {k: "set" for k in conf}
    # the step log judged 40 shared calls (half right, half of them coarse), too few recompute calls,
    # and slow-decode calls, which it does not refit
    cs = [Call("prefill/shared", ("coarse",) if i % 2 else (), i < 20) for i in range(40)]
    cs += [Call("prefill/recompute", (), False) for _ in range(MIN_FIT - 1)]
    cs += [Call("preemption/unread", (), False) for _ in range(50)]
    cs += [Call("slow/pace", (), False) for _ in range(50)]
    fit_witness(conf, disc, how, cs, "witness rounds A-G")
    # 20 right where the base predicts 20 x 1 + 20 x 0.8 = 36 base units: 20 / 36
    assert conf["prefill/shared"] == pytest.approx(20 / (20 + 20 * 0.8))
    assert "real vLLM" in how["prefill/shared"] and "A-G" in how["prefill/shared"]
    assert conf["prefill/recompute"] == 0.66 and how["prefill/recompute"] == "set"
    assert conf["preemption/unread"] == 0.5 and conf["slow/pace"] == 0.9


def test_calls_at_tight_targets_fit_a_base_of_their_own_drawn_toward_the_rules_fit_over_both():
    from eval.calibrate import MIN_FIT, WITNESS_PRIOR, fit_witness, stated

    conf = {"prefill/shared-checked": 0.9, "prefill/span": 0.9}
    disc = {"coarse": 0.8}
    how = {k: "set" for k in conf}
    tight: dict[str, float] = {}
    how_tight: dict[str, str] = {}
    # shared-checked: 100 calls at 100 ms, all right; 200 at tight targets, 100 of them right
    cs = [Call("prefill/shared-checked", (), True) for _ in range(100)]
    cs += [Call("prefill/shared-checked", (), i < 100, True) for i in range(200)]
    # span: plenty at tight targets, too few at loose ones to fit there
    cs += [Call("prefill/span", (), i < 90, True) for i in range(100)]
    cs += [Call("prefill/span", (), True) for _ in range(MIN_FIT - 1)]
    fit_witness(conf, disc, how, cs, "witness rounds ODD", (tight, how_tight))
    pooled = 200 / 300
    assert conf["prefill/shared-checked"] == pytest.approx((100 + WITNESS_PRIOR * pooled) / (100 + WITNESS_PRIOR))
    assert tight["prefill/shared-checked"] == pytest.approx((100 + WITNESS_PRIOR * pooled) / (200 + WITNESS_PRIOR))
    assert "at loose targets" in how["prefill/shared-checked"] and "at tight targets" in how_tight["prefill/shared-checked"]
    assert conf["prefill/span"] == 0.9 and how["prefill/span"] == "set" and "prefill/span" in tight
    # a call at a tight target states the tight base, one at a loose target the base
    t = Call("prefill/shared-checked", ("coarse",), True, True)
    assert stated(t, conf, disc, tight) == pytest.approx(tight["prefill/shared-checked"] * 0.8)
    assert stated(Call("prefill/shared-checked", (), True), conf, disc, tight) == conf["prefill/shared-checked"]
    # a rule without a tight base states its base at any target
    assert stated(Call("prefill/lone", (), True, True), {"prefill/lone": 0.7}, disc, tight) == 0.7


def test_the_witnessed_rounds_are_halved_every_other_round():
    from eval import witnessed
    from eval.calibrate import witness_rounds

    odd, even = witness_rounds("odd"), witness_rounds("even")
    every = witnessed.names()
    assert odd[:3] == ["A", "C-31", "E-51"] and even[:3] == ["B-21", "D-41", "F-61"]
    assert sorted(odd + even) == sorted(every) and not set(odd) & set(even)
    assert witness_rounds("none") == [] and witness_rounds("A-C") == ["A", "B-21", "C-31"]


def test_witnessed_rounds_are_chosen_by_letter_and_read_as_traces_with_the_engines_steps():
    import json
    import os

    from eval import witnessed

    assert witnessed.select("A-C,O") == ["A", "B-21", "C-31", "O-161"]
    assert witnessed.select("all") == witnessed.names() and len(witnessed.names()) >= 15
    # after Z come AA, AB, ...: a range runs in that order
    assert witnessed.select("Y-Z") == ["Y-261", "Z-271"]
    with pytest.raises(ValueError, match="no witnessed round 'ZZ'"):
        witnessed.select("ZZ")
    with pytest.raises(ValueError, match="no witnessed round 'C-A'"):
        witnessed.select("C-A")
    with witnessed.traces(["O-161"]) as paths:
        assert sorted(p.rsplit("/", 1)[1] for p in paths) == [
            "mixed-161.jsonl", "prefill-161.jsonl", "storm10x500-161.jsonl", "storm8x900-161.jsonl"]
        with open(paths[0]) as f:
            recs = [json.loads(line) for line in f]
        kept = paths
    assert recs[0]["kind"] == "header" and recs[0]["engine"]["version"] == "0.32.0"
    assert sum(r["kind"] == "step" for r in recs) > 100 and sum(r["kind"] == "request" for r in recs) > 100
    assert not any(os.path.exists(p) for p in kept)  # the temporary copies are gone
