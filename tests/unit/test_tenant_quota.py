"""A storage node keeps each tenant within its share of the limits and protects its reserve: ObjectStore on
real (small, temporary) DRAM and SSD segments, without a server."""

import asyncio

import pytest

from kvpool.errors import NoSpaceError, QuotaExceededError
from kvpool.protocol.checksum import checksum
from kvpool.protocol.tenants import MAX_TENANTS, NodeShare, scope_of
from kvpool.protocol.wire import WriteFlag
from kvpool.storenode.storage import policy, quota
from kvpool.storenode.storage.dram import DramSegment
from kvpool.storenode.background.maintenance import Maintenance
from kvpool.storenode.serving.metrics import NodeMetrics
from kvpool.storenode.background.tier_moves import Mover
from kvpool.storenode.storage.recovery import recover
from kvpool.storenode.storage.ssd import SsdSegment
from kvpool.storenode.storage.store import ROOM_BATCH, ObjectStore
from kvpool.storenode.storage.tenant_usage import OTHER
from kvpool.storenode.storage.tiers import StorageTier
from small_store import make_store  # noqa: F401 (a fixture)


def share(quota=0, quota_dram=0, quota_ssd=0, quota_objects=0, reserve=0) -> NodeShare:
    return NodeShare(quota, quota_dram, quota_ssd, quota_objects, reserve)


def key(tenant: str, name: str) -> bytes:
    return scope_of(tenant).key(name).encode()


def put(store: ObjectStore, stored_key: bytes, size: int, flags: int = 0, ttl_ms: int = 0):
    """What the server does for a WRITE, minus the socket; the clock moves on after it."""
    data = stored_key[-1:] * size
    res = store.reserve(stored_key, size, flags)
    segment = res.tier.segment
    if res.tier is store.dram:
        segment.view(res.offset, size)[:] = data
    else:
        segment.pwrite_all(stored_key, segment.key_offset(res.offset))
        segment.pwrite_all(data, segment.payload_offset(res.offset, len(stored_key)))
    rec = store.new_record(stored_key, 1, size, checksum(data), flags, 0, ttl_ms, 0)
    if res.tier is not store.dram:
        segment.write_header(res.offset, store.stored_object(rec))
    store.commit(res, rec)
    store.clock.now += 1
    return rec


def read(store: ObjectStore, rec) -> None:
    store.clock.now += 1
    store.count_read(rec, from_dram=rec.dram is not None)


def live(store: ObjectStore, tenant: str) -> list[str]:
    prefix = scope_of(tenant).prefix
    return sorted(rec.key.decode()[len(prefix):] for rec in store.index
                  if store.tenants.of_key(rec.key).name == tenant)


def assert_figures_exact(store: ObjectStore) -> None:
    """Each tenant's figures are what its indexed records add up to."""
    expected = {}
    for rec in store.index:
        figures = expected.setdefault(store.tenants.of_key(rec.key).name, [0, 0, 0, 0])
        figures[0] += 1
        figures[1] += rec.size
        figures[2] += rec.size if rec.dram is not None else 0
        figures[3] += rec.size if rec.ssd is not None else 0
    for usage in store.tenants.usages():
        assert [usage.objects, usage.bytes, *usage.tier_bytes] == expected.pop(usage.name, [0, 0, 0, 0]), usage.name
        for number, order in enumerate(usage.orders):
            if order is not None:
                assert len(order) == sum(1 for rec in store.index if rec.tenant is usage
                                         and (rec.dram, rec.ssd)[number] is not None)
    assert not expected
    assert sum(tier.objects for tier in store.tiers) == sum(
        (rec.dram is not None) + (rec.ssd is not None) for rec in store.index)


# -- quota


@pytest.mark.parametrize("mode", policy.POLICIES)
def test_at_its_quota_a_tenant_gives_up_its_own_coldest_object_and_nobody_elses(make_store, mode):
    store = make_store(mode=mode)
    store.set_tenant_shares({"a": share(quota=3000)})
    a = [put(store, key("a", f"k{i}"), 1000) for i in range(3)]
    b = put(store, key("b", "x"), 1000)
    plain = put(store, b"plain", 1000)
    read(store, a[0])  # k0 is now used more recently (LRU) and more often (LFU) than k1
    put(store, key("a", "k3"), 1000)
    assert live(store, "a") == ["k0", "k2", "k3"] and not a[1].live
    assert b.live and plain.live
    assert store.report("n")["evicted"] == [[key("a", "k1").decode(), 1]]  # the master forgets it
    figures = store.report("n")["tenants"]
    assert figures["a"]["evicted_quota"] == 1 and figures["a"]["evicted_pressure"] == 0
    assert figures["a"]["objects"] == 3 and figures["a"]["dram_bytes"] == 3000
    assert figures["b"]["evicted_quota"] == 0
    assert_figures_exact(store)


def test_expired_objects_of_the_tenant_go_before_its_coldest(make_store):
    store = make_store()
    store.set_tenant_shares({"a": share(quota=2000)})
    cold = put(store, key("a", "cold"), 1000)
    dying = put(store, key("a", "dying"), 1000, ttl_ms=1500)
    store.clock.now += 5
    put(store, key("a", "new"), 1000)
    assert cold.live and not dying.live
    assert store.tenants.of_key(key("a", "x")).evicted_quota == 0  # expired, not evicted by its quota


def test_quota_exceeded_when_nothing_of_its_own_may_go_and_nothing_changes(make_store):
    store = make_store()
    store.set_tenant_shares({"a": share(quota=3000)})
    pinned = put(store, key("a", "pinned"), 1000, flags=WriteFlag.HARD_PIN)
    held = put(store, key("a", "held"), 1000)
    busy = put(store, key("a", "busy"), 1000)
    other = put(store, key("b", "other"), 1000)
    assert store.hold(held.key, 1, 60_000)
    store.acquire(busy)
    before = (store.dram.used, store.tenants.of_key(pinned.key).figures())
    with pytest.raises(QuotaExceededError, match=r"tenant 'a' is at its quota of 3000 bytes"):
        store.reserve(key("a", "new"), 10, 0)
    assert all(rec.live for rec in (pinned, held, busy, other))
    usage = store.tenants.of_key(pinned.key)
    assert usage.refused == 1 and usage.pending_objects == 0 and store.dram.used == before[0]
    assert {k: v for k, v in usage.figures().items() if k != "refused"} == {
        k: v for k, v in before[1].items() if k != "refused"}
    assert store.take_dropped() == []
    with pytest.raises(QuotaExceededError, match="a 3001-byte object of tenant 'a' is larger than its quota"):
        store.reserve(key("a", "huge"), 3001, 0)
    store.release(busy)  # the reader is done: the busy one may go now
    put(store, key("a", "new"), 10)
    assert not busy.live and pinned.live and held.live


@pytest.mark.parametrize("limit", [share(quota=2000), share(quota_dram=2000)])
def test_soft_pinned_objects_go_only_after_unpinned_ones(make_store, limit):
    store = make_store()
    store.set_tenant_shares({"a": limit})
    res = store.reserve(key("a", "soft"), 1000, 0)
    soft = store.new_record(key("a", "soft"), 1, 1000, 0, 0, 0, 0, 60_000)
    store.commit(res, soft)
    store.clock.now += 1
    unpinned = put(store, key("a", "unpinned"), 1000)
    put(store, key("a", "new"), 1000)
    assert soft.live and not unpinned.live


def test_writes_in_flight_count_against_the_quota(make_store):
    store = make_store()
    store.set_tenant_shares({"a": share(quota=2000)})
    first = store.reserve(key("a", "1"), 1000, 0)
    store.reserve(key("a", "2"), 1000, 0)
    with pytest.raises(QuotaExceededError):  # nothing committed to give up, and two writes under way
        store.reserve(key("a", "3"), 1000, 0)
    store.abort(first)
    store.reserve(key("a", "3"), 1000, 0)
    assert store.tenants.of_key(key("a", "")).pending_bytes == 2000


def test_a_tier_quota_spills_to_the_other_tier_then_evicts_its_own(make_store):
    store = make_store(dram=64 * 1024, ssd=64 * 4096)
    store.set_tenant_shares({"a": share(quota_dram=2000, quota_ssd=1000)})
    k0, k1 = put(store, key("a", "k0"), 1000), put(store, key("a", "k1"), 1000)
    k2 = put(store, key("a", "k2"), 1000)  # its DRAM share is full: the write goes to SSD, nothing evicted
    assert (k0.dram, k1.dram) != (None, None) and k2.ssd is not None and k2.dram is None
    assert all(rec.live for rec in (k0, k1, k2))
    k3 = put(store, key("a", "k3"), 1000)  # both shares full: its coldest DRAM object makes room
    assert not k0.live and k1.live and k2.live and k3.dram is not None
    usage = store.tenants.of_key(k0.key)
    assert usage.tier_bytes == [2000, 1000] and usage.evicted_quota == 1
    with pytest.raises(QuotaExceededError, match="quota_ssd of 1000 bytes"):
        store.reserve(key("a", "big"), 1500, WriteFlag.PREFER_SSD | WriteFlag.HARD_PIN)
    assert_figures_exact(store)


def test_an_objects_quota_counts_objects(make_store):
    store = make_store()
    store.set_tenant_shares({"a": share(quota_objects=2)})
    first = put(store, key("a", "1"), 10)
    put(store, key("a", "2"), 5000)
    put(store, key("a", "3"), 10)
    assert live(store, "a") == ["2", "3"] and not first.live
    with pytest.raises(QuotaExceededError, match="quota_objects of 1 objects"):
        store.set_tenant_shares({"a": share(quota_objects=1)})
        for rec in list(store.index):
            store.hold(rec.key, 1, 60_000)
        store.reserve(key("a", "4"), 10, 0)


def test_lowering_a_share_is_kept_by_the_next_write_or_the_sweep(make_store):
    store = make_store()
    store.set_tenant_shares({"a": share(quota=5000), "b": share(quota=5000)})
    for i in range(4):
        put(store, key("a", f"{i}"), 1000)
        put(store, key("b", f"{i}"), 1000)
    store.set_tenant_shares({"a": share(quota=2000), "b": share(quota=2000)})
    put(store, key("a", "new"), 1000)  # a's next write brings a down, its coldest first
    assert live(store, "a") == ["3", "new"]
    assert live(store, "b") == ["0", "1", "2", "3"]
    assert quota.enforce(store) == 2  # the sweep brings b down
    assert live(store, "b") == ["2", "3"]
    store.set_tenant_shares({})  # no share: no limit
    for i in range(5):
        put(store, key("a", f"more{i}"), 1000)
    assert len(live(store, "a")) == 7 and quota.enforce(store) == 0
    assert_figures_exact(store)


def test_the_sweep_demotes_a_tenant_above_its_dram_share_rather_than_evict(make_store):
    store = make_store(dram=64 * 1024, ssd=64 * 4096)
    pressed = []
    store.on_pressure = lambda: pressed.append(True)
    recs = [put(store, key("a", f"{i}"), 1000) for i in range(8)]
    store.set_tenant_shares({"a": share(quota_dram=4000)})
    spilled = put(store, key("a", "spilled"), 1000)  # its DRAM share is over: the write goes to SSD...
    assert spilled.ssd is not None and pressed  # ...and wakes the sweep
    with pytest.raises(NoSpaceError, match="write through the socket"):  # as a shared-memory write into full DRAM
        store.reserve(key("a", "shm"), 1000, 0, dram_only=True)
    assert all(rec.live for rec in recs)
    asyncio.run(Maintenance(store).sweep())
    usage = store.tenants.of_key(spilled.key)
    assert usage.tier_bytes[0] == 0.75 * 4000 and usage.objects == 9 and usage.evicted_quota == usage.refused == 0
    assert [rec.dram is None for rec in recs] == [True] * 5 + [False] * 3  # its coldest went down
    assert put(store, key("a", "next"), 1000).dram is not None  # room in its DRAM share again
    assert_figures_exact(store)


def test_a_demotion_keeps_the_ssd_quota_and_a_promotion_the_dram_quota(make_store):
    store = make_store(dram=64 * 1024, ssd=64 * 4096)
    store.set_tenant_shares({"a": share(quota_ssd=1000)})
    old = put(store, key("a", "old"), 1000, flags=WriteFlag.PREFER_SSD)
    cold, colder = put(store, key("a", "cold"), 1000), put(store, key("a", "colder"), 1000)
    mover = Mover(store)
    assert asyncio.run(mover.demote(cold))  # the tenant's SSD share is full: its coldest SSD object goes
    assert cold.ssd is not None and cold.dram is None and not old.live
    store.hold(cold.key, 1, 60_000)
    assert not asyncio.run(mover.demote(colder))  # nothing of its own on SSD may go: the object is dropped
    assert not colder.live
    usage = store.tenants.of_key(old.key)
    assert usage.evicted_quota == 2 and usage.tier_bytes == [0, 1000]
    store.set_tenant_shares({"a": share(quota_dram=500)})
    assert not asyncio.run(mover.promote(cold))  # it would take a past its DRAM share
    store.set_tenant_shares({"a": share(quota_dram=1000)})
    assert asyncio.run(mover.promote(cold)) and cold.dram is not None
    assert usage.tier_bytes == [1000, 1000] and usage.pending_tier == [0, 0]
    assert_figures_exact(store)


# -- reserve


@pytest.mark.parametrize("mode", policy.POLICIES)
def test_pool_pressure_spares_a_tenant_at_its_reserve_and_takes_only_its_excess(make_store, mode):
    store = make_store(dram=8192, mode=mode)
    store.set_tenant_shares({"t": share(reserve=2048)})
    t = [put(store, key("t", f"{i}"), 1024) for i in range(3)]  # 1024 bytes above its reserve
    x = [put(store, key("x", f"{i}"), 1024) for i in range(3)]
    plain = [put(store, f"p{i}".encode(), 1024) for i in range(2)]
    assert store.dram.used == 8192
    for i in range(6):  # x floods: the coldest others go, but t only down to its reserve
        put(store, key("x", f"flood{i}"), 1024)
    assert not t[0].live and t[1].live and t[2].live
    assert not any(rec.live for rec in plain) and not any(rec.live for rec in x)
    usage = store.tenants.of_key(t[0].key)
    assert usage.bytes == 2048 and usage.evicted_pressure == 1
    for i in range(6):  # x's own objects are all that is left to take, for x's writes and unmarked ones
        put(store, key("x", f"again{i}"), 1024)
        put(store, f"plain{i}".encode(), 1024)
    assert t[1].live and t[2].live
    store.set_tenant_shares({})  # no reserve any more: t is just another tenant
    put(store, b"last", 1024)
    assert not t[1].live
    assert_figures_exact(store)


def test_a_write_needing_several_victims_takes_no_more_than_a_tenants_excess(make_store):
    store = make_store(dram=8192)
    store.set_tenant_shares({"t": share(reserve=2048)})
    t = [put(store, key("t", f"{i}"), 1024) for i in range(3)]  # the coldest, 1024 bytes above its reserve
    x = [put(store, key("x", f"{i}"), 1024) for i in range(5)]
    put(store, key("x", "big"), 2048)
    assert [rec.live for rec in t] == [False, True, True] and not x[0].live and x[-1].live


@pytest.mark.parametrize("mode", policy.POLICIES)
def test_pressure_ranks_the_tenants_objects_against_each_other_as_the_policy_does(make_store, mode):
    store = make_store(mode=mode)
    popular_but_old = put(store, key("a", "k"), 100)
    for _ in range(3):
        read(store, popular_but_old)
    recent_but_unread = put(store, key("b", "k"), 100)
    store.clock.now += 1
    coldest = store.victims(store.dram, None, 1)
    assert coldest == [recent_but_unread if mode == policy.LFU else popular_but_old]


def test_room_for_a_large_write_is_made_over_several_batches_of_tenants_objects(make_store):
    store = make_store(dram=64 * 128)
    small = [put(store, key("a", f"{i}"), 128) for i in range(64)]
    big = put(store, key("a", "big"), 3000)  # more victims than one batch (ROOM_BATCH)
    assert big.dram is not None and sum(not rec.live for rec in small) == 24 > ROOM_BATCH
    assert_figures_exact(store)


def test_the_victims_left_from_a_batch_are_taken_only_while_still_cold_and_allowed(make_store):
    store = make_store(dram=8192)
    store.set_tenant_shares({"t": share(reserve=4096)})
    t = [put(store, key("t", f"{i}"), 1024) for i in range(6)]
    x = [put(store, key("x", f"{i}"), 1024) for i in range(2)]
    put(store, key("t", "new"), 1024)  # t's write takes its own coldest, t[0]; t[1:] and x are left over
    assert not t[0].live
    read(store, t[1])  # used since: no longer among the coldest
    put(store, key("x", "2"), 1024)
    assert t[1].live and not t[2].live
    put(store, key("x", "3"), 1024)  # t keeps its reserve after losing t[3]...
    assert not t[3].live
    put(store, key("x", "4"), 1024)  # ...but not after losing t[4]: x's own coldest goes
    assert t[4].live and t[5].live and not x[0].live
    assert store.tenants.of_key(t[0].key).bytes == 4096


def test_a_protected_tenant_evicts_its_own_and_no_space_when_nothing_else_may_go(make_store):
    store = make_store(dram=4096)
    store.set_tenant_shares({"t": share(reserve=4096), "u": share(reserve=4096)})
    t = [put(store, key("t", f"{i}"), 1024) for i in range(2)]
    u = [put(store, key("u", f"{i}"), 1024) for i in range(2)]
    with pytest.raises(NoSpaceError, match="nothing more may be evicted"):
        store.reserve(b"plain", 1024, 0)
    assert store.tenants.none.refused == 1
    put(store, key("t", "new"), 1024)  # t's own coldest goes for t's write, never u's
    assert not t[0].live and t[1].live and all(rec.live for rec in u)


def test_choosing_a_victim_never_walks_a_protected_tenants_objects(make_store):
    store = make_store(dram=1 << 20)
    store.set_tenant_shares({"t": share(reserve=1 << 30)})
    for i in range(50):
        put(store, key("t", f"{i}"), 100)
    victim = put(store, b"plain", 100)
    usage = store.tenants.of_key(key("t", ""))

    class Untouchable(type(usage.orders[0])):
        def __iter__(self):
            raise AssertionError("a protected tenant's order was walked")

    order = usage.orders[0]
    order.__class__ = Untouchable
    assert store.victims(store.dram, None, 16) == [victim]
    order.__class__ = Untouchable.__mro__[1]
    assert len(store.victims(store.dram, None, 16, writer=usage)) == 16  # the writer's own may go


def test_the_sweep_spares_a_tenant_at_its_reserve_but_demotes_it(make_store):
    store = make_store(dram=8192, ssd=4 * 4096)
    store.set_tenant_shares({"t": share(reserve=8192)})
    t = put(store, key("t", "0"), 3000, flags=WriteFlag.PREFER_SSD)
    plain = put(store, b"p", 3000, flags=WriteFlag.PREFER_SSD)
    assert store.victims(store.ssd, 1, 32) == [plain]
    hot = put(store, key("t", "hot"), 3000)
    assert store.victims(store.dram, 1, 32, protect=False) == [hot]  # a demotion is no eviction
    assert store.victims(store.dram, 1, 32) == []
    assert t.live


def test_a_demotion_that_finds_no_room_keeps_a_protected_tenants_object_in_dram(make_store):
    store = make_store(dram=64 * 1024, ssd=2 * 4096, hard_pin_quota=1 << 20)
    for i in range(2):
        put(store, f"pinned{i}".encode(), 3000, flags=WriteFlag.HARD_PIN | WriteFlag.PREFER_SSD)
    store.set_tenant_shares({"t": share(reserve=5000)})
    t, plain = put(store, key("t", "k"), 1000), put(store, b"plain", 1000)
    mover = Mover(store)
    assert not asyncio.run(mover.demote(t)) and t.live and t.dram is not None  # it stays in DRAM
    assert not asyncio.run(mover.demote(plain)) and not plain.live  # nowhere to go: evicted, as before


# -- figures


def test_figures_stay_exact_through_every_change(make_store, tmp_path):
    store = make_store(dram=16 * 1024, ssd=16 * 4096)
    store.set_tenant_shares({"a": share(quota=6000, reserve=1000)})
    recs = []
    for i in range(6):
        recs.append(put(store, key("a", f"{i}"), 1000 + i))
        recs.append(put(store, key("b", f"{i}"), 2000))
        recs.append(put(store, f"plain{i}".encode(), 1500, ttl_ms=3000 if i % 2 else 0))
        assert_figures_exact(store)
    recs.append(put(store, key("a", "same"), 700))
    put(store, key("a", "same"), 700)  # the same version again replaces the record
    assert_figures_exact(store)
    assert store.free(key("b", "0"), 1)
    assert_figures_exact(store)
    mover = Mover(store)
    for rec in [r for r in recs if r.live and r.dram is not None][:4]:
        asyncio.run(mover.demote(rec))
        assert_figures_exact(store)
    promoted = next(r for r in recs if r.live and r.dram is None)
    assert asyncio.run(mover.promote(promoted)) and promoted.dram is not None and promoted.ssd is not None
    assert_figures_exact(store)
    store.release_from(store.dram, promoted)  # its DRAM copy goes: a copy, not an object
    assert_figures_exact(store)
    store.clock.now += 10
    store.expire_due()
    assert not any(rec.live and rec.expires_at for rec in store.index)
    assert_figures_exact(store)
    for i in range(20):  # pressure evictions in both tiers
        put(store, key("c", f"{i}"), 3000, flags=WriteFlag.PREFER_SSD if i % 2 else 0)
        assert_figures_exact(store)
    figures = store.report("n")["tenants"]
    assert figures["c"]["objects"] == len(live(store, "c")) and figures["b"]["evicted_pressure"] > 0
    # A restart adopts the SSD objects; each is counted again for its tenant.
    on_ssd = {}
    for rec in store.index:
        if rec.ssd is not None:
            name = store.tenants.of_key(rec.key).name
            on_ssd[name] = on_ssd.get(name, 0) + rec.size
    ssd_dir = store.ssd.segment.path.rsplit("/", 1)[0]
    store.ssd.segment.close()
    again = ObjectStore(StorageTier(DramSegment(4096, "again", directory=str(tmp_path)), 0.9, 0.75),
                        StorageTier(SsdSegment(ssd_dir, 16 * 4096), 0.9, 0.75))
    try:
        recover(again)
        assert_figures_exact(again)
        assert {u.name: u.tier_bytes[1] for u in again.tenants.usages() if u.objects} == on_ssd
    finally:
        for tier in again.tiers:
            tier.segment.close()


def test_reads_misses_and_refusals_are_counted_per_tenant(make_store):
    store = make_store(dram=4096)
    rec = put(store, key("a", "k"), 100)
    read(store, rec)
    read(store, rec)
    store.count_miss(key("a", "gone"))
    store.count_miss(b"unmarked")
    with pytest.raises(NoSpaceError):
        store.reserve(key("b", "huge"), 4096, WriteFlag.HARD_PIN)  # past the hard-pin quota
    figures = store.report("n")["tenants"]
    assert figures["a"] == {"objects": 1, "dram_bytes": 100, "ssd_bytes": 0, "hits": 2, "misses": 1,
                            "evicted_quota": 0, "evicted_pressure": 0, "refused": 0}
    assert figures["b"]["refused"] == 1 and figures["b"]["objects"] == 0
    assert "" not in figures  # keys of no tenant are listed once they hold objects
    put(store, b"plain", 10)
    assert store.report("n")["tenants"][""]["objects"] == 1


def test_tenant_metrics_keep_a_bounded_label_set_against_made_up_tenants(make_store):
    store = make_store(dram=1 << 20)
    store.set_tenant_shares({"a": share(quota=1 << 20)})
    put(store, key("a", "k"), 10)
    for i in range(3 * MAX_TENANTS):  # a flood of names no operator created
        put(store, key(f"fake{i}", "k"), 10)
    put(store, b"\x01\xff\xfe\x01k", 10)  # not even a name
    metrics = NodeMetrics()
    metrics.track_tenants(store.tenants)
    labels = set()
    for family in metrics.registry.collect():
        for sample in family.samples:
            if "tenant" in sample.labels:
                labels.add(sample.labels["tenant"])
    assert labels == {"a", "", OTHER}
    assert metrics.registry.get_sample_value("kvpool_node_tenant_objects", {"tenant": OTHER}) == 3 * MAX_TENANTS + 1
    assert metrics.registry.get_sample_value("kvpool_node_tenant_bytes", {"tenant": "a", "tier": "dram"}) == 10
    assert metrics.registry.get_sample_value("kvpool_node_tenant_evictions_total",
                                             {"tenant": "a", "reason": "quota"}) == 0
    assert len(list(store.tenants.usages())) <= MAX_TENANTS + 3  # the table is bounded too
    assert_figures_exact(store)
