"""The master's object table: which version of each key is visible, where its bytes are,
and how much of every node's segment is taken.

Pure bookkeeping: no I/O. Every method runs to completion on the event loop, so
the table needs no locks. Whatever releases extents (overwrite, remove, revoke,
reclaim, a lost node) queues FreeOrders; the owner drains them with
take_frees() and tells the nodes to forget those extents (best effort: a node
checks (key, generation) before freeing anything, so a late order is harmless).
"""

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from kvpool.allocator import ExtentAllocator, align_up
from kvpool.cluster_layout import NodeRecord
from kvpool.errors import (
    InvalidArgumentError, KeyExistsError, KeyNotFoundError, NoSpaceError, PutExpiredError,
    ValueTooLargeError,
)

from .placement import MostFreeSpace, PlacementPolicy

DRAM = "dram"  # the only tier objects are placed in for now


@dataclass(frozen=True)
class Replica:
    node_id: str
    address: str  # HOST:PORT of the node's data port
    tier: str
    offset: int
    length: int  # the object's size; the allocator may reserve a little more


@dataclass(frozen=True)
class ObjectVersion:
    key: str
    size: int
    checksum: int
    generation: int
    replicas: tuple[Replica, ...]


@dataclass(frozen=True)
class FreeOrder:
    """An extent the master took back: its node should forget (key, generation) there."""

    address: str
    key: bytes
    generation: int
    offset: int


@dataclass
class Dropped:
    """What losing (or restarting) a node cost."""

    node_id: str
    removed: list[str] = field(default_factory=list)  # committed keys whose last replica was there
    revoked: list[str] = field(default_factory=list)  # pending puts that had a target there


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    removes: int = 0
    reclaimed_puts: int = 0


@dataclass
class _Pending:
    version: ObjectVersion
    deadline: float


class NodeState:
    """A registered storage node: its identity and one allocator per tier."""

    def __init__(self, record: NodeRecord, alignment: int):
        self.node_id = record.node_id
        self.instance = record.instance
        self.address = record.address
        self.transports = list(record.transports)
        self.tiers = {name: ExtentAllocator(tier.capacity, alignment) for name, tier in record.tiers.items()}
        # generation -> key of every version (pending or committed) with an extent here,
        # so dropping the node touches only its own objects.
        self.versions: dict[int, str] = {}

    @property
    def free_bytes(self) -> int:
        dram = self.tiers.get(DRAM)
        return dram.free_bytes if dram else 0

    @property
    def largest_free(self) -> int:
        dram = self.tiers.get(DRAM)
        return dram.largest_free if dram else 0


class ObjectTable:
    def __init__(self, *, placement: PlacementPolicy | None = None, put_timeout: float = 30.0,
                 max_object_size: int | None = None, clock: Callable[[], float] = time.monotonic,
                 first_generation: int | None = None, alignment: int = 64):
        self.placement = placement or MostFreeSpace()
        self.put_timeout = put_timeout
        self._max_object_size = max_object_size
        self._clock = clock
        self._alignment = alignment
        # Seeded from the wall clock so a restarted master never hands out a generation
        # a node may still hold from before.
        self._generations = itertools.count(time.time_ns() if first_generation is None else first_generation)
        self.nodes: dict[str, NodeState] = {}
        self._committed: dict[str, ObjectVersion] = {}
        self._pending: dict[str, _Pending] = {}
        self._bytes = 0  # sum of committed sizes
        self._frees: list[FreeOrder] = []
        self.counters = Counters()

    # ----- membership -----

    def upsert_node(self, record: NodeRecord) -> Dropped | None:
        """Add a node, or refresh one; a new instance of a known node lost all its data."""
        node = self.nodes.get(record.node_id)
        if node is not None and node.instance == record.instance:
            node.address = record.address
            node.transports = list(record.transports)
            return None
        dropped = self.drop_node(record.node_id) if node is not None else None
        self.nodes[record.node_id] = NodeState(record, self._alignment)
        return dropped

    def drop_node(self, node_id: str) -> Dropped:
        """Forget a node and every replica on it; unknown nodes are a no-op."""
        dropped = Dropped(node_id)
        node = self.nodes.pop(node_id, None)
        if node is None:
            return dropped
        for generation, key in node.versions.items():
            pending = self._pending.get(key)
            if pending is not None and pending.version.generation == generation:
                # The client cannot finish writing to a node that is gone.
                del self._pending[key]
                dropped.revoked.append(key)
                self._release(pending.version)
                continue
            version = self._committed.get(key)
            if version is None or version.generation != generation:
                continue
            survivors = tuple(r for r in version.replicas if r.node_id != node_id)
            if survivors:
                self._committed[key] = replace(version, replicas=survivors)
            else:
                del self._committed[key]
                self._bytes -= version.size
                dropped.removed.append(key)
        return dropped

    # ----- puts -----

    @property
    def max_object_size(self) -> int:
        """The configured limit, else the largest DRAM segment of any node."""
        if self._max_object_size is not None:
            return self._max_object_size
        return max((n.tiers[DRAM].capacity for n in self.nodes.values() if DRAM in n.tiers), default=0)

    def put_start(self, key: str, size: int, checksum: int, overwrite: bool = False,
                  replicas: int = 1) -> ObjectVersion:
        """Reserve extents for a new version of `key`; it stays invisible until put_end."""
        if size < 0:
            raise InvalidArgumentError(f"size must not be negative, got {size}")
        self._expire_if_due(key)
        if key in self._pending:
            raise KeyExistsError(f"put of {key!r} in progress")
        if key in self._committed and not overwrite:
            raise KeyExistsError(f"{key!r} already exists")
        placed: tuple[Replica, ...] = ()
        if size > 0:
            placed = self._place(size, max(replicas, 1))
        version = ObjectVersion(key, size, checksum, next(self._generations), placed)
        for r in placed:
            self.nodes[r.node_id].versions[version.generation] = key
        self._pending[key] = _Pending(version, self._clock() + self.put_timeout)
        return version

    def _place(self, size: int, count: int) -> tuple[Replica, ...]:
        if not self.nodes:
            raise NoSpaceError("no storage nodes")
        limit = self.max_object_size
        if size > limit:
            raise ValueTooLargeError(f"object of {size} bytes exceeds the maximum of {limit}")
        candidates = [n for n in self.nodes.values() if DRAM in n.tiers]
        need = align_up(size, self._alignment)
        chosen = self.placement.choose(candidates, need, count)
        placed = []
        for node in chosen:
            offset = node.tiers[DRAM].allocate(size)
            if offset is None:
                continue  # a policy that misjudged the fit; the others may still do
            placed.append(Replica(node.node_id, node.address, DRAM, offset, size))
        if not placed:
            raise NoSpaceError(f"no storage node has room for {size} bytes")
        return tuple(placed)

    def put_end(self, key: str, generation: int) -> ObjectVersion:
        """Make the pending version visible; frees whatever version it replaces."""
        pending = self._take_pending(key, generation)
        old = self._committed.get(key)
        self._committed[key] = pending.version
        self._bytes += pending.version.size
        self.counters.puts += 1
        if old is not None:
            self._bytes -= old.size
            self._release(old)
        return pending.version

    def put_revoke(self, key: str, generation: int) -> None:
        """Abandon a pending put; the previous version (if any) stays."""
        self._release(self._take_pending(key, generation).version)

    def _take_pending(self, key: str, generation: int) -> _Pending:
        self._expire_if_due(key)
        pending = self._pending.get(key)
        if pending is None or pending.version.generation != generation:
            raise PutExpiredError(f"no pending put of {key!r} with generation {generation} "
                                  f"(never started, revoked, or reclaimed after {self.put_timeout:g}s)")
        del self._pending[key]
        return pending

    def reclaim_expired(self) -> list[str]:
        """Revoke every pending put past its deadline; returns their keys."""
        now = self._clock()
        keys = [k for k, p in self._pending.items() if p.deadline <= now]
        for key in keys:
            self._release(self._pending.pop(key).version)
        self.counters.reclaimed_puts += len(keys)
        return keys

    def _expire_if_due(self, key: str) -> None:
        # The periodic reclaim may not have run yet; the outcome must not depend on it.
        pending = self._pending.get(key)
        if pending is not None and pending.deadline <= self._clock():
            del self._pending[key]
            self.counters.reclaimed_puts += 1
            self._release(pending.version)

    # ----- reads and removes -----

    def get(self, key: str) -> ObjectVersion:
        version = self._committed.get(key)
        if version is None:
            self.counters.misses += 1
            raise KeyNotFoundError(f"{key!r} not found")
        self.counters.hits += 1
        return version

    def exists(self, key: str) -> bool:
        return key in self._committed

    def remove(self, key: str) -> None:
        """Drop the committed version of `key` (a pending put of it is left alone)."""
        version = self._committed.pop(key, None)
        if version is None:
            raise KeyNotFoundError(f"{key!r} not found")
        self._bytes -= version.size
        self.counters.removes += 1
        self._release(version)

    def remove_by_prefix(self, prefix: str) -> int:
        """Remove every committed key starting with `prefix`; returns how many."""
        keys = [k for k in self._committed if k.startswith(prefix)]
        for key in keys:
            self.remove(key)
        return len(keys)

    def _release(self, version: ObjectVersion) -> None:
        """Give a version's extents back to their allocators (nodes already gone are skipped)."""
        raw_key = version.key.encode()
        for r in version.replicas:
            node = self.nodes.get(r.node_id)
            if node is None or node.versions.pop(version.generation, None) is None:
                continue
            node.tiers[r.tier].free(r.offset)
            self._frees.append(FreeOrder(r.address, raw_key, version.generation, r.offset))

    def take_frees(self) -> list[FreeOrder]:
        """The extents released since the last call, for the nodes to forget."""
        frees, self._frees = self._frees, []
        return frees

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

    def objects_on(self, node_id: str) -> dict[str, int]:
        """Committed replicas per tier on one node."""
        counts: dict[str, int] = {}
        for generation, key in self.nodes[node_id].versions.items():
            version = self._committed.get(key)
            if version is None or version.generation != generation:
                continue
            for r in version.replicas:
                if r.node_id == node_id:
                    counts[r.tier] = counts.get(r.tier, 0) + 1
        return counts
