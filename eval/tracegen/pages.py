"""Prometheus text pages in each engine family's own names, rendered from the engine model's state.

The trace's engine records say what these pages say (``records``, written from the same state);
tests/test_tracegen.py checks that kvtop's adapters read exactly those records from the pages.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_NUM_PREEMPTIONS_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
CREATED = 1.7e9


@dataclass
class Cum:
    """A cumulative histogram fed in time order."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    n: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def add(self, v: float) -> None:
        i = bisect_right(self.bounds, v - 1e-12)
        if i < len(self.bounds):
            self.counts[i] += 1
        self.n += 1
        self.total += v

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        acc = 0
        sep = "," if labels else ""
        for b, c in zip(self.bounds, self.counts, strict=True):
            acc += c
            out.append(f'{name}_bucket{{{labels}{sep}le="{b!r}"}} {acc}.0')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}.0')
        lb = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_count{lb} {self.n}.0")
        out.append(f"{name}_sum{lb} {self.total!r}")
        return out


@dataclass
class State:
    running: int
    waiting: int
    used_blocks: int
    total_blocks: int
    block: int
    preemptions: int
    prompt: int
    generation: int
    stop: int
    length: int
    abort: int
    model: str


def vllm_page(s: State, itl: Cum, ttft: Cum, npre: Cum | None = None) -> str:
    """``npre``: vllm:request_num_preemptions, one observation per ended request (zeros included);
    on the real vLLM 0.32 its sum matched the preemption counter."""
    lb = f'engine="0",model_name="{s.model}"'
    L = [
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lb}}} {s.running}.0",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lb}}} {s.waiting}.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lb}}} {s.used_blocks / s.total_blocks!r}",
    ]
    for name, v in (("vllm:num_preemptions", s.preemptions), ("vllm:prompt_tokens", s.prompt),
                    ("vllm:generation_tokens", s.generation)):
        L += [f"# TYPE {name} counter", f"{name}_total{{{lb}}} {v}.0", f"{name}_created{{{lb}}} {CREATED!r}"]
    L.append("# TYPE vllm:request_success counter")
    for reason, v in (("abort", s.abort), ("length", s.length), ("stop", s.stop)):
        L.append(f'vllm:request_success_total{{{lb},finished_reason="{reason}"}} {v}.0')
    L += itl.lines("vllm:inter_token_latency_seconds", lb)
    L += ttft.lines("vllm:time_to_first_token_seconds", lb)
    if npre is not None:
        L += npre.lines("vllm:request_num_preemptions", lb)
    L += ["# TYPE vllm:cache_config_info gauge",
          f'vllm:cache_config_info{{block_size="{s.block}",cache_dtype="auto",enable_prefix_caching="True",'
          f'engine="0",kv_cache_size_tokens="{s.total_blocks * s.block}",kv_offloading_size="None",'
          f'num_cpu_blocks="None",num_gpu_blocks="{s.total_blocks}"}} 1.0']
    return "\n".join(L) + "\n"


def sglang_page(s: State, itl: Cum, ttft: Cum) -> str:
    """SGLang names; its ITL histogram takes one observation per generated token."""
    lb = f'model_name="{s.model}"'
    cap = s.total_blocks * s.block
    L = [
        "# TYPE sglang:num_running_reqs gauge", f"sglang:num_running_reqs{{{lb}}} {s.running}.0",
        "# TYPE sglang:num_queue_reqs gauge", f"sglang:num_queue_reqs{{{lb}}} {s.waiting}.0",
        "# TYPE sglang:token_usage gauge", f"sglang:token_usage{{{lb}}} {s.used_blocks / s.total_blocks!r}",
        "# TYPE sglang:num_used_tokens gauge", f"sglang:num_used_tokens{{{lb}}} {s.used_blocks * s.block}.0",
        "# TYPE sglang:max_total_num_tokens gauge", f"sglang:max_total_num_tokens{{{lb}}} {cap}.0",
        "# TYPE sglang:page_size gauge", f"sglang:page_size{{{lb}}} {s.block}.0",
    ]
    for name, v in (("sglang:prompt_tokens", s.prompt), ("sglang:generation_tokens", s.generation),
                    ("sglang:num_requests", s.stop + s.length + s.abort),
                    ("sglang:num_aborted_requests", s.abort),
                    ("sglang:num_retracted_requests", s.preemptions)):
        L += [f"# TYPE {name} counter", f"{name}_total{{{lb}}} {v}.0"]
    L += itl.lines("sglang:inter_token_latency_seconds", lb)
    L += ttft.lines("sglang:time_to_first_token_seconds", lb)
    return "\n".join(L) + "\n"


def tgi_page(s: State, itl: Cum, ttft: Cum, prompt_n: int, gen_n: int) -> str:
    """TGI router names (no model label, counters without ``_total``). ``itl`` here holds
    per-request mean time per token, observed when a request finishes."""
    cap = s.total_blocks * s.block
    L = [
        "# TYPE tgi_batch_current_size gauge", f"tgi_batch_current_size {s.running}.0",
        "# TYPE tgi_queue_size gauge", f"tgi_queue_size {s.waiting}.0",
        "# TYPE tgi_batch_max_total_tokens gauge", f"tgi_batch_max_total_tokens {cap}.0",
        "# TYPE tgi_batch_current_max_tokens gauge", f"tgi_batch_current_max_tokens {s.used_blocks * s.block}.0",
        "# TYPE tgi_request_success counter", f"tgi_request_success {s.stop + s.length}.0",
        "# TYPE tgi_request_count counter", f"tgi_request_count {s.stop + s.length + s.abort}.0",
        "# TYPE tgi_request_input_length histogram",
        f'tgi_request_input_length_bucket{{le="+Inf"}} {prompt_n}.0',
        f"tgi_request_input_length_count {prompt_n}.0", f"tgi_request_input_length_sum {s.prompt}.0",
        "# TYPE tgi_request_generated_tokens histogram",
        f'tgi_request_generated_tokens_bucket{{le="+Inf"}} {gen_n}.0',
        f"tgi_request_generated_tokens_count {gen_n}.0", f"tgi_request_generated_tokens_sum {s.generation}.0",
    ]
    L += itl.lines("tgi_request_mean_time_per_token_duration", "")
    return "\n".join(L) + "\n"
