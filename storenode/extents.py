"""Which (key, generation) each extent of a tier holds, so stale reads and frees are refused."""

from bisect import bisect_left
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExtentRecord:
    key: bytes
    generation: int
    length: int
    checksum: int


class ExtentTable:
    """offset -> ExtentRecord for one tier; recorded extents never overlap.

    The master allocates extents, so a WRITE overlapping older records means those
    were freed (or their node was forgotten) and reused: the older records are dropped.
    """

    def __init__(self):
        self._offsets: list[int] = []  # sorted
        self._records: dict[int, ExtentRecord] = {}
        self.bytes = 0

    @property
    def objects(self) -> int:
        return len(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def invalidate(self, offset: int, length: int) -> int:
        """Drop every record overlapping [offset, offset+length); returns how many."""
        if length <= 0:
            return 0
        end = offset + length
        lo = bisect_left(self._offsets, offset)
        if lo and self._end_of(self._offsets[lo - 1]) > offset:
            lo -= 1  # the record just before starts earlier but reaches into the range
        hi = bisect_left(self._offsets, end, lo)
        for start in self._offsets[lo:hi]:
            self.bytes -= self._records.pop(start).length
        del self._offsets[lo:hi]
        return hi - lo

    def record(self, offset: int, key: bytes, generation: int, length: int, checksum: int) -> None:
        """Remember that [offset, offset+length) now holds (key, generation)."""
        if length <= 0 or offset < 0:
            raise ValueError(f"bad extent: offset {offset}, length {length}")
        self.invalidate(offset, length)
        self._offsets.insert(bisect_left(self._offsets, offset), offset)
        self._records[offset] = ExtentRecord(key, generation, length, checksum)
        self.bytes += length

    def lookup(self, offset: int, key: bytes, generation: int, length: int) -> ExtentRecord | None:
        """The record at offset if it still holds exactly (key, generation, length)."""
        rec = self._records.get(offset)
        if rec is None or rec.key != key or rec.generation != generation or rec.length != length:
            return None
        return rec

    def free(self, offset: int, key: bytes, generation: int) -> bool:
        """Forget the record at offset if it holds (key, generation)."""
        rec = self._records.get(offset)
        if rec is None or rec.key != key or rec.generation != generation:
            return False
        del self._records[offset]
        del self._offsets[bisect_left(self._offsets, offset)]
        self.bytes -= rec.length
        return True

    def _end_of(self, start: int) -> int:
        return start + self._records[start].length
