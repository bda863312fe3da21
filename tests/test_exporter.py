"""`kvtop agent`'s Prometheus series (kvtop/views/exporter.py), fed by a simulated preemption storm."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtop.analysis.advice.advisor import ACTIONS
from kvtop.analysis.live import LiveAnalyzer
from kvtop.core import Core
from kvtop.model.records import EngineRecord, GpuRecord, HostRecord, RequestRecord
from kvtop.sim.simulate import Simulation
from kvtop.sim.workload import load_preset
from kvtop.sources.host import SIG_CGROUP_SHMEM, SIG_ENGINE_SHMEM, SIG_GUP, SIG_MLOCKED
from kvtop.views.exporter import AgentMetrics, engine_label


def _storm(seconds: float) -> tuple[Core, AgentMetrics, list]:
    core = Core(itl_target_s=0.1, analysis=LiveAnalyzer(itl_target_s=0.1))
    m = AgentMetrics(request_engine="10.0.0.5:8000")
    recs: list = []

    def emit(r) -> None:  # noqa: ANN001
        if isinstance(r, EngineRecord):
            r.url = "http://10.0.0.5:8000"
        recs.append(r)
        core.ingest(r)
        m.sink(r)

    Simulation(load_preset("preemption-storm"), 1, seconds, emit, scrape_interval_s=1.0).run()
    assert core.analysis is not None
    core.analysis.report(core.now + 30)  # let every spike's evidence window pass
    m.update(core.snapshot(core.now + 30), core.analysis.counters() if core.analysis else None)
    return core, m, recs


def _samples(m: AgentMetrics) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[s.name].append((s.labels, s.value))
    return out


@pytest.fixture(scope="module")
def storm():
    return _storm(30.0)


def test_spike_and_stall_counters_are_the_analyzers_counts(storm):
    core, m, _ = storm
    s = _samples(m)
    an = core.analysis.an
    spikes = {lb["cause"]: v for lb, v in s["kvtop_token_gap_spikes_total"]}
    assert spikes == {c: float(n) for c, n in an.cause_counts.items()}
    assert spikes["preemption"] >= 10, spikes  # the storm's stalls are preemptions
    stall = {lb["cause"]: v for lb, v in s["kvtop_stall_seconds_total"]}
    for c, n in spikes.items():
        assert stall[c] >= 0.1 * n - 1e-9  # each spike is a gap longer than the 100 ms target
    assert {lb["engine"] for lb, _ in s["kvtop_token_gap_spikes_total"]} == {"10.0.0.5:8000"}
    [(lb, v)] = s["kvtop_preemptions_attributed_total"]
    assert 0 < v <= spikes["preemption"]
    [(lb, v)] = s["kvtop_engine_preemptions_total"]
    assert v == core.snapshot().engines[0].preemptions_total > 0


def test_client_side_histograms_count_every_gap_and_first_token(storm):
    _, m, recs = storm
    tokens: Counter[str] = Counter()
    arrived = set()
    for r in recs:
        if isinstance(r, RequestRecord):
            if r.event in ("token", "first_token"):
                tokens[r.id] += 1
            elif r.event == "arrive":
                arrived.add(r.id)
    s = _samples(m)
    [(_, gaps)] = s["kvtop_stream_inter_token_gap_seconds_count"]
    assert gaps == sum(n - 1 for n in tokens.values())
    [(_, ttft)] = s["kvtop_stream_time_to_first_token_seconds_count"]
    assert ttft == sum(1 for rid in tokens if rid in arrived)
    # the storm's stalls show up in the tail: some gaps are above the 100 ms target
    below = {lb["le"]: v for lb, v in s["kvtop_stream_inter_token_gap_seconds_bucket"]}
    assert below["0.1"] < below["+Inf"]


def test_series_follow_prometheus_conventions_and_never_carry_a_request_id(storm):
    _, m, recs = storm
    ids = {r.id for r in recs if isinstance(r, RequestRecord)}
    for fam in text_string_to_metric_families(m.render().decode()):
        assert fam.name.startswith("kvtop_") and ":" not in fam.name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples)
        for s in fam.samples:
            assert not {"id", "request_id", "request"} & set(s.labels)
            assert not ids & set(s.labels.values())


def test_series_count_stays_bounded_as_the_run_grows():
    def count(seconds: float) -> int:
        _, m, _ = _storm(seconds)
        return sum(len(f.samples) for f in text_string_to_metric_families(m.render().decode()))

    short, long = count(5.0), count(25.0)
    assert short == long  # no series per request, per stream or per spike


def test_verdict_is_a_state_set_over_every_action(storm):
    core, m, _ = storm
    s = _samples(m)
    acts = {lb["action"]: v for lb, v in s["kvtop_verdict"]}
    assert set(acts) == set(ACTIONS)  # the label set never changes with the verdict
    current = core.snapshot(core.now + 30).analysis.verdict
    assert [a for a, v in acts.items() if v == 1] == [current.action]
    assert sum(acts.values()) == 1
    assert all(lb["engine"] == "10.0.0.5:8000" for lb, _ in s["kvtop_verdict"])
    mech = {lb["mechanism"]: v for lb, v in s["kvtop_verdict_mechanism"]}
    assert set(mech) == {"swap", "recompute"}
    assert [k for k, v in mech.items() if v == 1] == ([current.mechanism] if current.mechanism else [])
    [(_, conf)] = s["kvtop_verdict_confidence"]
    assert 0 <= conf <= 1


def test_without_an_analysis_every_action_is_0_and_the_series_still_exist():
    core = Core()
    m = AgentMetrics(request_engine="10.0.0.5:8000")
    m.update(core.snapshot())
    s = _samples(m)
    assert {lb["action"]: v for lb, v in s["kvtop_verdict"]} == {a: 0.0 for a in ACTIONS}


def test_label_values_are_tokens_and_each_label_means_one_thing():
    core = Core()
    m = AgentMetrics(request_engine="10.0.0.5:8000")
    host = HostRecord(t=1.0, mem_available_bytes=1 << 30,
                      pinned_signals={SIG_MLOCKED: 4096, SIG_GUP: 0, SIG_ENGINE_SHMEM: 3 << 30, SIG_CGROUP_SHMEM: None},
                      pinned_signal=SIG_ENGINE_SHMEM, pinned_bytes=3 << 30)
    core.ingest(host)
    for r in (RequestRecord(t=1.0, id="a", event="arrive", source="capture"),
              RequestRecord(t=1.1, id="b", event="arrive", source="probe")):
        core.ingest(r)
        m.sink(r)
    m.update(core.snapshot())
    s = _samples(m)
    sig = {lb["signal"]: v for lb, v in s["kvtop_host_memory_signal_bytes"]}
    assert sig == {"mlocked": 4096.0, "gup_pinned": 0.0, "engine_shmem": float(3 << 30)}
    # the pinned name holds the pinned estimate only (one series: nothing to sum), never Mlocked
    assert s["kvtop_host_pinned_memory_bytes"] == [({"signal": "engine_shmem"}, float(3 << 30))]
    assert {lb["observer"]: v for lb, v in s["kvtop_streams_observed_total"]} == {"capture": 1.0, "probe": 1.0}
    for fam in text_string_to_metric_families(m.render().decode()):
        for smp in fam.samples:
            assert "source" not in smp.labels, smp
            for k, v in smp.labels.items():
                if k not in ("engine", "model_name", "UUID", "version", "le", "pod", "namespace", "node"):
                    assert re.fullmatch(r"[a-z0-9_.+]*|\+Inf", v), (smp.name, k, v)


def test_model_name_comes_from_the_engine_and_pod_labels_from_the_downward_api():
    core = Core(itl_target_s=0.1, analysis=LiveAnalyzer(itl_target_s=0.1))
    env = {"POD_NAME": "vllm-7d9f-x2", "POD_NAMESPACE": "inference", "NODE_NAME": "gpu-node-1"}
    m = AgentMetrics(request_engine="10.0.0.5:8000", env=env)
    core.ingest(EngineRecord(t=1.0, adapter="vllm", url="http://10.0.0.5:8000", up=True, model="Qwen/Qwen2.5-7B",
                             kv_usage=0.5))
    m.update(core.snapshot(), core.analysis.counters() if core.analysis else None)
    s = _samples(m)
    [(lb, _)] = s["kvtop_engine_kv_cache_usage_ratio"]
    assert lb == {"engine": "10.0.0.5:8000", "model_name": "Qwen/Qwen2.5-7B"}
    assert {lb["model_name"] for lb, _ in s["kvtop_token_gap_spikes_total"]} == {"Qwen/Qwen2.5-7B"}
    [(lb, v)] = s["kvtop_agent_info"]
    assert v == 1 and (lb["pod"], lb["namespace"], lb["node"]) == ("vllm-7d9f-x2", "inference", "gpu-node-1")
    m2 = AgentMetrics(env={})
    m2.update(Core().snapshot())
    [(lb, _)] = _samples(m2)["kvtop_agent_info"]
    assert (lb["pod"], lb["namespace"]) == ("", "")


def test_gpu_series_use_dcgm_quantities_and_flag_a_downtrained_link():
    core = Core()
    m = AgentMetrics()
    core.ingest(GpuRecord(t=1.0, index=0, uuid="GPU-abc", mem_used_bytes=40 << 30, mem_total_bytes=80 << 30,
                          pcie_tx_bytes_per_s=6e9, pcie_rx_bytes_per_s=1e9, pcie_link_gen=3, pcie_link_gen_max=4,
                          pcie_link_width=16, pcie_link_width_max=16, pcie_replay_count=7, util_pct=90))
    core.ingest(GpuRecord(t=1.0, index=1, uuid="GPU-def", mem_used_bytes=1 << 30, mem_total_bytes=80 << 30,
                          pcie_link_gen=4, pcie_link_gen_max=4, pcie_link_width=16, pcie_link_width_max=16))
    m.update(core.snapshot())
    s = _samples(m)
    used = {lb["gpu"]: v for lb, v in s["kvtop_gpu_fb_used_bytes"]}
    assert used == {"0": float(40 << 30), "1": float(1 << 30)}
    assert {lb["UUID"] for lb, _ in s["kvtop_gpu_fb_used_bytes"]} == {"GPU-abc", "GPU-def"}
    down = {lb["gpu"]: v for lb, v in s["kvtop_gpu_pcie_link_downtrained"]}
    assert down == {"0": 1.0, "1": 0.0}
    assert dict((lb["gpu"], v) for lb, v in s["kvtop_gpu_pcie_replay_total"]) == {"0": 7.0}
    # GPU 0 has no NVML byte counters: its 20 ms sample is a gauge; no counter pretends otherwise
    assert dict((lb["gpu"], v) for lb, v in s["kvtop_gpu_pcie_tx_sampled_bytes_per_second"]) == {"0": 6e9}
    assert "kvtop_gpu_pcie_tx_bytes_total" not in s


def test_pcie_bytes_are_nvml_counters_exact_at_any_scrape_interval():
    """The exported series is the driver's cumulative counter: a scrape every 7 s sees every byte
    moved in between, bursts included, where a 1 s rate gauge sampled every 7 s would see 1 of 7."""
    core = Core()
    m = AgentMetrics()
    tx = 0
    moved: list[int] = []
    seen: list[float] = []
    for t in range(1, 16):
        step = (5 << 30) if t % 3 == 0 else (1 << 20)  # bursty traffic
        tx += step
        moved.append(step)
        core.ingest(GpuRecord(t=float(t), index=0, uuid="GPU-abc", pcie_source="field_counters",
                              pcie_tx_bytes_per_s=float(step), pcie_rx_bytes_per_s=1.0,
                              pcie_tx_bytes_total=tx, pcie_rx_bytes_total=7 * t))
        m.update(core.snapshot())
        [(lb, v)] = _samples(m)["kvtop_gpu_pcie_tx_bytes_total"]
        seen.append(v)
    assert lb == {"gpu": "0", "UUID": "GPU-abc"} and seen[-1] == float(tx)
    for a, b in ((0, 7), (7, 14)):  # scrapes at t=1, 8, 15
        assert seen[b] - seen[a] == float(sum(moved[a + 1:b + 1]))
    sampled_every_7s = [moved[a] for a in (0, 7, 14)]
    assert sum(sampled_every_7s) * 7 != sum(moved[1:])  # what a 1 s gauge would have said
    assert "kvtop_gpu_pcie_tx_sampled_bytes_per_second" not in _samples(m)


def test_a_failed_scrape_counts_as_a_scrape_error_and_marks_the_source_stale():
    core = Core()
    m = AgentMetrics()
    for t in (1.0, 2.0, 3.0):
        rec = EngineRecord(t=t, adapter="vllm", url="http://10.0.0.7:8000", up=False, warnings=["refused"])
        core.ingest(rec)
        m.sink(rec)
    m.update(core.snapshot(), stale_after_s=10.0)
    s = _samples(m)
    assert s["kvtop_engine_scrape_errors_total"] == [({"engine": "10.0.0.7:8000"}, 3.0)]
    assert s["kvtop_engine_stale"] == [({"engine": "10.0.0.7:8000", "model_name": ""}, 1.0)]
    assert ({"adapter": "vllm", "engine": "10.0.0.7:8000", "model_name": ""}, 0.0) in s["kvtop_engine_up"]
    assert s["kvtop_gpu_stale"] == [({}, 0.0)]  # not read here: not stale


def test_a_dead_engine_keeps_no_gauge_of_what_it_last_said_and_errors_count_from_0():
    """An engine that answered (KV 0.8, 3 waiting) then stopped: its gauges go rather than hold the
    old values as if current; up 0, stale 1, and its monotonic counter stay. Its error counter
    existed at 0 from its first scrape, so increase() sees the first failure."""
    core = Core()
    m = AgentMetrics()
    ok = EngineRecord(t=1.0, adapter="vllm", url="http://10.0.0.7:8000", up=True, kv_usage=0.8, running=5,
                      waiting=3, preemptions_total=4)
    core.ingest(ok)
    m.sink(ok)
    m.update(core.snapshot())
    s = _samples(m)
    assert s["kvtop_engine_scrape_errors_total"] == [({"engine": "10.0.0.7:8000"}, 0.0)]
    assert [v for _, v in s["kvtop_engine_waiting_requests"]] == [3.0]
    assert not [n for n in s if n.endswith("_created")]
    down = EngineRecord(t=2.0, adapter="vllm", url="http://10.0.0.7:8000", up=False, warnings=["refused"])
    core.ingest(down)
    m.sink(down)
    m.update(core.snapshot())
    s = _samples(m)
    assert s["kvtop_engine_scrape_errors_total"] == [({"engine": "10.0.0.7:8000"}, 1.0)]
    for gone in ("kvtop_engine_kv_cache_usage_ratio", "kvtop_engine_running_requests", "kvtop_engine_waiting_requests"):
        assert not s.get(gone), (gone, s.get(gone))
    assert [v for _, v in s["kvtop_engine_up"]] == [0.0] and [v for _, v in s["kvtop_engine_stale"]] == [1.0]
    assert [v for _, v in s["kvtop_engine_preemptions_total"]] == [4.0]


def test_before_a_target_is_known_the_verdict_is_insufficient_data_not_no_action():
    """Probe streams only, no --itl-target-ms: the target waits for 2,000 gaps, and until then no gap
    was judged. The state-set said no_action (confidence 0.9: "ITL target met")."""
    live = LiveAnalyzer()
    core = Core(analysis=live)
    m = AgentMetrics(request_engine="10.0.0.5:8000")
    t = 0.0
    for i in range(4):
        rid = f"p{i}"
        for rec in [RequestRecord(t=t, id=rid, event="arrive"), *(RequestRecord(t=t + 0.05 + 0.01 * k, id=rid, event="token")
                                                                for k in range(100)),
                    RequestRecord(t=t + 1.1, id=rid, event="finish")]:
            core.ingest(rec)
            m.sink(rec)
        t += 1.2
    m.update(core.snapshot(t + 5), live.counters())
    s = _samples(m)
    acts = {lb["action"]: v for lb, v in s["kvtop_verdict"]}
    assert [a for a, v in acts.items() if v == 1] == ["insufficient_data"], acts
    verdict = core.snapshot(t + 5).analysis.verdict
    assert "no ITL target yet to judge the 396 inter-token gaps by" in verdict.reasons[0], verdict.reasons


@pytest.mark.parametrize(("url", "engine", "want"), [
    ("http://10.0.0.5:8000", None, "10.0.0.5:8000"),
    ("http://10.0.0.5:8000/metrics", "0", "10.0.0.5:8000"),
    ("10.0.0.5:30000", "1", "10.0.0.5:30000/1"),
    ("https://gw.example/llama", None, "gw.example/llama"),
])
def test_engine_label(url, engine, want):
    assert engine_label(url, engine) == want
