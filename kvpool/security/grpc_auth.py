"""The cluster credential on the master's gRPC calls (kvpool/security/auth.py holds the keys).

gRPC gives no hook at connection time, so each call carries a proof in its metadata: the role,
the time, a fresh nonce and an HMAC over them and the method, never the key itself. The master
takes a proof once, within WINDOW seconds of its time, so one seen on the wire cannot be replayed.
"""

import collections
import contextvars
import hashlib
import hmac
import secrets
import time

import grpc

from .auth import Credential, Role, Verifier
from ..errors import ForbiddenError

METADATA = "kvpool-auth"
WINDOW = 300.0  # seconds a proof's clock may be off the master's (and how long its nonce is remembered)
MAX_REMEMBERED = 200_000  # nonces of recent calls kept to refuse replays; calls past it wait for room


def _mac(key: bytes, role: int, stamp: str, nonce: str, method: str) -> str:
    message = f"kvpool grpc v1|{role}|{stamp}|{nonce}|{method}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def call_proof(credential: Credential, method: str) -> str:
    stamp, nonce = str(int(time.time())), secrets.token_hex(16)
    return f"{int(credential.role)}.{stamp}.{nonce}.{_mac(credential.key, credential.role, stamp, nonce, method)}"


class CallVerifier:
    """The master's check of each call's proof."""

    def __init__(self, verifier: Verifier, clock=time.time):
        self.verifier = verifier
        self.clock = clock
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()  # nonce -> when taken

    def check(self, proof: str | None, method: str) -> Role:
        if self.verifier.open:
            return Role.MEMBER
        if not proof:
            raise ForbiddenError("this master needs the cluster token (KVPOOL_TOKEN_FILE or KVPOOL_TOKEN)")
        try:
            role_text, stamp, nonce, mac = proof.split(".")
            role, when = int(role_text), int(stamp)
        except ValueError:
            raise ForbiddenError("malformed kvpool-auth metadata") from None
        key = self.verifier.key(role)
        if key is None or not hmac.compare_digest(mac, _mac(key, role, stamp, nonce, method)):
            raise ForbiddenError("wrong cluster token")
        now = self.clock()
        if abs(now - when) > WINDOW:
            raise ForbiddenError(f"call proof made {now - when:+.0f}s from the master's clock (more than {WINDOW:g}s)")
        self._forget_before(now - WINDOW)
        if nonce in self._seen:
            raise ForbiddenError("call proof already used (a replayed call)")
        if len(self._seen) >= MAX_REMEMBERED:
            raise ForbiddenError("too many calls in the replay window; try again")
        self._seen[nonce] = now
        return Role(role)

    def _forget_before(self, oldest: float) -> None:
        seen = self._seen
        while seen:
            nonce, when = next(iter(seen.items()))
            if when >= oldest:
                return
            del seen[nonce]


class ClientAuth:
    """Adds a fresh proof to every call of a channel (grpc.aio files an interceptor under its first
    kind only, so each kind gets its own class below)."""

    def __init__(self, credential: Credential):
        self.credential = credential

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(METADATA, call_proof(self.credential, method))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryAuth(ClientAuth, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamAuth(ClientAuth, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def client_interceptors(credential: Credential | None) -> list:
    return [_UnaryAuth(credential), _StreamAuth(credential)] if credential is not None else []


class _BlockingClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """ClientAuth for a blocking channel (tools and tests)."""

    def __init__(self, credential: Credential):
        self.credential = credential

    def _details(self, details):
        # grpc hands a blocking channel's interceptors its call details as a namedtuple
        metadata = [*(details.metadata or ()), (METADATA, call_proof(self.credential, details.method))]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def blocking_channel(address: str, credential: Credential | None, options=(), tls=None) -> grpc.Channel:
    """A blocking gRPC channel to a master whose calls carry `credential`'s proof (tls: TlsFiles)."""
    channel = grpc.secure_channel(address, tls.grpc_channel_credentials(), options=options) if tls is not None \
        else grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _BlockingClientAuth(credential)) if credential is not None else channel


HEALTH_METHODS = "/grpc.health.v1.Health/"  # answered without a proof: they tell only whether it serves


class ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose proof does not hold; counts them in `refused`."""

    def __init__(self, verifier: Verifier, on_refused=None):
        self.calls = CallVerifier(verifier)
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_METHODS):
            return await continuation(handler_call_details)  # serving or not, for orchestrators' probes
        proof = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == METADATA:
                proof = value.decode() if isinstance(value, bytes) else value
        try:
            role = self.calls.check(proof, handler_call_details.method)
        except ForbiddenError as exc:
            if self.on_refused is not None:
                self.on_refused()
            return _refusal(await continuation(handler_call_details), str(exc))
        return _as_role(await continuation(handler_call_details), role)


# The role the current gRPC call proved, for the service's dispatch (kvpool/security/roles.py): set by
# ServerAuth around each call's handler; a call that did not pass it proved nothing.
CALLER_ROLE: contextvars.ContextVar[Role] = contextvars.ContextVar("kvpool_caller_role", default=Role.CLIENT)


def _as_role(handler, role: Role):
    """`handler` run with CALLER_ROLE set to `role` (a unary one: the server streams are the client's to
    call, roles.py)."""
    if handler is None or handler.response_streaming or handler.request_streaming:
        return handler
    behavior = handler.unary_unary

    async def unary(request, context):
        CALLER_ROLE.set(role)
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


def _refusal(handler, message: str):
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler is

    if handler is None:
        return None
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, handler.request_deserializer,
                                                    handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)
