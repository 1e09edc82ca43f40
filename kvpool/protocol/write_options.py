"""How a node keeps a written object: the WRITE_OPTIONS block of kvpool/protocol/wire.py as a value.

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

# The longest TTL or pin anyone may ask for (100 years): what a node keeps an object until must fit the
# SSD header's signed 64-bit milliseconds, whatever a peer sends.
MAX_LIFETIME_SECONDS = 100 * 365 * 86400


def lifetime_problem(name: str, seconds) -> str | None:
    """Why `seconds` cannot be a TTL or pin time (0: none); None when it can."""
    if not (0 <= seconds <= MAX_LIFETIME_SECONDS):  # also NaN
        return f"{name} must be from 0 to {MAX_LIFETIME_SECONDS} seconds (100 years), got {seconds!r}"
    return None

# lz4 turns n stored bytes into at most about 255 n raw ones: a raw size beyond that is a lie, and whoever
# believed it would allocate that much to decompress into.
LZ4_MAX_RATIO = 255


def raw_size_problem(stored: int, raw: int, compressed: bool) -> str | None:
    """Why `raw` cannot be the size before compression of `stored` stored bytes; None when it can."""
    if not compressed:
        return None if raw in (0, stored) else f"raw_size {raw} differs from size {stored} of an uncompressed value"
    limit = stored * LZ4_MAX_RATIO + 16
    if not 0 < raw <= limit:
        return f"raw_size {raw} cannot come from {stored} lz4 bytes (1 to {limit})"
    return None
