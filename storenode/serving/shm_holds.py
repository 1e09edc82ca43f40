"""What one shared-memory client holds through the node's DRAM mapping, and when it must let go.

A LOCATE pins its record (neither freed nor moved while the client copies out) until the client's RELEASE
or for wire.LOCATE_LEASE seconds, whichever comes first; an ALLOCATE holds its reserved extent until the
COMMIT or RELEASE, or for the allocation timeout (the node's --frame-timeout): a client that never
answers holds nothing for long. Whatever is left is given back when the connection ends.
"""

import asyncio
import time
from typing import NamedTuple

from kvpool.protocol import wire

from kvpool.storenode.storage.index import ObjectRecord
from kvpool.storenode.serving.metrics import NodeMetrics
from kvpool.storenode.serving.ops import Request, StoredOptions
from kvpool.storenode.storage.store import ObjectStore, Reservation


class Allocation(NamedTuple):
    """An ALLOCATEd extent the client is copying into, until its COMMIT."""

    reservation: Reservation
    request: Request  # the ALLOCATE: key, generation, flags, length and checksum to commit
    options: StoredOptions
    due: float  # time.monotonic() after which it is given back


class SharedMemoryHolds:
    def __init__(self, store: ObjectStore, metrics: NodeMetrics, allocation_timeout: float):
        self.store = store
        self.metrics = metrics
        self.allocation_timeout = allocation_timeout
        self.loop = asyncio.get_running_loop()
        # (key, generation) -> [(record LOCATEd, lease end)], oldest first
        self.located: dict[tuple, list[tuple[ObjectRecord, float]]] = {}
        self.allocated: dict[tuple, Allocation] = {}  # (key, generation) -> not committed yet
        self._lease_timer: asyncio.TimerHandle | None = None
        self._allocation_timer: asyncio.TimerHandle | None = None

    def locate(self, rec: ObjectRecord) -> None:
        """Pin a record the client reads through the mapping, for one lease at most."""
        self.store.acquire(rec)
        self.located.setdefault((rec.key, rec.generation), []).append((rec, time.monotonic() + wire.LOCATE_LEASE))
        if self._lease_timer is None:
            self._lease_timer = self.loop.call_later(wire.LOCATE_LEASE, self._end_leases)

    def is_allocated(self, key: bytes, generation: int) -> bool:
        return (key, generation) in self.allocated

    def allocate(self, res: Reservation, req: Request, options: StoredOptions) -> None:
        self.allocated[(req.key, req.generation)] = Allocation(res, req, options,
                                                               time.monotonic() + self.allocation_timeout)
        if self._allocation_timer is None:
            self._allocation_timer = self.loop.call_later(self.allocation_timeout, self._end_allocations)

    def take_allocation(self, key: bytes, generation: int) -> Allocation | None:
        """The allocation a COMMIT completes (no longer held here), or None when there is none."""
        return self.allocated.pop((key, generation), None)

    def release(self, key: bytes, generation: int) -> None:
        """Give back a LOCATE's pin, or an ALLOCATE never committed (the writer gave up). Releasing
        what is not held is a no-op (e.g. a COMMIT got there first)."""
        located = self.located.get((key, generation))
        if located:
            self.store.release(located.pop(0)[0])
            if not located:
                del self.located[(key, generation)]
        else:
            pending = self.allocated.pop((key, generation), None)
            if pending is not None:
                self.store.abort(pending.reservation)

    def _end_leases(self) -> None:
        """Release the LOCATEs whose lease is over (their RELEASE is late or will never come)."""
        self._lease_timer = None
        now = time.monotonic()
        for where, located in list(self.located.items()):
            while located and located[0][1] <= now:
                self.store.release(located.pop(0)[0])
            if not located:
                del self.located[where]
        if self.located:
            soonest = min(located[0][1] for located in self.located.values())
            self._lease_timer = self.loop.call_later(max(0.0, soonest - now), self._end_leases)

    def _end_allocations(self) -> None:
        """Give back the ALLOCATEd extents whose COMMIT is overdue (a late COMMIT finds nothing)."""
        self._allocation_timer = None
        now = time.monotonic()
        for where, pending in list(self.allocated.items()):
            if pending.due <= now:
                del self.allocated[where]
                self.store.abort(pending.reservation)
                self.metrics.error("allocate", "EXPIRED")
        if self.allocated:
            soonest = min(pending.due for pending in self.allocated.values())
            self._allocation_timer = self.loop.call_later(max(0.0, soonest - now), self._end_allocations)

    def give_back(self) -> None:
        """The connection ended: whatever its client held through the mapping is the node's again."""
        for timer in (self._lease_timer, self._allocation_timer):
            if timer is not None:
                timer.cancel()
        self._lease_timer = self._allocation_timer = None
        for located in self.located.values():
            for rec, _lease_end in located:
                self.store.release(rec)
        for pending in self.allocated.values():
            self.store.abort(pending.reservation)
        self.located.clear()
        self.allocated.clear()
