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

from kvpool.protocol.cluster_layout import DEFAULT_CLUSTER
from kvpool.errors import KvpoolError
from kvpool.runtime.http_endpoint import HttpServer, Request
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
        self._http: HttpServer | None = None

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
        self._tasks.append(loop.create_future())  # runs until stop(), whatever it follows (HTTP is served here)
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
        """Answer /route, /finished and /engines on host:port (0: a free port) on the service's event loop, every
        connection bounded (kvpool/runtime/http_endpoint.py); returns the port. Call after start()."""
        if self.client_token is None:
            log.warning("router: no cluster token, so its HTTP endpoints answer anyone who reaches them")
        self._http = HttpServer(self._respond, methods=(b"GET", b"POST"), max_body=MAX_BODY)
        return asyncio.run_coroutine_threadsafe(self._http.start(host, port), self._loop).result(10)

    async def _respond(self, request: Request) -> tuple:
        path = request.path
        if path not in PROBES and self.client_token is not None and not auth.bearer_matches(
                request.headers.get("authorization"), self.client_token):
            return _json(401, {"error": UNAUTHORIZED}, ("WWW-Authenticate", 'Bearer realm="kvpool router"'))
        if request.method == b"GET":
            if path == "/engines":
                return _json(200, self.state())
            if path in PROBES:  # answering at all, and following engines
                alive = self._thread is not None and self._thread.is_alive()
                return _json(200 if alive else 503, {"ok": alive})
            return _json(404, {"error": f"no {path}"})
        try:
            body = json.loads(request.body or b"{}")
            if path == "/route":
                tokens = body["token_ids"]
                if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                    raise ValueError("token_ids must be a list of integers")
                engine, scores = await asyncio.to_thread(self.choose, tokens)  # the loop goes on following events
                return _json(200, {"engine": engine, "scores": [dataclasses.asdict(s) for s in scores]})
            if path == "/finished":
                self.finished(str(body["engine"]))
                return _json(200, {})
            return _json(404, {"error": f"no {path}"})
        except (ValueError, KeyError, TypeError) as exc:
            return _json(400, {"error": f"{type(exc).__name__}: {exc}"})

    def stop(self) -> None:
        if self._http is not None and self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._http.close)
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


def _json(status: int, value, *headers: tuple[str, str]) -> tuple:
    return status, "application/json", json.dumps(value).encode(), headers
