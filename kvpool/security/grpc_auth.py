"""The cluster credential on the master's gRPC calls (kvpool/security/auth.py holds the keys).

gRPC gives no hook at connection time, so each call carries a proof in its metadata: the role, the time
(milliseconds), a fresh nonce, the master it is for and an HMAC over them, the method and a digest of the
serialized request, never the key itself. A master takes a proof once (replay_cache.py), only if it is
for this master and this very request: one seen on the wire cannot be replayed there, at another master
or with another request. The master a proof is for is named by its advertised gRPC address (what etcd,
Stats and NOT_LEADER name it by), which a caller learns from the master's Stats before any other call;
Stats alone may be asked with a proof for no master in particular (it only tells who the masters are).
"""

import contextvars
import hashlib
import hmac
import secrets
import time

import grpc
from kvpool.proto import kvpool_pb2 as pb

from .auth import MEMBER, Credential, Role, Verifier
from .roles import CLIENT, Caller
from .replay_cache import ProofRefused, ReplayCache
from ..errors import ForbiddenError

METADATA = "kvpool-auth"
VERSION = "2"
STATS = "/kvpool.Master/Stats"  # the one method a proof may be for no master in particular ("")


def _mac(key: bytes, role: int | str, made_ms: int, nonce: str, master: str, method: str, request_digest: bytes) -> str:
    message = f"kvpool grpc v{VERSION}|{role}|{made_ms}|{nonce}|{master}|{method}|".encode() + request_digest
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def request_digest(request: bytes) -> bytes:
    return hashlib.sha256(request).digest()


def call_proof(credential: Credential, method: str, master: str, request: bytes, made_ms: int | None = None) -> str:
    """The proof for calling `method` with the serialized `request` at the master advertised as `master`."""
    made_ms = int(time.time() * 1000) if made_ms is None else made_ms
    nonce = secrets.token_hex(16)
    who = _who(credential)
    mac = _mac(credential.key, who, made_ms, nonce, master, method, request_digest(request))
    return f"{VERSION}.{who}.{made_ms}.{nonce}.{mac}.{master}"


def _who(credential: Credential) -> str:
    """The proof's role field: the role's number, and for a tenant ROLE:NAME:VERSION (a tenant's name has
    no '.')."""
    role = str(int(credential.role))
    return f"{role}:{credential.ident.decode()}" if credential.tenant else role


class CallVerifier:
    """The master's check of each call's proof. master: this master's advertised address."""

    def __init__(self, verifier: Verifier, master: str = "", clock=time.time, cache: ReplayCache | None = None):
        self.verifier = verifier
        self.master = master
        self.clock = clock
        self.cache = cache if cache is not None else ReplayCache()

    def check(self, proof: str | None, method: str, digest: bytes) -> Caller:
        """The caller `proof` proves for `method` called with a request of this `digest` (request_digest)."""
        if self.verifier.open:
            return MEMBER
        if not proof:
            raise ForbiddenError("this master needs the cluster token (KVPOOL_TOKEN_FILE or KVPOOL_TOKEN)")
        try:
            version, who, made, nonce, mac, master = proof.split(".", 5)
            role_text, _, ident = who.partition(":")
            role, made_ms = int(role_text), int(made)
        except ValueError:
            raise ForbiddenError("malformed kvpool-auth metadata") from None
        if version != VERSION:
            raise ForbiddenError(f"call proof of version {version!r}; this master takes version {VERSION} "
                                 "(upgrade the client)")
        if master != self.master and not (method == STATS and master == ""):
            raise ForbiddenError(f"call proof made for master {master or '(any)'!r}; this is {self.master!r}")
        found = self.verifier.caller_key(role, ident.encode())
        if found is None or not hmac.compare_digest(mac, _mac(found[1], who, made_ms, nonce, master, method, digest)):
            raise ForbiddenError(("wrong tenant token (rotated, deleted, or never made)" if role == Role.TENANT else
                                  "wrong cluster token") + ", or a proof made for another method or request")
        try:
            self.cache.take(made_ms, nonce, int(self.clock() * 1000))
        except ProofRefused as exc:
            raise ForbiddenError(str(exc)) from None
        return found[0]


class MasterName:
    """Which master a channel's proofs are for: its advertised address, taken to be the address dialled
    until its Stats names it (`confirmed`)."""

    def __init__(self, dialled: str):
        self.address = dialled
        self.confirmed = False

    def learned(self, advertised: str) -> None:
        if advertised:
            self.address = advertised
        self.confirmed = True

    def proof(self, credential: Credential, method: str, request) -> str:
        """The proof for `request`: a message, or bytes sent as they are (a channel call without a serializer)."""
        master = self.address if self.confirmed or method != STATS else ""
        body = request if isinstance(request, bytes) else request.SerializeToString()
        return call_proof(credential, method, master, body)


class ClientAuth:
    """Adds a fresh proof to every call of a channel to one master (grpc.aio files an interceptor under its
    first kind only, so each kind gets its own class below)."""

    def __init__(self, credential: Credential, master: MasterName):
        self.credential = credential
        self.master = master

    def _details(self, details: grpc.aio.ClientCallDetails, request) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(METADATA, self.master.proof(self.credential, method, request))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryAuth(ClientAuth, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details, request), request)


class _StreamAuth(ClientAuth, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details, request), request)


def client_interceptors(credential: Credential | None, master: MasterName) -> list:
    """The interceptors of a channel to `master` (whose Stats the caller reads into it: MasterName.learned)."""
    return [_UnaryAuth(credential, master), _StreamAuth(credential, master)] if credential is not None else []


class _BlockingClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """ClientAuth for a blocking channel (tools and tests): asks the master's Stats on the first call that
    needs its name."""

    def __init__(self, credential: Credential, channel: grpc.Channel, dialled: str):
        self.credential = credential
        self.master = MasterName(dialled)
        self._stats = channel.unary_unary(STATS, request_serializer=pb.StatsRequest.SerializeToString,
                                          response_deserializer=pb.StatsResponse.FromString)

    def _details(self, details, request):
        if not self.master.confirmed and details.method != STATS:
            request_stats = pb.StatsRequest()
            proof = self.master.proof(self.credential, STATS, request_stats)
            self.master.learned(self._stats(request_stats, timeout=details.timeout or 10.0,
                                            metadata=[(METADATA, proof)]).address)
        # grpc hands a blocking channel's interceptors its call details as a namedtuple
        proof = self.master.proof(self.credential, details.method, request)
        return details._replace(metadata=[*(details.metadata or ()), (METADATA, proof)])

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details, request), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details, request), request)


def blocking_channel(address: str, credential: Credential | None, options=(), tls=None) -> grpc.Channel:
    """A blocking gRPC channel to a master whose calls carry `credential`'s proof (tls: TlsFiles)."""
    channel = grpc.secure_channel(address, tls.grpc_channel_credentials(), options=options) if tls is not None \
        else grpc.insecure_channel(address, options=options)
    if credential is None:
        return channel
    return grpc.intercept_channel(channel, _BlockingClientAuth(credential, channel, address))


HEALTH_METHODS = "/grpc.health.v1.Health/"  # answered without a proof: they tell only whether it serves


class ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose proof does not hold for this master, its method and its
    request; counts them through `on_refused`. `calls.master`: this master's advertised address, set once bound."""

    def __init__(self, verifier: Verifier, on_refused=None, cache: ReplayCache | None = None):
        self.calls = CallVerifier(verifier, cache=cache)
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHODS):
            return handler  # serving or not, for orchestrators' probes
        if self.calls.verifier.open:
            return _as_caller(handler, MEMBER)
        if handler.request_streaming:
            return None  # the service has no client streams: UNIMPLEMENTED rather than a stream proved by nothing
        proof = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == METADATA:
                proof = value.decode() if isinstance(value, bytes) else value
        return self._checked(handler, proof, handler_call_details.method)

    def _checked(self, handler, proof: str | None, method: str):
        """`handler`, run only once `proof` holds for `method` and the request's bytes (seen as they are
        deserialized), with CALLER set to the caller it proved."""
        deserialize = handler.request_deserializer
        digest: list[bytes] = []

        def deserializer(data: bytes):
            digest.append(request_digest(data))
            return deserialize(data) if deserialize is not None else data

        async def proved(context) -> Caller:
            try:
                if len(digest) != 1:
                    raise ForbiddenError("no request to check the call proof against")
                return self.calls.check(proof, method, digest[0])
            except ForbiddenError as exc:
                if self.on_refused is not None:
                    self.on_refused()
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

        if handler.response_streaming:
            streams = handler.unary_stream

            async def stream(request, context):
                CALLER.set(await proved(context))
                return await streams(request, context)

            return grpc.unary_stream_rpc_method_handler(stream, deserializer, handler.response_serializer)
        behavior = handler.unary_unary

        async def unary(request, context):
            CALLER.set(await proved(context))
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, deserializer, handler.response_serializer)


# Who the current gRPC call proved, for the service's dispatch (kvpool/security/roles.py): set by
# ServerAuth around each call's handler; a call that did not pass it proved nothing.
CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("kvpool_caller", default=CLIENT)


def _as_caller(handler, caller: Caller):
    """`handler` run with CALLER set to `caller` (a unary one: the server streams are the client's to
    call, roles.py)."""
    if handler.response_streaming or handler.request_streaming:
        return handler
    behavior = handler.unary_unary

    async def unary(request, context):
        CALLER.set(caller)
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
