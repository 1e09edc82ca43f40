"""The requests only a member of the cluster sends storage nodes, over TCP.

The master (FREE, HOLD, REPORT, EVICTIONS, INVENTORY, COPY: master/nodes/node_io.py,
eviction_watch.py, repair.py) and storage nodes (the WRITE of a COPY to another
node: storenode/background/replica_push.py) reach nodes through a TcpLink; a node serves these
only to a peer that proved the member role. The connections and the
requests any peer sends are kvpool/net/node_connections.py's; a client's data
transport (client/tcp.py) is built on those alone.
"""

from ..protocol import inventory, wire
from ..errors import InvalidArgumentError, ProtocolError
from .node_connections import NodeConnections

_FREE, _HOLD = wire.Op.FREE, wire.Op.HOLD
_REPORT, _INVENTORY, _COPY = wire.Op.REPORT, wire.Op.INVENTORY, wire.Op.COPY
_EVICTIONS, _INVENTORY_CHANGES = wire.Op.EVICTIONS, wire.Op.INVENTORY_CHANGES
_FREE_SHARED, _SHARED_SCAN = wire.Op.FREE_SHARED, wire.Op.SHARED_SCAN


class TcpLink(NodeConnections):
    """A member's requests to storage nodes, on connections of its own."""

    async def free(self, address, key, generation) -> bool:
        (result,) = await self.free_many(address, [(key, generation)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def free_many(self, address: str, items: list[tuple[bytes, int]], shared: bool = False) -> list:
        """FREE each (key, generation) at the node at `address` (`shared`: the shared tier's file, which
        that node mounts), pipelined in one send; per item True/False (freed / not held) or the exception
        it was refused with."""
        connection = await self._connection(address)
        return await connection.batch(_FREE_SHARED if shared else _FREE,
                                      [(key, generation, b"", 0, None) for key, generation in items])

    async def shared_scan(self, address: str) -> inventory.Reply:
        """What the shared tier's manifests hold, read by the node at `address` (which mounts it)."""
        connection = await self._connection(address)
        body = await connection.request(_SHARED_SCAN, b"", 0, 0, 0)
        try:
            return inventory.Reply(body)
        except ProtocolError as exc:
            raise ProtocolError(f"node {address}'s shared scan: {exc}") from None

    async def hold(self, address, key, generation, ms) -> bool:
        if ms < 0:
            raise InvalidArgumentError(f"hold of {ms} ms: must be >= 0")
        connection = await self._connection(address)
        return await connection.request(_HOLD, key, generation, int(ms), 0)

    async def copy(self, address: str, key: bytes, generation: int, destination: str) -> None:
        """Have the node at `address` write its (key, generation) to the node at `destination`."""
        target = destination.encode()
        if len(target) > wire.MAX_COPY_TARGET:
            raise InvalidArgumentError(f"destination address of {len(target)} bytes")
        connection = await self._connection(address)
        await connection.request(_COPY, key, generation, 0, len(target), payload=target)

    async def report(self, address: str, term: int = 0) -> dict:
        """term: the asking master's leader term; the node then refuses WRITEs of older terms."""
        return await self._json(address, _REPORT, dict, term)

    async def inventory(self, address: str, term: int = 0) -> inventory.Reply:
        """term: as for report (a new leader's INVENTORY fences the leaders before it)."""
        connection = await self._connection(address)
        body = await connection.request(_INVENTORY, b"", 0, term, 0)
        try:
            return inventory.Reply(body)
        except ProtocolError as exc:
            raise ProtocolError(f"node {address}: {exc}") from None

    async def inventory_changes(self, address: str, since: int, term: int = 0) -> "inventory.Changes":
        """What changed in the node's inventory after change number `since` (0: all of it); `term` as for
        inventory (0: a standby's read, which fences nothing)."""
        connection = await self._connection(address)
        body = await connection.request(_INVENTORY_CHANGES, b"", since, term, 0)
        try:
            return inventory.Changes(body)
        except ProtocolError as exc:
            raise ProtocolError(f"node {address}: {exc}") from None

    async def evictions(self, address: str, term: int = 0) -> dict:
        """Waits (up to wire.EVICTIONS_WAIT) for the node to drop objects; it holds up every later
        request on the connection meanwhile, so use a TcpLink that sends nothing else."""
        return await self._json(address, _EVICTIONS, dict, term)

