"""How a node keeps a written object: the WRITE_OPTIONS block of kvpool/wire.py as a value.

Clients fill it from put's options, a node copying an object to another fills
it from what is left of the object's own (storenode/copier.py).
"""

from typing import NamedTuple

from .wire import WRITE_OPTIONS


class WriteOptions(NamedTuple):
    """How the node should keep a written object (sent as the WRITE_OPTIONS block)."""

    flags: int = 0        # wire.WriteFlag bits
    ttl_ms: int = 0       # 0 = no expiry
    soft_pin_ms: int = 0  # 0 = not soft-pinned
    raw_size: int = 0     # size before compression; 0 = the stored size (not compressed)

    def pack(self, stored_size: int) -> bytes:
        return WRITE_OPTIONS.pack(self.ttl_ms, self.soft_pin_ms, self.raw_size or stored_size)


NO_OPTIONS = WriteOptions()
