"""Per storage node, the best data transport both sides allow: shared memory, then UCX, then TCP.

On first contact the client asks the node (HELLO over TCP) what it offers and
attaches to the first of the allowed transports that works. A transport that
fails a transfer (UnavailableError, ProtocolError) is set aside for that node
for DOWN_SECONDS, logged once, and the transfer is retried on the next one: a
failing fast path costs time, never a transfer. HELLO and the shared-memory
path's control messages travel over TCP.
"""

import asyncio
import collections
import logging
import time
from typing import Sequence

from kvpool.protocol import transports
from kvpool.errors import KvpoolError, ProtocolError, UnavailableError
from kvpool.protocol.parts import Parts
from kvpool.net.node_connections import DEFAULT_CONNECT_TIMEOUT

from kvpool.client.shm import ShmPath
from kvpool.client.waiting import LOOP_IO
from kvpool.client.tcp import TcpTransport
from kvpool.client.transport import DataPath, ReadItem, Transport, WriteItem

log = logging.getLogger(__name__)

DOWN_SECONDS = 30.0  # how long a failed transport is left alone before it is tried again
_PATH_FAILED = (UnavailableError, ProtocolError)


def _make_ucx(credential, tickets) -> DataPath | None:
    from kvpool.client import ucx

    if not ucx.available():  # the optional extra kvpool[ucx] is not installed
        log.info("UCX transport not available: install kvpool[ucx]")
        return None
    return ucx.UcxTransport(credential=credential, tickets=tickets)


class TransportSelector(Transport):
    """allowed: transport names (kvpool.protocol.transports), default $KVPOOL_TRANSPORTS or all of them.
    credential: what this client proves to each node (kvpool/security/auth.py).
    tls: kvpool/security/tls.py TlsFiles when the cluster runs TLS (None: plain TCP).
    io: how TCP waits (client/waiting.py)."""

    def __init__(self, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, allowed: Sequence[str] | None = None,
                 credential=None, io=LOOP_IO, tls=None):
        self.allowed = tuple(allowed) if allowed is not None else transports.from_environment()
        if tls is not None and transports.UCX in self.allowed:  # UCX has no encryption: not over a TLS cluster
            log.info("UCX transport not used: the cluster runs TLS")
            self.allowed = tuple(name for name in self.allowed if name != transports.UCX)
        self.tcp = TcpTransport(connect_timeout, credential, tls, io)
        self._io = io
        self._fast: dict[str, DataPath] = {}
        if transports.SHM in self.allowed:
            self._fast[transports.SHM] = ShmPath(self.tcp)
        if transports.UCX in self.allowed:
            ucx = _make_ucx(credential, self._ucx_ticket)
            if ucx is not None:
                self._fast[transports.UCX] = ucx
        self._moved: collections.Counter = collections.Counter()  # transport name -> value bytes moved
        self._routes: dict[str, tuple[float, list]] = {}  # address -> (rebuild after, [(name, path)])
        self._routing: dict[str, asyncio.Future] = {}
        self._down: dict[tuple[str, str], float] = {}  # (address, name) -> left alone until

    # -- choosing

    async def route(self, address: str) -> list:
        """[(name, path)] to try for `address`, best first."""
        cached = self._routes.get(address)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        pending = self._routing.get(address)
        if pending is None:
            pending = self._routing[address] = asyncio.ensure_future(self._build_route(address))
            pending.add_done_callback(lambda _: self._routing.pop(address, None))
        return await asyncio.shield(pending)

    async def _build_route(self, address: str) -> list:
        now = time.monotonic()
        wanted = [name for name in self.allowed if self._down.get((address, name), 0) <= now]
        hello = None
        if any(name in self._fast for name in wanted):
            hello = await self.tcp.hello(address)
        offered = hello.get("transports") if isinstance(hello, dict) else None
        route = []
        for name in wanted:
            if name == transports.TCP:
                route.append((name, self.tcp))
                continue
            path = self._fast.get(name)
            if path is None or (isinstance(offered, dict) and name not in offered):
                continue  # not offered by this node: nothing failed, nothing to report
            try:
                await path.attach(address, hello)
            except KvpoolError as exc:
                self._set_aside(address, name, exc, now)
                continue
            route.append((name, path))
        if not route:
            raise UnavailableError(f"no allowed transport ({','.join(self.allowed)}) reaches node {address}")
        downs = [until for (where, _), until in self._down.items() if where == address and until > now]
        self._routes[address] = (min(downs, default=float("inf")), route)
        return route

    async def _ucx_ticket(self, address: str) -> bytes:
        """A one-use ticket for a UCX CONNECT, asked of the node on our authenticated TCP connection."""
        from kvpool.client.ucx import ticket_of

        return ticket_of(await self.tcp.hello(address), address)

    def _set_aside(self, address: str, name: str, exc: Exception, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._down.get((address, name), 0) <= now:  # once per period
            log.warning("node %s: not using %s for %.0f s (%s)", address, name, DOWN_SECONDS, exc)
        self._down[(address, name)] = now + DOWN_SECONDS
        self._routes.pop(address, None)

    @property
    def moved(self) -> dict:
        """Value bytes moved per transport; what the shm path sent over its TCP connection counts as TCP."""
        moved = collections.Counter(self._moved)
        shm = self._fast.get(transports.SHM)
        if shm is not None and shm.by_socket:
            moved[transports.SHM] -= shm.by_socket
            moved[transports.TCP] += shm.by_socket
        return {name: count for name, count in moved.items() if count > 0}

    def register_buffer(self, view: memoryview) -> None:
        """Hand a buffer used for many transfers to the transports that register memory (UCX)."""
        for path in self._fast.values():
            path.register_buffer(view)

    def transport_for(self, address: str) -> str | None:
        """The transport value bytes to `address` take now (None before first contact)."""
        cached = self._routes.get(address)
        return cached[1][0][0] if cached else None

    # -- moving bytes

    async def _one(self, address: str, size: int, call):
        order = _fallback_order(await self.route(address))
        for position, (name, path) in enumerate(order):
            if path is not self.tcp:
                await self._io.to_loop()  # only TCP requests are answered on the socket (waiting.py)
            try:
                result = await call(path)
            except _PATH_FAILED as exc:
                if name == transports.TCP or position == len(order) - 1:
                    raise
                self._set_aside(address, name, exc)
                continue
            self._moved[name] += size
            return result
        raise AssertionError("unreachable")

    async def _many(self, address: str, items: Sequence, call) -> list:
        """Per-item results; the items a transport failed as a path are retried on the next one."""
        try:
            route = await self.route(address)
        except KvpoolError as exc:
            return [type(exc)(str(exc)) for _ in items]
        results: list = [None] * len(items)
        todo = list(range(len(items)))
        order = _fallback_order(route)
        for position, (name, path) in enumerate(order):
            if path is not self.tcp:
                await self._io.to_loop()
            outcomes = await call(path, [items[i] for i in todo])
            retry = [i for i, outcome in zip(todo, outcomes) if isinstance(outcome, _PATH_FAILED)]
            for i, outcome in zip(todo, outcomes):
                results[i] = outcome
                if not isinstance(outcome, BaseException):
                    self._moved[name] += _size(items[i])
            if not retry or name == transports.TCP or position == len(order) - 1:
                break
            self._set_aside(address, name, results[retry[0]])
            todo = retry
        return results

    async def write(self, address, key, generation, data, checksum, options=None, term=0) -> None:
        return await self._one(address, len(data), lambda path: path.write(
            address, key, generation, _whole(path, data), checksum, options, term))

    async def read_into(self, address, key, generation, buf) -> int:
        async def read(path):
            if path.takes_parts or not isinstance(buf, Parts):
                return await path.read_into(address, key, generation, buf)
            staged = buf.flat_or_new()
            digest = await path.read_into(address, key, generation, staged)
            buf.fill_from(staged)
            return digest

        return await self._one(address, len(buf), read)

    async def write_many(self, address: str, items: Sequence[WriteItem]) -> list:
        def write(path, some):
            if not path.takes_parts and any(isinstance(item.data, Parts) for item in some):
                some = [item._replace(data=_whole(path, item.data)) for item in some]
            return path.write_many(address, some)

        return await self._many(address, items, write)

    async def read_many(self, address: str, items: Sequence[ReadItem]) -> list:
        async def read(path, some):
            if path.takes_parts or not any(isinstance(item.buf, Parts) for item in some):
                return await path.read_many(address, some)
            staged = [item._replace(buf=item.buf.flat_or_new()) if isinstance(item.buf, Parts) else item
                      for item in some]
            outcomes = await path.read_many(address, staged)
            for item, stage, outcome in zip(some, staged, outcomes):
                if stage is not item and not isinstance(outcome, BaseException):
                    item.buf.fill_from(stage.buf)
            return outcomes

        return await self._many(address, items, read)

    async def close(self) -> None:
        for path in self._fast.values():
            await path.close()
        await self.tcp.close()


def _fallback_order(route: list) -> list:
    """The best path first; if it fails, TCP next when allowed: it fails fast when the node itself
    is gone, where another fast path (UCX notices a dead peer only by a timeout) would hang."""
    tcp = [entry for entry in route if entry[0] == transports.TCP]
    return route[:1] + tcp + [entry for entry in route[1:] if entry[0] != transports.TCP]


def _whole(path: DataPath, data):
    """The value as `path` takes it: Parts gathered into one buffer for a path that cannot send them (unless
    they are one view)."""
    if isinstance(data, Parts) and not path.takes_parts:
        return data.views[0] if len(data.views) == 1 else data.gather()
    return data


def _size(item) -> int:
    return len(item.buf) if isinstance(item, ReadItem) else len(item.data)
