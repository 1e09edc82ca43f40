"""The etcd client of every kvpool component: aetcd, with etcd's user authentication done so
that it survives what aetcd's does not.

etcd hands out a token at Authenticate and forgets it when it restarts (simple tokens) or
when it expires (JWT); aetcd authenticates once per connection and then fails every call.
Here each unary call carries the current token from an interceptor, and a call refused for
an invalid token logs in again and is retried once. Streams (watches, lease keep-alives)
take the token current when they open; the components reopen them after an error anyway.

Users and passwords come from the cluster credentials (kvpool/security/auth.py): the members log in
as MEMBER_USER (read and write), clients as CLIENT_USER (read only: they look up the
leading master), each with a password derived from its role key, so neither is stored
anywhere. `enable_auth` creates both on a fresh etcd and turns authentication on.

An etcd with authentication off takes anyone's writes to membership and leadership: an EtcdClient given a
credential finds it so at its first call and raises OpenEtcdError, unless made with allow_open (a master's or
node's --allow-etcd-without-auth; a client's lookup of the leader, which the master then proves itself to).
"""

import asyncio
import base64
import contextlib
import hashlib
import hmac
import http.client
import json
import logging
import secrets
import urllib.error
import urllib.request

import aetcd
import grpc
from aetcd import rpc, watcher

from ..security.auth import Credential, Role
from ..errors import KvpoolError, UnavailableError

log = logging.getLogger(__name__)

MEMBER_USER = "kvpool-member"
CLIENT_USER = "kvpool-client"
_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"
# A silent etcd (its host cut off) is found by the clock: while a call or stream is open, the channel pings
# every 6 s and drops a connection whose ping went unanswered for 3 s (etcd refuses pings more often than
# every 5 s, and any ping without a call open); a dropped one is dialled again within 2 s.
CHANNEL_OPTIONS = {
    "grpc.keepalive_time_ms": 6000,
    "grpc.keepalive_timeout_ms": 3000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.http2.max_pings_without_data": 0,
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 2000,
}
# Channel options, over CHANNEL_OPTIONS, of a client that reconnects (reconnect below): a connection of its own
# (gRPC shares one between channels to the same address, so a new channel would inherit the dead one, or its
# reconnection back-off), and each connect attempt given up after a second, so one made while etcd was
# unreachable does not outlast its return.
OWN_CONNECTION = {"grpc.use_local_subchannel_pool": 1, "grpc.initial_reconnect_backoff_ms": 200,
                  "grpc.min_reconnect_backoff_ms": 1000, "grpc.max_reconnect_backoff_ms": 1000}


ALLOW_FLAG = "--allow-etcd-without-auth"


class OpenEtcdError(KvpoolError):
    """The cluster has a secret but its etcd has authentication off, and that was not allowed."""


def add_open_etcd_argument(parser) -> None:
    parser.add_argument(ALLOW_FLAG, action="store_true",
                        help="go on when etcd has authentication off though the cluster has a secret (anyone who "
                             "reaches etcd could then change membership and leadership); default: refuse to start")


def login_of(credential: Credential) -> tuple[str, str]:
    """(etcd user, password) for a credential."""
    user = MEMBER_USER if credential.role == Role.MEMBER else CLIENT_USER
    return user, hmac.new(credential.key, b"kvpool etcd password v1", hashlib.sha256).hexdigest()


class _Tokens:
    """The current etcd token, renewed when etcd says it does not know it."""

    def __init__(self, user: str, password: str, endpoint: str = "", allow_open: bool = False):
        self.user, self.password = user, password
        self.endpoint, self.allow_open = endpoint, allow_open
        self.token = ""
        self.unused = False  # etcd has authentication off: calls go without a token
        self.stub: rpc.AuthStub | None = None
        self._renewing: asyncio.Future | None = None

    async def renew(self, timeout: float | None) -> None:
        if self._renewing is None:  # concurrent callers share one login
            self._renewing = asyncio.ensure_future(self._login(timeout))
        try:
            await asyncio.shield(self._renewing)
        finally:
            if self._renewing is not None and self._renewing.done():
                self._renewing = None

    async def _login(self, timeout: float | None) -> None:
        try:
            reply = await self.stub.Authenticate(rpc.AuthenticateRequest(name=self.user, password=self.password),
                                                 timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if "authentication is not enabled" not in (exc.details() or ""):
                raise
            if not self.allow_open:
                raise OpenEtcdError(f"etcd at {self.endpoint} has authentication off though the cluster has a "
                                    f"secret (anyone who reaches it could change membership and leadership): run "
                                    f"`kvpool etcd-auth --etcd {self.endpoint}`, or pass {ALLOW_FLAG}") from None
            if not self.unused:
                log.warning("etcd has authentication off: anyone who reaches it can change the cluster's "
                            "membership and leadership (see docs/security.md)")
            self.unused = True
            return
        self.token = reply.token


def _refused_token(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED or "auth token" in (exc.details() or "")


class _TokenMetadata:
    """The metadata of a stream (watches: aetcd passes it when each opens), read as it opens."""

    def __init__(self, tokens: "_Tokens"):
        self.tokens = tokens

    def __iter__(self):
        return iter((("token", self.tokens.token),) if self.tokens.token else ())

    def __len__(self):
        return 1 if self.tokens.token else 0


class _TokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, tokens: _Tokens, timeout: float | None):
        self.tokens = tokens
        self.timeout = timeout

    def _details(self, details):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        # The token aetcd passed (as it was when the call began) is replaced by the current one.
        metadata = grpc.aio.Metadata(*((k, v) for k, v in (details.metadata or ()) if k != "token"))
        if method != _AUTHENTICATE and self.tokens.token:
            metadata.add("token", self.tokens.token)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        if not self.tokens.token and not self.tokens.unused \
                and client_call_details.method not in (_AUTHENTICATE, _AUTHENTICATE.encode()):
            await self.tokens.renew(self.timeout)
        call = await continuation(self._details(client_call_details), request)
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            if not _refused_token(exc) or client_call_details.method in (_AUTHENTICATE, _AUTHENTICATE.encode()):
                raise
            log.info("etcd refused our token (%s); logging in again", exc.details())
            await self.tokens.renew(self.timeout)
            call = await continuation(self._details(client_call_details), request)
        return call



class EtcdClient(aetcd.Client):
    """aetcd.Client logging in as `credential`'s etcd user (None: no etcd authentication)."""

    def __init__(self, host: str, port: int, credential: Credential | None = None, timeout=None, tls=None,
                 allow_open: bool = False, **options):
        """tls: kvpool/security/tls.py TlsFiles (etcd's certificate is checked against its CA).
        allow_open: with a credential, go on (warning) when etcd has authentication off; else its first call
        raises OpenEtcdError."""
        options["options"] = {**CHANNEL_OPTIONS, **(options.get("options") or {})}
        super().__init__(host=host, port=port, timeout=timeout, **options)
        self._login = login_of(credential) if credential is not None else None
        self._tls = tls
        self._allow_open = allow_open

    async def connect(self) -> None:
        if self._login is None and self._tls is None:
            return await super().connect()
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            tokens = _Tokens(*self._login, f"{self._host}:{self._port}", self._allow_open) if self._login \
                else _Tokens("", "")
            tokens.unused = self._login is None
            interceptors = [_TokenInterceptor(tokens, self._timeout)]
            target, options = f"{self._host}:{self._port}", list(self._options.items())
            if self._tls is not None:
                self.channel = grpc.aio.secure_channel(target, self._tls.grpc_channel_credentials(), options=options,
                                                       interceptors=interceptors)
            else:
                self.channel = grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
            tokens.stub = self.auth_stub = rpc.AuthStub(self.channel)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            # Streams are not intercepted (grpc.aio's stream interceptors break aetcd's watches): aetcd
            # passes this metadata to each watch and lease keep-alive as it opens.
            self.metadata = _TokenMetadata(tokens)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


async def reconnect(etcd: aetcd.Client, timeout: float = 1.0) -> None:
    """Move `etcd` to a new connection: calls from now on use it. For a connection that may be dead without
    knowing it (etcd cut off silently): TCP's retransmission back-off would find etcd again many seconds
    after it returned. Give the client OWN_CONNECTION's options, or the new channel shares the old
    connection. Calls still waiting on the old one are cancelled (grpc.aio raises CancelledError in them):
    only for a client whose callers bound their calls themselves and have given up on them."""
    old_channel, old_watcher = etcd.channel, etcd._watcher
    etcd._connected.clear()
    await etcd.connect()
    for closing in (old_watcher.shutdown() if old_watcher is not None else None,
                    old_channel.close() if old_channel is not None else None):
        if closing is not None:
            try:
                await asyncio.wait_for(closing, timeout)
            except Exception as exc:  # noqa: BLE001 - what is left of it goes with the process
                log.debug("closing the old etcd connection failed: %s", exc)


async def follow_prefix(etcd: aetcd.Client, prefix: bytes, read, retry_delay: float, what: str) -> None:
    """Await read() once the watch of `prefix` is open (what changed before it began), and again after every
    change under it, until cancelled; after a failed watch (etcd away), open it again `retry_delay` later. For
    records that are few, read whole each time: no event is missed or applied out of order."""
    while True:
        try:
            watch = await etcd.watch_prefix(prefix)
            try:
                await read()
                async for _event in watch:
                    await read()
            finally:
                with contextlib.suppress(Exception):
                    await watch.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - etcd away: keep what was read, watch again later
            log.debug("%s failed (%s: %s)", what, type(exc).__name__, exc)
        await asyncio.sleep(retry_delay)


def enable_auth(endpoint: str, secret: str, prefix: str = "/kvpool/", timeout: float = 10.0, tls=None) -> bool:
    """Create the members' and the clients' etcd users on the etcd at `endpoint` and turn
    authentication on (etcd's JSON gateway; a root user with a random password that nobody
    keeps is needed to turn it on). Members may read and write under `prefix` (all keys when
    empty), clients only read. An etcd with authentication already on is left as it is:
    returns False then, True when it was set up now. tls: TlsFiles when etcd serves TLS."""
    context = tls.client_context() if tls is not None else None
    try:
        if _post(endpoint, "/v3/auth/status", {}, timeout, context).get("enabled"):
            return False
    except RuntimeError as exc:
        if "user name is empty" in str(exc):  # an etcd with authentication on answers no anonymous caller
            return False
        raise
    start, end = (prefix.encode(), _prefix_end(prefix.encode())) if prefix else (b"\0", b"\0")
    steps = [("role/add", {"name": "kvpool-member"}), ("role/add", {"name": "kvpool-client"}),
             ("role/grant", {"name": "kvpool-member", "perm": {"permType": "READWRITE", "key": _b64(start),
                                                               "range_end": _b64(end)}}),
             ("role/grant", {"name": "kvpool-client", "perm": {"permType": "READ", "key": _b64(start),
                                                               "range_end": _b64(end)}}),
             ("role/add", {"name": "root"})]
    for credential in (Credential.for_member(secret), Credential.for_client(secret)):
        user, password = login_of(credential)
        role = "kvpool-member" if credential.role == Role.MEMBER else "kvpool-client"
        steps += [("user/add", {"name": user, "password": password}), ("user/grant", {"user": user, "role": role})]
    steps += [("user/add", {"name": "root", "password": secrets.token_hex(16)}),
              ("user/grant", {"user": "root", "role": "root"}), ("enable", {})]
    for path, body in steps:
        _post(endpoint, f"/v3/auth/{path}", body, timeout, context)
    return True


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])  # the prefixes used here end below 0xff


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _post(endpoint: str, path: str, body: dict, timeout: float, context=None) -> dict:
    scheme = "https" if context is not None else "http"
    request = urllib.request.Request(f"{scheme}://{endpoint}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
            return json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode("utf-8", "replace")
        if "already exists" in text or "already granted" in text:  # set up before: keep it
            return {}
        raise RuntimeError(f"etcd {path}: {exc.code} {text}") from None
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError) as exc:  # no HTTP reply at all
        raise UnavailableError(f"etcd {endpoint} unreachable: {getattr(exc, 'reason', None) or exc}") from None
