"""A new leader's start: the object table rebuilt from what the nodes hold, while it serves.

There is no per-object record in etcd: every node keeps, for each object it
stores, its key, generation, size, checksum and options, and a put is
acknowledged only after its nodes stored it. So the nodes' inventories, asked
for all at once, are the record: the table adopts them by its inventory rule
(ObjectTable.adopt_inventory: for a key held at several generations the newest
wins and the older copies are freed). The INVENTORY request carries the new
leader's term, so from that moment the node refuses WRITEs placed by an older
leader: whatever such a leader placed before is in the inventory, whatever it
places after never lands. The leader serves as soon as the inventories are in,
and adopts them in the background (unadopted.py: a call naming keys adopts
theirs first); generations it hands out are above every one they hold.
"""

import asyncio
import logging
import time

from kvpool.protocol import inventory

from kvpool.master.leadership.inventory_mirror import Layer
from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.inventory_match import Adopted
from kvpool.master.table.objects import ObjectTable

log = logging.getLogger(__name__)

ATTEMPTS = 3
RETRY_DELAY = 0.3
SLICE = 5_000  # entries adopted between yields: calls are served on this loop in between


async def _inventory(node_io: NodeIO, node_id: str, address: str, timeout: float) -> inventory.Reply | None:
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return await node_io.inventory(address, timeout, node_id)
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
    loop in between: a node may hold millions of objects, calls are served on this loop, and
    entries decoded all at once would leave the heap fragmented for good. FREEs of what
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
    if node is not None and node.instance == instance and not node.shared:
        node.reconciled = True  # REPORTs may renew its read grant once it owes no FREE (node_reports.py)
        node_io.grants.reconciled(node.address)
    return outcome


async def _changes_since(table: ObjectTable, node_io: NodeIO, copy, timeout: float) -> bool:
    """Complete a standby's copy of a node's inventory (inventory_mirror.NodeCopy) with what changed since,
    and give it to the table; False (nothing given) when the node cannot say (another release, another
    numbering, no answer): its whole INVENTORY is read instead."""
    try:
        changes = await node_io.inventory_changes(copy.address, copy.reached, timeout)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - read whole instead
        log.info("node %s did not say what changed since the standby's copy (%s: %s); reading its inventory",
                 copy.node_id, type(exc).__name__, exc)
        return False
    if not copy.apply(changes, copy.reached, Layer(changes, time.time())):
        return False
    table.take_entries(copy.node_id, copy.instance, copy.masks(time.time()))
    log.info("node %s: the standby's copy of its inventory, and %d slots changed since", copy.node_id,
             copy.layers[-1].changed)
    return True


async def inventories(table: ObjectTable, node_io: NodeIO, nodes: list[tuple[str, str, str]], timeout: float,
                      mirror=None):
    """The INVENTORY of each of `nodes` ((node_id, instance, address) each), all asked at once, given
    to the table as each comes (ObjectTable.take_inventory: indexed while the others are built); of a
    node `mirror` (inventory_mirror.InventoryMirror) holds a copy of, only what changed since:
    ([(node_id, instance) of each that answered], [the nodes that did not])."""
    answered, silent = [], []

    async def one(node_id: str, instance: str, address: str) -> None:
        copy = mirror.take(node_id, instance, address) if mirror is not None else None
        if copy is not None and await _changes_since(table, node_io, copy, timeout):
            answered.append((node_id, instance))
            return
        reply = await _inventory(node_io, node_id, address, timeout)
        if reply is None:
            silent.append((node_id, instance, address))
        else:
            table.take_inventory(node_id, instance, reply)
            answered.append((node_id, instance))

    await asyncio.gather(*(one(*node) for node in nodes))
    return answered, silent


def start_adopting(table: ObjectTable, node_io: NodeIO, answered: list, known_disputes: dict | None = None) -> int:
    """Adopt the inventories of `answered` while serving (ObjectTable.start_adopting); returns the entries
    left to adopt_rest. The nodes that answered may be REPORTed (their read grants renewed) from now:
    every key held at more than one generation is adopted already, so none of them holds a version
    another holds a newer one of, and a version this term replaces is adopted first and freed, its
    FREE owed (no REPORT until confirmed)."""
    left = table.start_adopting(known_disputes)
    node_io.submit_frees(table.take_frees())
    for node_id, instance in answered:
        node = table.nodes.get(node_id)
        if node is not None and node.instance == instance and not node.shared:
            node.reconciled = True
            node_io.grants.reconciled(node.address)
    return left


async def adopt_rest(table: ObjectTable, node_io: NodeIO) -> None:
    """Adopt what start_adopting left, a slice at a time, yielding to the loop between slices (calls
    naming keys adopt theirs first, whenever they come)."""
    loop = asyncio.get_running_loop()
    started, left, rejected = loop.time(), table.adopting, 0
    while (outcome := table.adopt_next(SLICE)) is not None:
        rejected += len(outcome.rejected)
        node_io.submit_frees(table.take_frees())
        await asyncio.sleep(0)
    log.info("adopted the nodes' inventories in %.2fs: %d entries left when serving began, %d objects now; "
             "%d stale versions freed", loop.time() - started, left, table.object_count, rejected)
