"""The client's data transport over TCP: the node connections (kvpool/net/node_connections.py:
one pipelined connection per node, WRITE, HELLO) with the READs and the pipelined batches
that client/transport.py asks of a transport, and nothing a client may not send: what only
a member sends nodes is kvpool/net/tcp_link.py's.
"""

from typing import Sequence

from kvpool.security import auth
from kvpool.errors import KvpoolError
from kvpool.net.node_connections import DEFAULT_CONNECT_TIMEOUT, NodeConnections
from kvpool.security.tls import client_files
from kvpool.protocol.wire import Op

from kvpool.client.waiting import LOOP_IO
from kvpool.client.transport import ReadItem, Transport, WriteItem

_WRITE, _READ = Op.WRITE, Op.READ
ENVIRONMENT = object()  # TcpTransport's default credential: the client token from the environment


class TcpTransport(NodeConnections, Transport):
    """Transport over TCP. Connections open lazily, one per node address, and are shared
    by every coroutine on the event loop that first used them."""

    takes_parts = True  # sends from and receives into each part

    def __init__(self, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, credential=ENVIRONMENT, tls=ENVIRONMENT,
                 io=LOOP_IO):
        """credential: what to prove to nodes (kvpool/security/auth.py); tls: kvpool/security/tls.py TlsFiles to connect
        with (None: plain TCP). By default both come from this process's environment. io: how node
        requests wait for their answers (client/waiting.py)."""
        files = client_files() if tls is ENVIRONMENT else tls
        super().__init__(connect_timeout, auth.client_credential() if credential is ENVIRONMENT else credential,
                         files.client_context() if files is not None else None)
        self._io = io

    async def write(self, address, key, generation, data, checksum, options=None, term=0) -> None:
        connection = await self._connection(address)
        await self._io.request(connection, _WRITE, key, generation, term, len(data), checksum, payload=data,
                               options=options)

    async def read_into(self, address, key, generation, buf) -> int:
        connection = await self._connection(address)
        return await self._io.request(connection, _READ, key, generation, 0, len(buf), buf=buf)

    async def write_many(self, address: str, items: Sequence[WriteItem]) -> list:
        return await self._many(address, _WRITE, items)

    async def read_many(self, address: str, items: Sequence[ReadItem]) -> list:
        return await self._many(address, _READ, items)

    async def _many(self, address: str, op: int, items: Sequence) -> list:
        try:
            connection = await self._connection(address)
        except KvpoolError as exc:
            return [type(exc)(str(exc)) for _ in items]
        return await self._io.batch(connection, op, items)
