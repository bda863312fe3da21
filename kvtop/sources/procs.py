"""Which local processes are the engine: attributes GPU memory (NVML) and RssShmem (/proc) to it.

The engine is found by its listening socket: the processes listening on the URL's port on a
loopback or wildcard address, plus all their children (vLLM V1 keeps the GPU in an EngineCore
child of the API server). Without permission to see other users' sockets or processes the answer
is an empty set, which callers show as "unknown", never as zero.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import psutil

_WILDCARD = {"0.0.0.0", "::", ""}


def _port_and_host(url: str) -> tuple[int, str] | None:
    if "//" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if port is None:
        port = {"http": 80, "https": 443}.get(parts.scheme)
    if port is None:
        return None
    return port, (parts.hostname or "localhost")


def _local_addresses() -> set[str]:
    out = {"localhost"}
    try:
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                out.add(a.address.split("%", 1)[0])
    except (OSError, psutil.Error):
        pass
    return out


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def listening_pids(port: int, host: str = "localhost") -> set[int]:
    """PIDs with a socket listening on ``port`` at loopback/any (or at ``host`` if it is local)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, PermissionError, OSError):
        return set()
    pids = set()
    for c in conns:
        if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != port or c.pid is None:
            continue
        ip = c.laddr.ip
        if ip in _WILDCARD or _is_loopback(ip) or ip == host:
            pids.add(c.pid)
    return pids


def with_children(pids: Iterable[int]) -> set[int]:
    out = set()
    for pid in pids:
        out.add(pid)
        try:
            out.update(ch.pid for ch in psutil.Process(pid).children(recursive=True))
        except (psutil.Error, PermissionError):
            continue
    return out


def engine_pids_for_url(url: str) -> set[int]:
    """Engine PIDs for a metrics/API URL; empty when the engine is remote or not visible to us."""
    ph = _port_and_host(url)
    if ph is None:
        return set()
    port, host = ph
    if not (host == "localhost" or _is_loopback(host) or host in _local_addresses()):
        return set()
    return with_children(listening_pids(port, host))


class EnginePids:
    """A cached ``engine_pids`` callable for GpuSource / HostSource.

    Scanning sockets walks every /proc/PID/fd, so results are kept for ``ttl_s``; an empty answer
    is retried sooner because the engine may still be starting.
    """

    def __init__(self, urls: Iterable[str], ttl_s: float = 30.0,
                 lookup: Callable[[str], set[int]] = engine_pids_for_url,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.urls = list(urls)
        self.ttl_s = ttl_s
        self._lookup = lookup
        self._clock = clock
        self._cached: set[int] = set()
        self._at: float | None = None

    def __call__(self) -> set[int]:
        now = self._clock()
        ttl = self.ttl_s if self._cached else min(self.ttl_s, 5.0)
        if self._at is None or now - self._at >= ttl:
            pids: set[int] = set()
            for u in self.urls:
                pids |= self._lookup(u)
            self._cached, self._at = pids, now
        return set(self._cached)
