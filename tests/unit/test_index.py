"""The node's object index and store logic on real (small, temporary) segments, without a server."""

import os
import random

import pytest

from kvpool.protocol import inventory
from kvpool.protocol.checksum import checksum
from kvpool.protocol.inventory import DRAM_BIT, SSD_BIT, Entry
from kvpool.storenode.storage import policy
from kvpool.errors import NoSpaceError, ValueTooLargeError
from kvpool.storenode.storage.dram import DramSegment, remove_stale_segments, segment_name
from kvpool.storenode.storage.index import ObjectIndex, ObjectRecord
from kvpool.storenode.storage.recovery import recover
from kvpool.storenode.storage.ssd import SsdSegment
from kvpool.storenode.storage.store import ObjectStore
from kvpool.storenode.storage.tiers import StorageTier
from kvpool.protocol.wire import WriteFlag
from allocator_state import free_extents
from small_store import Clock, make_store  # noqa: F401 (a fixture)


# -- ObjectIndex

def test_index_by_key_and_generation():
    index = ObjectIndex()
    a1, a2 = ObjectRecord(b"a", 1, 10, 0), ObjectRecord(b"a", 2, 20, 0)
    assert index.add(a1) is None and index.add(a2) is None
    assert index.get(b"a", 1) is a1 and index.get(b"a", 2) is a2 and index.get(b"a", 3) is None
    assert index.has_key(b"a") and not index.has_key(b"b")
    again = ObjectRecord(b"a", 1, 11, 0)
    assert index.add(again) is a1 and not a1.live  # same version again replaces the old record
    assert len(index) == 2 and set(index) == {again, a2}
    assert index.remove(a2) and not index.remove(a2)
    assert index.remove(again) and not index.has_key(b"a") and len(index) == 0


def test_index_counts_hard_pinned_bytes_and_queues_expiry():
    index = ObjectIndex()
    pinned = ObjectRecord(b"p", 1, 500, 0, flags=WriteFlag.HARD_PIN)
    soon = ObjectRecord(b"s", 1, 10, 0, expires_at=5.0)
    later = ObjectRecord(b"l", 1, 10, 0, expires_at=50.0)
    for rec in (pinned, soon, later):
        index.add(rec)
    assert index.hard_pinned_bytes == 500
    assert index.due(4.9) == []
    assert index.due(10.0) == [soon]
    index.remove(later)
    assert index.due(100.0) == []  # removed records leave the queue unseen
    index.remove(pinned)
    assert index.hard_pinned_bytes == 0


def test_records_gone_before_their_ttl_do_not_pile_up_in_the_expiry_queue():
    import random

    index, rng = ObjectIndex(), random.Random(5)
    live = {}
    for i in range(20_000):  # a client writing with long TTLs and removing (or being evicted) at once
        rec = ObjectRecord(b"k%d" % i, 1, 10, 0, expires_at=1e6 + rng.random() * 1e6)
        index.add(rec)
        if i % 10 == 0:
            live[rec.key] = rec
        else:
            index.remove(rec)
        assert len(index._expiry) <= 2 * len(live) + 1025
    assert len(index._expiry) < 5000  # 2,000 live; without the rebuild 20,000 stay queued until their TTL
    due = index.due(1.5e6)  # still exactly the live records past their TTL, once each
    assert sorted(r.key for r in due) == sorted(k for k, r in live.items() if r.expires_at <= 1.5e6)
    assert sorted(r.key for r in index.due(3e6)) == sorted(k for k, r in live.items() if r.expires_at > 1.5e6)


# -- ObjectStore

def put(store: ObjectStore, key: bytes, data: bytes, generation: int = 1, flags: int = 0, ttl_ms: int = 0,
        soft_pin_ms: int = 0) -> ObjectRecord:
    """What the server does for a WRITE, minus the socket."""
    res = store.reserve(key, len(data), flags)
    if res.tier is store.dram:
        store.dram.segment.view(res.offset, len(data))[:] = data
    else:
        segment = res.tier.segment
        segment.pwrite_all(key, segment.key_offset(res.offset))
        segment.pwrite_all(data, segment.payload_offset(res.offset, len(key)))
    rec = store.new_record(key, generation, len(data), checksum(data), flags, 0, ttl_ms, soft_pin_ms)
    if res.tier is not store.dram:
        res.tier.segment.write_header(res.offset, store.stored_object(rec))
    store.commit(res, rec)
    return rec


def test_write_falls_back_to_ssd_then_evicts_coldest(make_store):
    store = make_store(dram=8192, ssd=4 * 4096)
    a = put(store, b"a", b"x" * 8000)
    assert a.dram is not None
    b = put(store, b"b", b"y" * 3000)  # DRAM has no room: SSD
    assert (b.dram, b.ssd) == (None, 0)
    store.clock.now += 1
    for key in (b"c", b"d", b"e"):
        put(store, key, b"z" * 3000)
        store.clock.now += 1
    assert store.ssd.used == 4 * 4096
    put(store, b"f", b"w" * 3000)  # full: the coldest SSD object (b) goes
    assert not b.live and store.lookup(b"b", 1) == (None, "missing")
    assert store.report("n")["evicted"] == [["b", 1]]
    assert store.ssd.evictions == 1 and store.ssd.evicted_bytes == 3000


def test_a_shared_memory_write_into_full_dram_evicts_nothing_when_an_ssd_can_take_it(make_store):
    store = make_store(dram=8192, ssd=4 * 4096)
    a = put(store, b"a", b"x" * 8000)
    pressed = []
    store.on_pressure = lambda: pressed.append(True)
    with pytest.raises(NoSpaceError, match="through the socket"):
        store.reserve(b"b", 3000, 0, dram_only=True)
    assert a.live and a.dram is not None and store.dram.evictions == 0 and pressed  # the sweep is woken instead
    assert put(store, b"b", b"y" * 3000).ssd is not None  # the socket WRITE the client falls back to
    only_dram = make_store(dram=8192)
    put(only_dram, b"a", b"x" * 8000)
    assert only_dram.reserve(b"b", 3000, 0, dram_only=True).tier is only_dram.dram  # no SSD: room is made


def test_nothing_evictable_is_no_space_and_too_big_is_too_large(make_store):
    store = make_store(dram=8192, hard_pin_quota=8192)
    put(store, b"pinned", b"p" * 4096, flags=WriteFlag.HARD_PIN)
    held = put(store, b"held", b"h" * 4096)
    assert store.hold(b"held", 1, 60_000)
    with pytest.raises(NoSpaceError, match="nothing more may be evicted"):
        store.reserve(b"new", 100, 0)
    with pytest.raises(ValueTooLargeError):
        store.reserve(b"huge", 8193, 0)
    store.clock.now += 61
    assert store.reserve(b"new", 100, 0).offset is not None  # the hold lapsed: held was evicted
    assert not held.live


def test_hold_is_capped_by_max_hold(make_store):
    store = make_store(max_hold=2.0)
    rec = put(store, b"k", b"v" * 10)
    assert store.hold(b"k", 1, 3_600_000)
    assert rec.hold_until == store.clock.now + 2.0
    assert store.hold(b"k", 1, 100)  # a shorter hold never shortens one in force
    assert rec.hold_until == store.clock.now + 2.0
    assert not store.hold(b"k", 2, 100)


def test_hard_pin_quota_counts_pending_writes(make_store):
    store = make_store(dram=64 * 1024, hard_pin_quota=1000)
    res = store.reserve(b"a", 600, WriteFlag.HARD_PIN)
    with pytest.raises(NoSpaceError, match="quota"):
        store.reserve(b"b", 600, WriteFlag.HARD_PIN)
    store.abort(res)
    put(store, b"b", b"b" * 600, flags=WriteFlag.HARD_PIN)
    assert store.dram.pinned_bytes == 600
    with pytest.raises(NoSpaceError, match="quota"):
        store.reserve(b"c", 401, WriteFlag.HARD_PIN)
    assert store.free(b"b", 1)
    assert store.dram.pinned_bytes == 0
    store.reserve(b"c", 1000, WriteFlag.HARD_PIN)


def test_busy_records_are_freed_only_when_the_transfer_ends(make_store):
    store = make_store(dram=8192)
    rec = put(store, b"k", b"v" * 4096)
    store.acquire(rec)
    assert store.free(b"k", 1)
    assert store.lookup(b"k", 1) == (None, "missing")  # unindexed at once...
    assert store.dram.used == 4096 and rec.dram is not None  # ...but its bytes stay for the reader
    with pytest.raises(NoSpaceError):
        store.reserve(b"other", 8192, 0)
    store.release(rec)
    assert store.dram.used == 0 and rec.dram is None
    # Busy records are never chosen as victims either.
    busy = put(store, b"busy", b"b" * 8192)
    store.acquire(busy)
    with pytest.raises(NoSpaceError):
        store.reserve(b"x", 64, 0)
    store.release(busy)
    assert store.reserve(b"x", 64, 0)


def test_expired_objects_are_not_served_and_are_listed(make_store):
    store = make_store()
    put(store, b"t", b"v" * 10, ttl_ms=500)
    assert store.lookup(b"t", 1)[0] is not None
    store.clock.now += 0.5
    assert store.lookup(b"t", 1) == (None, "missing")
    assert store.report("n")["evicted"] == [["t", 1]]
    put(store, b"u", b"v" * 10, ttl_ms=500)
    store.clock.now += 1
    assert store.expire_due() == 1 and store.inventory() == []


def test_expired_objects_go_before_the_coldest_live_one(make_store):
    store = make_store(dram=4 * 4096)
    cold = put(store, b"cold", b"c" * 4000)
    store.clock.now += 1
    soon = put(store, b"soon", b"s" * 4000, ttl_ms=2000, soft_pin_ms=60_000)  # pins do not keep it
    store.clock.now += 1
    put(store, b"later", b"l" * 4000, ttl_ms=60_000)
    put(store, b"hot", b"h" * 4000)
    store.clock.now += 5
    put(store, b"new", b"n" * 4000)  # full: what ran out goes, however recently used
    assert not soon.live and cold.live
    assert store.report("n")["evicted"] == [["soon", 1]]
    put(store, b"newer", b"n" * 4000)  # then the coldest
    assert not cold.live


def test_reads_keep_objects_warm_lru_and_lfu(make_store):
    # LRU keeps what was read last; LFU what was read most, and an unread newcomer goes first.
    for mode, survivors in (("lru", {b"b", b"d", b"e"}), ("lfu", {b"a", b"b", b"e"})):
        store = make_store(dram=3 * 4096, mode=mode)
        a = put(store, b"a", b"a" * 4000)
        for _ in range(3):
            store.count_read(a, from_dram=True)
        store.clock.now += 1
        b = put(store, b"b", b"b" * 4000)
        put(store, b"c", b"c" * 4000)
        store.count_read(b, from_dram=True)  # the most recent read; a has the most
        put(store, b"d", b"d" * 4000)
        put(store, b"e", b"e" * 4000)
        assert {r.key for r in store.index} == survivors, mode


def test_soft_pinned_go_only_after_unpinned(make_store):
    store = make_store(dram=4 * 1024)
    soft = put(store, b"soft", b"s" * 1024, soft_pin_ms=60_000)
    store.clock.now += 1
    plain = []
    for i in range(3):
        plain.append(put(store, b"p%d" % i, b"p" * 1024))
        store.clock.now += 1
    put(store, b"new", b"n" * 1024)
    assert soft.live and not plain[0].live and plain[1].live
    store.clock.now += 61  # the soft pin lapsed: now it is the coldest
    put(store, b"new2", b"n" * 1024)
    assert not soft.live and plain[1].live


def test_dram_copy_of_an_object_also_on_ssd_is_dropped_before_anything_is_lost(make_store):
    store = make_store(dram=4096, ssd=8 * 4096)
    rec = put(store, b"both", b"b" * 4096)
    rec.ssd = store.ssd.alloc.allocate(store.ssd.extent_length(rec))
    store.join_tier(store.ssd, rec)
    other = put(store, b"other", b"o" * 4096, flags=WriteFlag.PREFER_SSD)  # SSD has room: no eviction at all
    assert other.ssd is not None and rec.dram is not None
    store.release_from(store.dram, rec)
    assert rec.live and rec.dram is None and rec.ssd is not None and store.dram.demotions == 1


# -- recovery

def test_recovery_adopts_intact_objects_and_drops_torn_and_expired(make_store, tmp_path):
    clock = Clock()
    clock.now = 2_000_000_000.0  # recovery compares expiry with the real clock: keep these valid
    store = make_store(dram=4096, ssd=64 * 4096, clock=clock)
    good = [os.urandom(n) for n in (1, 4000, 20_000)]
    for i, data in enumerate(good):
        put(store, b"good%d" % i, data, generation=10 + i, flags=WriteFlag.PREFER_SSD)
    torn_data = os.urandom(9000)
    torn = put(store, b"torn", torn_data, generation=7, flags=WriteFlag.PREFER_SSD)
    freed = put(store, b"freed", os.urandom(100), generation=8, flags=WriteFlag.PREFER_SSD)
    clock.now = 1.0
    put(store, b"expired", os.urandom(100), generation=9, flags=WriteFlag.PREFER_SSD, ttl_ms=1000)
    clock.now = 2_000_000_000.0
    # Stored before nodes bounded generations: a master adopting it could never place the key again.
    put(store, b"poisoned", os.urandom(100), generation=2**64 - 1, flags=WriteFlag.PREFER_SSD)
    segment = store.ssd.segment
    segment.pwrite_all(bytes([torn_data[5000] ^ 0xFF]), segment.payload_offset(torn.ssd, len(b"torn")) + 5000)
    # Key and payload written but no header: a WRITE killed mid-way.
    segment.pwrite_all(b"half written", 60 * 4096 + 200)
    store.free(b"freed", 8)
    assert freed.ssd is None
    ssd_dir = os.path.dirname(segment.path)
    segment.close()

    again = ObjectStore(StorageTier(DramSegment(4096, "r", directory=str(tmp_path)), 0.9, 0.75),
                        StorageTier(SsdSegment(ssd_dir, 64 * 4096), 0.9, 0.75))
    try:
        assert recover(again) == {"ok": 3, "torn": 1, "expired": 1, "duplicate": 0, "out_of_range": 1}
        inv = {(e.key, e.generation): e for e in again.inventory()}
        assert set(inv) == {("good0", 10), ("good1", 11), ("good2", 12)}
        for i, data in enumerate(good):
            rec, _ = again.lookup(b"good%d" % i, 10 + i)
            buf = bytearray(rec.size)
            again.ssd.segment.pread_into(buf, again.ssd.segment.payload_offset(rec.ssd, len(rec.key)))
            assert bytes(buf) == data and rec.checksum == checksum(data)
        assert sorted(again.report("n")["evicted"]) == [["expired", 9], ["poisoned", 2**64 - 1], ["torn", 7]]
        assert again.ssd.used == sum(again.ssd.alloc.aligned(again.ssd.extent_length(r)) for r in again.index)
        # Dropped headers were cleared: a second restart finds only the intact objects.
        again.ssd.segment.close()
        third = StorageTier(SsdSegment(ssd_dir, 64 * 4096), 0.9, 0.75)
        again.tiers[1] = again.ssd = third
        again.index = ObjectIndex()
        assert recover(again) == {"ok": 3, "torn": 0, "expired": 0, "duplicate": 0, "out_of_range": 0}
    finally:
        for tier in again.tiers:
            tier.segment.close()


def test_ssd_segment_is_locked_while_in_use(tmp_path):
    from kvpool.errors import UnavailableError

    first = SsdSegment(str(tmp_path), 4096)
    try:
        with pytest.raises(UnavailableError, match="in use"):
            SsdSegment(str(tmp_path), 4096)
    finally:
        first.close()
    SsdSegment(str(tmp_path), 4096).close()


def test_stale_dram_segments_are_removed_unless_in_use(tmp_path):
    live = DramSegment(4096, segment_name("c", "n1", "a" * 32), directory=str(tmp_path))
    stale = tmp_path / segment_name("c", "n1", "b" * 32)
    stale.write_bytes(b"x")
    other_node = tmp_path / segment_name("c", "n1-x", "c" * 32)
    other_node.write_bytes(b"x")
    try:
        assert remove_stale_segments("c", "n1", str(tmp_path)) == [str(stale)]
        assert os.path.exists(live.path) and other_node.exists()
    finally:
        live.close()


def test_recovery_keeps_one_copy_of_a_version_found_twice(tmp_path):
    from kvpool.storenode.storage.ssd import StoredObject

    segment = SsdSegment(str(tmp_path / "ssd"), 16 * 4096)
    data = os.urandom(5000)
    obj = StoredObject(b"k", 3, len(data), checksum(data), 0, len(data), 0)
    for offset in (0, 8 * 4096):  # a rewrite whose old copy was never cleared
        segment.write_object(offset, obj, data)
    store = ObjectStore(StorageTier(DramSegment(4096, "d", directory=str(tmp_path)), 0.9, 0.75),
                        StorageTier(segment, 0.9, 0.75))
    try:
        assert recover(store) == {"ok": 1, "torn": 0, "expired": 0, "duplicate": 1, "out_of_range": 0}
        assert [(e.key, e.generation) for e in store.inventory()] == [("k", 3)]
        assert store.ssd.used == 2 * 4096 and segment.read_header(8 * 4096) is None
    finally:
        for tier in store.tiers:
            tier.segment.close()


def test_allocator_claim_carves_a_given_extent():
    from kvpool.storenode.storage.allocator import ExtentAllocator

    alloc = ExtentAllocator(64 * 1024, alignment=4096)
    assert alloc.claim(8192, 5000) == 8192
    assert free_extents(alloc) == [(0, 8192), (16384, 64 * 1024 - 16384)]
    with pytest.raises(ValueError):
        alloc.claim(12288, 4096)  # overlaps the claimed extent
    with pytest.raises(ValueError):
        alloc.claim(100, 10)  # unaligned
    assert alloc.claim(0, 8192) == 8192
    assert alloc.free(8192) == 8192 and alloc.free(0) == 8192
    assert free_extents(alloc) == [(0, 64 * 1024)]


# -- the INVENTORY reply, kept as columns (storenode/storage/inventory_columns.py), against the records themselves:
# random writes, overwrites, FREEs, evictions, copies gained and dropped between tiers, busy records and TTLs
# run out; after every step the reply holds exactly the live, unexpired records, as built from each record.

def from_records(store) -> list[Entry]:
    """The reply's entries built from each live record (what the node sent before keeping columns)."""
    now = store.clock()
    return [Entry(rec.key.decode(), rec.generation, rec.size, rec.checksum, rec.flags, rec.raw_size,
                  rec.ttl_ms(now),
                  (DRAM_BIT if rec.dram is not None else 0) | (SSD_BIT if rec.ssd is not None else 0))
            for rec in store.index if not policy.expired(rec, now)]


def check(store) -> None:
    assert sorted(store.inventory()) == sorted(from_records(store))


@pytest.mark.parametrize("seed", range(12))
def test_the_reply_follows_every_change_of_the_records(make_store, seed):
    rng = random.Random(seed)
    store = make_store(dram=16 * 4096, ssd=16 * 4096)
    generation = 0
    for _ in range(400):
        action = rng.random()
        live = list(store.index)
        if action < 0.45 or not live:
            generation += 1
            flags = rng.choice([0, 0, int(WriteFlag.PREFER_SSD)])
            try:
                put(store, f"k{rng.randrange(12)}".encode(), bytes([generation % 256]) * rng.randrange(1, 3000),
                    generation, flags=flags, ttl_ms=rng.choice([0, 0, 500, 5000]))
            except NoSpaceError:
                pass
        elif action < 0.55:
            rec = rng.choice(live)
            assert store.free(rec.key, rec.generation)
        elif action < 0.62:
            store.evict(rng.choice(live), "test")
        elif action < 0.75:  # a copy gained in the other tier (a demotion's or a promotion's end)
            rec = rng.choice(live)
            tier = store.ssd if rec.ssd is None else store.dram
            if rec.dram is None or rec.ssd is None:
                offset = tier.alloc.allocate(tier.extent_length(rec))
                if offset is not None:
                    setattr(rec, tier.name, offset)
                    store.join_tier(tier, rec)
        elif action < 0.85:  # one of two copies dropped
            both = [rec for rec in live if rec.dram is not None and rec.ssd is not None and not rec.refcount]
            if both:
                rec = rng.choice(both)
                store.drop_copy(rec, rng.choice(store.tiers))
        elif action < 0.92:  # a transfer holds a record across its FREE
            rec = rng.choice(live)
            store.acquire(rec)
            store.free(rec.key, rec.generation)
            check(store)
            store.release(rec)
        else:
            store.clock.now += rng.choice([0.1, 1.0, 3.0])
            if rng.random() < 0.5:
                store.expire_due()
        check(store)
    assert len(store.index) > 0


def test_expired_records_are_left_out_before_their_sweep(make_store):
    store = make_store()
    put(store, b"short", b"s" * 100, 1, ttl_ms=1000)
    put(store, b"long", b"l" * 100, 2, ttl_ms=10_000)
    put(store, b"none", b"n" * 100, 3)
    store.clock.now += 2.5
    entries = {e.key: e for e in store.inventory()}
    assert set(entries) == {"long", "none"}
    assert entries["long"].ttl_ms == 7500 and entries["none"].ttl_ms == 0
    assert entries["long"].tiers == DRAM_BIT


def test_slots_are_reused_and_the_reply_matches_the_old_encoding():
    index = ObjectIndex()
    a, b = ObjectRecord(b"a", 1, 10, 7, raw_size=10), ObjectRecord(b"bb", 2, 20, 8, raw_size=40)
    index.add(a)
    index.add(b)
    index.columns.join(a, DRAM_BIT)
    index.columns.join(b, SSD_BIT)
    assert (a.slot, b.slot) == (0, 1)
    index.remove(a)
    assert a.slot == -1
    c = ObjectRecord(b"ccc", 3, 30, 9, flags=4, raw_size=30)
    index.add(c)
    index.columns.join(c, DRAM_BIT | SSD_BIT)
    assert c.slot == 0  # a's slot again
    expected = inventory.encode([Entry("ccc", 3, 30, 9, 4, 30, 0, DRAM_BIT | SSD_BIT), Entry("bb", 2, 20, 8, 0, 40, 0, SSD_BIT)])
    assert index.columns.reply(0.0) == expected
