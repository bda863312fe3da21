"""Passive capture of the engine's token streams: no proxy in the path, no canary requests.

``packets`` (the AF_PACKET socket and its BPF filter) -> ``tcp`` (reassembly per connection) ->
``http`` (HTTP/1.1 request/response parsing, SSE through ``kvtop.sources.sse.StreamRecorder``) ->
request records with ``source: "capture"``. ``source`` runs it on an event loop.

For another command (``kvtop agent``)::

    cap = CaptureSource(port, emit, clock, notice=print_line)
    cap.open()                      # CaptureUnavailable: one line on how to grant CAP_NET_RAW
    task = asyncio.create_task(cap.run(stop_event))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtop.sources.capture.http import CaptureStats
    from kvtop.sources.capture.packets import CaptureUnavailable
    from kvtop.sources.capture.source import CaptureSource, RequestOwners

__all__ = ["CaptureSource", "CaptureStats", "CaptureUnavailable", "RequestOwners", "check_capture"]

# Every command's parser imports ``options`` from here: the parsing machinery loads on first use.
_WHERE = {"CaptureStats": "http", "CaptureUnavailable": "packets", "CaptureSource": "source",
          "RequestOwners": "source"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"kvtop.sources.capture.{_WHERE[name]}"), name)
    raise AttributeError(name)


def check_capture(port: int) -> None:
    """Raise ``CaptureUnavailable`` (with the one-line fix) unless a capture on ``port`` can open here."""
    from kvtop.sources.capture.packets import PacketSocket  # the parsers load on first use (see above)

    PacketSocket(port, rcvbuf=1 << 16, ring=False).close()
