"""Which engine a record is about, as one comparable key.

Request records name the engine that served them the way their source reached it (the proxy's
upstream URL, the probe's URL, a captured connection's ``host:port``); engine records carry the URL
kvtop scraped (``--url``, or a Prometheus ``instance``). Both reduce to ``host:port``: the scheme's
default port when none is given, the host lower-cased, and the loopback names (``localhost``,
``::1``, ``0.0.0.0``) read as ``127.0.0.1``, since a proxy in front of ``localhost:8000`` and a
scrape of ``127.0.0.1:8000/metrics`` reach the same engine. Paths, queries and user-info differ
between a metrics URL and an API URL of one engine and are dropped.
"""

from __future__ import annotations

from functools import lru_cache
from urllib.parse import urlsplit

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "ip6-localhost"})
_DEFAULT_PORT = {"http": 80, "https": 443}


@lru_cache(maxsize=1024)
def engine_address(where: str | None) -> str | None:
    """``host:port`` for a URL or ``host:port`` string; None when there is nothing to read."""
    if not where or not isinstance(where, str):
        return None
    s = where.strip()
    if not s:
        return None
    if "://" not in s:
        s = "http://" + s
    try:
        parts = urlsplit(s)
        host = (parts.hostname or "").lower()
        port = parts.port
    except ValueError:
        return where.strip().lower()  # not a URL after all: the string itself is the identity
    if not host:
        return where.strip().lower()
    if host in _LOOPBACK or host.startswith("127."):
        host = "127.0.0.1"
    if port is None:
        port = _DEFAULT_PORT.get(parts.scheme.lower(), 80)
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"
