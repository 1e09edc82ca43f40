"""The staging pool: one slab of page-locked host memory, allocated once, handed out in contiguous runs of
chunks. Every device transfer's bytes pass through it (or straight to a node's mapping, transfers.py), so it
bounds the host memory device transfers take: a transfer that finds too little free waits for another to
give some back (back-pressure), within its call's deadline.
"""

import asyncio
from typing import NamedTuple

from kvpool.errors import InvalidArgumentError

DEFAULT_POOL_SIZE = 256 * 1024 * 1024
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
MIN_CHUNK_SIZE = 64 * 1024


class Lease(NamedTuple):
    first: int  # chunk index
    chunks: int
    view: memoryview  # the run's bytes


def check_sizes(pool_size: int, chunk_size: int) -> None:
    for name, value in (("device_pool_size", pool_size), ("device_chunk_size", chunk_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgumentError(f"{name} must be a positive number of bytes, got {value!r}")
    if chunk_size < MIN_CHUNK_SIZE or pool_size < 2 * chunk_size:
        raise InvalidArgumentError(f"device_chunk_size {chunk_size} must be at least {MIN_CHUNK_SIZE} and "
                                   f"device_pool_size {pool_size} at least two chunks")


class StagingPool:
    def __init__(self, engine, pool_size: int, chunk_size: int, on_allocated=None):
        check_sizes(pool_size, chunk_size)
        self.engine = engine
        self.chunk_size = chunk_size
        self.count = pool_size // chunk_size
        self.size = self.count * chunk_size
        self._on_allocated = on_allocated  # called with the slab once made (transports register it)
        self._slab: memoryview | None = None
        self._free = [True] * self.count
        self._waiters: list[tuple[int, asyncio.Future]] = []  # (chunks, future), first come first served
        self.in_use = 0  # bytes
        self.peak = 0
        self.waits = 0  # takes that had to wait for another transfer to give chunks back

    def chunks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.chunk_size))

    def try_take(self, nbytes: int) -> Lease | None:
        """A run of chunks holding `nbytes`, or None when no such run is free now (or others wait first)."""
        need = self.chunks_for(nbytes)
        if need > self.count:
            raise InvalidArgumentError(f"a device transfer of {nbytes} bytes is larger than the staging pool "
                                       f"({self.size} bytes): raise the client's device_pool_size")
        if self._waiters:
            return None
        return self._take(need)

    async def take(self, nbytes: int) -> Lease:
        """As try_take, waiting (in turn) until the chunks are free."""
        lease = self.try_take(nbytes)
        if lease is not None:
            return lease
        need = self.chunks_for(nbytes)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((need, waiter))
        self.waits += 1
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give(waiter.result())  # granted as it was cancelled
            elif (need, waiter) in self._waiters:
                self._waiters.remove((need, waiter))
                self._grant()  # those behind it may fit now
            raise

    def give(self, lease: Lease) -> None:
        for i in range(lease.first, lease.first + lease.chunks):
            self._free[i] = True
        self.in_use -= lease.chunks * self.chunk_size
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            need, waiter = self._waiters[0]
            if waiter.done():
                self._waiters.pop(0)
                continue
            lease = self._take(need)
            if lease is None:
                return
            self._waiters.pop(0)
            waiter.set_result(lease)

    def _take(self, need: int) -> Lease | None:
        run = 0
        for i, free in enumerate(self._free):
            run = run + 1 if free else 0
            if run == need:
                first = i - need + 1
                for j in range(first, i + 1):
                    self._free[j] = False
                self.in_use += need * self.chunk_size
                self.peak = max(self.peak, self.in_use)
                start = first * self.chunk_size
                return Lease(first, need, self.slab()[start:start + need * self.chunk_size])
        return None

    def slab(self) -> memoryview:
        if self._slab is None:
            self._slab = self.engine.pinned(self.size)
            if self._on_allocated is not None:
                self._on_allocated(self._slab)
        return self._slab

    def report(self) -> dict:
        return {"pool_bytes": self.size, "chunk_bytes": self.chunk_size, "allocated_bytes":
                0 if self._slab is None else self.size, "in_use_bytes": self.in_use, "peak_bytes": self.peak,
                "waits": self.waits}
