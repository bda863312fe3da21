"""Named situations: an engine, its traffic, and what happens between the engine and the client.

Each situation is one of the rows kvtop's attribution has to get right (or at least not get
confidently wrong). Numbers are chosen so a 100 ms ITL target separates normal steps (15-40 ms)
from stalls; they were not tuned against kvtop's analysis.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from .stepper import EngineSpec, Req, lognormal

ITL_TARGET_S = 0.1


@dataclass(frozen=True)
class ClassSpec:
    name: str
    rate_per_s: float = 0.0
    burst: int = 0  # requests arriving at ``start_s`` all at once (batch jobs)
    start_s: float = 0.0
    stop_s: float | None = None
    prompt: tuple[float, float, int, int] = (600, 0.6, 32, 4000)  # median, sigma, min, max
    output: tuple[float, float, int, int] = (300, 0.6, 16, 2000)
    priority: int = 0
    patience_s: float | None = None
    max_tokens: int | None = None  # an output reaching it finishes "length"


@dataclass(frozen=True)
class DeliverySpec:
    observed_frac: float = 1.0
    merge_rate_per_s: float = 0.0  # API-server lag episodes per second
    merge_len_s: tuple[float, float] = (0.12, 0.45)
    merge_share: float = 0.35  # share of active streams caught in one episode
    split_frac: float = 0.0  # merged flushes written as many records within a millisecond
    slow_reader_frac: float = 0.0
    slow_reader_rate_per_s: float = 0.15  # stalls per second of a slow reader's stream
    slow_reader_len_s: tuple[float, float] = (0.4, 3.5)
    host_pause_rate_per_s: float = 0.0  # whole host (engine, API server, kvtop) stops
    host_pause_len_s: tuple[float, float] = (0.3, 2.2)
    api_stall_rate_per_s: float = 0.0  # API server only: the engine keeps stepping, /metrics too stalls
    api_stall_len_s: tuple[float, float] = (0.3, 1.5)
    prompt_on_arrive: bool = True  # clients sending token ids: the proxy knows the prompt length


@dataclass(frozen=True)
class Situation:
    name: str
    about: str
    engine: EngineSpec
    classes: tuple[ClassSpec, ...]
    delivery: DeliverySpec = field(default_factory=DeliverySpec)
    duration_s: float = 90.0


CHAT = ClassSpec("interactive", rate_per_s=1.6, prompt=(500, 0.7, 32, 3000), output=(250, 0.7, 16, 1200))
BATCH = ClassSpec("batch", burst=8, prompt=(1500, 0.4, 256, 4000), output=(1500, 0.3, 400, 2500),
                  priority=1, max_tokens=2500)
RAG = ClassSpec("rag", rate_per_s=0.12, start_s=5.0, prompt=(9000, 0.25, 4000, 14000), output=(120, 0.5, 16, 400))
# A storm: KV for roughly half of what the batch jobs and the chats want at once.
STORM = EngineSpec(kv_tokens=20_000, max_seqs=48, token_budget=1024)
AMPLE = EngineSpec(kv_tokens=400_000, max_seqs=256, token_budget=2048)

SITUATIONS: dict[str, Situation] = {}


def _add(s: Situation) -> None:
    SITUATIONS[s.name] = s


_add(Situation("base", "KV storm (vLLM V1, FCFS, chunked prefill), impatient chats, a few slow readers",
               STORM, (replace(CHAT, patience_s=4.0), BATCH),
               DeliverySpec(slow_reader_frac=0.08)))
_add(Situation("prefill", "ample KV, chunked prefill off, 9K-token RAG prompts stall every stream",
               replace(AMPLE, chunked=False), (replace(CHAT, rate_per_s=3.0), replace(RAG, rate_per_s=0.2))))
_add(Situation("slow-onset", "ample KV; from 40 s to 60 s short requests pour in and every step is 4x slower "
               "(e.g. clocks throttled): an abrupt slow-decode onset",
               replace(AMPLE, slowdowns=((40.0, 4.0), (60.0, 1.0))),
               (replace(CHAT, rate_per_s=2.0), ClassSpec("short", rate_per_s=6.0, start_s=40.0, stop_s=60.0,
                                                         prompt=(120, 0.4, 16, 400), output=(60, 0.5, 8, 200)))))
_add(Situation("multitoken", "KV storm with speculative decoding (k=3) and API-server merging",
               replace(STORM, spec_k=3, kv_tokens=14_000), (CHAT, replace(BATCH, burst=10)),
               DeliverySpec(merge_rate_per_s=0.6, split_frac=0.5)))
_add(Situation("delivery", "KV storm with slow readers, host pauses and API-server stalls",
               STORM, (CHAT, BATCH),
               DeliverySpec(slow_reader_frac=0.3, host_pause_rate_per_s=0.08, api_stall_rate_per_s=0.06)))
_add(Situation("sparse", "KV storm plus long prompts, only 20 % of streams observed",
               replace(STORM, chunked=False), (replace(CHAT, rate_per_s=2.5), BATCH, RAG),
               DeliverySpec(observed_frac=0.2)))
_add(Situation("sglang", "KV storm on SGLang semantics (retractions counted when they happen)",
               replace(STORM, semantics="sglang"), (replace(CHAT, patience_s=4.0), BATCH)))
_add(Situation("nopreempt", "TGI-like engine that never preempts (admission reserves prompt + output): "
               "queueing, long prompts, slow readers and host pauses",
               replace(STORM, semantics="never", chunked=False, kv_tokens=40_000), (CHAT, BATCH, RAG),
               DeliverySpec(slow_reader_frac=0.15, host_pause_rate_per_s=0.05)))
_add(Situation("priority", "KV storm, priority scheduling: batch jobs (priority 1) are the victims",
               replace(STORM, scheduler="priority"), (replace(CHAT, rate_per_s=2.2), BATCH)))
_add(Situation("mixed", "everything at once: priority storm, spec decoding, long prompts, merging, slow "
               "readers, host pauses, API stalls, 50 % observed, 4x slower steps from 60 s to 70 s",
               replace(STORM, scheduler="priority", spec_k=2, chunked=False, slowdowns=((60.0, 4.0), (70.0, 1.0))),
               (replace(CHAT, patience_s=5.0), BATCH, RAG),
               DeliverySpec(observed_frac=0.5, merge_rate_per_s=0.3, split_frac=0.5, slow_reader_frac=0.15,
                            host_pause_rate_per_s=0.04, api_stall_rate_per_s=0.03)))


def requests(sit: Situation, seed: int, duration_s: float) -> list[Req]:
    """The situation's traffic for ``seed`` (same seed, same requests)."""
    rng = random.Random(f"{seed}:traffic:{sit.name}")
    obs = random.Random(f"{seed}:observe:{sit.name}")
    out: list[Req] = []
    n = 0
    for c in sit.classes:
        times: list[float] = [c.start_s + 0.001 * i for i in range(c.burst)]
        if c.rate_per_s > 0:
            t = c.start_s
            stop = duration_s if c.stop_s is None else min(duration_s, c.stop_s)
            while True:
                t += rng.expovariate(c.rate_per_s)
                if t >= stop:
                    break
                times.append(t)
        for t in times:
            n += 1
            prompt = int(lognormal(rng, *c.prompt[:2], c.prompt[2], c.prompt[3]))
            output = int(lognormal(rng, *c.output[:2], c.output[2], c.output[3]))
            reason = "stop"
            if c.max_tokens is not None and output >= c.max_tokens:
                output, reason = c.max_tokens, "length"
            rid = f"{c.name[:3]}-{seed}-{n:05d}"
            out.append(Req(rid, c.name, round(t, 6), prompt, output, c.priority, c.patience_s,
                           observed=obs.random() < sit.delivery.observed_frac, need=prompt, finish_reason=reason))
    out.sort(key=lambda r: (r.arrive, r.id))
    return out
