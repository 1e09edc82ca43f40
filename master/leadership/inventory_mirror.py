"""A standby's copy of every node's inventory, kept current while it follows, so that its takeover reads only
what changed since (INVENTORY_CHANGES) instead of every node's whole INVENTORY.

A new leader serves once it knows every node's inventory (takeover.py); read whole at takeover that costs the
nodes' replies, the transfer and the indexing of every entry: at 10,000,000 objects over two nodes the read took
7.1 s on top of the election lease. A standby reads each node's inventory once, then every MIRROR_INTERVAL the
slots changed since (nothing is fenced: term 0), each reply a layer with its keys hashed and sorted ahead
(unadopted.NodeEntries), a newer layer masking the entries of the slots it changed in the older ones. At
takeover, the new leader asks each node for what changed since its copy with its term (which fences older
leaders, as INVENTORY does), so the copy plus that last layer is exactly what the node holds, and hands the layers
to the table. Disputes between layers (a key at two generations) are found ahead too, pair by pair.

The nodes stay the authority: a copy is used only for the same node instance and the same numbering (series);
otherwise, or for a node the copy does not know, or a node of a release without INVENTORY_CHANGES, the takeover
reads the whole INVENTORY as before.
"""

import asyncio
import logging
import time

import numpy as np

from kvpool.errors import ProtocolError
from kvpool.master.table.unadopted import NodeEntries, clashes
from kvpool.protocol import cluster_layout, inventory
from kvpool.protocol.cluster_layout import NodeRecord

log = logging.getLogger(__name__)

MIRROR_INTERVAL = 1.0  # seconds between a standby's reads of what changed on each node
FETCH_TIMEOUT = 10.0
MERGE_AT = 8  # layers after the first merged into one past this (on the standby: the node is not asked)
# Once the changes since the first layer are half as many as its entries, the node's inventory is read whole
# again (a whole read holds the node's loop about 0.15 s per million objects).


class Layer:
    """One INVENTORY_CHANGES reply: its entries (hashed for lookups), their slots, which of them a newer layer
    changed, and when it was read (the TTLs in it count from then)."""

    def __init__(self, changes: inventory.Changes, ttl_from: float):
        """`ttl_from`: when it was read (the TTLs in it count from then)."""
        self.entries = NodeEntries(changes.reply)
        self.slots = changes.slots
        self.changed = len(changes.slots) + len(changes.gone)  # slots it changed, those now empty included
        self.superseded = np.zeros(len(self.slots), dtype=bool)
        self.ttl_from = ttl_from

    @classmethod
    def merged(cls, layers: list["Layer"]) -> "Layer":
        """One layer of what `layers` (oldest first) hold and no later one of them superseded, as if read
        when the newest was (the older TTLs counted down to then; those run out left out)."""
        ttl_from = layers[-1].ttl_from
        keys, records, slots = [], [], []
        for layer in layers:  # the layers are left as they are: a merge given up on changes nothing
            positions = np.flatnonzero(~layer.superseded)
            columns = layer.entries.reply.columns_at(positions)  # copies
            alive = ~inventory.count_down(columns.records["ttl_ms"], int((ttl_from - layer.ttl_from) * 1000))
            keys += [key for key, keep in zip(columns.keys, alive.tolist()) if keep]
            records.append(columns.records[alive])
            slots.append(layer.slots[positions][alive])
        raw = [key.encode("utf-8", "surrogateescape") for key in keys]
        body = inventory.encode_records(np.concatenate(records), b"".join(raw))
        out = cls.__new__(cls)
        out.entries = NodeEntries(inventory.Reply(bytearray(body)))
        out.slots = np.concatenate(slots)
        out.changed = sum(layer.changed for layer in layers)
        out.superseded = np.zeros(len(out.slots), dtype=bool)
        out.ttl_from = ttl_from
        return out

    def supersede(self, changed: np.ndarray, top: int) -> None:
        """Mask the entries of the slots marked in `changed` (a boolean array over slots below `top`)."""
        inside = self.slots < top
        self.superseded[inside] |= changed[self.slots[inside]]


class NodeCopy:
    """One node's inventory as a standby holds it: its layers, the series and change number they reach."""

    def __init__(self, node_id: str, instance: str, address: str):
        self.node_id, self.instance, self.address = node_id, instance, address
        self.series = ""
        self.reached = 0
        self.layers: list[Layer] = []

    def since(self) -> int:
        """The change number to ask from: 0 (read it whole) when there is nothing yet, or the changes since the
        first layer outgrew it."""
        if not self.layers:
            return 0
        later = sum(layer.changed for layer in self.layers[1:])
        return 0 if 2 * later > len(self.layers[0].slots) else self.reached

    def merge(self) -> None:
        """Past MERGE_AT layers, the layers after the first become one (each lookup searches every layer)."""
        if len(self.layers) > MERGE_AT:
            self.layers[1:] = [Layer.merged(self.layers[1:])]

    def apply(self, changes: inventory.Changes, since: int, layer: Layer) -> bool:
        """Add a reply asked `since` (`layer`: made of it); False (nothing changed here) when it cannot follow
        this copy: another numbering than the layers'. A reply asked from 0 replaces them all."""
        if since == 0:
            self.layers = []
        elif changes.series != self.series or changes.changes < self.reached:
            return False
        self.series = changes.series
        if self.layers:
            touched = np.concatenate([changes.slots, changes.gone])
            if len(touched):
                top = int(touched.max()) + 1
                changed = np.zeros(top, dtype=bool)
                changed[touched] = True
                for older in self.layers:
                    older.supersede(changed, top)
        self.layers.append(layer)
        self.reached = changes.changes
        return True

    def masks(self, now: float) -> list[tuple[NodeEntries, np.ndarray]]:
        """Each layer's entries with the mask of those not to adopt: superseded, or past their TTL by `now`
        (their remaining lifetimes are made shorter by the time since they were read)."""
        out = []
        for layer in self.layers:
            ran_out = layer.entries.reply.age(int((now - layer.ttl_from) * 1000))
            layer.ttl_from = now  # aged to now: asked again later, only the time since counts
            out.append((layer.entries, layer.superseded | ran_out))
        return out


def find_disputes(entries: list[NodeEntries], known: dict) -> dict:
    """clashes() of every pair of `entries` by their idents: those in `known` taken from it, the rest found
    (pairs of entries no longer held are left out)."""
    found = {}
    for i, one in enumerate(entries):
        for other in entries[i + 1:]:
            pair = (one.ident, other.ident)
            found[pair] = known[pair] if pair in known else clashes(one, other)
    return found


class InventoryMirror:
    """Keeps a NodeCopy of every registered node while this master follows (run()); take() hands one to a
    takeover. `link`: a TcpLink proving the member role."""

    def __init__(self, etcd, cluster: str, link, interval: float = MIRROR_INTERVAL):
        self._etcd, self._prefix, self._link, self._interval = etcd, cluster_layout.nodes_prefix(cluster), link, interval
        self._copies: dict[str, NodeCopy] = {}
        self._unsupported: set[str] = set()  # instances that answered INVENTORY_CHANGES as an unknown op
        self.disputes: dict[tuple[int, int], np.ndarray] = {}  # clashes() by pair of layers' entries (idents)
        self._task: asyncio.Task | None = None

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd unreachable: the copies wait (a takeover reads whole)
                log.debug("inventory copies not refreshed (%s: %s)", type(exc).__name__, exc)
            await asyncio.sleep(self._interval)

    async def refresh(self) -> None:
        """Read what changed on every registered node (those of the shared tier and older releases aside)."""
        records = []
        for kv in await self._etcd.get_prefix(self._prefix):
            try:
                records.append(NodeRecord.from_json(kv.value))
            except (ValueError, TypeError, KeyError):
                continue
        present = {record.node_id for record in records}
        for gone in set(self._copies) - present:
            del self._copies[gone]
        await asyncio.gather(*(self._refresh_node(record) for record in records
                               if record.instance not in self._unsupported))
        entries = [layer.entries for copy in self._copies.values() for layer in copy.layers]
        self.disputes = await asyncio.to_thread(find_disputes, entries, self.disputes)

    async def _refresh_node(self, record: NodeRecord) -> None:
        copy = self._copies.get(record.node_id)
        if copy is None or copy.instance != record.instance or copy.address != record.address:
            copy = self._copies[record.node_id] = NodeCopy(record.node_id, record.instance, record.address)
        since = copy.since()
        try:
            changes = await asyncio.wait_for(self._link.inventory_changes(record.address, since), FETCH_TIMEOUT)
        except ProtocolError as exc:
            if "unknown op" in str(exc).lower():
                self._unsupported.add(record.instance)
                log.info("node %s does not know INVENTORY_CHANGES (an older release): no copy of its inventory "
                         "is kept, a takeover reads it whole", record.node_id)
            self._copies.pop(record.node_id, None)
            return
        except Exception:  # noqa: BLE001 - unreachable now: the copy waits (the takeover asks what changed since)
            return
        layer = await asyncio.to_thread(Layer, changes, time.time())  # hashing a million keys takes ~0.15 s
        if self._copies.get(record.node_id) is not copy or not copy.apply(changes, since, layer):
            self._copies.pop(record.node_id, None)
            return
        if len(copy.layers) > MERGE_AT:
            merging = copy.layers[1:]
            merged = await asyncio.to_thread(Layer.merged, merging)
            if self._copies.get(record.node_id) is copy and copy.layers[1:] == merging:
                copy.layers[1:] = [merged]
        elif since == 0:
            log.info("node %s's inventory read whole for this standby's copy: %d objects", record.node_id,
                     len(changes.reply))

    def take(self, node_id: str, instance: str, address: str) -> NodeCopy | None:
        """The copy of that node instance at that address, if there is one (no longer kept here)."""
        copy = self._copies.pop(node_id, None)
        if copy is None or copy.instance != instance or copy.address != address or not copy.layers:
            return None
        return copy

    def clear(self) -> None:
        self._copies.clear()
        self.disputes = {}

    def start(self) -> None:
        """Follow the nodes (run()) in a task of its own, until stop()."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="inventory-copies")

    async def stop(self) -> None:
        """The refreshes end; the copies stay for a takeover to take."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
