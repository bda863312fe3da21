"""Which event loop the proxy runs on: uvloop when installed (``pip install 'kvtop-console[fast]'``), else asyncio.

uvloop cuts the proxy's CPU per forwarded chunk by about a quarter (bench/proxy_overhead.py
--compare); the proxy behaves the same on either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOPS = ("auto", "asyncio", "uvloop")


class LoopUnavailable(Exception):
    pass


def resolve_loop(name: str) -> str:
    """``auto`` -> ``uvloop`` when importable, else ``asyncio``; ``uvloop`` must be importable."""
    if name not in LOOPS:
        raise LoopUnavailable(f"--loop must be one of {', '.join(LOOPS)}, not {name!r}")
    if name == "asyncio":
        return name
    try:
        import uvloop  # noqa: F401  (optional dependency: kvtop-console[fast])
    except ImportError:
        if name == "uvloop":
            raise LoopUnavailable("--loop uvloop: uvloop is not installed (pip install 'kvtop-console[fast]')") from None
        return "asyncio"
    return "uvloop"


def run(coro: Coroutine[Any, Any, T], loop: str = "asyncio") -> T:
    if loop == "uvloop":
        import uvloop  # optional dependency (resolve_loop checked it is there)

        out: T = uvloop.run(coro)
        return out
    return asyncio.run(coro)
