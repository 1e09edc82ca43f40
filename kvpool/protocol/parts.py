"""A value made of several buffers in order (Parts).

client/values.py makes them from callers' objects; they live here because the
TCP connection to nodes (kvpool/net/tcp_connection.py), which the master and the
nodes use too, sends from and receives into each part.
"""


class Parts:
    """One value made of several buffers in order, e.g. a KV block's K and V for every layer:
    gathered into one stored object on a put, scattered back into the same layout on a get,
    with no copy in between (the transports send from and receive into each part)."""

    __slots__ = ("views", "size")
    # A flexible destination takes a value smaller than itself into its front (as a flat buffer does); parts
    # made of callers' buffers are a layout, which the value must fill exactly.
    flexible = False

    def __init__(self, views):
        self.views = [view for view in views if len(view)]
        self.size = sum(len(view) for view in self.views)

    def __len__(self) -> int:
        return self.size

    def gather(self) -> memoryview:
        """The parts copied into one buffer (for what needs contiguous bytes: compression, UCX)."""
        whole = memoryview(bytearray(self.size))
        self.copy_to(whole)
        return whole

    def copy_to(self, whole: memoryview) -> None:
        """Copy the parts, in order, into `whole` (len == self.size)."""
        position = 0
        for view in self.views:
            whole[position:position + len(view)] = view
            position += len(view)

    def flat_or_new(self) -> memoryview:
        """Where a reader that takes one flat buffer receives this value: the one view when there is one (no
        copy after), else a new buffer to copy_from."""
        return self.views[0] if len(self.views) == 1 else memoryview(bytearray(self.size))

    def fill_from(self, received: memoryview) -> None:
        """After a read into flat_or_new(): copy what arrived into the parts, unless it landed there already."""
        if not (len(self.views) == 1 and received is self.views[0]):
            self.copy_from(received)

    def deliver_from(self, source: memoryview) -> int | None:
        """A destination that can take `source` (a node's mapped extent) by itself does so and returns its
        checksum (client/device: one DMA to device memory); None: copy it in as usual."""
        return None

    async def landed(self) -> None:
        """Wait until what deliver_from took has arrived (before the source may be given back)."""

    def undeliver(self) -> None:
        """A new fill of this destination begins: what deliver_from took before no longer counts."""

    def copy_from(self, whole: memoryview) -> None:
        """Fill the parts, in order, from `whole` (len == self.size)."""
        position = 0
        for view in self.views:
            view[:] = whole[position:position + len(view)]
            position += len(view)


def pieces(value) -> list | tuple:
    """The flat views a value or destination consists of, in order: its parts, or itself."""
    return value.views if isinstance(value, Parts) else (value,)
