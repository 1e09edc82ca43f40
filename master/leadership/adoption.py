"""Takes back what a storage node still holds when it (re)joins.

A node that restarts keeps its SSD objects, and after a master restart every
node holds objects the new master never heard of. On each new node instance the
master asks for its INVENTORY and lets the object table adopt what matches;
the rest is freed on the node.
"""

import asyncio
import logging

from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.objects import ObjectTable
from kvpool.master.leadership.takeover import adopt_in_slices

log = logging.getLogger(__name__)

INVENTORY_TIMEOUT = 10.0
ATTEMPTS = 3
RETRY_DELAY = 0.5


class Adopter:
    def __init__(self, table: ObjectTable, node_io: NodeIO, timeout: float = INVENTORY_TIMEOUT,
                 retry_delay: float = RETRY_DELAY):
        self._table = table
        self._node_io = node_io
        self._timeout = timeout
        self._retry_delay = retry_delay
        self._tasks: set[asyncio.Task] = set()
        self._initial_done = asyncio.Event()  # a new leader's first inventories are all adopted
        self._initial_done.set()

    def initial_adoption(self, running: bool) -> None:
        """A new leader adopts its first inventories in the background (takeover.py) while `running`:
        an inventory asked again meanwhile waits until they are adopted, so no entry of a node's first
        inventory is adopted after (over) what its second one says."""
        if running:
            self._initial_done.clear()
        else:
            self._initial_done.set()

    def node_joined(self, node_id: str, instance: str, address: str) -> None:
        """Called for every new node instance; the inventory is fetched in the background."""
        task = asyncio.get_running_loop().create_task(self._adopt(node_id, instance, address),
                                                      name=f"inventory {node_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _current(self, node_id: str, instance: str) -> bool:
        node = self._table.nodes.get(node_id)
        return node is not None and node.instance == instance

    async def _adopt(self, node_id: str, instance: str, address: str) -> None:
        # A node this leader stopped REPORTing (silent, lapsed or dropped) is trusted again only once the
        # grant its last REPORTs gave has surely ended: no REPORT still under way can then renew it.
        await self._node_io.grants.until_ended(address)
        await self._initial_done.wait()  # bounded: the background adoption yields only between slices
        attempt = 0
        while True:  # until it answers, or leaves (its lease ends) or restarts: it serves no read before
            attempt += 1
            if not self._current(node_id, instance):
                return  # gone or restarted again meanwhile: that instance gets its own turn
            try:
                # FREEs still owed go first, so the inventory no longer lists what they free.
                if not await self._node_io.settle(address, self._timeout):
                    raise TimeoutError("FREEs owed to it not confirmed")
                entries = await self._node_io.inventory(address, self._timeout, node_id)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried: what it holds stays unknown meanwhile
                if attempt == ATTEMPTS:
                    log.warning("no INVENTORY from node %s at %s after %d attempts (%s: %s); what it holds "
                                "stays unknown to the master until it answers", node_id, address, ATTEMPTS,
                                type(exc).__name__, exc)
                await asyncio.sleep(self._retry_delay)
        outcome = await adopt_in_slices(self._table, self._node_io, node_id, instance, entries)
        if entries:
            log.info("node %s inventory: %d replicas taken back, %d objects re-created, %d stale entries freed",
                     node_id, len(outcome.adopted), len(outcome.created), len(outcome.rejected))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
