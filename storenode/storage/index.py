"""The node's object index: (key, generation) -> where and how each stored object lives."""

import heapq
from dataclasses import dataclass

from kvpool.protocol.wire import WriteFlag

from kvpool.storenode.storage.inventory_columns import InventoryColumns

_HARD_PIN = int(WriteFlag.HARD_PIN)  # plain int: IntFlag arithmetic is slow on the per-request path


@dataclass(slots=True, eq=False)  # identity equality: records go in sets
class ObjectRecord:
    key: bytes
    generation: int
    size: int
    checksum: int
    flags: int = 0
    raw_size: int = 0
    expires_at: float = 0.0      # unix seconds; 0 = no TTL
    soft_pin_until: float = 0.0  # unix seconds
    hold_until: float = 0.0      # unix seconds
    dram: int | None = None      # extent offset of the DRAM copy
    ssd: int | None = None       # extent offset of the SSD copy
    last_access: float = 0.0
    hits: int = 0
    window_start: float = 0.0    # promotion window (policy.count_hit_for_promotion)
    window_hits: int = 0
    refcount: int = 0            # running transfers; nothing is freed or moved while > 0
    live: bool = True            # False once dropped from the index; extents go when refcount is 0
    promoting: bool = False
    slot: int = -1               # its row in the index's InventoryColumns while indexed
    tenant: object = None        # its tenant's TenantUsage (storenode/storage/tenant_usage.py), set by the store

    @property
    def held(self) -> bool:
        """Live, with a copy in this node's DRAM or SSD (not only staged for, or moved to, the shared tier)."""
        return self.live and (self.dram is not None or self.ssd is not None)

    @property
    def hard_pin(self) -> bool:
        return self.flags & _HARD_PIN != 0

    def ttl_ms(self, now: float) -> int:
        """Remaining lifetime in ms (at least 1 while alive); 0 = no TTL."""
        if not self.expires_at:
            return 0
        return max(1, int((self.expires_at - now) * 1000))

    @property
    def name(self) -> str:
        return f"{self.key.decode('utf-8', 'replace')!r}@{self.generation}"


class ObjectIndex:
    """Live records by key and generation, plus an expiry queue for TTL sweeps.

    Usually a key has one generation here; an overwrite briefly leaves two
    until the master FREEs the old one.
    """

    def __init__(self):
        self._by_key: dict[bytes, dict[int, ObjectRecord]] = {}
        self._expiry: list[tuple[float, int, ObjectRecord]] = []  # (expires_at, tiebreak, record)
        self._expiry_dead = 0  # records in _expiry no longer live
        self._due_until = 0.0  # due() has taken every record expiring by then off _expiry
        self._seq = 0
        self.count = 0
        self.hard_pinned_bytes = 0
        self.columns = InventoryColumns()  # the live records as the INVENTORY reply carries them

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        for generations in self._by_key.values():
            yield from generations.values()

    def get(self, key: bytes, generation: int) -> ObjectRecord | None:
        generations = self._by_key.get(key)
        return generations.get(generation) if generations else None

    def has_key(self, key: bytes) -> bool:
        return key in self._by_key

    def add(self, rec: ObjectRecord) -> ObjectRecord | None:
        """Index `rec`; returns the record it replaces (same key and generation), already unindexed."""
        key, generation = rec.key, rec.generation
        by_key = self._by_key
        generations = by_key.get(key)
        old = None
        if generations is not None and (old := generations.get(generation)) is not None:
            self.remove(old)
            generations = by_key.get(key)
        if generations is None:
            by_key[key] = {generation: rec}
        else:
            generations[generation] = rec
        self.columns.add(rec)
        self.count += 1
        if rec.flags & _HARD_PIN:
            self.hard_pinned_bytes += rec.size
        if rec.expires_at:
            self._seq += 1
            heapq.heappush(self._expiry, (rec.expires_at, self._seq, rec))
        return old

    def remove(self, rec: ObjectRecord) -> bool:
        """Unindex `rec` (marks it not live); False if it was not indexed."""
        generations = self._by_key.get(rec.key)
        if not generations or generations.get(rec.generation) is not rec:
            return False
        del generations[rec.generation]
        if not generations:
            del self._by_key[rec.key]
        self.columns.remove(rec)
        self.count -= 1
        if rec.flags & _HARD_PIN:
            self.hard_pinned_bytes -= rec.size
        rec.live = False
        if rec.expires_at > self._due_until:  # still queued (due() took every one up to _due_until)
            self._expiry_dead += 1
            if self._expiry_dead > 1024 and 2 * self._expiry_dead > len(self._expiry):
                self._drop_dead_expiries()
        return True

    def _drop_dead_expiries(self) -> None:
        """The expiry queue without the records gone before their TTL: a client removing what it wrote with a
        long TTL would otherwise keep them all here until then (at most twice the live ones stay queued)."""
        self._expiry = [entry for entry in self._expiry if entry[2].live]
        heapq.heapify(self._expiry)
        self._expiry_dead = 0

    def due(self, now: float) -> list[ObjectRecord]:
        """Live records whose TTL ran out by `now` (taken off the expiry queue)."""
        out = []
        self._due_until = max(self._due_until, now)
        while self._expiry and self._expiry[0][0] <= now:
            _, _, rec = heapq.heappop(self._expiry)
            if rec.live:
                out.append(rec)
            elif self._expiry_dead:
                self._expiry_dead -= 1
        return out
