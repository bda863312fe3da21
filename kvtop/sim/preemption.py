"""Preemption of a running sequence, the host swap link, and resume accounting.

``recompute`` frees the victim's blocks (its full ones stay cached, so a resume can hit them) and
re-prefills on readmission; ``swap`` copies its private blocks to host memory over a link and back
(falling back to recompute when host memory is full). Copies in each direction are serialised on
the link; with ``swap.overlap`` off they block the engine step (vLLM V0), with it on they run
beside it. vLLM V1 counts a preemption when the victim produces its next output, not when it is
preempted (docs/engines.md §2.4, docs/real-engines.md), so a victim carries ``pending_preempts``
until its resume, which is also when its ``resume`` truth record is written. Which sequence is the
victim, and moving it between queues, is the scheduler's business (``kvtop.sim.engine``).
"""

from __future__ import annotations

from typing import Any

from kvtop.model.records import TruthRecord
from kvtop.sim.blocks import BlockPool
from kvtop.sim.seq import SWAPPED, WAITING, Seq
from kvtop.sim.stats import Sink, Stats
from kvtop.sim.workload import EngineConfig

# resume_info keys copied into the resume truth record
_RESUME_KEYS = ("mode", "hit_tokens", "recompute_tokens", "swap_out_s", "swap_in_s", "fallback")


class Preemptor:
    def __init__(self, cfg: EngineConfig, pool: BlockPool, stats: Stats, sink: Sink, t0: float = 0.0):
        self.cfg = cfg
        self.pool = pool
        self.stats = stats
        self.sink = sink
        self.host_used = 0  # blocks held in host memory by swapped-out sequences
        self.link_out_free = t0  # when the GPU->host direction of the link is next idle
        self.link_in_free = t0

    def transfer_s(self, nbytes: float) -> float:
        """Link time for ``nbytes``: a fixed cost per copy (one per block, or per ``copy_bytes``
        piece when the KV layout splits blocks) plus the bytes at link speed."""
        sw = self.cfg.swap
        g = sw.copy_bytes or self.cfg.block_bytes
        copies = -(-int(nbytes) // g)
        return copies * sw.copy_overhead_s + nbytes / sw.link_bytes_per_s

    def preempt(self, v: Seq, t: float) -> float | None:
        """Evict ``v`` (already taken off the running list). Returns the time a blocking swap-out
        ends, else None. The caller puts ``v`` back at the front of the waiting queue."""
        self.stats.preempt_events += 1
        v.n_preempts += 1
        v.pending_preempts += 1
        v.preempted_at = v.last_t if v.preempted_at is None else v.preempted_at
        ctx = v.computed
        cfg = self.cfg
        mode = cfg.preemption_mode
        done_t = None
        private = v.blocks - v.shared
        bb = cfg.block_bytes
        data: dict[str, Any] = {"mode": mode, "context_tokens": ctx, "generated": v.generated,
                                "kv_usage": round(self.pool.usage, 4), "cause": "kv_full"}
        if mode == "swap" and private * bb <= cfg.swap.host_capacity_bytes - self.host_used * bb:
            nbytes = private * bb
            dur = self.transfer_s(nbytes)
            start = max(t, self.link_out_free)
            done_t = start + dur
            self.link_out_free = done_t
            self.stats.offload_bytes["GPU_to_CPU"] += nbytes
            self.stats.offload_time["GPU_to_CPU"] += dur
            freed = self.pool.free_all(v, keep_private_cache=False)
            v.host_blocks = private
            self.host_used += private
            v.out_done = done_t
            v.state = SWAPPED
            data.update(freed, swap_out_bytes=nbytes, swap_out_s=round(dur, 6))
            if cfg.swap.overlap:
                done_t = None
        else:
            if mode == "swap":
                data["mode"] = "recompute"
                data["fallback"] = "host_full"
            freed = self.pool.free_all(v, keep_private_cache=True)
            v.computed = 0
            v.state = WAITING
            data.update(freed)
        v.resume_info = data
        self.sink.on_truth(TruthRecord(t, "preempt", v.id, dict(data)))
        return done_t

    def swap_in(self, s: Seq, t0: float, shared: int) -> float:
        """Copy a readmitted swapped sequence's private blocks back (its ``shared`` prefix blocks
        are still resident). Returns when the copy ends."""
        cfg = self.cfg
        moved = (-(-s.computed // cfg.block_size) - shared) * cfg.block_bytes
        moved = max(0, moved)
        dur = self.transfer_s(moved)
        # not before the swap-out finished, nor before earlier swap-ins on the link
        start = max(t0, self.link_in_free, s.out_done)
        done = start + dur
        self.link_in_free = done
        self.stats.offload_bytes["CPU_to_GPU"] += moved
        self.stats.offload_time["CPU_to_GPU"] += dur
        self.host_used -= s.host_blocks
        s.host_blocks = 0
        if s.resume_info is not None:
            s.resume_info["readmit_t"] = t0
            s.resume_info["swap_in_bytes"] = moved
            s.resume_info["swap_in_s"] = round(dur, 6)
        return done

    @staticmethod
    def note_readmit(s: Seq, t0: float, hit_tokens: int, recompute_tokens: int) -> None:
        """A recompute victim is scheduled again: what the prefix cache saved and what it recomputes."""
        if s.resume_info is not None:
            s.resume_info["readmit_t"] = t0
            s.resume_info["hit_tokens"] = hit_tokens
            s.resume_info["recompute_tokens"] = recompute_tokens

    @staticmethod
    def note_progress(s: Seq, t_end: float) -> None:
        """After a step: when the victim has the KV it had when preempted, its recovery is over."""
        info = s.resume_info
        if info is not None and "recovered_t" not in info and s.computed >= info["context_tokens"]:
            info["recovered_t"] = t_end

    def resumed(self, s: Seq, t_end: float) -> None:
        """The victim's first output after a preemption: vLLM V1 counts the preemption now."""
        counted = s.pending_preempts
        self.stats.preemptions += counted
        s.pending_preempts = 0
        info = s.resume_info or {}
        self.sink.on_truth(TruthRecord(t_end, "resume", s.id, {
            **{k: v for k, v in info.items() if k in _RESUME_KEYS},
            "t_start": s.preempted_at, "t_end": t_end,
            "stall_s": round(t_end - (s.preempted_at or t_end), 6), "cause": "preemption",
            # wait: queued until memory was free again; resume: the mechanism's own cost, from
            # readmission until the KV the victim had when preempted is back on the GPU
            "wait_s": round(info.get("readmit_t", t_end) - (s.preempted_at or t_end), 6),
            "resume_s": round(info.get("recovered_t", t_end) - info.get("readmit_t", t_end), 6),
            "preemptions": s.n_preempts, "counted": counted}))
        s.preempted_at = None
        s.resume_info = None

    def release_host(self, s: Seq) -> None:
        """A swapped-out sequence went away: its host copy is dropped."""
        if s.host_blocks:
            self.host_used -= s.host_blocks
            s.host_blocks = 0
