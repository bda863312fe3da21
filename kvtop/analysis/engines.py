"""What the analysis needs to know about an engine, from its adapter (loaded by name)."""

from __future__ import annotations

from typing import NamedTuple

from kvtop.plugin import PluginError, load_adapter


class EngineSemantics(NamedTuple):
    """What an engine's adapter says about it (``kvtop.adapters.base.Adapter``)."""

    preempts: bool  # it ever preempts a running request
    settings: dict[str, str]  # its spelling of each setting the advisor names
    counted_at: str | None  # when its preemption counter steps: "resume", "retract", None (not stated)
    in_order: bool  # it admits prompts in arrival order within a request class (``admits_in_order``)
    budget_holds_decodes: bool  # its token budget counts decode tokens too (``budget_holds_decodes``)
    setting_notes: dict[str, str]  # what it requires of a setting's value (``setting_notes``)
    warning: str | None  # why the adapter could not be read
    host_tier: str | None = None  # its host KV tier where a run states none (``host_tier``)
    chunks_prefills: bool | None = None  # it chunks long prompts unless told otherwise (``chunks_prefills``)
    budget_in_blocks: bool = False  # its token budget is a whole number of KV blocks (``budget_in_blocks``)


def engine_semantics(name: str | None) -> EngineSemantics:
    """The semantics of the adapter named ``name``. The counting moment is "resume" (vLLM V1: when
    the victim is scheduled again), "retract" (SGLang) or None (not stated: any step near the stall
    counts)."""
    if not name:
        return EngineSemantics(True, {}, None, False, False, {}, None)
    try:
        cls = load_adapter(name)
    except PluginError as e:
        return EngineSemantics(True, {}, None, False, False, {}, f"engine-specific settings unavailable: {e}")
    counted = cls.preempt_counted_at
    settings: dict[str, str] = {k: v for k, v in cls.settings.items()}
    return EngineSemantics(bool(cls.preempts), settings, counted if counted in ("resume", "retract") else None,
                           bool(cls.admits_in_order), bool(cls.budget_holds_decodes),
                           {str(k): v for k, v in cls.setting_notes.items()}, None, cls.host_tier,
                           cls.chunks_prefills, bool(cls.budget_in_blocks))
