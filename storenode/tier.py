"""A storage tier: one contiguous byte range the node stores extents in.

DRAM is the only tier today; an SSD tier would implement the same interface.
"""

from abc import ABC, abstractmethod

from kvpool.errors import InvalidArgumentError


class Tier(ABC):
    name: str
    capacity: int
    path: str = ""  # backing file a same-host reader could map; "" when there is none

    def contains(self, offset: int, length: int) -> bool:
        return 0 <= offset and 0 <= length and offset + length <= self.capacity

    def view(self, offset: int, length: int) -> memoryview:
        """A writable memoryview of [offset, offset+length); InvalidArgumentError if out of range."""
        if not self.contains(offset, length):
            raise InvalidArgumentError(
                f"extent [{offset}, {offset + length}) is outside the {self.name} tier of {self.capacity} bytes")
        return self._slice(offset, length)

    @abstractmethod
    def _slice(self, offset: int, length: int) -> memoryview:
        """The bytes of an extent already checked to be in range."""

    @abstractmethod
    def close(self) -> None:
        """Release the tier's memory and backing file."""
