"""The adapter registry: listing, loading and detecting engine adapters.

The contract itself (``EngineAdapter`` and the page API) is the SDK in ``kvtop.adapters``; it is
re-exported here for older imports. Built-in adapters live in ``plugins/`` (installed as
``kvtop_plugins``) and register through the entry-point group ``kvtop.engines`` exactly like
third-party ones. Listing adapters never imports them.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from kvtop.adapters.base import NORMALIZED_FIELDS, EngineAdapter, Setting

__all__ = [
    "GROUP", "NORMALIZED_FIELDS", "AdapterInfo", "EngineAdapter", "PluginError", "Setting", "detect_adapter",
    "list_adapters", "load_adapter", "load_plugin_file",
]

GROUP = "kvtop.engines"


class PluginError(Exception):
    """An adapter could not be found or loaded. The message is one line for the user."""


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    target: str  # "module:attr"
    dist: str | None
    version: str | None


_file_plugins: dict[str, type[EngineAdapter]] = {}


_eps_cache: tuple[tuple[str, ...], list[EntryPoint]] | None = None


def _entry_points() -> list[EntryPoint]:
    """The ``kvtop.engines`` entry points. Scanning every installed distribution costs ~20 ms, so the
    result is kept while the import path is unchanged (a new plugin needs a new process anyway)."""
    global _eps_cache
    key = tuple(sys.path)
    if _eps_cache is None or _eps_cache[0] != key:
        _eps_cache = (key, list(entry_points(group=GROUP)))
    return _eps_cache[1]


def list_adapters() -> list[AdapterInfo]:
    """Registered adapters, from entry-point metadata only (nothing is imported)."""
    out: dict[str, AdapterInfo] = {}
    for ep in _entry_points():
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
    for ep in _entry_points():
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
