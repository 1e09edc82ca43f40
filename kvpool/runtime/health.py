"""What a component tells an orchestrator: alive (its event loop still turns) and ready (it can do its work).

Every component serves them over HTTP beside its Prometheus metrics, on --metrics-port: GET /metrics, /healthz
(liveness: 200 while the event loop has turned in the last STALL seconds) and /readyz (readiness: 200 when the
component says it is ready, "ok" or "ok: " and its role, e.g. a master's "leading" or "standing by"; else 503
with the reason). Kubernetes probes these; the master also answers gRPC's
standard health service (master/serving/health_service.py). The HTTP server is kvpool/runtime/http_endpoint.py
(on the component's own event loop, bounded).
"""

import asyncio
import time
from typing import Callable

from .http_endpoint import HTTP_CONNECTIONS, HttpEndpoint

STALL = 10.0  # seconds without a turn of the event loop before /healthz fails
BEAT = 1.0


class Health:
    """ready(): (True, "") or (False, why not); set by the component as it comes up and goes down."""

    def __init__(self, ready: Callable[[], tuple[bool, str]] = lambda: (False, "starting")):
        self.ready = ready
        self._last = time.monotonic()

    async def beat(self) -> None:
        """Run on the component's event loop: each turn proves the loop is not stuck."""
        while True:
            self._last = time.monotonic()
            await asyncio.sleep(BEAT)

    def alive(self) -> tuple[bool, str]:
        stalled = time.monotonic() - self._last
        if stalled > STALL:
            return False, f"event loop has not turned for {stalled:.0f} s"
        return True, ""


def probe_answer(health: Health, path: str) -> tuple[int, bytes]:
    """(status, body) of /healthz or /readyz."""
    try:
        ok, why = (health.alive if path == "/healthz" else health.ready)()
    except Exception as exc:  # a probe must get an answer, whatever broke
        ok, why = False, f"check failed: {exc}"
    return (200 if ok else 503), (b"ok: " + why.encode() if ok and why else b"ok" if ok else why.encode()) + b"\n"


async def serve_http(port: int, host: str, registry, health: Health,
                     connections: int = HTTP_CONNECTIONS) -> HttpEndpoint:
    """Serve /metrics, /healthz and /readyz on host:port, on the running event loop; returns the server
    (close() stops it)."""
    endpoint = HttpEndpoint(registry, lambda path: probe_answer(health, path), connections)
    await endpoint.start(host, port)
    return endpoint
