"""A new leader's start: the object table rebuilt from what the nodes hold.

There is no per-object record in etcd: every node keeps, for each object it
stores, its key, generation, size, checksum and options, and a put is
acknowledged only after its nodes stored it. So the nodes' inventories, asked
for all at once, are the record: the table adopts them by its inventory rule
(ObjectTable.adopt_inventory: for a key held at several generations the newest
wins and the older copies are freed). The INVENTORY request carries the new
leader's term, so from that moment the node refuses WRITEs placed by an older
leader: whatever such a leader placed before is in the inventory, whatever it
places after never lands.
"""

import asyncio
import logging

from kvpool.protocol import inventory

from .node_io import NodeIO
from .inventory_match import Adopted
from .objects import ObjectTable

log = logging.getLogger(__name__)

ATTEMPTS = 3
RETRY_DELAY = 0.3
SLICE = 5_000  # entries adopted between yields: the election lease is refreshed on this loop too


async def _inventory(node_io: NodeIO, address: str, timeout: float) -> inventory.Reply | None:
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return await node_io.inventory(address, timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried, then left to the background adopter
            if attempt == ATTEMPTS:
                log.warning("no INVENTORY from %s (%s: %s); its objects are taken back when it answers",
                            address, type(exc).__name__, exc)
                return None
            await asyncio.sleep(RETRY_DELAY)
    return None


async def adopt_in_slices(table: ObjectTable, node_io: NodeIO, node_id: str, instance: str,
                          reply: inventory.Reply) -> Adopted:
    """The table adopts a node's inventory a slice at a time, decoded just before, yielding to the
    loop in between: a node may hold millions of objects, the election lease is refreshed on this
    loop, and entries decoded all at once would leave the heap fragmented for good. FREEs of what
    was rejected are sent as they come."""
    outcome = Adopted(node_id)
    for columns in reply.column_slices(SLICE):
        part = table.adopt_columns(node_id, instance, columns)
        outcome.adopted += part.adopted
        outcome.created += part.created
        outcome.rejected += part.rejected
        node_io.submit_frees(table.take_frees())
        await asyncio.sleep(0)
    node = table.nodes.get(node_id)
    if node is not None and node.instance == instance:
        node.reconciled = True  # REPORTs may renew its read grant once it owes no FREE (node_reports.py)
        node_io.grants.reconciled(node.address)
    return outcome


async def rebuild(table: ObjectTable, node_io: NodeIO, nodes: list[tuple[str, str, str]],
                  timeout: float) -> list[tuple[str, str, str]]:
    """Adopt the inventories of `nodes` ((node_id, instance, address) each), all asked at once;
    returns the nodes that did not answer."""
    silent = []

    async def one(node_id: str, instance: str, address: str) -> None:
        entries = await _inventory(node_io, address, timeout)
        if entries is None:
            silent.append((node_id, instance, address))
            return
        outcome = await adopt_in_slices(table, node_io, node_id, instance, entries)
        if outcome.rejected:
            log.info("node %s holds %d stale versions; freeing them", node_id, len(outcome.rejected))

    await asyncio.gather(*(one(*node) for node in nodes))
    return silent
