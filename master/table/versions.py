"""What the master knows of one object version: where its copies are and how it was put.

Plain values (frozen, hashable where shared): the object table holds them packed
(version_store.py) and unpacks one for each read.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

from kvpool.errors import InvalidArgumentError

DRAM = "dram"
SSD = "ssd"
TIERS = (DRAM, SSD)
SHARED = "shared"  # the cluster's shared directory (master/table/shared_tier.py): never a put's preferred tier
PINS = ("none", "soft", "hard")


@dataclass(frozen=True)
class PutOptions:
    """What the client asked for about where and how long an object is kept (echoed back)."""

    tier: str | None = None  # preferred tier; None = DRAM
    pin: str = "none"
    pin_ttl_seconds: float = 0.0
    ttl_seconds: float = 0.0  # 0 = no expiry

    def validate(self) -> None:
        if self.tier is not None and self.tier not in TIERS and self.tier != SHARED:
            raise InvalidArgumentError(f"unknown tier {self.tier!r}")
        if self.pin not in PINS:
            raise InvalidArgumentError(f"unknown pin {self.pin!r}")
        for name, value in (("pin_ttl_seconds", self.pin_ttl_seconds), ("ttl_seconds", self.ttl_seconds)):
            if not (0 <= value < math.inf):  # also rejects NaN
                raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value}")


NO_OPTIONS = PutOptions()


class Replica(NamedTuple):
    """One copy of a version (its bytes: the version's size). Few distinct ones exist: the table
    shares them, and the tuples of them, between objects (a tuple: hashed and compared in C, as
    every put looks its replica set up)."""

    node_id: str
    address: str  # HOST:PORT of the node's data port
    tier: str     # where the node last said it keeps the bytes (a guess until it says)


class ObjectVersion(NamedTuple):
    """A tuple, not a dataclass: the table builds one for every read, and a frozen dataclass
    takes several times as long to make. Changed copies come from _replace()."""

    key: str
    size: int       # stored bytes (compressed size when compressed)
    checksum: int
    generation: int
    replicas: tuple[Replica, ...]
    options: PutOptions = NO_OPTIONS
    compressed: bool = False
    raw_size: int = 0
    expires_at: float | None = None  # table clock; None = never
    target_replicas: int = 1  # copies the master keeps; repair restores them after a node is lost

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now
