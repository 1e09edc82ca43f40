"""Validation of put's keyword options and their two encodings: PutOptions for the
master (which records them) and WriteOptions for the storage node (which acts on them)."""

import math

from kvpool.errors import InvalidArgumentError
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol.write_options import NO_OPTIONS, WriteOptions, lifetime_problem, placed_options

DEFAULT_SOFT_PIN_SECONDS = 600.0
# "object": the shared tier by the name it has when it is a bucket (--object-store): the same tier
TIERS = {None: pb.TIER_UNSPECIFIED, "dram": pb.DRAM, "ssd": pb.SSD, "shared": pb.SHARED, "object": pb.SHARED}
PINS = {None: pb.PIN_NONE, "soft": pb.PIN_SOFT, "hard": pb.PIN_HARD}


class PutChoices:
    """Resolved options of one put call (shared by every key of a batch_put)."""

    __slots__ = ("request", "prefer_ssd", "hard_pin", "soft_pin_seconds", "ttl_seconds", "to_shared")

    def __init__(self, request: pb.PutOptions | None, prefer_ssd: bool, hard_pin: bool, soft_pin_seconds: float,
                 ttl_seconds: float, to_shared: bool = False):
        self.request = request  # None when every option is the default: nothing to send
        self.prefer_ssd = prefer_ssd
        self.hard_pin = hard_pin
        self.soft_pin_seconds = soft_pin_seconds
        self.ttl_seconds = ttl_seconds
        self.to_shared = to_shared  # tier="shared": the node moves it on to the shared tier once stored

    def write_options(self, compressed: bool, raw_size: int) -> WriteOptions:
        """What the WRITE carries: the same as the leader seals (write_options.placed_options)."""
        if self.request is None and not compressed:
            return NO_OPTIONS
        return placed_options(self.prefer_ssd, self.hard_pin, self.soft_pin_seconds, self.ttl_seconds, compressed,
                              raw_size, self.to_shared)


DEFAULT_CHOICES = PutChoices(None, False, False, 0.0, 0.0)


def _seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive number of seconds or None, got {value!r}")
    problem = lifetime_problem(name, value)
    if problem:
        raise InvalidArgumentError(problem)
    return float(value)


def resolve(tier=None, pin=None, pin_ttl=None, ttl=None) -> PutChoices:
    """PutChoices for put's keywords; InvalidArgumentError for anything out of range."""
    if tier is None and pin is None and pin_ttl is None and ttl is None:
        return DEFAULT_CHOICES
    if not isinstance(tier, (str, type(None))) or tier not in TIERS:
        raise InvalidArgumentError(f"tier must be None, 'dram', 'ssd', 'shared' or 'object', got {tier!r}")
    if not isinstance(pin, (str, type(None))) or pin not in PINS:
        raise InvalidArgumentError(f"pin must be None, 'soft' or 'hard', got {pin!r}")
    if pin_ttl is not None and pin != "soft":
        raise InvalidArgumentError("pin_ttl applies to pin='soft' only")
    pin_seconds = 0.0
    if pin == "soft":
        pin_seconds = DEFAULT_SOFT_PIN_SECONDS if pin_ttl is None else _seconds("pin_ttl", pin_ttl)
    ttl_seconds = 0.0 if ttl is None else _seconds("ttl", ttl)
    request = pb.PutOptions(tier=TIERS[tier], pin=PINS[pin], pin_ttl_seconds=pin_seconds, ttl_seconds=ttl_seconds)
    return PutChoices(request, tier == "ssd", pin == "hard", pin_seconds, ttl_seconds, TIERS[tier] == pb.SHARED)


def hold_seconds(hold) -> float:
    """A valid exists(..., hold=) value: seconds >= 0 (0 = hold nothing)."""
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not math.isfinite(hold) or hold < 0:
        raise InvalidArgumentError(f"hold must be a number of seconds >= 0, got {hold!r}")
    return float(hold)


def replica_counts(replicas, min_replicas, default: int) -> tuple[int, int]:
    """(copies to write, copies that must succeed; 0 = all) for put's replicas/min_replicas."""
    count = default if replicas is None else replicas
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidArgumentError(f"replicas must be a positive integer, got {replicas!r}")
    if min_replicas is None:
        return count, 0
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or not 1 <= min_replicas <= count:
        raise InvalidArgumentError(f"min_replicas must be an integer from 1 to replicas ({count}), "
                                   f"got {min_replicas!r}")
    return count, min_replicas
