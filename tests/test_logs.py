"""Engine log-line parsers: SGLang retraction (three historical forms) and decode lines, vLLM V0 preemption."""

from __future__ import annotations

import pytest
from conftest import fixture_text

from kvtop.sources.logs import SglangDecodeBatch, SglangRetraction, VllmPreemption, parse_line, parse_lines

TAIL = ", #new_token_ratio: 0.4000 -> 0.7000"


def test_sglang_fixture_lines():
    events = list(parse_lines(fixture_text("sglang-preemption-log-1.txt").splitlines()))
    assert len(events) == 3  # comment lines 1-5 are skipped
    a, b, c = events
    # line 6 (A): 2025-05..2025-12 INFO form
    assert a == SglangRetraction(retracted_reqs=1, new_token_ratio_before=0.9998, new_token_ratio_after=1.0,
                                 form="2025-05..2025-12")
    # line 7 (B): real PD decode-node line with timestamp and TP rank
    assert isinstance(b, SglangDecodeBatch)
    assert (b.timestamp, b.ranks) == ("2026-04-07 13:24:13", {"TP": 0})
    assert (b.running_reqs, b.num_tokens, b.token_usage, b.queue_reqs) == (10, 485248, 0.94, 0)
    assert (b.prealloc_reqs, b.transfer_reqs, b.retracted_reqs, b.gen_throughput) == (1, 12, 0, 259.82)
    # line 8 (C): older "Decode batch." form
    assert (c.running_reqs, c.num_tokens, c.token_usage, c.gen_throughput, c.queue_reqs) == (233, 370959, 0.82, 4594.01, 317)
    assert c.retracted_reqs is None and c.timestamp is None


def test_sglang_current_form_with_gains_and_ranks():
    ev = parse_line("[2026-01-05 10:00:01 DP1 TP0] KV cache pool is full. Retract requests. "
                    "#retracted_reqs: 3, #new_tokens_gained: 4096, #mamba_num_gained: 2" + TAIL + "\n")
    assert ev == SglangRetraction(3, 0.4, 0.7, "2025-12+", new_tokens_gained=4096, mamba_num_gained=2,
                                  timestamp="2026-01-05 10:00:01", ranks={"DP": 1, "TP": 0})


def test_sglang_oldest_form_and_test_mode():
    old = parse_line("[2025-03-01 08:00:00 TP0] Decode out of memory happened. #retracted_reqs: 2" + TAIL)
    assert (old.form, old.retracted_reqs, old.new_token_ratio_after) == ("pre-2025-05", 2, 0.7)
    forced = parse_line("Testing retraction. KV cache pool is full. Retract requests. #retracted_reqs: 1, "
                        "#new_tokens_gained: 10" + TAIL)
    assert forced.testing is True and forced.form == "2025-12+"


def test_vllm_docs_variant_fixture():
    (ev,) = parse_lines(fixture_text("vllm-preemption-log-1.txt").splitlines())
    # line 14: no "]" after the line number and total_cumulative_preemption_cnt=1
    assert ev == VllmPreemption(request_id="0", mode="RECOMPUTE", cumulative=1, docs_variant=True,
                                timestamp="05-09 00:49:33", source="scheduler.py:1057")
    rec = ev.to_record(12.5)
    assert (rec.t, rec.id, rec.event, rec.source) == (12.5, "0", "preempt", "engine")


MSG = ("Sequence group {rid} is preempted by PreemptionMode.{mode} mode because there is not enough KV cache "
       "space. This can affect the end-to-end performance. Increase gpu_memory_utilization or "
       "tensor_parallel_size to provide more KV cache memory. total_num_cumulative_preemption={n}")


@pytest.mark.parametrize("prefix", [
    "WARNING 05-09 00:49:33 scheduler.py:1057] ",  # logger format until 2025-02
    "WARNING 05-09 00:49:33 [scheduler.py:1057] ",  # #13011
    "(EngineCore pid=4242) WARNING 05-09 00:49:33 [core/scheduler.py:1057] ",  # fileinfo + process prefix
])
def test_vllm_code_forms(prefix):
    ev = parse_line(prefix + MSG.format(rid="cmpl-7f3a-0", mode="SWAP", n=51))
    assert (ev.request_id, ev.mode, ev.cumulative, ev.docs_variant) == ("cmpl-7f3a-0", "SWAP", 51, False)
    assert ev.source.endswith("scheduler.py:1057")


def test_other_lines_are_ignored():
    for line in ["", "INFO 05-09 00:49:33 [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s",
                 "Decode batch. nothing here", "#retracted_reqs: x", "Sequence group 1 finished"]:
        assert parse_line(line) is None
