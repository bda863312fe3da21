"""Detection scores shared by adapters, so every engine scores pages on the same scale."""

from __future__ import annotations

from collections.abc import Iterable

SURE = 0.95  # the engine's prefix and one of its always-exported families
LIKELY = 0.6  # the prefix only (a renamed or partial page)


def prefix_score(metric_names: Iterable[str], prefix: str, core: Iterable[str] = (),
                 core_prefixes: tuple[str, ...] = ()) -> float:
    """0 when no name starts with ``prefix``; ``SURE`` when a ``core`` name is present or a name
    starts with one of ``core_prefixes``; ``LIKELY`` otherwise."""
    names = metric_names if isinstance(metric_names, (set, frozenset)) else set(metric_names)
    if not any(m.startswith(prefix) for m in names):
        return 0.0
    if any(c in names for c in core) or (core_prefixes and any(m.startswith(core_prefixes) for m in names)):
        return SURE
    return LIKELY
