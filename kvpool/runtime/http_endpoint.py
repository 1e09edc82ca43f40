"""The HTTP server of a component's /metrics and probes (kvpool/runtime/health.py), and of the router's
endpoints (connectors/routing_service.py): on the component's own event loop, one request per connection,
every connection bounded.

It listens on 0.0.0.0 in compose and Kubernetes, so anyone may connect: each connection must deliver its
request head (at most MAX_HEAD bytes) and take its answer within REQUEST_DEADLINE of its accept, and at most
`connections` are open at once (HTTP_PER_ADDRESS from one address); past either cap a new connection displaces
the oldest open one (kvpool/sockets/admission.py says why displacing beats refusing), so a flood of idle
connections holds neither threads nor descriptors and a probe or scrape still gets in. The exposition is
prometheus_client's (its text format, or OpenMetrics when the scraper asks for it), as before.
"""

import asyncio
import logging
from typing import Callable, NamedTuple

from prometheus_client.exposition import choose_encoder

from kvpool.sockets.admission import Admission

log = logging.getLogger(__name__)

HTTP_CONNECTIONS = 64  # open at once: probes every few seconds and a scraper or two need a handful
HTTP_PER_ADDRESS = 16
REQUEST_DEADLINE = 5.0  # seconds from accept to the answer sent: a probe's own timeout is about this
MAX_HEAD = 8192  # request line and headers; a scraper's are a few hundred bytes
PROBES = ("/healthz", "/readyz")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            413: "Content Too Large", 503: "Service Unavailable"}


class Request(NamedTuple):
    method: bytes
    path: str  # without its query
    headers: dict  # lower-case name -> value (latin-1 text)
    body: bytes


class HttpServer:
    """A bounded HTTP/1.1 server on the running event loop: one request per connection (its head at most
    MAX_HEAD bytes, a body at most `max_body`), answered by `respond(request) -> (status, content type, body,
    extra headers)` (a coroutine function, or a plain one), all within `deadline` of the accept."""

    def __init__(self, respond: Callable, connections: int = HTTP_CONNECTIONS, deadline: float = REQUEST_DEADLINE,
                 methods: tuple = (b"GET", b"HEAD"), max_body: int = 0):
        self.respond = respond
        self.deadline = deadline
        self.methods = methods
        self.max_body = max_body
        # No connection proves anything here: each holds an "unproved" slot until its one answer is sent.
        self.slots = Admission(connections, connections, min(HTTP_PER_ADDRESS, connections))
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD, backlog=128)
        return self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._open):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        peer = writer.get_extra_info("peername")
        admitted, displaced = self.slots.admit(task, peer[0] if peer else "?")
        if not admitted:  # (never with every slot "unproved": a new one displaces the oldest instead)
            writer.transport.abort()
            return
        for old in displaced:
            old.cancel()
        self._open.add(task)
        answered = False
        try:
            async with asyncio.timeout(self.deadline):
                writer.write(await self._answer(reader))
                await writer.drain()
            answered = True
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # too slow, gone, or a head past MAX_HEAD: nothing to answer
        finally:
            self.slots.forget(task)
            self._open.discard(task)
            if answered:
                writer.close()
            else:
                writer.transport.abort()

    async def _answer(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, _, header_lines = head.partition(b"\r\n")
        parts = request_line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response(400, "text/plain", b"bad request line\n")
        method, path = parts[0], parts[1].split(b"?", 1)[0].decode("latin-1")
        if method not in self.methods:
            return _response(405, "text/plain", b" or ".join(self.methods) + b" only\n")
        headers = {}
        for line in header_lines.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name:
                headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        try:
            length = int(headers.get("content-length") or 0)
        except ValueError:
            return _response(400, "text/plain", b"bad Content-Length\n")
        if not 0 <= length <= self.max_body:
            return _response(413, "text/plain", f"a body of at most {self.max_body} bytes\n".encode())
        body = await reader.readexactly(length) if length else b""
        answer = self.respond(Request(method, path, headers, body))
        if asyncio.iscoroutine(answer):
            answer = await answer
        status, content_type, data, extra = answer
        return _response(status, content_type, data, with_body=method != b"HEAD", headers=extra)


class HttpEndpoint(HttpServer):
    """/metrics and the probes: probe(path) -> (status, body) for the PROBES paths; every other path answers
    the metrics of `registry` (as prometheus_client's own server does)."""

    def __init__(self, registry, probe: Callable[[str], tuple[int, bytes]], connections: int = HTTP_CONNECTIONS,
                 deadline: float = REQUEST_DEADLINE):
        super().__init__(self._metrics_or_probe, connections, deadline)
        self.registry = registry
        self.probe = probe

    async def _metrics_or_probe(self, request: Request) -> tuple:
        if request.path in PROBES:
            status, body = self.probe(request.path)
            return status, "text/plain", body, ()
        body, content_type = await asyncio.to_thread(self._exposition, request.headers.get("accept", ""))
        return 200, content_type, body, ()

    def _exposition(self, accept: str) -> tuple[bytes, str]:
        """The metrics text in the format the scraper's Accept header asks for, chosen as prometheus_client's
        own server chooses it."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


def _response(status: int, content_type: str, body: bytes, with_body: bool = True, headers: tuple = ()) -> bytes:
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: {content_type}\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
    return head + body if with_body else head
