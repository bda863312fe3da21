"""GPU tracker: each GPU's latest reading plus its recent PCIe traffic; derives the GPU events (lost
off the bus, link down-trained under load) and the GpuViews."""

from __future__ import annotations

from collections import deque

from kvtop.core.events import EventLog
from kvtop.model.records import GpuRecord
from kvtop.model.sanitize import printable
from kvtop.snapshot import GpuView

# Bytes/s per lane per direction by PCIe generation (8b/10b for Gen1-2, 128b/130b after).
_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}


def pcie_capacity_bytes_per_s(gen: int | None, width: int | None) -> float | None:
    if not gen or not width or gen not in _LANE_BYTES_PER_S:
        return None
    return _LANE_BYTES_PER_S[gen] * width


def downtrained(rec: GpuRecord) -> bool:
    # Idle links down-train on purpose; only flag it while traffic flows.
    busy = (rec.pcie_tx_bytes_per_s or 0) + (rec.pcie_rx_bytes_per_s or 0) > 1e9 or (rec.util_pct or 0) > 50
    if not busy:
        return False
    g, gm, w, wm = rec.pcie_link_gen, rec.pcie_link_gen_max, rec.pcie_link_width, rec.pcie_link_width_max
    return bool((g and gm and g < gm) or (w and wm and w < wm))


class GpuTracker:
    def __init__(self, log: EventLog) -> None:
        self._log = log
        # index -> (latest reading, PCIe TX history, PCIe RX history)
        self._gpus: dict[int, tuple[GpuRecord, deque[float], deque[float]]] = {}

    def ingest(self, rec: GpuRecord) -> None:
        if rec.name is not None:
            rec.name = printable(rec.name, 120)
        prev = self._gpus.get(rec.index)
        tx, rx = (prev[1], prev[2]) if prev else (deque(maxlen=120), deque(maxlen=120))
        if rec.pcie_tx_bytes_per_s is not None:
            tx.append(rec.pcie_tx_bytes_per_s)
        if rec.pcie_rx_bytes_per_s is not None:
            rx.append(rec.pcie_rx_bytes_per_s)
        if prev and rec.lost and not prev[0].lost:
            self._log.add(rec.t, "error", "source_error", f"GPU {rec.index}: lost (fell off the bus?)")
        self._gpus[rec.index] = (rec, tx, rx)
        if downtrained(rec) and not (prev and downtrained(prev[0])):
            self._log.add(rec.t, "warning", "link_downtrained",
                          f"GPU {rec.index}: PCIe link Gen{rec.pcie_link_gen} x{rec.pcie_link_width} under load "
                          f"(max Gen{rec.pcie_link_gen_max} x{rec.pcie_link_width_max})")

    def views(self) -> tuple[GpuView, ...]:
        # stored readings are never changed after ingest, so snapshots share them rather than copy
        return tuple(
            GpuView(record=grec,
                    pcie_capacity_bytes_per_s=pcie_capacity_bytes_per_s(grec.pcie_link_gen, grec.pcie_link_width),
                    link_downtrained=downtrained(grec), pcie_tx_history=tuple(tx), pcie_rx_history=tuple(rx))
            for grec, tx, rx in sorted(self._gpus.values(), key=lambda x: x[0].index)
        )
