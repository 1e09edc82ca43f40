"""How a node keeps a written object: the WRITE_OPTIONS block of kvpool/protocol/wire.py as a value.

Clients fill it from put's options and the leader's seal over the copy, a node copying an object to
another fills it from what is left of the object's own (storenode/background/replica_push.py), unsealed.
"""

from typing import NamedTuple

from .wire import NO_SEAL, WRITE_OPTIONS, WriteFlag


class WriteOptions(NamedTuple):
    """How the node should keep a written object (sent as the WRITE_OPTIONS block)."""

    flags: int = 0        # wire.WriteFlag bits
    ttl_ms: int = 0       # 0 = no expiry
    soft_pin_ms: int = 0  # 0 = not soft-pinned
    raw_size: int = 0     # size before compression; 0 = the stored size (not compressed)
    seal: bytes = NO_SEAL  # the leader's seal over the copy being written (kvpool/security/placement_seal.py)

    def pack(self, stored_size: int) -> bytes:
        return WRITE_OPTIONS.pack(self.ttl_ms, self.soft_pin_ms, self.raw_size or stored_size, self.seal)


NO_OPTIONS = WriteOptions()


def milliseconds(seconds: float) -> int:
    """A TTL or pin time as the WRITE carries it; a positive duration never rounds down to "none"."""
    return max(1, round(seconds * 1000)) if seconds else 0


def placed_options(prefer_ssd: bool, hard_pin: bool, soft_pin_seconds: float, ttl_seconds: float,
                   compressed: bool, raw_size: int, to_shared: bool = False) -> WriteOptions:
    """The WriteOptions of a put with these choices: what the client sends and the leader seals alike."""
    flags = ((WriteFlag.PREFER_SSD if prefer_ssd else 0) | (WriteFlag.HARD_PIN if hard_pin else 0)
             | (WriteFlag.COMPRESSED if compressed else 0) | (WriteFlag.TO_SHARED if to_shared else 0))
    if not (flags or ttl_seconds or soft_pin_seconds):
        return NO_OPTIONS
    return WriteOptions(int(flags), milliseconds(ttl_seconds), milliseconds(soft_pin_seconds),
                        raw_size if compressed else 0)

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
