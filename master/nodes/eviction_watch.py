"""Keeps an EVICTIONS request outstanding at every storage node, so the table drops an evicted
replica a round trip after the node dropped it instead of at its next REPORT.

Until the master knows, lookups call the object present (the engine then loads a block that is
gone) and a put of the key again is refused as existing. EVICTIONS waits on the node until it
has something to tell, so it holds up its connection: the watch has a TcpLink of its own.
REPORT still carries whatever this watch did not take (e.g. while its connection is down).
"""

import asyncio
import logging

from kvpool.protocol import wire
from kvpool.net.tcp_link import TcpLink

from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.objects import ObjectTable

log = logging.getLogger(__name__)

INTERVAL = 0.5  # seconds between looks at the node list, and the pause after a failed request


class EvictionWatch:
    def __init__(self, table: ObjectTable, node_io: NodeIO, interval: float = INTERVAL):
        self._table = table
        self._node_io = node_io
        self.interval = interval
        self._link = TcpLink(credential=node_io.credential, tls=node_io.tls)
        self._watches: dict[tuple[str, str], asyncio.Task] = {}  # (node id, instance) -> its watch

    async def run(self) -> None:
        try:
            while True:
                self._sync()
                await asyncio.sleep(self.interval)
        finally:
            tasks = list(self._watches.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._link.close()

    def _sync(self) -> None:
        """A watch for every registered node instance, and none for one that is gone."""
        nodes = {(n.node_id, n.instance): n.address for n in self._table.nodes.values() if not n.shared}
        for ident in [i for i in self._watches if i not in nodes]:
            self._watches.pop(ident).cancel()
        for ident, address in nodes.items():
            if ident not in self._watches:
                self._watches[ident] = asyncio.create_task(self._watch(*ident, address),
                                                           name=f"evictions-{ident[0]}")

    async def _watch(self, node_id: str, instance: str, address: str) -> None:
        timeout = wire.EVICTIONS_WAIT + max(1.0, 2 * self.interval)
        while True:
            try:
                async with asyncio.timeout(timeout):
                    reply = await self._link.evictions(address, self._node_io.term)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the node's REPORT still carries them; try again
                self._node_io.failed(address, "EVICTIONS", exc)
                await asyncio.sleep(self.interval)
                continue
            removed = self._table.apply_evictions(node_id, instance, reply.get("evicted"))
            self._node_io.submit_frees(self._table.take_frees())
            if removed:
                log.debug("node %s evicted the last replica of %d objects", node_id, len(removed))
