"""eval/prompt_cost.py: a prompt's part of its engine step as the witness prices it (its time beyond
the decode-only steps just before it), pooled by prompt size into a marginal prefill rate."""

from __future__ import annotations

import pytest

from eval.prompt_cost import by_size, prompt_parts


def _step(t: float, dur: float, prompt: int = 0, recompute: int = 0) -> dict:
    reqs = [["d1", 1, 0, 0, 1], ["d2", 1, 0, 0, 1]]  # two decoding requests in every step
    if prompt or recompute:
        reqs.append(["p", prompt + recompute, prompt, recompute, 1])
    return {"kind": "step", "t": t, "end": t + dur, "reqs": reqs}


def test_a_prompt_step_is_priced_beyond_the_decode_steps_before_it_and_pooled_by_size():
    steps, t = [], 0.0
    for _ in range(8):
        steps.append(_step(t, 0.010))
        t += 0.010
    # a 10-token prompt that took 2 ms of its step, a 200-token one 40 ms, a recompute (not a prompt's)
    for dur, prompt, rec in ((0.012, 10, 0), (0.010, 0, 0), (0.050, 200, 0), (0.030, 0, 300)):
        steps.append(_step(t, dur, prompt, rec))
        t += dur
    parts = prompt_parts(steps)
    assert [p for p, _ in parts] == [10, 200]
    assert [x for _, x in parts] == pytest.approx([0.002, 0.040])
    rows = {name: (n, med, rate) for name, n, med, rate in by_size(parts)}
    assert rows["<= 64"][0] == 1 and rows["<= 64"][2] == pytest.approx(5000)  # 10 tokens in 2 ms
    assert rows["65-255"][2] == pytest.approx(5000) and rows[">= 256"] == (0, None, None)


def test_a_prompt_step_with_no_decode_step_before_it_is_not_priced():
    assert prompt_parts([_step(0.0, 0.05, prompt=20), _step(0.05, 0.01)]) == []
