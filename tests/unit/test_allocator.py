"""ExtentAllocator under random fragmentation: extents never overlap, the books balance,
and freeing everything coalesces back into the single extent we started with."""

import random

import pytest

from kvpool.storenode.storage.allocator import ExtentAllocator

from allocator_state import allocated_extents, free_extents, largest_free


def check_invariants(alloc: ExtentAllocator) -> None:
    used = allocated_extents(alloc)
    free = free_extents(alloc)
    # Allocated and free extents tile [0, capacity) exactly: no overlap, no gap.
    tiles = sorted(used + free)
    cursor = 0
    for offset, length in tiles:
        assert offset == cursor, f"gap or overlap at {cursor}: next extent starts at {offset}"
        assert offset % alloc.alignment == 0 and length % alloc.alignment == 0
        cursor = offset + length
    assert cursor == alloc.capacity
    # Free extents are always fully coalesced: no two are adjacent.
    for (a, alen), (b, _) in zip(free, free[1:]):
        assert a + alen < b
    assert alloc.used == sum(length for _, length in used)
    assert alloc.free_bytes == alloc.capacity - alloc.used
    assert largest_free(alloc) == max((length for _, length in free), default=0)


@pytest.mark.parametrize("seed", range(8))
def test_random_alloc_free_keeps_invariants_and_coalesces(seed):
    rng = random.Random(seed)
    alloc = ExtentAllocator(1 << 20, alignment=64)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            assert alloc.free(offset) == alloc.aligned(live.pop(offset))
        else:
            length = rng.choice([1, 63, 64, 65, 500, 4096, rng.randint(1, 40000)])
            offset = alloc.allocate(length)
            if offset is None:
                # Best fit only fails when really no free extent is big enough.
                assert largest_free(alloc) < alloc.aligned(length)
                continue
            assert offset % 64 == 0
            assert offset + length <= alloc.capacity
            live[offset] = length
        check_invariants(alloc)
    for offset in rng.sample(list(live), len(live)):
        alloc.free(offset)
    check_invariants(alloc)
    assert free_extents(alloc) == [(0, alloc.capacity)]
    assert alloc.used == 0


def test_exhaustion_returns_none_then_recovers():
    alloc = ExtentAllocator(64 * 10)
    offsets = [alloc.allocate(64) for _ in range(10)]
    assert sorted(offsets) == [64 * i for i in range(10)]
    assert alloc.allocate(1) is None
    assert alloc.free_bytes == 0 and largest_free(alloc) == 0
    alloc.free(offsets[3])
    alloc.free(offsets[4])
    assert largest_free(alloc) == 128
    assert alloc.allocate(129) is None  # 192 aligned bytes do not fit in the 128-byte hole
    assert alloc.allocate(100) == offsets[3]


def test_best_fit_prefers_smallest_hole():
    alloc = ExtentAllocator(64 * 100)
    a = alloc.allocate(64 * 10)
    alloc.allocate(64)
    b = alloc.allocate(64 * 2)
    alloc.allocate(64)
    alloc.free(a)  # 10-unit hole at the start
    alloc.free(b)  # 2-unit hole in the middle
    assert alloc.allocate(64 * 2) == b


def test_alignment_and_capacity_rounding():
    alloc = ExtentAllocator(1000, alignment=256)
    assert alloc.capacity == 768
    assert alloc.allocate(1) == 0
    assert alloc.used == 256
    assert alloc.allocate(300) == 256
    assert alloc.allocate(1) is None


def test_bad_arguments():
    alloc = ExtentAllocator(4096)
    with pytest.raises(ValueError):
        alloc.allocate(0)
    with pytest.raises(KeyError):
        alloc.free(64)  # never allocated
    off = alloc.allocate(10)
    alloc.free(off)
    with pytest.raises(KeyError):
        alloc.free(off)  # double free
    with pytest.raises(ValueError):
        ExtentAllocator(4096, alignment=48)


def test_reset_forgets_allocations():
    alloc = ExtentAllocator(4096)
    alloc.allocate(100)
    alloc.allocate(100)
    alloc.reset()
    assert alloc.used == 0
    assert free_extents(alloc) == [(0, 4096)]


def test_zero_capacity_allocates_nothing():
    alloc = ExtentAllocator(0)
    assert alloc.allocate(1) is None
    assert largest_free(alloc) == 0
