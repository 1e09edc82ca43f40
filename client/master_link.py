"""The client's gRPC link to the master, found directly or through etcd.

Every failure leaves here as a kvpool.errors type: a status in a response
becomes its typed error (see `check`), an unreachable master becomes
UnavailableError. With etcd, an UNAVAILABLE master is looked up again (it may
have restarted elsewhere) and the call is retried once.
"""

import asyncio
import json

import grpc

from kvpool.cluster_layout import DEFAULT_CLUSTER, master_key, parse_hostport
from kvpool.errors import InternalError, InvalidArgumentError, UnavailableError, error_for
from kvpool.proto import kvpool_pb2_grpc

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


class MasterLink:
    def __init__(self, address: str | None = None, etcd: str | None = None,
                 cluster: str = DEFAULT_CLUSTER, rpc_timeout: float = DEFAULT_RPC_TIMEOUT):
        if (address is None) == (etcd is None):
            raise InvalidArgumentError("give either the master address or the etcd endpoint (not both)")
        for endpoint in (address, etcd):
            if endpoint is not None:
                try:
                    parse_hostport(endpoint)
                except ValueError as exc:
                    raise InvalidArgumentError(str(exc)) from None
        self.address = address
        self.etcd = etcd
        self.cluster = cluster
        self.rpc_timeout = rpc_timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvpool_pb2_grpc.MasterStub | None = None
        self._epoch = 0  # bumped on every (re)connect, so concurrent failures reconnect once
        self._lock = asyncio.Lock()
        self._retired: list = []  # channels to a master address given up on

    async def call(self, method: str, request):
        """Invoke Master.<method>; the response is returned as is (statuses unchecked)."""
        if self._stub is None:
            await self._reconnect(self._epoch)
        epoch = self._epoch
        try:
            return await getattr(self._stub, method)(request, timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or self.etcd is None:
                raise self._error(method, exc) from None
        # The master may have moved: ask etcd where it is now and try once more.
        await self._reconnect(epoch)
        try:
            return await getattr(self._stub, method)(request, timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(method, exc) from None

    def _error(self, method: str, exc: grpc.aio.AioRpcError):
        code = exc.code()
        text = f"master {self.address or '?'} {method}: {code.name}: {exc.details()}"
        if code in _UNREACHABLE:
            return UnavailableError(text)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgumentError(text)
        return InternalError(text)

    async def _reconnect(self, seen_epoch: int) -> None:
        async with self._lock:
            if self._epoch != seen_epoch:  # someone else reconnected meanwhile
                return
            address = await self._resolve() if self.etcd is not None else self.address
            if self._channel is not None and address == self.address:
                return  # same master: its channel reconnects by itself
            old, self.address = self._channel, address
            self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._stub = kvpool_pb2_grpc.MasterStub(self._channel)
            self._epoch += 1
            if old is not None:
                # Closing it now would cancel calls still in flight on it; it goes at close().
                self._retired.append(old)

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
        channels = [*self._retired, self._channel]
        self._channel, self._stub, self._retired = None, None, []
        for channel in channels:
            if channel is not None:
                await channel.close()

