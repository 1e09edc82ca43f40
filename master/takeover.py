"""A new leader's start: the placement record checked against what the nodes really hold.

The record says where each object was placed; the nodes' inventories say what
survived. What a node holds wins: a recorded replica its node does not list is
dropped (an object left with none is removed, and its record deleted), and what a
node holds that the record lacks is adopted or freed by the table's usual
inventory rule (ObjectTable.adopt_inventory). A node that does not answer keeps
its recorded replicas; reads there fail over, and its next restart re-adopts.
"""

import asyncio
import logging

from .node_io import NodeIO
from .objects import ObjectTable

log = logging.getLogger(__name__)

ATTEMPTS = 3
RETRY_DELAY = 0.3


async def _inventory(node_io: NodeIO, address: str, timeout: float) -> list | None:
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return await node_io.inventory(address, timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried, then the node's recorded replicas are kept
            if attempt == ATTEMPTS:
                log.warning("no INVENTORY from %s (%s: %s); keeping its recorded replicas", address,
                            type(exc).__name__, exc)
                return None
            await asyncio.sleep(RETRY_DELAY)
    return None


def apply_inventory(table: ObjectTable, node_id: str, instance: str, entries: list) -> int:
    """Adopt a node's inventory and drop the replicas the table places there that it lacks;
    returns how many replicas were dropped."""
    table.adopt_inventory(node_id, instance, entries)
    node = table.nodes.get(node_id)
    if node is None or node.instance != instance:
        return 0
    held = set()
    for entry in entries:
        try:
            held.add((str(entry["key"]), int(entry["generation"])))
        except (KeyError, TypeError, ValueError):
            continue
    dropped = 0
    for generation, key in list(node.versions.items()):
        version = table.lookup(key)
        if version is not None and version.generation == generation and (key, generation) not in held:
            table.drop_replica(key, generation, node_id)
            dropped += 1
    return dropped


async def reconcile(table: ObjectTable, node_io: NodeIO, nodes: list[tuple[str, str, str]],
                    timeout: float) -> None:
    """Check the table against the inventories of `nodes` ((node_id, instance, address) each)."""
    async def one(node_id: str, instance: str, address: str) -> None:
        entries = await _inventory(node_io, address, timeout)
        if entries is None:
            return
        dropped = apply_inventory(table, node_id, instance, entries)
        node_io.submit_frees(table.take_frees())
        if dropped:
            log.info("node %s no longer holds %d recorded replicas", node_id, dropped)

    await asyncio.gather(*(one(*node) for node in nodes))
