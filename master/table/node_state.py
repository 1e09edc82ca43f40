"""One registered storage node as the master's object table sees it: identity, tier
capacities, what it last reported, and the bytes sent to it since (which that report
could not show yet). Placement reads these for every put.
"""

from collections import deque

from kvpool.protocol.cluster_layout import SHARED_TIER, NodeRecord


def capacities(record: NodeRecord) -> dict[str, int]:
    """The node's own tiers (the shared directory it mounts is the cluster's: master/table/shared_tier.py)."""
    return {name: tier.capacity for name, tier in record.tiers.items() if tier.capacity > 0 and name != SHARED_TIER}


class NodeState:
    """A registered storage node: identity, tier capacities, and what it last reported."""

    def __init__(self, record: NodeRecord):
        self.node_id = record.node_id
        self.instance = record.instance
        self.address = record.address
        self.transports = list(record.transports)
        self.capacity = capacities(record)
        self.zone = record.zone
        self.draining = False  # no new placement; its objects are copied elsewhere, then freed here
        self.shared = False  # the shared tier's pseudo-node (master/table/shared_tier.py): never placed on, REPORTed
        # or dropped by membership
        self.reported: dict[str, dict] = {}  # tier -> that tier's block of the last REPORT
        self.reports = 0  # REPORTs taken in from this node
        self.version = ""  # its release, as its last REPORT named it
        self.shared_fault = ""  # why it skips the shared tier now, as its last REPORT said ("": it does not)
        self.tenants: dict = {}  # name -> its figures on this node, as the last REPORT gave them
        # Its INVENTORY adopted by this leader since it joined or lost contact: only then is it REPORTed,
        # which lets it serve reads (master/nodes/read_grants.py).
        self.reconciled = False
        # Keys whose committed version has a copy here, so dropping or draining the node touches
        # only its own objects (a set: ~30 bytes a copy where a generation -> key dict took ~80).
        self.keys: set[str] = set()
        # Bytes the last REPORT cannot show yet: pending puts (generation -> tier, size, key), and
        # puts committed after that report was asked for (with the table sequence of the commit),
        # with running sums per tier: placement reads them for every put.
        self.pending: dict[int, tuple[str, int, str]] = {}
        self._unreported: deque[tuple[int, str, int, int]] = deque()  # (seq, tier, bytes, replicas)
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

    def landed(self, seq: int, tier: str, size: int, count: int = 1) -> None:
        """`count` replicas of `size` bytes in all committed here at table sequence `seq`, which REPORTs
        asked for before it cannot show."""
        self._unreported.append((seq, tier, size, count))
        self._unreported_bytes[tier] = self._unreported_bytes.get(tier, 0) + size
        self._unreported_objects[tier] = self._unreported_objects.get(tier, 0) + count

    def reported_up_to(self, mark: int) -> None:
        """A REPORT asked for at `mark` arrived: it shows every replica committed up to there."""
        while self._unreported and self._unreported[0][0] <= mark:
            _, tier, size, count = self._unreported.popleft()
            self._unreported_bytes[tier] -= size
            self._unreported_objects[tier] -= count

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
