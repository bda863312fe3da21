"""What the analysis needs to know about an engine, from its adapter (loaded by name)."""

from __future__ import annotations

from kvtop.plugin import PluginError, load_adapter


def engine_semantics(name: str | None) -> tuple[bool, dict[str, str], str | None, str | None]:
    """(preempts, setting names, when its preemption counter steps, warning) from the adapter named
    ``name``. The counting moment is "resume" (vLLM V1: when the victim is scheduled again),
    "retract" (SGLang) or None (not stated: any step near the stall counts)."""
    if not name:
        return True, {}, None, None
    try:
        cls = load_adapter(name)
    except PluginError as e:
        return True, {}, None, f"engine-specific settings unavailable: {e}"
    counted = cls.preempt_counted_at
    settings: dict[str, str] = {k: v for k, v in cls.settings.items()}
    return (bool(cls.preempts), settings,
            counted if counted in ("resume", "retract") else None, None)

