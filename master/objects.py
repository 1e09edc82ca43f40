"""The master's object table: which version of each key is visible, which nodes hold it,
and how full every node is believed to be.

Pure bookkeeping: no I/O. Every method runs to completion on the event loop, so
the table needs no locks. Nodes place objects inside themselves; the master
only names nodes. What it knows of a node's usage is the node's last REPORT plus
the bytes of puts it sent there since, which that report could not yet show.

Whatever releases a replica (overwrite, remove, revoke, reclaim, expiry, a
rejected inventory entry) queues a FreeOrder; the owner drains them with
take_frees() and tells the nodes (best effort: a node checks (key, generation)
before freeing anything, so a late order is harmless).
"""

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpool.protocol.cluster_layout import NodeRecord
from kvpool.errors import KeyNotFoundError
from kvpool.protocol.inventory import DRAM_BIT, SSD_BIT, Columns, Entry
from kvpool.protocol.wire import WriteFlag

from .version_store import VersionStore
from .versions import DRAM, NO_OPTIONS, PINS, SSD, TIERS, ObjectVersion, PutOptions, Replica  # noqa: F401
from .placement import MostFreeSpace, PlacementPolicy
from .puts import MAX_REPLICAS, PendingPut, Puts

@dataclass(frozen=True)
class FreeOrder:
    """A replica the master gave up: its node should forget (key, generation)."""

    address: str
    key: bytes
    generation: int


@dataclass
class Dropped:
    """What losing (or restarting) a node cost."""

    node_id: str
    removed: list[str] = field(default_factory=list)  # committed keys whose last replica was there
    revoked: list[str] = field(default_factory=list)  # pending puts that had a target there


@dataclass
class Adopted:
    """The outcome of matching a node's inventory against the table."""

    node_id: str
    adopted: list[str] = field(default_factory=list)   # replicas added back to known versions
    created: list[str] = field(default_factory=list)   # keys the master did not know, now committed
    rejected: list[str] = field(default_factory=list)  # entries the node was told to free


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    removes: int = 0
    reclaimed_puts: int = 0
    expired: int = 0           # objects dropped because their ttl passed
    evicted_replicas: int = 0  # replicas dropped because their node reported evicting them
    evicted_objects: int = 0   # objects removed because their last replica was evicted
    adopted: int = 0           # replicas taken back from a node's inventory
    reports: int = 0
    repairs_done: int = 0      # replicas copied to a new node to restore an object's target
    repair_bytes: int = 0


class NodeState:
    """A registered storage node: identity, tier capacities, and what it last reported."""

    def __init__(self, record: NodeRecord):
        self.node_id = record.node_id
        self.instance = record.instance
        self.address = record.address
        self.transports = list(record.transports)
        self.capacity = {name: tier.capacity for name, tier in record.tiers.items() if tier.capacity > 0}
        self.zone = record.zone
        self.draining = False  # no new placement; its objects are copied elsewhere, then freed here
        self.reported: dict[str, dict] = {}  # tier -> that tier's block of the last REPORT
        # Keys whose committed version has a copy here, so dropping or draining the node touches
        # only its own objects (a set: ~30 bytes a copy where a generation -> key dict took ~80).
        self.keys: set[str] = set()
        # Bytes the last REPORT cannot show yet: pending puts (generation -> tier, size, key), and
        # puts committed after that report was asked for (with the table sequence of the commit),
        # with running sums per tier: placement reads them for every put.
        self.pending: dict[int, tuple[str, int, str]] = {}
        self._unreported: deque[tuple[int, str, int]] = deque()
        self._pending_bytes: dict[str, int] = {}
        self._unreported_bytes: dict[str, int] = {}
        self._unreported_objects: dict[str, int] = {}

    def reserve(self, generation: int, tier: str, size: int, key: str) -> None:
        """A pending put placed here."""
        self.pending[generation] = (tier, size, key)
        self._pending_bytes[tier] = self._pending_bytes.get(tier, 0) + size

    def unreserve(self, generation: int) -> None:
        """A pending put placed here ended (committed, revoked, evicted); unknown ones are a no-op."""
        entry = self.pending.pop(generation, None)
        if entry is not None:
            self._pending_bytes[entry[0]] -= entry[1]

    def landed(self, seq: int, tier: str, size: int) -> None:
        """A replica committed here at table sequence `seq`, which REPORTs asked for before it cannot show."""
        self._unreported.append((seq, tier, size))
        self._unreported_bytes[tier] = self._unreported_bytes.get(tier, 0) + size
        self._unreported_objects[tier] = self._unreported_objects.get(tier, 0) + 1

    def reported_up_to(self, mark: int) -> None:
        """A REPORT asked for at `mark` arrived: it shows every replica committed up to there."""
        while self._unreported and self._unreported[0][0] <= mark:
            _, tier, size = self._unreported.popleft()
            self._unreported_bytes[tier] -= size
            self._unreported_objects[tier] -= 1

    def used(self, tier: str) -> int:
        return int(self.reported.get(tier, {}).get("used", 0))

    def estimated_use(self, tier: str) -> tuple[int, int]:
        """(objects, bytes) in a tier: the last REPORT plus puts committed since, so a put
        shows at once. Bytes are capped at the capacity: the node has been making room
        (demoting, evicting) since that report too."""
        reported = self.reported.get(tier, {})
        objects = int(reported.get("objects") or 0) + self._unreported_objects.get(tier, 0)
        used = self.used(tier) + self._unreported_bytes.get(tier, 0)
        return objects, min(used, self.capacity.get(tier, used))

    def reserved(self, tier: str) -> int:
        return self._pending_bytes.get(tier, 0) + self._unreported_bytes.get(tier, 0)

    def free_bytes(self, tier: str) -> int:
        """Capacity minus reported use minus bytes sent since; may be negative (the node evicts)."""
        # Inlined used() and reserved(): every placement asks this of every node.
        capacity = self._capacity.get(tier)
        if capacity is None:
            return 0
        reported = self.reported.get(tier)
        used = int(reported.get("used", 0)) if reported else 0
        return capacity - used - self._pending_bytes.get(tier, 0) - self._unreported_bytes.get(tier, 0)

    @property
    def capacity(self) -> dict[str, int]:
        return self._capacity

    @capacity.setter
    def capacity(self, tiers: dict[str, int]) -> None:
        self._capacity = tiers
        self.largest_tier = max(tiers.values(), default=0)  # read by every placement


class ObjectTable(Puts):
    def __init__(self, *, placement: PlacementPolicy | None = None, put_timeout: float = 30.0,
                 max_object_size: int | None = None, clock: Callable[[], float] = time.monotonic,
                 first_generation: int | None = None, max_replicas: int = MAX_REPLICAS):
        self.placement = placement or MostFreeSpace()
        self.put_timeout = put_timeout
        self.max_replicas = max_replicas
        self._max_object_size = max_object_size
        self._clock = clock
        # Seeded from the wall clock so a restarted master never hands out a generation
        # a node may still hold from before.
        self._next_generation = time.time_ns() if first_generation is None else first_generation
        self._seq = itertools.count(1)  # orders commits against REPORT requests
        self._last_seq = 0
        self.nodes: dict[str, NodeState] = {}
        # Can track changed keys for whoever follows the table (track_changes); off until one does.
        self._committed = VersionStore()
        self._pending: dict[str, PendingPut] = {}
        self._bytes = 0  # sum of committed sizes
        self._frees: list[FreeOrder] = []
        self.counters = Counters()
        # Keys that may have fewer live copies than their target (repair.py checks and clears).
        self.repair_keys: set[str] = set()
        self._replica_sets: dict = {}  # (node ids, tier) -> replicas placed there; dropped as nodes change

    def reset(self) -> None:
        """Forget every node, object and pending put (a deposed leader's table may be stale; the next
        term rebuilds it from the nodes' inventories). The generation counter and the counters go on,
        so no generation is ever handed out twice."""
        self.nodes = {}
        tracking = self._committed.tracking
        self._committed = VersionStore()
        self._committed.tracking = tracking
        self._pending = {}
        self._bytes = 0
        self._frees = []
        self.repair_keys = set()
        self._replica_sets = {}

    def _new_generation(self) -> int:
        generation = self._next_generation
        self._next_generation += 1
        return generation

    # ----- membership -----

    def upsert_node(self, record: NodeRecord) -> Dropped | None:
        """Add a node, or refresh one; a new instance of a known node lost what it held
        (until its inventory gives some of it back)."""
        self._replica_sets = {}  # an address may change
        node = self.nodes.get(record.node_id)
        if node is not None and node.instance == record.instance:
            node.address = record.address
            node.transports = list(record.transports)
            node.capacity = {name: t.capacity for name, t in record.tiers.items() if t.capacity > 0}
            node.zone = record.zone
            return None
        dropped = self.drop_node(record.node_id) if node is not None else None
        self.nodes[record.node_id] = NodeState(record)
        self.nodes[record.node_id].draining = node is not None and node.draining  # a restart does not undo a drain
        return dropped

    def drop_node(self, node_id: str) -> Dropped:
        """Forget a node and every replica on it; unknown nodes are a no-op."""
        self._replica_sets = {}
        dropped = Dropped(node_id)
        node = self.nodes.pop(node_id, None)
        if node is None:
            return dropped
        for generation, (_, _, key) in node.pending.items():
            pending = self._pending.get(key)
            if pending is not None and pending.version.generation == generation:
                # The client cannot finish writing to a node that is gone.
                del self._pending[key]
                dropped.revoked.append(key)
                self._release_pending(pending.version)
        dropped.removed, kept, gone_bytes = self._committed.without_node(node_id, node.keys)
        self._bytes -= gone_bytes
        self.repair_keys.update(kept)  # a lost node is a failure: its copies are made again
        return dropped

    def _drop_replica(self, key: str, generation: int, node_id: str) -> bool:
        """Take one node's replica off a committed version; True if that removed the object."""
        version = self._committed.get(key)
        if version is None or version.generation != generation:
            return False
        survivors = tuple(r for r in version.replicas if r.node_id != node_id)
        if len(survivors) == len(version.replicas):
            return False
        node = self.nodes.get(node_id)
        if node is not None:
            node.keys.discard(key)
        if survivors:
            self._committed[key] = version._replace(replicas=survivors)
            return False
        del self._committed[key]
        self._bytes -= version.size
        return True

    # ----- what nodes tell the master -----

    def report_mark(self) -> int:
        """Taken just before asking a node for a REPORT: commits up to here are in its answer."""
        return self._last_seq

    def apply_report(self, node_id: str, instance: str, report: dict, mark: int) -> list[str]:
        """Take in one REPORT (asked for at `mark`): usage per tier, and drop the replicas the
        node evicted. Returns the keys that lost their last replica. A report from an instance
        that is no longer registered is ignored."""
        node = self.nodes.get(node_id)
        if node is None or node.instance != instance:
            return []
        tiers = report.get("tiers") or {}
        node.reported = {name: dict(stats) for name, stats in tiers.items() if isinstance(stats, dict)}
        node.reported_up_to(mark)
        self.counters.reports += 1
        return self._apply_evicted(node, report.get("evicted"))

    def apply_evictions(self, node_id: str, instance: str, evicted) -> list[str]:
        """Drop the replicas a node says it evicted ([key, generation] each, from REPORT or
        EVICTIONS); returns the keys that lost their last replica. Ignored from an instance
        no longer registered."""
        node = self.nodes.get(node_id)
        if node is None or node.instance != instance:
            return []
        return self._apply_evicted(node, evicted)

    def _apply_evicted(self, node: NodeState, evicted) -> list[str]:
        removed = []
        for entry in evicted or ():
            try:
                key, generation = str(entry[0]), int(entry[1])
            except (TypeError, ValueError, IndexError):
                continue
            if self._evicted(node, key, generation):
                removed.append(key)
        return removed

    def _evicted(self, node: NodeState, key: str, generation: int) -> bool:
        pending = self._pending.get(key)
        if pending is not None and pending.version.generation == generation:
            # Evicted before PutEnd: that target no longer counts; put_end decides if any is left.
            version = pending.version
            pending.version = version._replace(replicas=tuple(r for r in version.replicas
                                                              if r.node_id != node.node_id))
            node.unreserve(generation)
            self.counters.evicted_replicas += 1
            return False
        version = self._committed.get(key)
        if version is None or version.generation != generation:
            return False
        self.counters.evicted_replicas += 1
        if self._drop_replica(key, generation, node.node_id):
            self.counters.evicted_objects += 1
            return True
        self._accept_loss(key)
        return False

    def _accept_loss(self, key: str) -> None:
        """A node chose to drop a copy (eviction, not failure): the object keeps one copy fewer
        rather than being repaired back onto a node that is short of room."""
        version = self._committed[key]
        if version.target_replicas > 1:
            self._committed[key] = version._replace(target_replicas=version.target_replicas - 1)

    def drop_replica(self, key: str, generation: int, node_id: str) -> bool:
        """The node said it does not hold (key, generation): forget that replica.
        True if the object is gone as a result."""
        removed = self._drop_replica(key, generation, node_id)
        if removed:
            self.counters.evicted_objects += 1
        elif key in self._committed:
            self._accept_loss(key)
        return removed

    def adopt_inventory(self, node_id: str, instance: str, entries: list) -> Adopted:
        """Match what a (re)started node still holds against the table.

        The nodes are the record of what was committed (a new leader starts from their
        inventories alone), so an entry is taken back when the master has that key
        committed at the same generation (and size and checksum), does not know the key
        at all, or knows only an older generation (the newer complete version wins and
        the older one is freed). Anything else is stale and the node is told to free it.
        """
        outcome = Adopted(node_id)
        node = self.nodes.get(node_id)
        if node is None or node.instance != instance:
            return outcome
        now = self._clock()
        committed, pending, held = self._committed, self._pending, node.keys
        dram_replica = (Replica(node_id, node.address, DRAM),)
        ssd_replica = (Replica(node_id, node.address, SSD),)
        for entry in entries:
            key, generation, size, checksum = entry.key, entry.generation, entry.size, entry.checksum
            version = committed.get(key)
            if version is not None and version.expired(now):
                self._expire_object_if_due(key)
                version = None
            if version is None or version.generation < generation:
                if key in pending:
                    self._frees.append(FreeOrder(node.address, key.encode(), generation))
                    outcome.rejected.append(key)
                    continue
                if version is not None:  # its copies are let go before the newer one's are noted
                    self._bytes -= version.size
                    self._release_committed(version)
                replicas = dram_replica if entry.in_dram else ssd_replica
                if entry.flags or entry.ttl_ms:
                    committed[key] = self._version_from_inventory(entry, replicas, now)
                else:  # the common case, without building a version to pack
                    committed.add_plain(key, generation, checksum, size, replicas)
                self._bytes += size
                if generation >= self._next_generation:
                    self._next_generation = generation + 1
                held.add(key)
                outcome.created.append(key)
            elif version.generation == generation and version.size == size and version.checksum == checksum:
                if all(r.node_id != node_id for r in version.replicas):
                    replicas = version.replicas + (dram_replica if entry.in_dram else ssd_replica)
                    # Each copy found was placed on purpose: the object keeps at least that many.
                    committed[key] = version._replace(replicas=replicas,
                                                      target_replicas=max(version.target_replicas, len(replicas)))
                    held.add(key)
                outcome.adopted.append(key)
            else:
                self._frees.append(FreeOrder(node.address, key.encode(), generation))
                outcome.rejected.append(key)
        self.counters.adopted += len(outcome.adopted) + len(outcome.created)
        return outcome

    def adopt_columns(self, node_id: str, instance: str, columns: Columns) -> Adopted:
        """adopt_inventory of one slice of an INVENTORY reply. Entries for keys the table does not
        know, without options or ttl (what a new leader mostly sees), are taken in bulk; the rest
        one by one by the same rule."""
        outcome = Adopted(node_id)
        node = self.nodes.get(node_id)
        if node is None or node.instance != instance:
            return outcome
        keys, records = columns
        if not keys:
            return outcome
        distinct = set(keys)
        if len(distinct) != len(keys):  # a key at two generations (an overwrite in flight): one by one
            return self.adopt_inventory(node_id, instance, columns.entries())
        taken = distinct.intersection(self._committed.keys())
        if self._pending:
            taken.update(distinct.intersection(self._pending))
        bulk = (records["flags"] == 0) & (records["ttl_ms"] == 0)
        if taken:
            bulk &= np.fromiter((k not in taken for k in keys), dtype=bool, count=len(keys))
        tiers = records["tiers"]
        in_dram = ((tiers & DRAM_BIT) != 0) | ((tiers & SSD_BIT) == 0)
        every = bool(bulk.all())
        for tier, chosen in ((DRAM, bulk & in_dram), (SSD, bulk & ~in_dram)):
            if every and bool(chosen.all()):
                chosen_keys, chosen_records = keys, records
            else:
                where = np.flatnonzero(chosen)
                if not len(where):
                    continue
                chosen_keys, chosen_records = [keys[i] for i in where.tolist()], records[where]
            generations = chosen_records["generation"]
            self._committed.add_plain_many(chosen_keys, generations, chosen_records["checksum"],
                                           chosen_records["size"], (Replica(node_id, node.address, tier),))
            node.keys.update(chosen_keys)
            self._bytes += int(chosen_records["size"].sum())
            self._next_generation = max(self._next_generation, int(generations.max()) + 1)
            outcome.created += chosen_keys
        self.counters.adopted += len(outcome.created)
        if not every:
            where = np.flatnonzero(~bulk).tolist()
            rest = self.adopt_inventory(node_id, instance,
                                        Columns([keys[i] for i in where], records[where]).entries())
            outcome.adopted += rest.adopted
            outcome.created += rest.created
            outcome.rejected += rest.rejected
        return outcome

    @staticmethod
    def _version_from_inventory(entry: Entry, replicas: tuple[Replica, ...], now: float) -> ObjectVersion:
        flags = entry.flags
        options = PutOptions(tier=SSD if flags & WriteFlag.PREFER_SSD else None,
                             pin="hard" if flags & WriteFlag.HARD_PIN else "none")
        return ObjectVersion(entry.key, entry.size, entry.checksum, entry.generation, replicas, options=options,
                             compressed=bool(flags & WriteFlag.COMPRESSED),
                             raw_size=entry.raw_size or entry.size,
                             expires_at=now + entry.ttl_ms / 1000 if entry.ttl_ms > 0 else None)

    # ----- puts -----

    @property
    def max_object_size(self) -> int:
        """The largest tier of any node, or the configured limit if that is smaller."""
        largest = max((n.largest_tier for n in self.nodes.values()), default=0)
        if self._max_object_size is not None:
            return min(self._max_object_size, largest)
        return largest

    # ----- object ttl -----

    def _expire_object_if_due(self, key: str) -> bool:
        """Drop `key` if its ttl has passed; True if it did."""
        expires_at = self._committed.expiring.get(key)
        if expires_at is None or expires_at > self._clock():
            return False
        version = self._committed[key]
        del self._committed[key]
        self._bytes -= version.size
        self.counters.expired += 1
        self._release_committed(version)
        return True

    def drop_expired(self) -> list[str]:
        """Drop every committed object past its ttl; returns their keys."""
        now = self._clock()
        keys = [k for k, expires_at in self._committed.expiring.items() if expires_at <= now]
        for key in keys:
            self._expire_object_if_due(key)
        return keys

    # ----- reads and removes -----

    def get(self, key: str) -> ObjectVersion:
        self._expire_object_if_due(key)
        version = self._committed.get(key)
        if version is None:
            self.counters.misses += 1
            raise KeyNotFoundError(f"{key!r} not found")
        self.counters.hits += 1
        return version

    def lookup(self, key: str) -> ObjectVersion | None:
        """The live committed version, without counting a hit or miss."""
        self._expire_object_if_due(key)
        return self._committed.get(key)

    def exists(self, key: str) -> bool:
        self._expire_object_if_due(key)
        return key in self._committed

    def remove(self, key: str) -> None:
        """Drop the committed version of `key` (a pending put of it is left alone)."""
        self._expire_object_if_due(key)
        version = self._committed.pop(key, None)
        if version is None:
            raise KeyNotFoundError(f"{key!r} not found")
        self._bytes -= version.size
        self.counters.removes += 1
        self._release_committed(version)

    def remove_by_prefix(self, prefix: str) -> int:
        """Remove every live committed key starting with `prefix`; returns how many."""
        keys = [k for k in self._committed if k.startswith(prefix)]
        removed = 0
        for key in keys:
            if not self._expire_object_if_due(key):
                self.remove(key)
                removed += 1
        return removed

    def _release_pending(self, version: ObjectVersion) -> None:
        """Tell the nodes of a pending put's targets to forget it (nodes gone or already told are skipped)."""
        raw_key = version.key.encode()
        for r in version.replicas:
            node = self.nodes.get(r.node_id)
            if node is not None and version.generation in node.pending:
                node.unreserve(version.generation)
                self._frees.append(FreeOrder(r.address, raw_key, version.generation))

    def _release_committed(self, version: ObjectVersion) -> None:
        """Tell the nodes of a committed version's replicas to forget it (nodes gone or already told are
        skipped). Called before any newer version of the key is noted on its nodes, so a node's key
        still stands for this version."""
        raw_key = version.key.encode()
        for r in version.replicas:
            node = self.nodes.get(r.node_id)
            if node is not None and version.key in node.keys:
                node.keys.discard(version.key)
                self._frees.append(FreeOrder(r.address, raw_key, version.generation))

    def take_frees(self) -> list[FreeOrder]:
        """The replicas released since the last call, for the nodes to forget."""
        frees, self._frees = self._frees, []
        return frees

    # ----- change tracking, for whoever follows the table -----

    def track_changes(self, on: bool = True) -> None:
        """Start (or stop) marking the keys whose committed version changes, for take_changed_keys()."""
        self._committed.tracking = on

    def take_changed_keys(self, limit: int | None = None) -> list[str]:
        """Keys whose committed version changed (committed, replaced, removed, re-placed) since the last call."""
        return self._committed.take_changed(limit)

    @property
    def has_changes(self) -> bool:
        return self._committed.has_changes

    def take_appeared_and_gone(self) -> tuple[list[str], list[str]]:
        """Keys committed since the last take that were absent before, and keys gone that were present
        (what the key feed reports); a key only replaced or re-placed is in neither."""
        return self._committed.take_appeared_and_gone()

    def committed_keys(self, prefix: str = "") -> list[str]:
        """Every committed key starting with `prefix` (one not yet dropped after its ttl included)."""
        return [key for key in self._committed if key.startswith(prefix)]

    # ----- accounting -----

    @property
    def object_count(self) -> int:
        return len(self._committed)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def objects_on(self, node_id: str) -> int:
        """Committed replicas on one node."""
        return len(self.nodes[node_id].keys)

    # ----- replication: what repair and drain need -----

    def live_count(self, version: ObjectVersion) -> int:
        """Copies that count towards the target: on registered nodes that are not draining."""
        return sum(1 for r in version.replicas
                   if (node := self.nodes.get(r.node_id)) is not None and not node.draining)

    def under_replicated(self) -> int:
        """Objects with fewer live copies than their target (repair may not find room for all)."""
        count = 0
        for key in self.repair_keys:
            version = self._committed.get(key)
            if version is not None and self.live_count(version) < version.target_replicas:
                count += 1
        return count

    def start_drain(self, node_id: str) -> int:
        """Stop placing on a node and have repair copy its objects elsewhere; returns how many
        objects have a copy there."""
        node = self.nodes.get(node_id)
        if node is None:
            raise KeyNotFoundError(f"no storage node {node_id!r}")
        node.draining = True
        keys = list(node.keys)
        self.repair_keys.update(keys)
        for key in keys:
            self.settle_drain(key)
        return len(keys)

    def add_replica(self, key: str, generation: int, node_id: str, tier: str) -> bool:
        """A repair copied (key, generation) to node_id. False (and the copy is freed) when that
        version is no longer current or the node is gone or restarted."""
        node = self.nodes.get(node_id)
        version = self._committed.get(key)
        if node is None or version is None or version.generation != generation:
            if node is not None:
                self._frees.append(FreeOrder(node.address, key.encode(), generation))
            return False
        if any(r.node_id == node_id for r in version.replicas):
            return True
        self._committed[key] = version._replace(replicas=version.replicas + (Replica(node_id, node.address, tier),))
        node.keys.add(key)
        seq = self._last_seq = next(self._seq)
        node.landed(seq, tier, version.size)
        self.counters.repairs_done += 1
        self.counters.repair_bytes += version.size
        self.settle_drain(key)
        return True

    def settle_drain(self, key: str) -> None:
        """Once an object has its target of copies off draining nodes, free its draining copies."""
        version = self._committed.get(key)
        if version is None or self.live_count(version) < version.target_replicas:
            return
        leaving = tuple(r for r in version.replicas
                        if (node := self.nodes.get(r.node_id)) is not None and node.draining)
        if not leaving:
            return
        self._committed[key] = version._replace(replicas=tuple(r for r in version.replicas if r not in leaving))
        self._release_committed(version._replace(replicas=leaving))
