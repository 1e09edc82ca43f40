"""The client's gRPC link to the leading master, found from a list of masters or through etcd.

Every failure leaves here as a kvpool.errors type: a status in a response
becomes its typed error (see `check`), an unreachable master becomes
UnavailableError. A master that does not lead answers FAILED_PRECONDITION with
the leader's address in the "kvpool-leader" trailing metadata (see the end of
kvpool.proto): the link switches to that master and retries. With several
masters configured, or etcd, an unreachable master is also retried elsewhere
(the next configured one, or whoever etcd names) until the RPC timeout ends.
"""

import asyncio
import json

import grpc
from kvpool.proto import kvpool_pb2_grpc

from kvpool.cluster_layout import DEFAULT_CLUSTER, master_key, parse_hostport
from kvpool.errors import (
    InternalError,
    InvalidArgumentError,
    NotLeaderError,
    UnavailableError,
    error_for,
)

DEFAULT_RPC_TIMEOUT = 10.0
_CHANNEL_OPTIONS = (
    # A restarted master should be found again in well under a second, not after gRPC's 1s+ backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def check(response):
    """`response` if its status is OK, else raise the typed error it carries."""
    if response.status:
        raise error_for(response.status, response.message)
    return response


LEADER_METADATA = "kvpool-leader"
RETRY_BACKOFF = (0.02, 0.5)  # first and longest pause before asking again when nothing new is known


def _leader_hint(exc: grpc.aio.AioRpcError) -> str | None:
    """The leader a NOT_LEADER answer names ("" if none is elected); None if it is not such an answer."""
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == LEADER_METADATA:
            return value.decode() if isinstance(value, bytes) else value
    return None


class MasterLink:
    def __init__(self, address: str | None = None, etcd: str | None = None,
                 cluster: str = DEFAULT_CLUSTER, rpc_timeout: float = DEFAULT_RPC_TIMEOUT):
        if (address is None) == (etcd is None):
            raise InvalidArgumentError("give either the master address(es) or the etcd endpoint (not both)")
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] if address is not None else []
        if address is not None and not self.addresses:
            raise InvalidArgumentError(f"no master address in {address!r}")
        for endpoint in [*self.addresses, *([etcd] if etcd else [])]:
            try:
                parse_hostport(endpoint)
            except ValueError as exc:
                raise InvalidArgumentError(str(exc)) from None
        self.address = self.addresses[0] if self.addresses else None
        self.etcd = etcd
        self.cluster = cluster
        self.rpc_timeout = rpc_timeout
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, kvpool_pb2_grpc.MasterStub] = {}

    @property
    def _can_move(self) -> bool:
        """Whether another master may answer when this one cannot."""
        return self.etcd is not None or len(self.addresses) > 1

    def _stub(self, address: str) -> kvpool_pb2_grpc.MasterStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            stub = self._stubs[address] = kvpool_pb2_grpc.MasterStub(channel)
        return stub

    async def call(self, method: str, request):
        """Invoke Master.<method> on the leader; the response is returned as is (statuses unchecked)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rpc_timeout
        pause = RETRY_BACKOFF[0]
        if self.address is None:
            self.address = await self._resolve()
        while True:
            address = self.address
            remaining = deadline - loop.time()
            try:
                return await getattr(self._stub(address), method)(request, timeout=max(remaining, 0.001))
            except grpc.aio.AioRpcError as exc:
                leader = _leader_hint(exc)
                if leader is None and (exc.code() != grpc.StatusCode.UNAVAILABLE or not self._can_move):
                    raise self._error(method, exc) from None
                last = exc
            if deadline - loop.time() <= 0:
                raise self._error(method, last) from None
            if leader and leader != address:
                self.address = leader  # told where to go: no pause
                continue
            # Nobody named (no leader yet, or this one is gone): look elsewhere after a pause.
            await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
            pause = min(pause * 2, RETRY_BACKOFF[1])
            try:
                self.address = await self._next_address(address)
            except UnavailableError:
                if deadline - loop.time() <= 0:
                    raise

    async def _next_address(self, failed: str) -> str:
        if self.etcd is not None:
            return await self._resolve()
        if failed in self.addresses:
            return self.addresses[(self.addresses.index(failed) + 1) % len(self.addresses)]
        return self.addresses[0]

    def _error(self, method: str, exc: grpc.aio.AioRpcError):
        code = exc.code()
        text = f"master {self.address or '?'} {method}: {code.name}: {exc.details()}"
        if _leader_hint(exc) is not None:
            return NotLeaderError(text + " (no leader answered in time)")
        if code in _UNREACHABLE:
            return UnavailableError(text)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgumentError(text)
        return InternalError(text)

    async def _resolve(self) -> str:
        """The master address registered in etcd for this cluster."""
        import aetcd  # only etcd-configured clients need it

        host, port = parse_hostport(self.etcd)
        try:
            async with aetcd.Client(host=host, port=port, timeout=self.rpc_timeout) as etcd:
                record = await etcd.get(master_key(self.cluster))
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError, OSError) as exc:
            raise UnavailableError(f"etcd {self.etcd} unreachable: {exc}") from None
        if record is None or not record.value:
            raise UnavailableError(f"no master registered in etcd {self.etcd} for cluster {self.cluster!r}")
        try:
            return json.loads(record.value)["address"]
        except (ValueError, KeyError, TypeError) as exc:
            raise UnavailableError(f"unreadable master record in etcd: {exc!r}") from None

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels, self._stubs = {}, {}
        for channel in channels:
            await channel.close()
