"""The contracts of data transports: TCP (always), same-host shared memory, UCX.

A transport moves value bytes between this process and storage nodes, addressed
as "HOST:PORT" (the node's TCP data address, its identity for every transport)
plus the (key, generation) of one stored version; where the node keeps the bytes
(DRAM or SSD, which extent) is its own business. It knows nothing about the
master; errors come back as kvpool.errors types. UnavailableError or
ProtocolError from a DataPath means the path failed (the caller may retry the
transfer on another one); any other error is the node's answer about the data.
"""

from abc import ABC, abstractmethod
from typing import NamedTuple, Sequence

from kvpool.protocol.write_options import WriteOptions


class WriteItem(NamedTuple):
    key: bytes
    generation: int
    data: memoryview  # flat bytes (format "B"): its len() is its byte length
    checksum: int
    options: WriteOptions | None = None
    term: int = 0  # term of the master that placed the put (the WRITE arg: nodes refuse older terms)


class ReadItem(NamedTuple):
    key: bytes
    generation: int
    buf: memoryview  # flat writable bytes, exactly the object's stored size


class DataPath(ABC):
    """Moving value bytes: what every transport offers.

    Values and destinations are flat byte memoryviews, or client.values.Parts where the
    transport says takes_parts (others get one contiguous buffer: see client/selector.py)."""

    takes_parts = False

    @abstractmethod
    async def write(self, address: str, key: bytes, generation: int, data: memoryview, checksum: int,
                    options: WriteOptions | None = None, term: int = 0) -> None:
        """Store `data` as (key, generation); the node verifies `checksum` before keeping it
        (and refuses it if a master of a newer term than `term` has spoken to it; 0 = unfenced)."""

    @abstractmethod
    async def read_into(self, address: str, key: bytes, generation: int, buf: memoryview) -> int:
        """Fill `buf` (len = stored size) with (key, generation); returns the checksum of the
        bytes that arrived, computed while they arrive (the caller compares it with the object's)."""

    @abstractmethod
    async def write_many(self, address: str, items: Sequence[WriteItem]) -> list:
        """Pipelined writes to one node: per item None, or the exception it failed with."""

    @abstractmethod
    async def read_many(self, address: str, items: Sequence[ReadItem]) -> list:
        """Pipelined reads from one node: per item the checksum of what arrived, or an exception."""

    @abstractmethod
    async def close(self) -> None:
        """Drop every connection; requests in flight fail with UnavailableError."""

    def register_buffer(self, view: memoryview) -> None:
        """A buffer that will be used for many transfers: a path that registers memory (UCX) does it
        once now instead of per transfer; the others need nothing."""


class Transport(DataPath):
    """What a client moves value bytes with: a DataPath to every node address, which may choose among
    several per node (client/selector.py). Requests only a master sends nodes (FREE, HOLD, REPORT,
    INVENTORY, PING, COPY, EVICTIONS) are not part of it: see kvpool/net/tcp_link.py."""

    @property
    def moved(self) -> dict:
        """Value bytes moved so far per transport name; {} when not counted."""
        return {}

    def transport_for(self, address: str) -> str | None:
        """The transport value bytes to `address` take now (None before first contact or unknown)."""
        return None
