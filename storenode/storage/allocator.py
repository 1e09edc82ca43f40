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

# A free extent in the by-length list is one int, length << _SHIFT | offset: ints compare several
# times faster than (length, offset) tuples, in the same order. Offsets stay below 2**_SHIFT (64 PiB).
_SHIFT = 56
_OFFSET = (1 << _SHIFT) - 1


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
        if capacity > _OFFSET:
            raise ValueError(f"capacity of {capacity} bytes is beyond what an allocator keeps ({_OFFSET})")
        self.alignment = alignment
        self._mask = alignment - 1
        self.capacity = capacity - capacity % alignment
        self.reset()

    def aligned(self, length: int) -> int:
        """Bytes an allocation of `length` really takes."""
        return align_up(length, self.alignment)

    def allocate(self, length: int) -> int | None:
        """Offset of a new extent of at least `length` bytes, or None if none fits."""
        if length <= 0:
            raise ValueError(f"length must be positive, got {length}")
        need = (length + self._mask) & ~self._mask
        by_size = self._by_size
        i = bisect_left(by_size, need << _SHIFT)
        if i == len(by_size):
            return None
        entry = by_size[i]
        size, offset = entry >> _SHIFT, entry & _OFFSET
        del by_size[i]
        sizes = self._sizes
        del sizes[offset]
        starts = self._starts
        if size > need:  # the rest stays free, in the same place among the starts
            starts[bisect_left(starts, offset)] = offset + need
            sizes[offset + need] = size - need
            insort(by_size, (size - need) << _SHIFT | (offset + need))
        else:
            del starts[bisect_left(starts, offset)]
        self._allocated[offset] = need
        self.used += need
        return offset

    def free(self, offset: int) -> int:
        """Release the extent at `offset`; returns its aligned length. KeyError if not allocated."""
        length = self._allocated.pop(offset)
        self.used -= length
        start, end = offset, offset + length
        starts, sizes = self._starts, self._sizes
        by_size = self._by_size
        i = bisect_left(starts, offset)
        if i < len(starts) and starts[i] == end:  # right neighbour is free: merged into this one
            right = sizes.pop(end)
            del by_size[bisect_left(by_size, right << _SHIFT | end)]
            del starts[i]
            end += right
        if i > 0 and (left := starts[i - 1]) + sizes[left] == start:  # left neighbour is free: it grows
            del by_size[bisect_left(by_size, sizes[left] << _SHIFT | left)]
            sizes[left] = end - left
            insort(by_size, (end - left) << _SHIFT | left)
        else:  # a new free extent, at index i of the starts
            starts.insert(i, start)
            sizes[start] = end - start
            insort(by_size, (end - start) << _SHIFT | start)
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
        self.used += need
        return need

    def reset(self) -> None:
        """Forget every allocation (also used when the segment behind it was replaced)."""
        self._starts: list[int] = []               # free extent offsets, ascending
        self._sizes: dict[int, int] = {}           # free extent offset -> length
        self._by_size: list[int] = []  # length << _SHIFT | offset: by length, then offset, ascending
        self._allocated: dict[int, int] = {}       # allocated offset -> aligned length
        self.used = 0  # bytes allocated (aligned)
        if self.capacity:
            self._add_free(0, self.capacity)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def _add_free(self, offset: int, length: int) -> None:
        insort(self._starts, offset)
        self._sizes[offset] = length
        insort(self._by_size, length << _SHIFT | offset)

    def _remove_free(self, offset: int) -> None:
        length = self._sizes.pop(offset)
        del self._starts[bisect_left(self._starts, offset)]
        del self._by_size[bisect_left(self._by_size, length << _SHIFT | offset)]
