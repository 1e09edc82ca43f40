"""What a (re)started node still holds, matched against the master's object table.

A part of ObjectTable (objects.py), working on the table's Ledger and its
PendingPuts. The nodes are the record of what was committed (a new leader
starts from their inventories alone: takeover.py), so an entry is taken back
when the master has that key committed at the same generation (and size and
checksum), does not know the key at all, or knows only an older generation (the
newer complete version wins and the older one is freed). Anything else is stale
and the node is told to free it.
"""

from dataclasses import dataclass, field

import numpy as np

from kvpool.protocol.inventory import DRAM_BIT, SSD_BIT, Columns, Entry
from kvpool.protocol.wire import WriteFlag

from kvpool.master.table.ledger import Ledger
from kvpool.master.table.node_state import NodeState
from kvpool.master.table.pending_puts import PendingPuts
from kvpool.master.table.shared_tier import with_copy
from kvpool.master.table.versions import DRAM, SHARED, SSD, ObjectVersion, PutOptions, Replica


@dataclass
class Adopted:
    """The outcome of matching a node's inventory against the table."""

    node_id: str
    adopted: list[str] = field(default_factory=list)   # replicas added back to known versions
    created: list[str] = field(default_factory=list)   # keys the master did not know, now committed
    rejected: list[str] = field(default_factory=list)  # entries the node was told to free


class InventoryMatch:
    def __init__(self, ledger: Ledger, pending: PendingPuts):
        self._ledger = ledger
        self._pending = pending

    def adopt_inventory(self, node_id: str, instance: str, entries: list) -> Adopted:
        """Match `entries` (kvpool.protocol.inventory.Entry each) of a node by the rule above."""
        outcome = Adopted(node_id)
        ledger = self._ledger
        node = ledger.nodes.get(node_id)
        if node is None or node.instance != instance:
            return outcome
        now = ledger.clock()
        committed, pending, held = ledger.committed, self._pending, node.keys
        dram_replica = (Replica(node_id, node.address, DRAM),)
        ssd_replica = (Replica(node_id, node.address, SSD),)
        if node.shared:  # the shared tier's scan (takeover.py): one kind of copy
            dram_replica = ssd_replica = self._ledger.shared.replica
        for entry in entries:
            key, generation, size, checksum = entry.key, entry.generation, entry.size, entry.checksum
            version = committed.get(key)
            if version is not None and version.expired(now):
                ledger.expire_if_due(key)
                version = None
            if version is None or version.generation < generation:
                if key in pending:
                    if pending.placed(key, generation):  # a put in flight to a node adopted again
                        continue
                    self._free(node, key, generation)
                    outcome.rejected.append(key)
                    continue
                if version is not None:  # its copies are let go before the newer one's are noted
                    ledger.bytes -= version.size
                    ledger.release_committed(version)
                replicas = dram_replica if entry.in_dram else ssd_replica
                if entry.flags or entry.ttl_ms:
                    committed[key] = _version_from_inventory(entry, replicas, now)
                else:  # the common case, without building a version to pack
                    committed.add_plain(key, generation, checksum, size, replicas)
                ledger.bytes += size
                ledger.generation_seen(generation)
                held.add(key)
                outcome.created.append(key)
            elif version.generation == generation and version.size == size and version.checksum == checksum:
                if all(r.node_id != node_id for r in version.replicas):
                    replicas = with_copy(version.replicas, dram_replica if entry.in_dram else ssd_replica)
                    # Each copy found was placed on purpose: the object keeps at least that many.
                    committed[key] = version._replace(replicas=replicas,
                                                      target_replicas=max(version.target_replicas, len(replicas)))
                    held.add(key)
                outcome.adopted.append(key)
            else:
                self._free(node, key, generation)
                outcome.rejected.append(key)
        ledger.counters.adopted += len(outcome.adopted) + len(outcome.created)
        return outcome

    def _free(self, node: NodeState, key: str, generation: int) -> None:
        """A rejected entry goes from where it was found (the shared tier's scan: its file)."""
        if node.shared:
            self._ledger.free_shared(key.encode(), generation)
        else:
            self._ledger.free(node.address, key.encode(), generation)

    def adopt_columns(self, node_id: str, instance: str, columns: Columns) -> Adopted:
        """adopt_inventory of one slice of an INVENTORY reply. Entries for keys the table does not
        know, without options or ttl (what a new leader mostly sees), are taken in bulk; the rest
        one by one by the same rule."""
        outcome = Adopted(node_id)
        ledger = self._ledger
        node = ledger.nodes.get(node_id)
        if node is None or node.instance != instance:
            return outcome
        keys, records = columns
        if not keys:
            return outcome
        distinct = set(keys)
        if len(distinct) != len(keys):  # a key at two generations (an overwrite in flight): one by one
            return self.adopt_inventory(node_id, instance, columns.entries())
        taken = distinct.intersection(ledger.committed.keys())
        if len(self._pending):
            taken.update(distinct.intersection(self._pending.keys()))
        bulk = (records["flags"] == 0) & (records["ttl_ms"] == 0)
        if taken:
            bulk &= np.fromiter((k not in taken for k in keys), dtype=bool, count=len(keys))
        tiers = records["tiers"]
        in_dram = ((tiers & DRAM_BIT) != 0) | ((tiers & SSD_BIT) == 0)
        every = bool(bulk.all())
        groups = ((SHARED, bulk),) if node.shared else ((DRAM, bulk & in_dram), (SSD, bulk & ~in_dram))
        for tier, chosen in groups:
            if every and bool(chosen.all()):
                chosen_keys, chosen_records = keys, records
            else:
                where = np.flatnonzero(chosen)
                if not len(where):
                    continue
                chosen_keys, chosen_records = [keys[i] for i in where.tolist()], records[where]
            generations = chosen_records["generation"]
            replicas = ledger.shared.replica if node.shared else (Replica(node_id, node.address, tier),)
            ledger.committed.add_plain_many(chosen_keys, generations, chosen_records["checksum"],
                                            chosen_records["size"], replicas)
            node.keys.update(chosen_keys)
            ledger.bytes += int(chosen_records["size"].sum())
            ledger.generation_seen(int(generations.max()))
            outcome.created += chosen_keys
        ledger.counters.adopted += len(outcome.created)
        if not every:
            where = np.flatnonzero(~bulk).tolist()
            rest = self.adopt_inventory(node_id, instance,
                                        Columns([keys[i] for i in where], records[where]).entries())
            outcome.adopted += rest.adopted
            outcome.created += rest.created
            outcome.rejected += rest.rejected
        return outcome


def _version_from_inventory(entry: Entry, replicas: tuple[Replica, ...], now: float) -> ObjectVersion:
    flags = entry.flags
    options = PutOptions(tier=SSD if flags & WriteFlag.PREFER_SSD else SHARED if flags & WriteFlag.TO_SHARED else None,
                         pin="hard" if flags & WriteFlag.HARD_PIN else "none")
    return ObjectVersion(entry.key, entry.size, entry.checksum, entry.generation, replicas, options=options,
                         compressed=bool(flags & WriteFlag.COMPRESSED),
                         raw_size=entry.raw_size or entry.size,
                         expires_at=now + entry.ttl_ms / 1000 if entry.ttl_ms > 0 else None)
