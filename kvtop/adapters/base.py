"""The engine-adapter contract: the base class every adapter subclasses and the names it may use.

An adapter turns one engine's interfaces into normalised ``EngineRecord``s. It sets ``name`` and
``fields`` (the normalised fields it can fill), implements ``detect`` and ``parse``, and names the
engine's own spelling of each tunable the advisor talks about in ``settings`` (keys: ``Setting``).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from enum import Enum
from typing import Any, ClassVar, Literal

from kvtop.model.records import EngineRecord
from kvtop.model.sanitize import positive_whole

# Every normalised engine field an adapter may fill; views show the rest as "n/a".
NORMALIZED_FIELDS = (
    "kv_usage",
    "running",
    "waiting",
    "preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "prefix_hits_total",
    "prefix_queries_total",
    "requests_finished_total",
    "requests_aborted_total",
    "kv_capacity_tokens",
    "block_size",
    "offload_capacity_bytes",
    "offload_out_bytes_total",
    "offload_in_bytes_total",
    "offload_out_seconds_total",
    "offload_in_seconds_total",
    "itl",
    "ttft",
    "model",
)


class Setting(str, Enum):
    """Generic names of the engine knobs the advisor recommends changing.

    A ``str`` enum: a member is equal to (and hashes like) its value, so ``settings`` dicts keyed by
    members still answer lookups by the plain name, and JSON output keeps the plain name.
    """

    MAX_SEQS = "max_seqs"
    BATCHED_TOKENS = "batched_tokens"
    CHUNKED_PREFILL = "chunked_prefill"
    MAX_PREFILL_TOKENS = "max_prefill_tokens"
    MAX_TOTAL_TOKENS = "max_total_tokens"
    MAX_BATCH_TOTAL_TOKENS = "max_batch_total_tokens"
    MAX_INPUT_TOKENS = "max_input_tokens"
    MAX_TOKENS = "max_tokens"
    WAITING_TOKENS = "waiting_tokens"
    GPU_MEMORY = "gpu_memory"
    KV_CACHE_BYTES = "kv_cache_bytes"  # the KV cache's size in bytes per GPU (vLLM --kv-cache-memory-bytes)
    ADMISSION = "admission"
    OFFLOAD_ENABLE = "offload_enable"
    OFFLOAD_SIZE = "offload_size"
    OFFLOAD_RATIO = "offload_ratio"
    OFFLOAD_BACKEND = "offload_backend"
    PREFIX_REUSE = "prefix_reuse"
    PARALLEL = "parallel"
    CTX = "ctx"
    UBATCH = "ubatch"
    KV_UNIFIED = "kv_unified"
    CONTEXT_SHIFT = "context_shift"
    CACHE_TYPE = "cache_type"

    def __str__(self) -> str:
        return self.value


class EngineAdapter(ABC):
    """Contract every engine adapter implements.

    ``parse`` must tolerate renamed metrics across versions, missing families and truncated pages
    (return what could be read, with ``warnings`` on the record). Values it copies need no
    cleaning: the scraper passes every record through ``kvtop.model.sanitize`` (NaN, infinities and
    negative counters become n/a with a warning), but conversions the adapter does itself
    (``int(...)``) must go through ``as_int`` so a non-finite value cannot raise.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    fields: ClassVar[frozenset[str]] = frozenset()
    # False for engines that never preempt a running request (TGI, llama.cpp): the advisor then
    # never names preemption as a cause for them.
    preempts: ClassVar[bool] = True
    # When the engine's preemption counter steps: "resume" (vLLM V1 counts when the victim is
    # scheduled again, never for one cancelled while waiting), "retract" (SGLang counts when it
    # happens) or None (unknown). The attribution rules read a stall's counter evidence by it.
    preempt_counted_at: ClassVar[Literal["resume", "retract"] | None] = None
    # True where the engine admits waiting prompts in arrival order within a request class (a
    # priority tier: kvtop reads it as the request's class), so a prompt that came later, no shorter
    # and of the same class, cannot finish its prefill first: the attribution then knows an earlier
    # request's first token, delivered late, came out of a step no later than the later one's.
    # False where the engine may reorder (SGLang's longest-prefix-match policy) or nobody checked.
    admits_in_order: ClassVar[bool] = False
    # True where the per-step token budget (``Setting.BATCHED_TOKENS``) counts every token a step
    # schedules, each running sequence's decode token included, so a chunk gets what the decodes
    # leave and the engine holds no more sequences than the budget (vLLM V1 refuses a
    # ``--max-num-seqs`` above ``--max-num-batched-tokens`` and lowers its default to it). False
    # where the budget is the prompt chunk's alone (SGLang's ``--chunked-prefill-size``).
    budget_holds_decodes: ClassVar[bool] = False
    # Whether the engine splits a prompt longer than its token budget over several steps unless told
    # otherwise: True (vLLM V1, SGLang, llama.cpp), False (TensorRT-LLM: enable_chunked_context is
    # off), None (TGI: its attention backend decides). Where it does not, a budget below the longest
    # prompt is refused at start (vLLM, TGI) or rejects the prompt: the advisor turns chunking on
    # with it (``Setting.CHUNKED_PREFILL``, where that is a switch of its own) or prescribes none.
    chunks_prefills: ClassVar[bool | None] = None
    # True where the token budget must be a whole number of KV blocks (SGLang refuses a
    # --chunked-prefill-size that --page-size does not divide).
    budget_in_blocks: ClassVar[bool] = False
    # What the engine requires of a setting's value that kvtop cannot check from outside, in a few
    # words; the advisor adds it to the reason of every value it prescribes for that setting.
    setting_notes: ClassVar[dict[Setting, str]] = {}
    # Extra HTTP paths (besides /metrics) the scraper should GET and hand to ``parse_extra``.
    extra_paths: ClassVar[tuple[str, ...]] = ()
    # The engine's own spelling of each knob (e.g. {Setting.MAX_SEQS: "--max-num-seqs"}).
    settings: ClassVar[dict[Setting, str]] = {}
    # The engine's host KV tier where a run does not state one, by the advisor's name for it
    # (``vllm_v1_offload``, ``sglang_hicache``; kvtop/analysis/advice/swapimpl.py): its size flag's
    # unit (GiB over all ranks, GB per rank) and what it requires follow from it. None: unknown.
    host_tier: ClassVar[str | None] = None
    # A path that names the engine's version (vLLM: /version). Asked once, and again after the
    # engine restarts (``restart_token`` changes: it may have been upgraded); ``parse_version``
    # reads the body. The version goes on every record: the advisor chooses flags by it.
    version_path: ClassVar[str | None] = None

    def parse_version(self, body: str) -> str | None:
        """The version named in the ``version_path`` response (default: a JSON ``{"version": ...}``)."""
        try:
            v = json.loads(body).get("version")
        except (ValueError, AttributeError):
            return None
        return str(v)[:64] if isinstance(v, (str, int, float)) and str(v).strip() else None

    # A path that states limits the engine runs under, by the names ``EngineRecord.limits`` uses
    # (vLLM and SGLang: /v1/models, whose model cards carry ``max_model_len``). Asked as the
    # version is (once per engine start); ``parse_limits`` reads the body.
    limits_path: ClassVar[str | None] = None

    def parse_limits(self, body: str) -> dict[str, int] | None:
        """The limits the ``limits_path`` response states (default: an OpenAI model list whose cards
        carry ``max_model_len``, the longest prompt + output one request may have): empty where the
        cards name none (older releases), None where the reply is no model list."""
        try:
            cards = json.loads(body).get("data")
        except (ValueError, AttributeError):
            return None
        if not isinstance(cards, list):
            return None
        found = (positive_whole(c.get("max_model_len")) for c in cards if isinstance(c, dict))
        lens = [n for n in found if n is not None]
        # a server's cards share its one bound (LoRA adapters are served under the base model's)
        return {"max_model_len": max(lens)} if lens else {}

    @classmethod
    @abstractmethod
    def detect(cls, metric_names: set[str]) -> float:
        """Score 0..1 for how sure this adapter is that a page with these metric names is its engine."""

    @abstractmethod
    def parse(self, text: str, t: float) -> list[EngineRecord]:
        """Parse one Prometheus text exposition into one record per engine instance."""

    def parse_extra(self, path: str, body: str, records: list[EngineRecord]) -> None:  # noqa: B027
        """Enrich ``records`` in place from an ``extra_paths`` response (default: nothing)."""

    def capacity(self, **info: Any) -> dict[str, Any]:
        """Optional: KV capacity from config info (capacity_tokens, block_size, offload bytes)."""
        return {}
