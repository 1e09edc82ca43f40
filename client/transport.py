"""The contract every data transport (TCP now; shared memory, UCX later) fulfils.

A transport moves value bytes between this process and storage nodes, addressed
as "HOST:PORT" plus an extent (offset) holding one (key, generation). It knows
nothing about the master; errors come back as kvpool.errors types.
"""

from abc import ABC, abstractmethod
from typing import NamedTuple, Sequence


class WriteItem(NamedTuple):
    key: bytes
    generation: int
    offset: int
    data: memoryview  # flat bytes (format "B"): its len() is its byte length
    checksum: int


class ReadItem(NamedTuple):
    key: bytes
    generation: int
    offset: int
    buf: memoryview  # flat writable bytes, exactly the object's size


class Transport(ABC):
    """Data-plane operations against one storage node address each."""

    @abstractmethod
    async def write(self, address: str, key: bytes, generation: int, offset: int,
                    data: memoryview, checksum: int) -> None:
        """Store `data` at the extent; the node verifies `checksum` before recording it."""

    @abstractmethod
    async def read_into(self, address: str, key: bytes, generation: int, offset: int,
                        buf: memoryview) -> int:
        """Fill `buf` (len = object size) from the extent; returns the checksum of the bytes
        that arrived, computed while they arrive (the caller compares it with the object's)."""

    @abstractmethod
    async def write_many(self, address: str, items: Sequence[WriteItem]) -> list:
        """Pipelined writes to one node: per item None, or the exception it failed with."""

    @abstractmethod
    async def read_many(self, address: str, items: Sequence[ReadItem]) -> list:
        """Pipelined reads from one node: per item the checksum of what arrived, or an exception."""

    @abstractmethod
    async def free(self, address: str, key: bytes, generation: int, offset: int) -> bool:
        """Forget the extent if it still holds (key, generation); False if it did not."""

    @abstractmethod
    async def ping(self, address: str) -> str:
        """The node id serving `address`."""

    @abstractmethod
    async def close(self) -> None:
        """Drop every connection; requests in flight fail with UnavailableError."""
