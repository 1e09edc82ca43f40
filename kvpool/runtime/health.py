"""What a component tells an orchestrator: alive (its event loop still turns) and ready (it can do its work).

Every component serves them over HTTP beside its Prometheus metrics, on --metrics-port: GET /metrics, /healthz
(liveness: 200 while the event loop has turned in the last STALL seconds) and /readyz (readiness: 200 when the
component says it is ready, "ok" or "ok: " and its role, e.g. a master's "leading" or "standing by"; else 503
with the reason). Kubernetes probes these; the master also answers gRPC's
standard health service (master/health_service.py).
"""

import asyncio
import threading
import time
from socketserver import ThreadingMixIn
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

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


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):  # probes every few seconds would fill the log
        pass


def serve_http(port: int, host: str, registry, health: Health):
    """Serve /metrics, /healthz and /readyz on host:port in a thread; returns the server (shutdown() stops it)."""
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if path in ("/healthz", "/readyz"):
            try:
                ok, why = (health.alive if path == "/healthz" else health.ready)()
            except Exception as exc:  # a probe must get an answer, whatever broke
                ok, why = False, f"check failed: {exc}"
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [(b"ok: " + why.encode() if ok and why else b"ok" if ok else why.encode()) + b"\n"]
        return metrics(environ, start_response)

    server = make_server(host, port, app, server_class=_Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="kvpool-http", daemon=True).start()
    return server
