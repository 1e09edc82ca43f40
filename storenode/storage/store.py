"""The node's placement brain: which tier and extent each object gets, and when it goes.

Everything here is synchronous and runs on the event loop, so index and
allocators change atomically between awaits. Byte transfers live elsewhere
(tcp_session.py, ucx_session.py, tier_moves.py) and hold a record's refcount while they run: removing a
busy record only unindexes it (new READs get NOT_FOUND) and its extents are
freed when the last transfer releases it.
"""

import logging
import time
from typing import NamedTuple

from kvpool.protocol import inventory
from kvpool.errors import NoSpaceError, UnavailableError, ValueTooLargeError
from kvpool.protocol.inventory import DRAM_BIT, SSD_BIT, Entry
from kvpool.protocol.tenants import SCOPE_MARK_BYTE, NodeShare
from kvpool.protocol import wire
from kvpool.protocol.wire import WriteFlag

from kvpool.storenode.storage import eviction_order, policy, quota
from kvpool.storenode.storage.index import ObjectIndex, ObjectRecord
from kvpool.storenode.storage.ssd import StoredObject
from kvpool.storenode.storage.tenant_usage import TenantTable, TenantUsage
from kvpool.storenode.storage.tiers import StorageTier

log = logging.getLogger(__name__)

MAX_EVICTED_LISTED = 100_000  # bound on the REPORT backlog if nobody polls
ROOM_BATCH = 16  # victims taken from a tier's order at a time while making room
# Plain ints: IntFlag arithmetic is slow on the per-request path.
_HARD_PIN, _PREFER_SSD, _TO_SHARED = int(WriteFlag.HARD_PIN), int(WriteFlag.PREFER_SSD), int(WriteFlag.TO_SHARED)
_new_reservation = tuple.__new__  # a NamedTuple from a tuple, without its Python-level constructor
MOVED = wire.MOVED_TO_SHARED  # the reason an object leaves the node for the shared tier (storenode/background/shared_tier.py)
STAGED = "staged"  # one a WRITE made room with, its bytes kept until written to the shared tier (then MOVED)
_NOT_PRESSURE = ("expired", "torn", quota.QUOTA, MOVED, STAGED)  # eviction reasons other than pool pressure


class Reservation(NamedTuple):
    tier: StorageTier
    offset: int
    hard_pinned: int  # bytes counted against the hard-pin quota until commit or abort
    pending: tuple | None  # (usage, bytes) counted against a tenant's quota until commit or abort


class ObjectStore:
    def __init__(self, dram: StorageTier, ssd: StorageTier | None = None, *, mode: str = policy.LRU,
                 hard_pin_quota: int = 0, max_hold: float = 300.0, promote_after: int = 2,
                 promote_window: float = 60.0, clock=time.time):
        self.dram, self.ssd = dram, ssd
        self.tiers = [dram] + ([ssd] if ssd else [])
        for tier in self.tiers:  # the store's policy decides how each tier orders its members
            tier.members = eviction_order.new_order(mode)
        self.coldness = eviction_order.coldness(mode)
        self.tenants = TenantTable(mode, self.tiers)
        self.spare_victims = quota.SpareVictims()  # make_room's, once tenants are met
        self.index = ObjectIndex()
        self.mode = mode
        self.hard_pin_quota = hard_pin_quota
        self.max_hold = max_hold
        self.promote_after, self.promote_window = promote_after, promote_window
        self.clock = clock
        self.on_pressure = lambda: None  # the maintenance task hooks in here
        self.on_dropped = lambda: None  # the server hooks in here: an EVICTIONS request may be waiting
        self._reserved_hard = 0
        self._evicted: list[list] = []
        self.to_share: list[ObjectRecord] = []  # put(tier="shared") objects the sweep moves on to the shared tier
        # With a shared tier (storenode/background/shared_tier.py): stage(rec) keeps a victim's bytes to write there rather
        # than lose it (False: no room to keep it); unstage(key, generation) forgets one the master freed.
        self.stage = None
        self.unstage = None

    def set_tenant_shares(self, shares: dict[str, NodeShare]) -> None:
        """The tenants' shares of their limits to keep from now on (tenant_usage.py, quota.py); a tenant
        absent has none. A lowered quota is brought down by the tenant's next write or the next sweep."""
        self.tenants.set_shares(shares)

    # -- WRITE: reserve an extent, receive into it, then commit (or abort)

    def reserve(self, key: bytes, size: int, flags: int, dram_only: bool = False) -> Reservation:
        """An extent for a new object: preferred tier, then the other, then after evicting; else NoSpaceError
        (QuotaExceededError: its tenant's share would not hold it). dram_only: a writer that fills the
        extent through the shared mapping."""
        usage = self.tenants.none
        if key.startswith(SCOPE_MARK_BYTE):
            usage = self.tenants.of_key(key)
        elif not flags & (_PREFER_SSD | _HARD_PIN):  # the everyday write: DRAM first, if it has room now
            dram = self.dram
            offset = dram.alloc.allocate(dram.segment.extent_length(len(key), size))
            if offset is not None:
                return _new_reservation(Reservation, (dram, offset, 0, None))
        try:
            return self._reserve(key, size, flags, dram_only, usage)
        except NoSpaceError:
            if not dram_only:  # refused through the shared mapping, a client writes through the socket
                usage.refused += 1
            raise

    @property
    def placing_ssd(self) -> bool:
        """Whether new objects and demotions may go to SSD: there is one, and its disk does not fail now."""
        return self.ssd is not None and self.ssd.fault is None

    def _reserve(self, key: bytes, size: int, flags: int, dram_only: bool, usage: TenantUsage) -> Reservation:
        if dram_only:
            order = [self.dram]
        else:
            order = [self.ssd, self.dram] if flags & _PREFER_SSD and self.ssd else self.tiers
        order = [tier for tier in order if tier.fits_ever(len(key), size)]
        failing = [tier for tier in order if tier.fault is not None]
        if failing:  # a disk that fails takes nothing new until it answers again
            order = [tier for tier in order if tier.fault is None]
            if not order:
                raise UnavailableError(f"{size} bytes fit only the {failing[0].name} tier, which fails now: "
                                       f"{failing[0].fault}")
        if not order:
            raise ValueTooLargeError(f"{size} bytes do not fit in any tier of this node "
                                     f"({', '.join(f'{t.name} {t.capacity}' for t in self.tiers)} bytes)")
        hard = size if flags & _HARD_PIN else 0
        if hard and not policy.hard_pin_fits(self.index.hard_pinned_bytes + self._reserved_hard, size,
                                             self.hard_pin_quota):
            raise NoSpaceError(f"hard-pin quota of {self.hard_pin_quota} bytes exceeded: "
                               f"{self.index.hard_pinned_bytes + self._reserved_hard} pinned, {size} more asked")
        limited = usage.limited
        if limited:
            if dram_only and self.placing_ssd and not quota.tier_has_room(usage, self.dram, size):
                self.on_pressure()  # as for a full DRAM below: the socket's WRITE spills to SSD
                raise NoSpaceError(f"tenant {usage.name!r} is at its DRAM share; write through the socket")
            order = quota.admit(self, usage, order, size)
        for tier in order:
            offset = tier.alloc.allocate(tier.segment.extent_length(len(key), size))
            if offset is not None:
                return self._reserved(tier, offset, hard, usage if limited else None, size)
        if dram_only and self.placing_ssd:
            # Making room in DRAM here would throw away objects the sweep could demote; a WRITE
            # over the socket can land on SSD (or make room there, where the coldest data is).
            self.on_pressure()
            raise NoSpaceError(f"DRAM full ({self.dram.used}/{self.dram.capacity} used); write through the socket")
        # The coldest data lives in the last tier: make room there first.
        for tier in reversed(self.tiers):
            if tier in order and tier.fault is None:
                offset = self.make_room(tier, tier.segment.extent_length(len(key), size), usage)
                if offset is not None:
                    return self._reserved(tier, offset, hard, usage if limited else None, size)
        raise NoSpaceError(f"no room for {size} bytes: " + ", ".join(
            f"{t.name} {t.used}/{t.capacity} used" for t in self.tiers) + "; nothing more may be evicted")

    def _reserved(self, tier: StorageTier, offset: int, hard: int, limited: TenantUsage | None,
                  size: int) -> Reservation:
        self._reserved_hard += hard
        if limited is None:
            return Reservation(tier, offset, hard, None)
        limited.pend(tier.number, size, 1)
        return Reservation(tier, offset, hard, (limited, size))

    def abort(self, res: Reservation) -> None:
        """Give back a reservation whose payload never arrived whole (no header was written)."""
        self._reserved_hard -= res.hard_pinned
        if res.pending is not None:
            res.pending[0].pend(res.tier.number, res.pending[1], -1)
        res.tier.alloc.free(res.offset)

    def new_record(self, key: bytes, generation: int, size: int, value_checksum: int, flags: int,
                   raw_size: int, ttl_ms: int, soft_pin_ms: int) -> ObjectRecord:
        now = self.clock()
        # (positional: expires_at, soft_pin_until, hold_until, dram, ssd, last_access)
        tenants = self.tenants
        rec = ObjectRecord(key, generation, size, value_checksum, flags, raw_size or size,
                           now + ttl_ms / 1000 if ttl_ms else 0.0, now + soft_pin_ms / 1000 if soft_pin_ms else 0.0,
                           0.0, None, None, now)
        rec.tenant = tenants.of_key(key) if key.startswith(SCOPE_MARK_BYTE) else tenants.none
        return rec

    def commit(self, res: Reservation, rec: ObjectRecord) -> None:
        """Make a fully received object visible (an older copy of the same version is dropped)."""
        tier, offset, hard_pinned, pending = res
        if hard_pinned:
            self._reserved_hard -= hard_pinned
        if pending is not None:
            pending[0].pend(tier.number, pending[1], -1)
        if tier is self.dram:
            rec.dram = offset
        else:
            rec.ssd = offset
        old = self.index.add(rec)
        if old is not None:
            self._unindexed(old, reason=None)
        usage = rec.tenant
        usage.objects += 1
        usage.bytes += rec.size
        self.join_tier(tier, rec)
        if rec.flags & _TO_SHARED:
            self.to_share.append(rec)
            self.on_pressure()
        elif tier.alloc.used > tier.high_bytes:  # above the high watermark (tier.excess() > 0), cheaply
            self.on_pressure()

    # -- READ and friends

    def lookup(self, key: bytes, generation: int):
        """(record, None) if readable, else (None, "stale" | "missing")."""
        rec = self.index.get(key, generation)
        if rec is None:
            return None, "stale" if self.index.has_key(key) else "missing"
        if rec.expires_at and policy.expired(rec, self.clock()):
            self.evict(rec, "expired")
            return None, "missing"
        return rec, None

    def count_read(self, rec: ObjectRecord, from_dram: bool) -> bool:
        """Account a READ served; True when an SSD-only object has earned a promotion."""
        now = self.clock()
        rec.last_access = now
        rec.hits += 1
        usage = rec.tenant
        usage.hits += 1
        if rec.dram is not None:
            usage.orders[0].touch(rec)
        if rec.ssd is not None:
            usage.orders[1].touch(rec)
        if from_dram:
            self.dram.hits += 1
            return False
        self.dram.misses += 1
        self.ssd.hits += 1
        promote = policy.count_hit_for_promotion(rec, now, self.promote_window, self.promote_after)
        return promote and not rec.promoting and rec.dram is None

    def count_miss(self, key: bytes = b"") -> None:
        """A READ of `key` answered NOT_FOUND or STALE."""
        for tier in self.tiers:
            tier.misses += 1
        self.tenants.of_key(key).misses += 1

    def acquire(self, rec: ObjectRecord) -> None:
        rec.refcount += 1

    def release(self, rec: ObjectRecord) -> None:
        rec.refcount -= 1
        if rec.refcount == 0 and not rec.live:
            self._free_extents(rec)

    def free(self, key: bytes, generation: int) -> bool:
        """FREE from the master: forget the object (its bytes go once no transfer uses them)."""
        rec = self.index.get(key, generation)
        if rec is None:
            return bool(self.unstage and self.unstage(key, generation))
        self.index.remove(rec)
        self._unindexed(rec, reason=None)
        return True

    def hold(self, key: bytes, generation: int, ms: int) -> bool:
        rec, _ = self.lookup(key, generation)
        if rec is None:
            return False
        now = self.clock()
        rec.hold_until = max(rec.hold_until, now + min(ms / 1000, self.max_hold))
        return True

    # -- eviction and tier moves

    def evict(self, rec: ObjectRecord, reason: str) -> None:
        """Drop an object for good on the node's own decision; the master learns it from REPORT."""
        if self.index.remove(rec):
            if log.isEnabledFor(logging.DEBUG):  # the name costs more than the eviction
                log.debug("evicting %s (%s)", rec.name, reason)
            self._unindexed(rec, reason=reason)

    def moved_to_shared(self, rec: ObjectRecord, reason: str = MOVED) -> None:
        """An object now in the shared tier leaves this node (the master learns it as MOVED, not lost), or
        (STAGED) one whose bytes are kept until they are (the master learns it then)."""
        if self.index.remove(rec):
            self._unindexed(rec, reason=reason)

    def drop_copy(self, rec: ObjectRecord, tier: StorageTier) -> None:
        """Free one tier's copy of an idle object that keeps a copy in another tier."""
        offset = getattr(rec, tier.name)
        assert rec.refcount == 0 and offset is not None and (rec.dram, rec.ssd).count(None) == 0
        self._leave(tier, rec)
        setattr(rec, tier.name, None)
        self.free_extent(tier, offset)

    def release_from(self, tier: StorageTier, rec: ObjectRecord) -> None:
        """Make room in `tier` by one victim: keep it elsewhere if it has another copy, else evict it."""
        if rec.dram is not None and rec.ssd is not None:
            self.drop_copy(rec, tier)
            if tier is self.dram:
                tier.demotions += 1
        elif self.stage is None or not self.stage(rec):  # kept to move on to the shared tier, or lost
            self.evict(rec, tier.full)

    def expire_due(self) -> int:
        due = self.index.due(self.clock())
        for rec in due:
            self.evict(rec, "expired")
        return len(due)

    def victims(self, tier: StorageTier, need: int | None, limit: int, writer: TenantUsage | None = None,
                protect: bool = True) -> list[ObjectRecord]:
        """What pool pressure gives up of `tier` first (quota.pressure_victims: coldest first across tenants,
        a tenant other than `writer` only above its reserve unless `protect` is off, i.e. for demotions)."""
        return quota.pressure_victims(self, tier, need, limit, writer, protect)

    def adopt(self, offset: int, obj: StoredObject) -> bool:
        """Index an object found intact on the SSD at start; False if that version is indexed already.

        A version is found twice only if the node died between writing a
        rewritten copy and clearing the old one: either copy is whole.
        """
        if self.index.get(obj.key, obj.generation) is not None:
            return False
        self.ssd.alloc.claim(offset, self.ssd.segment.extent_length(len(obj.key), obj.size))
        rec = ObjectRecord(obj.key, obj.generation, obj.size, obj.checksum, obj.flags, obj.raw_size,
                           expires_at=obj.expires_ms / 1000, ssd=offset, last_access=self.clock(),
                           tenant=self.tenants.of_key(obj.key))
        self.index.add(rec)
        rec.tenant.objects += 1
        rec.tenant.bytes += rec.size
        self.join_tier(self.ssd, rec)
        return True

    def note_dropped(self, key: bytes, generation: int, how: str | None = None) -> None:
        """List an object the node lost on its own (e.g. found torn) for the next REPORT, or (`how`) one it
        moved to the shared tier or copied from there (wire.MOVED_TO_SHARED, PROMOTED_FROM_SHARED)."""
        if len(self._evicted) < MAX_EVICTED_LISTED:
            name = key.decode("utf-8", "surrogateescape")
            self._evicted.append([name, generation] if how is None else [name, generation, how])
            self.on_dropped()

    def has_dropped(self) -> bool:
        return bool(self._evicted)

    def take_dropped(self) -> list[list]:
        """The objects dropped since the last REPORT or call, [key, generation] each, for the master."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def stored_object(self, rec: ObjectRecord) -> StoredObject:
        return StoredObject(rec.key, rec.generation, rec.size, rec.checksum, rec.flags, rec.raw_size,
                            int(rec.expires_at * 1000))

    # -- REPORT / INVENTORY

    def report(self, node_id: str) -> dict:
        tiers = {tier.name: tier.stats() for tier in self.tiers}
        return {"node_id": node_id, "tiers": tiers, "evicted": self.take_dropped(), "tenants": self.tenants.report()}

    def inventory(self) -> list[Entry]:
        return inventory.decode(b"".join(self.inventory_reply()))

    def inventory_reply(self) -> list:
        """Every live object, as the buffers of the INVENTORY reply (kvpool/protocol/inventory.py)."""
        return self.index.columns.reply_parts(self.clock())

    # -- bookkeeping

    def make_room(self, tier: StorageTier, length: int, writer: TenantUsage | None = None) -> int | None:
        """Give up victims of `tier` one by one until an extent of `length` fits; its offset, or None.
        What ran out of time goes first; then the coldest, taken a few at a time off the tier's order
        (off the tenants' orders, sparing those at their reserve but the writer's: self.victims)."""
        if self.expire_due():
            offset = tier.alloc.allocate(length)
            if offset is not None:
                return offset
        if not self.tenants.named():  # a node without tenants: off the tier's order, as it always was
            pick = lambda: policy.victims(tier.members, self.clock(), ROOM_BATCH)  # noqa: E731
        else:
            pick = lambda: self.spare_victims.take(self, tier, writer, ROOM_BATCH)  # noqa: E731
        while batch := pick():
            before = tier.objects
            for rec in batch:
                self.release_from(tier, rec)
                offset = tier.alloc.allocate(length)
                if offset is not None:
                    return offset
            if tier.objects >= before:  # nothing left the tier: no way to make room
                break
        return None

    def _unindexed(self, rec: ObjectRecord, reason: str | None) -> None:
        """After index.remove: leave the tiers now, free the bytes once no transfer uses them."""
        for tier, offset in ((self.dram, rec.dram), (self.ssd, rec.ssd)):
            if offset is not None:
                self._leave(tier, rec)
                if reason is MOVED or reason is STAGED:
                    tier.demotions += 1
                elif reason:
                    tier.evictions += 1
                    tier.evicted_bytes += rec.size
        usage = rec.tenant
        usage.objects -= 1
        usage.bytes -= rec.size
        if reason:
            if reason is quota.QUOTA:
                usage.evicted_quota += 1
            elif reason not in _NOT_PRESSURE:
                usage.evicted_pressure += 1
            if reason is not STAGED:  # (a staged one is told of once written)
                self.note_dropped(rec.key, rec.generation, MOVED if reason is MOVED else None)
        if rec.refcount == 0:
            self._free_extents(rec)

    def _free_extents(self, rec: ObjectRecord) -> None:
        offset = rec.dram
        if offset is not None:
            rec.dram = None
            self.dram.alloc.free(offset)
        offset = rec.ssd
        if offset is not None:
            rec.ssd = None
            self.free_extent(self.ssd, offset)

    def free_extent(self, tier: StorageTier, offset: int) -> None:
        if tier is self.ssd:
            tier.segment.clear_header(offset)  # before reuse, so a restart never revives it
        tier.alloc.free(offset)

    def join_tier(self, tier: StorageTier, rec: ObjectRecord) -> None:
        usage, number = rec.tenant, tier.number
        usage.orders[number].add(rec)
        usage.tier_bytes[number] += rec.size
        tier.objects += 1
        self.index.columns.join(rec, DRAM_BIT if tier is self.dram else SSD_BIT)
        if rec.flags & _HARD_PIN:
            tier.pinned_bytes += rec.size

    def _leave(self, tier: StorageTier, rec: ObjectRecord) -> None:
        self.index.columns.leave(rec, DRAM_BIT if tier is self.dram else SSD_BIT)
        usage, number = rec.tenant, tier.number
        if usage.orders[number].discard(rec):
            usage.tier_bytes[number] -= rec.size
            tier.objects -= 1
            if rec.flags & _HARD_PIN:
                tier.pinned_bytes -= rec.size
