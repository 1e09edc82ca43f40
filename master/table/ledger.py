"""What the master's object table holds, shared by its parts (objects.py composes them).

The committed versions, the registered nodes (node_state.py), the sum of committed
sizes, the FREEs owed to nodes, the counters and the generation counter, with the
few steps that keep them consistent with each other (commit a version, discard
one, take one node's copy off, release copies): every part of the table changes
the state through these, so each rule is written once. Pure bookkeeping: no I/O,
no awaits; every method runs to completion on the event loop.

Whatever releases a replica queues a FreeOrder; the owner drains them with
take_frees() and tells the nodes (best effort: a node checks (key, generation)
before freeing anything, so a late order is harmless).
"""

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.master.table.node_state import NodeState
from kvpool.master.table.shared_tier import SharedTier
from kvpool.master.table.version_store import VersionStore
from kvpool.master.table.versions import ObjectVersion


@dataclass(frozen=True)
class FreeOrder:
    """A replica the master gave up: its node should forget (key, generation)."""

    address: str
    key: bytes
    generation: int
    # Whether readers may have been given this version and a newer one (or a remove) replaced it: the answer
    # that replaced it waits until the node confirms the FREE or its read grant ends. A pending put's copy
    # (never named to a reader) is owed the same way, but nobody waits for it.
    replaced: bool = field(default=True, compare=False)
    shared: bool = field(default=False, compare=False)  # the copy is the shared tier's file (sent as FREE_SHARED)


@dataclass
class DroppedHolder:
    """A node dropped while its read grant may last until `until`: the generation it holds of each key."""

    address: str
    generations: dict[str, int]
    until: float


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


class Ledger:
    """The table's state. Public attributes, read (and, for `committed` and `nodes`, changed)
    by the table's parts:

    - clock: the table's monotonic clock (put deadlines, ttls).
    - nodes: node id -> NodeState of every registered node.
    - committed: the visible version of each key (a VersionStore; replaced by reset()).
    - bytes: sum of the committed versions' sizes.
    - counters: what happened, for Stats and metrics.
    - repair_keys: keys that may have fewer live copies than their target (repair.py checks and clears).
    - last_seq: the table sequence of the latest commit (REPORTs are matched against it).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, first_generation: int | None = None):
        self.clock = clock
        # Seeded from the wall clock so a restarted master never hands out a generation
        # a node may still hold from before.
        self._next_generation = time.time_ns() if first_generation is None else first_generation
        self._seq = itertools.count(1)  # orders commits against REPORT requests
        self.last_seq = 0
        self.nodes: dict[str, NodeState] = {}
        # Can track changed keys for whoever follows the table (track_changes); off until one does.
        self.committed = VersionStore()
        self.bytes = 0
        self._frees: list[FreeOrder] = []
        self.counters = Counters()
        self.repair_keys: set[str] = set()
        # Nodes dropped while their read grant may still hold: node id -> DroppedHolder (see still_serving).
        self.dropped_holders: dict[str, DroppedHolder] = {}
        # The shared tier (shared_tier.py): its pseudo-node joins `nodes` once a node mounting it registers.
        self.shared = SharedTier(self.nodes, lambda key: self.committed[key].size)
        self._unsent_shared: list[FreeOrder] = []  # shared FREEs ordered while no node served the tier

    def reset(self) -> None:
        """Forget every node and object. The generation counter and the counters go on, so no
        generation is ever handed out twice."""
        self.nodes.clear()
        tracking = self.committed.tracking
        self.committed = VersionStore()
        self.committed.tracking = tracking
        self.bytes = 0
        self._frees = []
        self.repair_keys.clear()
        self.dropped_holders.clear()
        self.shared.reset()
        self._unsent_shared = []

    # ----- generations and sequence -----

    def new_generation(self) -> int:
        generation = self._next_generation
        self._next_generation += 1
        return generation

    def generation_seen(self, generation: int) -> None:
        """A node holds `generation` (an inventory): never hand it out again."""
        if generation >= self._next_generation:
            self._next_generation = generation + 1

    def next_seq(self) -> int:
        """The sequence number of a commit happening now (NodeState.landed)."""
        seq = self.last_seq = next(self._seq)
        return seq

    # ----- committed versions -----

    def commit(self, key: str, version: ObjectVersion) -> None:
        """Make `version` the visible one: the version it replaces is released first (its copies are let
        go before the new version's are noted), then its copies are noted on their nodes."""
        self.commit_many([key], [version])

    def commit_many(self, keys: list[str], versions: list[ObjectVersion]) -> None:
        """commit() of each key (distinct) with its version, at one table sequence (nothing can ask
        for a REPORT in between)."""
        if self.dropped_holders:
            self._free_on_dropped(keys, versions)
        for old in self.committed.swap_many(keys, versions):
            self.bytes -= old.size
            self.release_committed(old)
        seq = self.last_seq = next(self._seq)  # next_seq()
        landed: dict[tuple[str, str], list] = {}  # (node id, tier) -> [bytes, replicas, keys] landing there
        added = 0
        for key, version in zip(keys, versions):
            size = version.size
            for r in version.replicas:
                there = landed.get((r.node_id, r.tier))
                if there is None:
                    landed[(r.node_id, r.tier)] = [size, 1, [key]]
                else:
                    there[0] += size
                    there[1] += 1
                    there[2].append(key)
            added += size
        nodes = self.nodes
        for (node_id, tier), (size, count, landed_keys) in landed.items():
            node = nodes.get(node_id)
            if node is not None:
                node.landed(seq, tier, size, count)
                node.keys.update(landed_keys)
        self.bytes += added

    def discard(self, key: str) -> ObjectVersion | None:
        """Drop the committed version of `key` and release its copies; None if there was none."""
        if self.dropped_holders:
            self._free_on_dropped([key])
        version = self.committed.pop(key, None)
        if version is not None:
            self.bytes -= version.size
            self.release_committed(version)
        return version

    def expire_if_due(self, key: str) -> bool:
        """Drop `key` if its ttl has passed; True if it did. Reads call it, so the answer never
        depends on whether the periodic sweep ran yet."""
        expires_at = self.committed.expiring.get(key)
        if expires_at is None or expires_at > self.clock():
            return False
        self.discard(key)
        self.counters.expired += 1
        return True

    def drop_copy(self, key: str, generation: int, node_id: str) -> bool | None:
        """drop_copies of one (key, generation)."""
        return self.drop_copies([(key, generation)], node_id)[0]

    def drop_copies(self, evicted: list[tuple[str, int]], node_id: str) -> list[bool | None]:
        """Take one node's copy off each committed (key, generation), in order. Per entry: True if
        that removed the object, False if it stays (other copies, or none was there), None if it is
        not the committed version. Nothing is freed: the node said it no longer holds them."""
        outcomes = self.committed.without_copies(evicted, node_id)
        results = []
        for outcome in outcomes:
            if outcome is None:
                results.append(None)
                continue
            gone, size = outcome
            if gone:
                self.bytes -= size
            results.append(gone)
        node = self.nodes.get(node_id)
        if node is not None:
            node.keys.difference_update([key for (key, _), outcome in zip(evicted, outcomes) if outcome])
        return results

    def live_count(self, version: ObjectVersion) -> int:
        """Copies that count towards the target: on registered nodes that are not draining."""
        nodes = self.nodes
        return sum(1 for r in version.replicas
                   if (node := nodes.get(r.node_id)) is not None and not node.draining)

    # ----- releasing copies -----

    def free(self, address: str, key: bytes, generation: int, replaced: bool = True) -> None:
        """Have the node at `address` forget (key, generation)."""
        self._frees.append(FreeOrder(address, key, generation, replaced))

    def free_shared(self, key: bytes, generation: int, replaced: bool = True) -> None:
        """Have the shared tier's file of (key, generation) go: ordered to every node that mounts the tier,
        since any of them could serve the file, so a replaced version is out of reach once each has confirmed
        it gone or its read grant has ended (kept back while none is registered)."""
        servers = self.shared.servers
        if not servers:
            self._unsent_shared.append(FreeOrder("", key, generation, replaced, True))
            return
        self._frees.extend(FreeOrder(server, key, generation, replaced, True) for server in servers.values())

    def release_pending(self, version: ObjectVersion) -> None:
        """Tell the nodes of a pending put's targets to forget it (nodes gone or already told are skipped)."""
        raw_key = version.key.encode()
        for r in version.replicas:
            node = self.nodes.get(r.node_id)
            if node is not None and version.generation in node.pending:
                node.unreserve(version.generation)
                self._frees.append(FreeOrder(r.address, raw_key, version.generation, replaced=False))

    def release_committed(self, version: ObjectVersion) -> None:
        """Tell the nodes of a committed version's replicas to forget it (nodes gone or already told are
        skipped). Called before any newer version of the key is noted on its nodes, so a node's key
        still stands for this version."""
        raw_key = version.key.encode()
        for r in version.replicas:
            node = self.nodes.get(r.node_id)
            if node is not None and version.key in node.keys:
                node.keys.discard(version.key)
                if node.shared:
                    self.free_shared(raw_key, version.generation)
                else:
                    self._frees.append(FreeOrder(r.address, raw_key, version.generation))

    def still_serving(self, node_id: str, address: str, keys, until: float) -> None:
        """A node is dropped while its read grant may last until `until` (master/nodes/read_grants.py): it may
        still serve what it holds of `keys`. So until then, replacing or removing one of them still
        orders its FREE there (owed until confirmed, and an overwrite waits out the grant as for any
        node that does not confirm)."""
        if until > self.clock():
            self.dropped_holders[node_id] = DroppedHolder(address, self.committed.generations(keys), until)

    def _free_on_dropped(self, keys: list[str], versions=None) -> None:
        now = self.clock()
        for node_id, holder in list(self.dropped_holders.items()):
            if holder.until <= now:
                del self.dropped_holders[node_id]
                continue
            held = holder.generations
            for i, key in enumerate(keys):
                generation = held.get(key)
                if generation is not None and (versions is None or versions[i].generation != generation):
                    del held[key]
                    self._frees.append(FreeOrder(holder.address, key.encode(), generation))

    def take_frees(self) -> list[FreeOrder]:
        """The replicas released since the last call, for the nodes to forget."""
        frees, self._frees = self._frees, []
        if self._unsent_shared and self.shared.servers:  # ordered while no node mounted the tier
            waiting, self._unsent_shared = self._unsent_shared, []
            for order in waiting:
                self.free_shared(order.key, order.generation, order.replaced)
            frees += self._frees
            self._frees = []
        return frees
