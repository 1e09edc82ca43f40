"""TCP connections to storage nodes, and the requests any peer may send on them.

One pipelined connection per node address (kvpool/net/tcp_connection.py), opened
on first use and proved with the peer's credential. On top of it: WRITE (a client's
put, a node's COPY to another node), HELLO (what a node offers) and the open
connection itself (the shared-memory path sends its control messages on it).
What a client adds (READ, batches) is client/tcp.py; what only a member sends
(FREE, HOLD, REPORT, INVENTORY, EVICTIONS, COPY) is kvpool/net/tcp_link.py.
"""

import asyncio
import functools
import json
import ssl

from ..protocol import wire
from ..security.auth import Credential, handshake
from ..protocol.cluster_layout import parse_hostport
from ..errors import ProtocolError, UnavailableError
from .netutil import ConnectAttempt, open_socket
from ..security.tls_socket import TlsSocket, handshake as tls_handshake
from .tcp_connection import Connection

DEFAULT_CONNECT_TIMEOUT = 3.0
_WRITE, _HELLO = wire.Op.WRITE, wire.Op.HELLO


class NodeConnections:
    """Connections to storage nodes over TCP. They open lazily, one per node address, and are
    shared by every coroutine on the event loop that first used them."""

    def __init__(self, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, credential: Credential | None = None,
                 tls: ssl.SSLContext | None = None):
        self.connect_timeout = connect_timeout
        self.credential = credential  # proved to each node as a connection opens (kvpool/security/auth.py)
        self.tls = tls  # a client context: connections are TLS (kvpool/security/tls_socket.py), nodes checked against it
        self._connections: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._closed = False

    async def _connection(self, address: str) -> Connection:
        connection = self._connections.get(address)
        if connection is not None:
            return connection
        if self._closed:
            raise UnavailableError("transport is closed")
        # Concurrent first calls to a node share one connect attempt.
        opening = self._connecting.get(address)
        if opening is None:
            opening = asyncio.ensure_future(self._open(address))
            self._connecting[address] = opening
            opening.add_done_callback(functools.partial(self._opened, address))
        return await asyncio.shield(opening)

    async def _open(self, address: str) -> Connection:
        try:
            host, port = parse_hostport(address)
        except ValueError as exc:
            raise UnavailableError(f"bad node address {address!r}: {exc}") from None
        # refused, unreachable: a node that is down fails fast
        with ConnectAttempt(f"node {address}", UnavailableError, self.connect_timeout) as attempt:
            async with asyncio.timeout(self.connect_timeout):
                sock = attempt.sock = await open_socket(host, port)
                if self.tls is not None:
                    sock = attempt.sock = TlsSocket(sock, self.tls, server_side=False, server_hostname=host)
                    await tls_handshake(sock)
                await handshake(sock, self.credential, f"node {address}")
        if self._closed:
            sock.close()
            raise UnavailableError("transport is closed")
        connection = Connection(self, address, sock)
        self._connections[address] = connection
        return connection

    def _opened(self, address: str, opening: asyncio.Future) -> None:
        if self._connecting.get(address) is opening:
            del self._connecting[address]

    def forget(self, connection: Connection) -> None:
        """A connection that closed: the next request to its node opens a new one."""
        if self._connections.get(connection.address) is connection:
            del self._connections[connection.address]

    async def connection(self, address: str) -> Connection:
        """The open connection to a node (other transports send their control messages on it)."""
        return await self._connection(address)

    async def write(self, address, key, generation, data, checksum, options=None, term=0) -> None:
        connection = await self._connection(address)
        await connection.request(_WRITE, key, generation, term, len(data), checksum, payload=data, options=options)

    async def hello(self, address: str) -> dict:
        """The node's id, instance, host id and the transports it offers (wire.Op.HELLO)."""
        return await self._json(address, _HELLO, dict)

    async def _json(self, address: str, op: int, kind: type, arg: int = 0):
        connection = await self._connection(address)
        body = await connection.request(op, b"", 0, arg, 0)
        try:
            value = json.loads(body)
        except ValueError as exc:
            raise ProtocolError(f"node {address}: {wire.Op(op).name} reply is not JSON: {exc}") from None
        if not isinstance(value, kind):
            raise ProtocolError(f"node {address}: {wire.Op(op).name} reply is a JSON {type(value).__name__}, "
                                f"expected {kind.__name__}")
        return value

    async def close(self) -> None:
        self._closed = True
        openings = list(self._connecting.values())  # a caller past its deadline may have left one going
        for opening in openings:
            opening.cancel()
        connections = list(self._connections.values())
        for connection in connections:
            connection.fail("transport closed")
        await asyncio.gather(*openings, *(c.reader for c in connections), return_exceptions=True)
