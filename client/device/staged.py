"""What a device value is on its way through the client: the caller's device memory (DeviceValue), its bytes
staged for a put (Staged), and the staging a get's bytes land in before they go on to the device (Landing).

Staged and Landing are Parts of one flat view into the staging pool, so every transport sends from or receives
into it as from any caller's buffer (UCX as a flat buffer: client/selector.py). Each also knows its device
memory, which lets the same-host path copy between that memory and the node's mapping in one DMA
(client/shm.py calls `copy_to` and `deliver_from`, as for any Parts).
"""

from kvpool.errors import InvalidArgumentError
from kvpool.protocol.parts import Parts


class DeviceValue:
    """The caller's device memory as one value or destination: its regions (the parts) in order."""

    __slots__ = ("engine", "regions", "size")

    def __init__(self, engine, regions: list):
        self.engine = engine
        self.regions = [region for region in regions if region.nbytes]
        self.size = sum(region.nbytes for region in self.regions)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, where: slice) -> "DeviceValue":
        """A range of a value of one region (batch_put_from / batch_get_into with offsets)."""
        start, stop, step = where.indices(self.size)
        if step != 1 or len(self.regions) > 1:
            raise InvalidArgumentError("only a contiguous range of one device buffer can be sliced")
        if not self.regions or stop <= start:
            return DeviceValue(self.engine, [])
        return DeviceValue(self.engine, [self.regions[0].slice(start, stop - start)])

    def spans(self, chunk: int, limit: int | None = None):
        """(offset in the value, region piece) covering its first `limit` bytes (all by default) in pieces of
        at most `chunk` bytes, none across a region's end."""
        left = self.size if limit is None else limit
        at = 0
        for region in self.regions:
            start = 0
            while start < region.nbytes and left > 0:
                size = min(chunk, region.nbytes - start, left)
                yield at, region.slice(start, size)
                at += size
                start += size
                left -= size


class Staged(Parts):
    """A device value's bytes in staging, with their checksum (taken as each chunk landed)."""

    __slots__ = ("digest", "source", "transfers")

    def __init__(self, view: memoryview, digest: int, source: DeviceValue, transfers):
        super().__init__([view])
        self.digest, self.source, self.transfers = digest, source, transfers

    def copy_to(self, whole: memoryview) -> None:
        """Into a node's extent (same host): from the device in one DMA where the mapping can be reached,
        else from staging. The node checks the checksum before keeping it, as for every write."""
        if not self.transfers.direct_out(self.source, whole):
            super().copy_to(whole)


class Landing(Parts):
    """The staging a get's bytes land in for device memory `dest`. Treated as a flat buffer (its front takes
    a smaller value) when `flexible` (a destination of one region), else as parts. `state["direct"]` tells whether the last fill went straight
    to the device (deliver_from) rather than into staging."""

    __slots__ = ("dest", "transfers", "state", "flexible")

    def __init__(self, view: memoryview, dest: DeviceValue, transfers, state: dict | None = None,
                 flexible: bool = True):
        super().__init__([view])
        self.views = [view]  # even when empty: the front of a zero-byte value
        self.dest, self.transfers, self.flexible = dest, transfers, flexible
        self.state = {"direct": False} if state is None else state

    def __getitem__(self, where: slice) -> "Landing":
        start, stop, _ = where.indices(self.size)
        if start:
            raise InvalidArgumentError("a landing is only taken from its front")
        self.state["direct"] = False  # a new fill begins (a read tries a replica)
        return Landing(self.views[0][:stop], self.dest, self.transfers, self.state, self.flexible)

    def __setitem__(self, where: slice, value) -> None:
        self.state["direct"] = False
        self.views[0][where] = value

    def deliver_from(self, source: memoryview) -> int | None:
        """Start copying a node's extent straight to the device (`landed` waits for it); the checksum of the
        source, or None when its mapping cannot be reached by DMA (the caller then copies into staging)."""
        started = self.transfers.direct_in(source, self.dest)
        if started is None:
            self.state["direct"] = False
            return None
        digest, self.state["copies"] = started
        self.state["direct"] = True
        return digest

    async def landed(self) -> None:
        copies = self.state.pop("copies", None)
        if copies is not None:
            await self.transfers.landed(copies)

    def undeliver(self) -> None:
        """What went straight to the device is not the value (it is being read again into staging)."""
        self.state["direct"] = False


def is_device(value) -> bool:
    """Whether a value or destination the client took is device memory."""
    return type(value) is DeviceValue
