"""Which flags the engine's own version takes, as far as kvtop knows it (engine notes below).

The scraper asks the engine for its version once per start (vLLM: ``/version``) and records it on
every engine record; ``build_situation`` and a saved scenario carry it as ``engine_version``.

Facts: vLLM 0.8.0 made the V1 engine the default; before it, V0 preempted by swapping live sequences
to host memory (``--preemption-mode swap`` with ``--swap-space`` GiB per GPU). V1 has no live-sequence
swap: its host tier is the KV offloading connector, whose command-line flags
(``--kv-offloading-size``/``--kv-offloading-backend``) were merged on 2025-11-01 and first released in
vLLM 0.11.1 (its source release's ``vllm/engine/arg_utils.py`` defines them, 0.11.0's does not;
docs/engines.md §2.7): an older V1 has no such flag. Until 0.14 the backend had no default, so kvtop
always prints both. Every flag the advisor prints for vLLM is started on a real vLLM of
``VLLM_CHECKED`` by the real-engine tier (tests/integration).
"""

from __future__ import annotations

import re

from kvtop.adapters.base import Setting
from kvtop.analysis.advice.situation import Num, Situation
from kvtop.model.records import SIM_ENGINE_VERSION

VLLM_V1_DEFAULT = (0, 8)
VLLM_OFFLOAD_FLAGS = (0, 11)  # the minor release whose 0.11.1 first has the offloading flags
VLLM_CHECKED = (0, 32)
VLLM_KV_CACHE_BYTES = (0, 10, 2)  # the first release whose arg_utils.py defines --kv-cache-memory-bytes


def parse_patch(version: str | None) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as ``0.32.0``, ``v0.11.1rc2`` or ``0.9.2+cpu``
    (patch 0 where it names none)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def parse(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string."""
    full = parse_patch(version)
    return None if full is None else full[:2]


def apply(s: Situation) -> None:
    """Choose the vLLM swap mechanism by version where the run did not state it, and say how far
    the printed flags were checked for this engine's version."""
    if s.engine != "vllm":
        return
    given = s.v("engine_version")
    ver = parse(str(given)) if given is not None else None
    checked = f"{VLLM_CHECKED[0]}.{VLLM_CHECKED[1]}"
    if given is None:
        _note(s, f"engine version unknown (kvtop asks vLLM's /version; none recorded): the flags are vLLM V1's, "
                       f"checked on vLLM {checked}")
        return
    if str(given).startswith(SIM_ENGINE_VERSION):
        return  # kvtop's own simulator: its flags are those of the vLLM V1 it models
    if ver is None:
        _note(s, f"engine version {given!r} not understood: the flags are vLLM V1's, checked on vLLM {checked}")
        return
    full = parse_patch(str(given))
    if full is not None and full < VLLM_KV_CACHE_BYTES and Setting.KV_CACHE_BYTES in s.settings_names:
        del s.settings_names[Setting.KV_CACHE_BYTES]
        _note(s, f"vLLM {given} predates --kv-cache-memory-bytes (first in vLLM 0.10.2): a larger KV cache is "
                 "given as --gpu-memory-utilization, where its current value and the GPU's memory are known")
    if ver < VLLM_V1_DEFAULT:
        if s.swap_impl is None:
            s.swap_impl = "vllm_v0_swap"
        _note(s, f"vLLM {given} runs the V0 engine: swap is live-sequence swapping (--preemption-mode swap, "
                       "--swap-space GiB per GPU); V1's KV offloading flags do not exist there")
    elif ver < VLLM_OFFLOAD_FLAGS or (ver == VLLM_OFFLOAD_FLAGS and str(given).split("+")[0] in ("0.11", "0.11.0")):
        if s.swap_impl is None:
            s.swap_impl = "none"
        _note(s, f"vLLM {given} predates --kv-offloading-size (first in vLLM 0.11.1): no host KV tier can be set by "
                 "a flag there, so swap is not prescribed; upgrade, or configure a KV connector (--kv-transfer-config)")
    elif ver[:2] != VLLM_CHECKED:
        _note(s, f"flags checked on vLLM {checked} (the real-engine tier starts it with them); this engine "
                       f"reports {given}: confirm each with `vllm serve --help` before applying")


def _note(s: Situation, text: str) -> None:
    if text not in s.notes:  # the console advises again on every refresh of the same situation
        s.notes.append(text)


def engine_version(version: str | None) -> Num | None:
    """The recorded version as the advisor's figure (None when nobody recorded one)."""
    return None if not version else Num(str(version), "", "measured", "the engine's own /version")
