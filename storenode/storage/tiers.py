"""One storage tier as the node manages it: segment, allocator, member objects, watermarks and counters."""

from kvpool.sharedfs.file_gate import FileGate, describe, fault_of
from kvpool.storenode.storage.allocator import ExtentAllocator

from kvpool.storenode.storage import eviction_order, policy


class StorageTier:
    """A segment (DramSegment or SsdSegment) with its own extent allocator.

    `members` holds the records of keys of no tenant with a copy in this tier, coldest first
    (eviction_order.py; the store sets the kind, LRU or LFU; each tenant keeps its own: tenant_usage.py),
    `objects` counts every tenant's; counters are totals
    since start. Each tier counts the moves it takes part in: a demotion counts
    in DRAM and in SSD alike, as does a promotion.
    """

    def __init__(self, segment, high: float, low: float):
        self.segment = segment
        self.name = segment.name
        self.alloc = ExtentAllocator(segment.capacity, segment.alignment)
        self.high, self.low = high, low
        self.high_bytes = high * self.alloc.capacity  # used above this: excess() > 0 (checked per write)
        self.full = f"{self.name} full"  # why its victims go (store.release_from)
        self.members = eviction_order.LruOrder()  # of keys of no tenant; each tenant has its own (tenant_usage.py)
        self.number = 1 if self.name == "ssd" else 0  # indexes per-tier figures (tenant_usage.py)
        self.objects = 0  # objects with a copy here, every tenant's
        self.pinned_bytes = 0  # hard-pinned objects with a copy here
        self.hits = self.misses = 0
        self.demotions = self.promotions = 0
        self.evictions = self.evicted_bytes = 0
        self.gate: FileGate | None = None  # a disk's (SSD): closed while it fails, and no object is placed here

    def watch(self, gate: FileGate) -> None:
        """An I/O error that says the segment's disk fails closes `gate` until its probe answers (file_gate.py)."""
        self.gate = gate

        def noticed(exc: OSError) -> None:
            fault = fault_of(exc)
            if fault is not None:
                gate.close(describe(fault))
        self.segment.on_fault = noticed

    @property
    def fault(self) -> str | None:
        """Why this tier takes nothing new now (its disk fails), or None."""
        return self.gate.fault if self.gate is not None else None

    @property
    def capacity(self) -> int:
        return self.alloc.capacity

    @property
    def used(self) -> int:
        return self.alloc.used

    def extent_length(self, rec) -> int:
        return self.segment.extent_length(len(rec.key), rec.size)

    def fits_ever(self, key_len: int, size: int) -> bool:
        return self.alloc.aligned(self.segment.extent_length(key_len, size)) <= self.capacity

    def excess(self) -> int:
        return policy.excess(self.used, self.capacity, self.high, self.low)

    def stats(self) -> dict:
        return {
            "capacity": self.capacity, "used": self.used, "objects": self.objects,
            "hits": self.hits, "misses": self.misses, "demotions": self.demotions,
            "promotions": self.promotions, "evictions": self.evictions, "evicted_bytes": self.evicted_bytes,
            "watermark": policy.watermark(self.used, self.capacity, self.high, self.low),
            "pinned_bytes": self.pinned_bytes, "fault": self.fault or "",
            "faults": self.gate.faults if self.gate is not None else 0,
        }
