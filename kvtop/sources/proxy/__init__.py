"""The recording reverse proxy: one aiohttp server (``server``), or N of them sharing a port (``pool``)."""

from kvtop.sources.proxy.pool import ProxyPool, make_proxy
from kvtop.sources.proxy.server import RecordingProxy, parse_listen

__all__ = ["ProxyPool", "RecordingProxy", "make_proxy", "parse_listen"]
