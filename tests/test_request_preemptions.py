"""vLLM's per-request preemption histogram joined with observed finishes: bounded memory."""

from __future__ import annotations


def test_finishes_are_not_kept_for_ever_where_no_engine_exports_the_histogram():
    # SGLang, TGI, llama.cpp and the simulator never export vllm:request_num_preemptions: nothing
    # pruned the finishes, and a console or agent grew by one tuple per finished request for ever
    from kvtop.analysis.attribution.request_preemptions import KEEP_S, RequestPreemptions

    rp = RequestPreemptions()
    for i in range(100_000):
        rp.finish(i * 0.1, f"r{i}")
    assert len(rp._finishes) <= KEEP_S / 0.1 + 1
    # with the histogram, an interval's one finish is still pinned to its request
    rp.scrape(("e", None), 10_000.0, 10.0, 3.0)
    rp.finish(10_000.5, "last")
    rp.scrape(("e", None), 10_001.0, 11.0, 5.0)
    assert rp.pinned == {"last": 2}
