"""GPU and host views share their fields with the records: the snapshot carries the latest reading
and adds only what the core derives, the JSON keeps the documented keys in the documented order,
and a trace never gains a view-only field."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from kvtop.core import Core
from kvtop.model.records import GpuRecord, HostRecord, from_dict, to_dict

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "kvtop" / "schemas" / "snapshot.schema.json").read_text())
GIB = 1 << 30
VIEW_ONLY = {"pcie_capacity_bytes_per_s", "link_downtrained", "pcie_tx_history", "pcie_rx_history"}


def _gpu(t: float, tx: float) -> GpuRecord:
    # a Gen5 x16 card trained down to Gen4 while it moves 20 GB/s
    return GpuRecord(t=t, index=0, uuid="GPU-0", name="NVIDIA H100", mem_used_bytes=70 * GIB,
                     mem_total_bytes=80 * GIB, pcie_tx_bytes_per_s=tx, pcie_rx_bytes_per_s=1e9,
                     pcie_source="field_counters", pcie_link_gen=4, pcie_link_width=16, pcie_link_gen_max=5,
                     pcie_link_width_max=16, util_pct=90.0, notes=["MIG off"])


def _host(t: float) -> HostRecord:
    return HostRecord(t=t, mem_total_bytes=512 * GIB, mem_available_bytes=300 * GIB, pinned_bytes=24 * GIB,
                      pinned_signal="Mlocked", pinned_signals={"Mlocked": 24 * GIB, "shmem": None}, notes=["cgroup v2"])


def _core() -> Core:
    core = Core(window_s=30.0)
    for t, tx in ((1.0, 18e9), (2.0, 20e9)):
        core.ingest(_gpu(t, tx))
        core.ingest(_host(t))
    return core


def test_gpu_view_is_the_latest_reading_plus_what_the_core_derives():
    (g,) = _core().snapshot().gpus
    assert g.record == _gpu(2.0, 20e9)
    # Gen4 x16: 16 lanes x 1.969 GB/s per direction; under load below its Gen5 max
    assert g.pcie_capacity_bytes_per_s == 16 * 1.969e9
    assert g.link_downtrained is True
    assert g.pcie_tx_history == (18e9, 20e9) and g.pcie_rx_history == (1e9, 1e9)


def test_trace_records_never_carry_view_only_fields():
    snap = _core().snapshot()
    line = to_dict(snap.gpus[0].record)
    assert not VIEW_ONLY & set(line)
    assert from_dict(json.loads(json.dumps(line))) == _gpu(2.0, 20e9)
    assert snap.host is not None and to_dict(snap.host) == to_dict(_host(2.0))


def test_snapshot_json_lists_the_documented_keys_in_order():
    doc = _core().snapshot().to_json()
    jsonschema.validate(doc, SCHEMA)
    gpu, host = doc["gpus"][0], doc["host"]
    # the schema lists every GPU and host key in the order the JSON has always had them; the
    # record's time is the snapshot's, never repeated per GPU
    assert list(gpu) == list(SCHEMA["$defs"]["gpu"]["properties"])
    assert list(host) == list(SCHEMA["$defs"]["host"]["properties"])
    assert gpu["pcie_capacity_bytes_per_s"] == 16 * 1.969e9 and gpu["link_downtrained"] is True
    assert gpu["notes"] == ["MIG off"] and host["pinned_signals"] == {"Mlocked": 24 * GIB, "shmem": None}
    hist = _core().snapshot().to_json(include_history=True)["gpus"][0]
    assert hist["pcie_tx_history"] == [18e9, 20e9]
    # with history: the two series sit before the notes
    assert list(hist)[-3:] == ["pcie_tx_history", "pcie_rx_history", "notes"]
