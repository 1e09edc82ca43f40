"""What an ExtentAllocator holds (storenode/storage/allocator.py), read from its lists: for the tests that check
its bookkeeping."""

from kvpool.storenode.storage import allocator


def free_extents(alloc: allocator.ExtentAllocator) -> list[tuple[int, int]]:
    """(offset, length) of every free extent, ascending."""
    return [(start, alloc._sizes[start]) for start in alloc._starts]


def allocated_extents(alloc: allocator.ExtentAllocator) -> list[tuple[int, int]]:
    """(offset, aligned length) of every allocated extent, ascending."""
    return sorted(alloc._allocated.items())


def largest_free(alloc: allocator.ExtentAllocator) -> int:
    """The length of the largest free extent, as the by-length list has it (0: none)."""
    return alloc._by_size[-1] >> allocator._SHIFT if alloc._by_size else 0
