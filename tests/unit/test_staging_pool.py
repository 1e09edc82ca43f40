"""The staging pool's bookkeeping (client/device/staging.py): contiguous runs of chunks, first fit, waiters
served first come first served, cancellation, its report and its size checks. Its engine is the host-memory
one (client/device/cpu.py), which only supplies the slab."""

import asyncio

import pytest

from kvpool.client.device.cpu import CpuCopyEngine
from kvpool.client.device.staging import MIN_CHUNK_SIZE, StagingPool, check_sizes
from kvpool.errors import InvalidArgumentError

from async_wait import until

CHUNK = MIN_CHUNK_SIZE
WAIT = 5.0  # seconds a test waits for a grant before it fails


def pool_of(chunks: int, **options) -> StagingPool:
    return StagingPool(CpuCopyEngine(), chunks * CHUNK, CHUNK, **options)


def free_chunks(pool: StagingPool) -> int:
    return pool.count - pool.in_use // CHUNK


def test_a_lease_is_a_contiguous_run_of_the_slab():
    pool = pool_of(8)
    lease = pool.try_take(2 * CHUNK + 1)  # three chunks: the last partly used
    assert (lease.first, lease.chunks, len(lease.view)) == (0, 3, 3 * CHUNK)
    lease.view[:5] = b"front"
    lease.view[-4:] = b"back"
    slab = pool.slab()
    assert bytes(slab[:5]) == b"front" and bytes(slab[3 * CHUNK - 4:3 * CHUNK]) == b"back"
    second = pool.try_take(CHUNK)
    assert (second.first, second.chunks) == (3, 1)
    second.view[:6] = b"second"
    assert bytes(slab[3 * CHUNK:3 * CHUNK + 6]) == b"second"  # right after the first run, not inside it
    assert pool.in_use == 4 * CHUNK
    assert pool.try_take(0).chunks == 1  # even an empty value holds a chunk while it moves


def test_free_chunks_that_are_not_contiguous_do_not_make_a_run():
    pool = pool_of(6)
    leases = [pool.try_take(CHUNK) for _ in range(6)]
    for lease in leases[::2]:  # chunks 0, 2, 4 free: three in all, none adjacent
        pool.give(lease)
    assert free_chunks(pool) == 3
    assert pool.try_take(2 * CHUNK) is None
    pool.give(leases[1])  # 0, 1, 2 now one run
    lease = pool.try_take(3 * CHUNK)
    assert (lease.first, lease.chunks) == (0, 3)


def test_the_first_run_that_fits_is_taken():
    pool = pool_of(8)
    a, b, c, d = (pool.try_take(n * CHUNK) for n in (2, 1, 3, 2))
    assert [x.first for x in (a, b, c, d)] == [0, 2, 3, 6]
    pool.give(c)  # 3..5 free
    pool.give(a)  # 0..1 free
    assert pool.try_take(CHUNK).first == 0  # the lowest run that holds it, not the largest
    assert pool.try_take(2 * CHUNK).first == 3  # 1 alone is too short
    assert pool.try_take(CHUNK).first == 1
    assert pool.try_take(CHUNK).first == 5
    assert pool.try_take(CHUNK) is None


def test_try_take_gives_nothing_while_others_wait():
    async def scenario():
        pool = pool_of(4)
        held = pool.try_take(3 * CHUNK)
        waiting = asyncio.ensure_future(pool.take(2 * CHUNK))  # does not fit: waits
        await until(lambda: pool.waits == 1)
        assert pool.try_take(CHUNK) is None  # one chunk is free, but it would overtake the waiter
        pool.give(held)
        lease = await asyncio.wait_for(waiting, WAIT)
        assert (lease.first, lease.chunks) == (0, 2)
        assert pool.try_take(CHUNK) is not None  # no one waits any more
        return pool

    pool = asyncio.run(scenario())
    assert pool.waits == 1


def test_waiters_are_granted_in_the_order_they_came():
    async def scenario():
        pool = pool_of(4)
        held = [pool.try_take(CHUNK) for _ in range(4)]
        granted = []

        async def take(name, chunks):
            lease = await pool.take(chunks * CHUNK)
            granted.append(name)
            return lease

        large = asyncio.ensure_future(take("large", 3))
        await until(lambda: pool.waits == 1)
        small = asyncio.ensure_future(take("small", 1))
        await until(lambda: pool.waits == 2)
        pool.give(held[3])  # room for the small one only: it waits behind the large one
        pool.give(held[2])
        assert pool.in_use == 2 * CHUNK  # nothing granted
        pool.give(held[1])  # 1..3 free: the large one first, then nothing left for the small one
        assert pool.in_use == 4 * CHUNK
        await asyncio.wait_for(large, WAIT)
        assert granted == ["large"] and not small.done()
        pool.give(held[0])
        await asyncio.wait_for(small, WAIT)
        assert granted == ["large", "small"]
        assert pool.in_use == 4 * CHUNK

    asyncio.run(scenario())


def test_a_cancelled_waiter_holds_nothing_and_lets_the_next_one_in():
    async def scenario():
        pool = pool_of(4)
        held = pool.try_take(2 * CHUNK)
        large = asyncio.ensure_future(pool.take(4 * CHUNK))
        await until(lambda: pool.waits == 1)
        small = asyncio.ensure_future(pool.take(2 * CHUNK))  # would fit, but waits behind the large one
        await until(lambda: pool.waits == 2)
        assert not small.done()
        large.cancel()
        lease = await asyncio.wait_for(small, WAIT)  # granted as soon as the one ahead of it left
        assert (lease.first, lease.chunks) == (2, 2)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(large, WAIT)
        pool.give(held)
        pool.give(lease)
        assert pool.in_use == 0
        assert pool.try_take(4 * CHUNK) is not None  # every chunk came back

    asyncio.run(scenario())


def test_a_waiter_cancelled_as_it_was_granted_gives_the_chunks_back():
    async def scenario():
        pool = pool_of(2)
        held = pool.try_take(2 * CHUNK)
        waiting = asyncio.ensure_future(pool.take(2 * CHUNK))
        await until(lambda: pool.waits == 1)
        pool.give(held)  # grants the waiter's run...
        assert pool.in_use == 2 * CHUNK
        waiting.cancel()  # ...and it is cancelled before it could take it
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pool.in_use == 0
        assert pool.try_take(2 * CHUNK) is not None

    asyncio.run(scenario())


def test_a_transfer_larger_than_the_pool_is_refused_at_once():
    pool = pool_of(4)
    with pytest.raises(InvalidArgumentError, match="device_pool_size"):
        pool.try_take(4 * CHUNK + 1)

    async def take():
        with pytest.raises(InvalidArgumentError, match="device_pool_size"):
            await pool.take(4 * CHUNK + 1)

    asyncio.run(take())
    assert pool.waits == 0 and pool.in_use == 0  # refused, not queued
    whole = pool.try_take(4 * CHUNK)  # the whole pool is not too large
    assert whole is not None
    pool.give(whole)


def test_the_report_and_the_slab_made_once_on_first_use():
    engine = CpuCopyEngine()
    allocated = []
    pool = StagingPool(engine, 5 * CHUNK + 100, CHUNK, on_allocated=allocated.append)  # whole chunks only
    assert pool.report() == {"pool_bytes": 5 * CHUNK, "chunk_bytes": CHUNK, "allocated_bytes": 0,
                             "in_use_bytes": 0, "peak_bytes": 0, "waits": 0}
    assert engine.pinned_bytes == 0 and allocated == []  # nothing pinned before a transfer needs it
    a = pool.try_take(3 * CHUNK)
    b = pool.try_take(CHUNK)
    pool.give(a)
    pool.try_take(CHUNK)
    assert pool.report() == {"pool_bytes": 5 * CHUNK, "chunk_bytes": CHUNK, "allocated_bytes": 5 * CHUNK,
                             "in_use_bytes": 2 * CHUNK, "peak_bytes": 4 * CHUNK, "waits": 0}
    pool.give(b)
    assert engine.pinned_bytes == 5 * CHUNK  # one slab, pinned once
    assert len(allocated) == 1 and len(allocated[0]) == 5 * CHUNK  # handed to the transports once


@pytest.mark.parametrize("pool_size, chunk_size, problem", [
    (0, CHUNK, "device_pool_size must be a positive number"),
    (-CHUNK, CHUNK, "device_pool_size must be a positive number"),
    (4.0 * CHUNK, CHUNK, "device_pool_size must be a positive number"),
    (True, CHUNK, "device_pool_size must be a positive number"),
    (4 * CHUNK, 0, "device_chunk_size must be a positive number"),
    (4 * CHUNK, "64KiB", "device_chunk_size must be a positive number"),
    (4 * CHUNK, CHUNK - 1, f"device_chunk_size {CHUNK - 1} must be at least {CHUNK}"),
    (2 * CHUNK - 1, CHUNK, f"device_pool_size {2 * CHUNK - 1} at least two chunks"),
])
def test_sizes_that_cannot_make_a_pool_are_refused(pool_size, chunk_size, problem):
    with pytest.raises(InvalidArgumentError, match=problem):
        check_sizes(pool_size, chunk_size)
    with pytest.raises(InvalidArgumentError, match=problem):
        StagingPool(CpuCopyEngine(), pool_size, chunk_size)


def test_the_smallest_pool_allowed():
    check_sizes(2 * CHUNK, CHUNK)
    pool = StagingPool(CpuCopyEngine(), 2 * CHUNK, CHUNK)
    assert pool.count == 2 and pool.chunks_for(2 * CHUNK) == 2 and pool.chunks_for(1) == 1
