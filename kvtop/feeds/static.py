"""The feed over a core that something else fills (tests, screenshots): nothing to run.

It lives apart from ``kvtop.pipeline`` (which re-exports it) so that the console, which builds one
when it is handed no feed, imports nothing that builds a Core: the views read a core through
``SnapshotSource`` alone (the import contract "Views import nothing from the core but the Snapshot").
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvtop.snapshot import SnapshotSource

if TYPE_CHECKING:  # a protocol for the type checker only: importing kvtop.pipeline would load the core
    from kvtop.pipeline import ReplayControls


class StaticFeed:
    """A ``kvtop.pipeline.Feed`` over any ``SnapshotSource``: it only hands that back."""

    def __init__(self, core: SnapshotSource):
        self._core = core
        self.interval_s = 1.0
        self.notice: str | None = None

    @property
    def core(self) -> SnapshotSource:
        return self._core

    @property
    def is_fleet(self) -> bool:
        return False

    async def run(self, stop: asyncio.Event | None = None) -> None:
        if stop is not None:
            await stop.wait()

    def refresh_now(self) -> None:
        pass

    def controls(self) -> ReplayControls | None:
        return None
