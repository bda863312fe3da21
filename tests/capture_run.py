"""An in-process passive capture of one port for the length of an ``async with`` block (needs a packet
socket: root or CAP_NET_RAW), as the live capture tests run it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvtop.model.records import RequestRecord
from kvtop.sources.capture import CaptureSource


@asynccontextmanager
async def capturing(port: int, settle_s: float = 0.1) -> AsyncIterator[tuple[list[RequestRecord], CaptureSource]]:
    """The records the capture emits and the capture itself (its ``stats``); reading starts
    ``settle_s`` before the block and stops, every packet read, when it ends."""
    got: list[RequestRecord] = []
    t0 = time.monotonic()
    cap = CaptureSource(port, got.append, lambda: time.monotonic() - t0)
    stop = asyncio.Event()
    task = asyncio.create_task(cap.run(stop))
    try:
        await asyncio.sleep(settle_s)
        yield got, cap
    finally:
        stop.set()
        await task
