"""The KV-aware router as a running service (connectors/router.py decides; this keeps it informed).

A thread of its own follows each engine's KV events (connectors/kv_events.py) and kvpool's stream of stored and
removed blocks of one namespace (connectors/block_events.py); choose() and finished() may be called from any
thread. serve_http() answers the same over HTTP for routers and gateways in other languages:

    POST /route     {"token_ids": [...]}  ->  {"engine": NAME, "scores": [{"engine", "local_blocks",
                                                "pool_blocks", "in_flight", "reusable", "cost"}, ...]}
    POST /finished  {"engine": NAME}      ->  {}
    GET  /engines                         ->  {NAME: {"blocks", "in_flight", "unmapped"}, ..., "pool_blocks": N}
    GET  /healthz, /readyz                ->  {"ok": true} while the service runs (probes)

Every path but the probes asks for the cluster's client token, `Authorization: Bearer <client token>` (what
`kvpool token client` prints, or KVPOOL_TOKEN_FILE as `kvpool up` gives clients): 401 without it. A router
of a cluster without a secret answers anyone.

`kvpool router` runs it from the command line.
"""

import asyncio
import dataclasses
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvpool.protocol.cluster_layout import DEFAULT_CLUSTER
from kvpool.errors import KvpoolError
from kvpool.security import auth

from .block_events import block_events
from .block_keys import BlockNamespace
from .kv_events import EngineEvents
from .router import Router

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20  # a /route body: token ids of the longest prompts, with room to spare
PROBES = ("/healthz", "/readyz")  # answered without a token: they tell only whether it runs
UNAUTHORIZED = ("this router needs the cluster's client token: send Authorization: Bearer <client token> "
                "(`kvpool token client`, or the file KVPOOL_TOKEN_FILE names)")


class RoutingService:
    """engines: name -> the ZMQ endpoint of its KV events ("" when it publishes none: its own cache is then
    unknown, the pool still counts); namespace: the blocks kvpool holds for these engines (the connector
    reports it); master / etcd / token / tls_ca: the kvpool cluster, as the Client takes them (token: by
    default the one the environment holds); its client token is what HTTP callers must present."""

    def __init__(self, engines: dict[str, str], namespace: BlockNamespace, *, master: str | None = None,
                 etcd: str | None = None, cluster: str = DEFAULT_CLUSTER, token: str | None = None,
                 pool_weight: float = 0.8, load_weight: float = 1.0):
        self.router = Router(list(engines), namespace.block_size, pool_weight, load_weight)
        self.endpoints = dict(engines)
        self.namespace = namespace
        self._cluster = {"master": master, "etcd": etcd, "cluster": cluster, "token": token}
        given = token if token is not None else auth.read_token()
        self.client_token = auth.client_token_of(given) if given else None  # None: HTTP callers prove nothing
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: list[asyncio.Task] = []
        self.followers: dict[str, EngineEvents] = {}
        self._http: ThreadingHTTPServer | None = None

    # -- for callers, from any thread

    def choose(self, token_ids) -> tuple[str, list]:
        with self._lock:
            return self.router.choose(list(token_ids))

    def finished(self, engine: str) -> None:
        with self._lock:
            self.router.finished(engine)

    def state(self) -> dict:
        with self._lock:
            views = {name: {"blocks": len(v.blocks), "in_flight": v.in_flight, "unmapped": v.unmapped}
                     for name, v in self.router.views.items()}
            return {**views, "pool_blocks": len(self.router.pool)}

    # -- running

    def start(self) -> "RoutingService":
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="kvpool-router", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        for name, endpoint in self.endpoints.items():
            if endpoint:
                follower = self.followers[name] = _Locked(self.router.view(name), endpoint, self._lock)
                self._tasks.append(loop.create_task(follower.run(), name=f"kv-events {name}"))
        if self._cluster["master"] or self._cluster["etcd"]:
            self._tasks.append(loop.create_task(self._follow_pool(), name="pool-events"))
        ready.set()
        try:
            loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
        finally:
            loop.close()

    async def _follow_pool(self) -> None:
        cluster = self._cluster
        while True:
            try:
                async for kind, block in block_events(self.namespace, cluster["master"], etcd=cluster["etcd"],
                                                      cluster=cluster["cluster"], token=cluster["token"]):
                    with self._lock:
                        self.router.pool_changed(kind, block)
            except KvpoolError as exc:  # e.g. a refused credential: told once, tried again later
                log.warning("router: kvpool's block stream failed (%s); trying again in 5 s", exc)
                await asyncio.sleep(5)

    def serve_http(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Answer /route, /finished and /engines on host:port (0: a free port) in threads; returns the port."""
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # noqa: D102 - quiet: one line per request would flood the log
                pass

            def do_GET(self):
                if self.path not in PROBES and not self._allowed():
                    return
                if self.path == "/engines":
                    self._answer(200, service.state())
                elif self.path in ("/healthz", "/readyz"):  # probes: answering at all, and following engines
                    alive = service._thread is not None and service._thread.is_alive()
                    self._answer(200 if alive else 503, {"ok": alive})
                else:
                    self._answer(404, {"error": f"no {self.path}"})

            def do_POST(self):
                if not self._allowed():
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    self._answer(413, {"error": f"a body of {length} bytes"})
                    return
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if self.path == "/route":
                        tokens = body["token_ids"]
                        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                            raise ValueError("token_ids must be a list of integers")
                        engine, scores = service.choose(tokens)
                        self._answer(200, {"engine": engine, "scores": [dataclasses.asdict(s) for s in scores]})
                    elif self.path == "/finished":
                        service.finished(str(body["engine"]))
                        self._answer(200, {})
                    else:
                        self._answer(404, {"error": f"no {self.path}"})
                except (ValueError, KeyError, TypeError) as exc:
                    self._answer(400, {"error": f"{type(exc).__name__}: {exc}"})

            def _allowed(self) -> bool:
                """Whether the request carries the client token; if not, it is answered 401 here."""
                if service.client_token is None or auth.bearer_matches(self.headers.get("Authorization"),
                                                                       service.client_token):
                    return True
                self._answer(401, {"error": UNAUTHORIZED}, ("WWW-Authenticate", 'Bearer realm="kvpool router"'))
                return False

            def _answer(self, status: int, value, *headers: tuple[str, str]) -> None:
                data = json.dumps(value).encode()
                self.send_response(status)
                for name, text in headers:
                    self.send_header(name, text)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        if self.client_token is None:
            log.warning("router: no cluster token, so its HTTP endpoints answer anyone who reaches them")
        self._http = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self._http.serve_forever, name="kvpool-router-http", daemon=True).start()
        return self._http.server_address[1]

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._loop is not None and self._thread is not None:
            for task in self._tasks:
                self._loop.call_soon_threadsafe(task.cancel)
            self._thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class _Locked(EngineEvents):
    """EngineEvents applying each message under the service's lock."""

    def __init__(self, view, endpoint: str, lock: threading.Lock):
        super().__init__(view, endpoint)
        self._lock = lock

    def take(self, frames: list[bytes]) -> None:
        with self._lock:
            super().take(frames)
