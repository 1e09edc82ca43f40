"""The shared tier as the master sees it: objects kept in the directory every storage node given
--shared-dir mounts (kvpool/sharedfs), held by the cluster rather than by a node.

The table holds such an object as a copy on a pseudo-node, SHARED_NODE: a NodeState in the ledger's
nodes (so commits, drops, frees and inventories treat it as any copy) that no placement, repair, REPORT
or membership change ever picks (`NodeState.shared`). Its address is that of a live node that mounts the
directory (`servers`): lookups name it, any such node serves the file, and FREEs of shared copies go
to every such node (the first unlinks the file; Ledger.free_shared). Its keys are kept coldest first,
touched by lookups, with their sizes, so the leader alone decides what goes at --shared-capacity (evict).
"""

from collections.abc import Callable, Iterable

from kvpool.protocol import wire
from kvpool.protocol.cluster_layout import SHARED_TIER, NodeRecord

from kvpool.master.table.node_state import NodeState
from kvpool.master.table.versions import SHARED, Replica

SHARED_NODE = "@shared"  # no storage node may take this id (storenode/main.py refuses it)
# How a node's dropped-object entry ([key, generation, how], EVICTIONS and REPORT) says it moved, not lost, it.
MOVED, PROMOTED = wire.MOVED_TO_SHARED, wire.PROMOTED_FROM_SHARED
HIGH, LOW = 0.95, 0.90  # of the capacity: above HIGH the coldest go, down to LOW


def with_copy(replicas: tuple[Replica, ...], copy: tuple[Replica, ...]) -> tuple[Replica, ...]:
    """`replicas` and one more copy, the shared tier's kept last (readers take the first replica)."""
    if copy[0].node_id == SHARED_NODE or not replicas or replicas[-1].node_id != SHARED_NODE:
        return replicas + copy
    return replicas[:-1] + copy + replicas[-1:]


class SharedKeys:
    """The keys with a copy in the shared tier, coldest first, with their sizes: NodeState.keys of the
    pseudo-node (the set methods the ledger calls on a node's keys)."""

    def __init__(self, size_of: Callable[[str], int]):
        self._size_of = size_of
        self._sizes: dict[str, int] = {}  # insertion order = coldness: touch() moves a key to the end
        self.bytes = 0

    def add(self, key: str) -> None:
        if key not in self._sizes:
            size = self._sizes[key] = self._size_of(key)
            self.bytes += size

    def update(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.add(key)

    def discard(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.bytes -= size

    def difference_update(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.discard(key)

    def size(self, key: str) -> int:
        return self._sizes.get(key, 0)

    def touch(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._sizes[key] = size

    def coldest(self) -> Iterable[str]:
        return iter(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __iter__(self):
        return iter(list(self._sizes))

    def __len__(self) -> int:
        return len(self._sizes)


class SharedTier:
    """Which live nodes mount the shared directory, and the pseudo-node holding its objects."""

    def __init__(self, nodes: dict[str, NodeState], size_of: Callable[[str], int]):
        self._nodes = nodes
        self._size_of = size_of
        self.servers: dict[str, str] = {}  # node id -> data address, of live nodes mounting the directory
        self.capacity = 0  # bytes, the largest --shared-capacity a server registered
        self.replica = (Replica(SHARED_NODE, "", SHARED),)  # the copy lookups name, at a server's address

    def reset(self) -> None:
        self.servers.clear()
        self.capacity = 0
        self.replica = (Replica(SHARED_NODE, "", SHARED),)

    @property
    def node(self) -> NodeState | None:
        return self._nodes.get(SHARED_NODE)

    @property
    def keys(self) -> SharedKeys | None:
        node = self.node
        return node.keys if node is not None else None

    @property
    def address(self) -> str:
        """The data address of a node that serves shared objects ("" while none is registered)."""
        return next(iter(self.servers.values()), "")

    def node_seen(self, record: NodeRecord) -> None:
        """A node registered or refreshed: a server of the tier if it mounts the directory."""
        tier = record.tiers.get(SHARED_TIER)
        if tier is None:
            self.node_gone(record.node_id)
            return
        self.servers[record.node_id] = record.address
        self.capacity = max(self.capacity, tier.capacity)
        self._readdress()

    def node_gone(self, node_id: str) -> None:
        if self.servers.pop(node_id, None) is not None:
            self._readdress()

    def _readdress(self) -> None:
        node = self.node
        if node is None:
            node = self._nodes[SHARED_NODE] = NodeState(NodeRecord(SHARED_NODE, SHARED, "", 0))
            node.shared = True
            node.keys = SharedKeys(self._size_of)
        node.address = self.address
        self.replica = (Replica(SHARED_NODE, node.address, SHARED),)

    def victims(self) -> list[str]:
        """Above HIGH of the capacity: the coldest keys whose going brings it down to LOW."""
        keys = self.keys
        if keys is None or not self.capacity or keys.bytes <= HIGH * self.capacity:
            return []
        excess, chosen = keys.bytes - LOW * self.capacity, []
        for key in keys.coldest():
            if excess <= 0:
                break
            chosen.append(key)
            excess -= keys.size(key)
        return chosen
