"""Extent allocation inside one node's memory segment.

Best fit over the free extents, kept twice: sorted by offset (to find the
neighbours a freed extent coalesces with) and sorted by (length, offset) (to
find the smallest extent that fits). Both lists are searched with bisect; the
list inserts move memory but no Python objects, so this stays cheap for the
tens of thousands of extents a segment holds.

Every extent starts on an `alignment` boundary and its length is rounded up to
a multiple of it, so the usable capacity is `capacity` rounded down.
"""

from bisect import bisect_left, insort


def align_up(length: int, alignment: int) -> int:
    """`length` rounded up to a multiple of `alignment` (a power of two)."""
    return (length + alignment - 1) & ~(alignment - 1)


class ExtentAllocator:
    """Hands out [offset, offset+length) ranges of a segment of `capacity` bytes.

    allocate() returns None when no free extent is large enough: running out of
    space is an everyday outcome for a cache, and the caller decides which
    error it means (it may still try another node). `free` is the method that
    releases an extent, so the free byte count is the `free_bytes` property.
    """

    def __init__(self, capacity: int, alignment: int = 64):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self.reset()

    def aligned(self, length: int) -> int:
        """Bytes an allocation of `length` really takes."""
        return align_up(length, self.alignment)

    def allocate(self, length: int) -> int | None:
        """Offset of a new extent of at least `length` bytes, or None if none fits."""
        if length <= 0:
            raise ValueError(f"length must be positive, got {length}")
        need = self.aligned(length)
        i = bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        size, offset = self._by_size[i]
        self._remove_free(offset)
        if size > need:
            self._add_free(offset + need, size - need)
        self._allocated[offset] = need
        self._used += need
        return offset

    def free(self, offset: int) -> int:
        """Release the extent at `offset`; returns its aligned length. KeyError if not allocated."""
        length = self._allocated.pop(offset)
        self._used -= length
        start, end = offset, offset + length
        i = bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] == end:  # right neighbour is free
            end += self._sizes[end]
            self._remove_free(self._starts[i])
        if i > 0:
            left = self._starts[i - 1]
            if left + self._sizes[left] == start:  # left neighbour is free
                start = left
                self._remove_free(left)
        self._add_free(start, end - start)
        return length

    def claim(self, offset: int, length: int) -> int:
        """Mark [offset, offset+aligned(length)) allocated, e.g. an extent found on disk at start.

        Returns the aligned length; ValueError unless the range is aligned and entirely free.
        """
        need = self.aligned(length)
        if length <= 0 or offset % self.alignment:
            raise ValueError(f"cannot claim unaligned or empty extent at {offset} of {length} bytes")
        i = bisect_left(self._starts, offset + 1) - 1  # the free extent starting at or before offset
        start = self._starts[i] if i >= 0 else -1
        if start < 0 or start + self._sizes[start] < offset + need:
            raise ValueError(f"extent [{offset}, {offset + need}) is not free")
        size = self._sizes[start]
        self._remove_free(start)
        if offset > start:
            self._add_free(start, offset - start)
        if start + size > offset + need:
            self._add_free(offset + need, start + size - offset - need)
        self._allocated[offset] = need
        self._used += need
        return need

    def reset(self) -> None:
        """Forget every allocation (also used when the segment behind it was replaced)."""
        self._starts: list[int] = []               # free extent offsets, ascending
        self._sizes: dict[int, int] = {}           # free extent offset -> length
        self._by_size: list[tuple[int, int]] = []  # (length, offset), ascending
        self._allocated: dict[int, int] = {}       # allocated offset -> aligned length
        self._used = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    @property
    def used(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, length) of every free extent, ascending; for tests and debugging."""
        return [(s, self._sizes[s]) for s in self._starts]

    def allocated_extents(self) -> list[tuple[int, int]]:
        return sorted(self._allocated.items())

    def _add_free(self, offset: int, length: int) -> None:
        insort(self._starts, offset)
        self._sizes[offset] = length
        insort(self._by_size, (length, offset))

    def _remove_free(self, offset: int) -> None:
        length = self._sizes.pop(offset)
        del self._starts[bisect_left(self._starts, offset)]
        del self._by_size[bisect_left(self._by_size, (length, offset))]
