"""Local engines found by asking the common serving ports of a host for a /metrics page."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

# vLLM / SGLang / TGI & llama.cpp / (common dev) / Triton metrics ports
PROBE_PORTS = (8000, 30000, 8080, 3000, 8002)


def looks_like_metrics(text: str) -> bool:
    """A Prometheus exposition: comment lines with HELP/TYPE, or at least one `name value` sample."""
    for line in text.splitlines()[:200]:
        if line.startswith(("# HELP ", "# TYPE ")):
            return True
    return False


def discover(ports: Sequence[int] = PROBE_PORTS, host: str = "127.0.0.1", timeout_s: float = 0.5) -> list[str]:
    """Base URLs of local servers answering /metrics with a Prometheus page, in port order."""

    def probe(port: int) -> str | None:
        url = f"http://{host}:{port}"
        try:
            r = httpx.get(url + "/metrics", timeout=timeout_s)
        except httpx.HTTPError:
            return None
        return url if r.status_code == 200 and looks_like_metrics(r.text) else None

    with ThreadPoolExecutor(max_workers=max(1, len(ports))) as ex:
        found = list(ex.map(probe, ports))
    return [u for u in found if u]
