"""The engine-adapter contract and registry (DESIGN §4).

An adapter turns one engine's interfaces into normalised ``EngineRecord``s. Built-in adapters
live in ``plugins/`` (installed as ``kvtop_plugins``) and register through the entry-point group
``kvtop.engines`` exactly like third-party ones. Listing adapters never imports them.
"""

from __future__ import annotations

import importlib.util
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar

from kvtop.model.records import EngineRecord

GROUP = "kvtop.engines"

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


class PluginError(Exception):
    """An adapter could not be found or loaded. The message is one line for the user."""


class EngineAdapter(ABC):
    """Contract every engine adapter implements.

    Subclasses set ``name`` and ``fields`` (the normalised fields they can fill) and implement
    ``detect`` and ``parse``. ``parse`` must tolerate renamed metrics across versions, missing
    families and truncated pages (return what could be read, with ``warnings`` on the record).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    fields: ClassVar[frozenset[str]] = frozenset()
    # False for engines that never preempt a running request (TGI, llama.cpp): the advisor then
    # never names preemption as a cause for them.
    preempts: ClassVar[bool] = True
    # Extra HTTP paths (besides /metrics) the scraper should GET and hand to ``parse_extra``.
    extra_paths: ClassVar[tuple[str, ...]] = ()
    # Engine-specific setting names the advisor uses (e.g. {"max_seqs": "--max-num-seqs"}).
    settings: ClassVar[dict[str, str]] = {}

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


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    target: str  # "module:attr"
    dist: str | None
    version: str | None


_file_plugins: dict[str, type[EngineAdapter]] = {}


def list_adapters() -> list[AdapterInfo]:
    """Registered adapters, from entry-point metadata only (nothing is imported)."""
    out: dict[str, AdapterInfo] = {}
    for ep in entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        out.setdefault(
            ep.name,
            AdapterInfo(ep.name, ep.value, dist.name if dist else None, dist.version if dist else None),
        )
    for name, cls in _file_plugins.items():
        out[name] = AdapterInfo(name, f"{cls.__module__}:{cls.__qualname__}", "--plugin", None)
    return sorted(out.values(), key=lambda a: a.name)


def load_adapter(name: str) -> type[EngineAdapter]:
    if name in _file_plugins:
        return _file_plugins[name]
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            try:
                cls = ep.load()
            except Exception as e:  # a broken third-party plugin must not take kvtop down
                raise PluginError(f"adapter {name!r} ({ep.value}) failed to load: {e}") from None
            if not (isinstance(cls, type) and issubclass(cls, EngineAdapter)):
                raise PluginError(f"adapter {name!r} ({ep.value}) is not an EngineAdapter subclass")
            return cls
    known = ", ".join(a.name for a in list_adapters()) or "none"
    raise PluginError(f"unknown adapter {name!r} (installed: {known})")


def load_plugin_file(path: str | Path) -> list[str]:
    """Load adapters from a single Python file (``--plugin PATH``); returns their names."""
    p = Path(path)
    if not p.is_file():
        raise PluginError(f"plugin file not found: {p}")
    mod_name = f"kvtop_file_plugin_{p.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise PluginError(f"cannot load plugin file {p}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise PluginError(f"plugin file {p} failed to import: {e}") from None
    names = []
    for obj in vars(mod).values():
        if isinstance(obj, type) and issubclass(obj, EngineAdapter) and obj is not EngineAdapter:
            if getattr(obj, "name", None):
                _file_plugins[obj.name] = obj
                names.append(obj.name)
    if not names:
        raise PluginError(f"plugin file {p} defines no EngineAdapter subclass with a name")
    return names


def detect_adapter(metric_names: set[str], min_score: float = 0.3) -> type[EngineAdapter] | None:
    """The adapter with the highest detect score for these metric names (None if nobody claims it)."""
    best: tuple[float, type[EngineAdapter]] | None = None
    for info in list_adapters():
        try:
            cls = load_adapter(info.name)
            score = float(cls.detect(metric_names))
        except Exception:  # one broken adapter must not break detection for the others
            continue
        if score >= min_score and (best is None or score > best[0]):
            best = (score, cls)
    return best[1] if best else None
