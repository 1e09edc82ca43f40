"""The master's object table as pure logic: put lifecycle, placement by reported usage,
evictions, ttl, inventory re-adoption, node loss."""

import time

import pytest

from kvpool.protocol.cluster_layout import NodeRecord, TierRecord
from kvpool.errors import (
    InvalidArgumentError, KeyExistsError, KeyNotFoundError, NoSpaceError, PutExpiredError, ValueTooLargeError,
)
from kvpool.protocol.inventory import DRAM_BIT, SSD_BIT, Entry
from kvpool.master.table.ledger import FreeOrder
from kvpool.master.table.objects import ObjectTable
from kvpool.master.table.versions import DRAM, SSD, PutOptions
from kvpool.protocol.wire import WriteFlag

MiB = 1 << 20


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def record(node_id, dram=MiB, ssd=0, instance="i1", port=7000):
    tiers = {"dram": TierRecord(capacity=dram)}
    if ssd:
        tiers["ssd"] = TierRecord(capacity=ssd, path="/x")
    return NodeRecord(node_id=node_id, instance=instance, host="127.0.0.1", data_port=port, tiers=tiers)


def report(dram_used=0, ssd_used=None, evicted=()):
    tiers = {"dram": {"capacity": MiB, "used": dram_used, "objects": 3, "hits": 5}}
    if ssd_used is not None:
        tiers["ssd"] = {"capacity": 8 * MiB, "used": ssd_used}
    return {"node_id": "ignored", "tiers": tiers, "evicted": [list(e) for e in evicted]}


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def table(clock):
    t = ObjectTable(put_timeout=10.0, clock=clock, first_generation=100)
    t.upsert_node(record("n1"))
    return t


def one_copy_and_two(table):
    """A second node, "both" on the two nodes and "only" on one: (both, only, only's node, the other node)."""
    table.upsert_node(record("n2", port=7001))
    both = put(table, "both", replicas=2)
    only = put(table, "only")
    only_node = only.replicas[0].node_id
    return both, only, only_node, "n2" if only_node == "n1" else "n1"


def put(table, key, size=100, **kw):
    v = table.put_start(key, size, 1, **kw)
    return table.put_end(key, v.generation)


# ----- put lifecycle -----

def test_put_is_invisible_until_put_end(table):
    v = table.put_start("k", 1000, checksum=7)
    assert v.generation == 100 and v.size == 1000 and v.checksum == 7 and v.raw_size == 1000
    assert [(r.node_id, r.address, r.tier) for r in v.replicas] == [("n1", "127.0.0.1:7000", DRAM)]
    assert table.nodes["n1"].reserved(DRAM) == 1000  # counted against the node until a report shows it
    assert not table.exists("k")
    with pytest.raises(KeyNotFoundError):
        table.get("k")
    assert table.pending_count == 1
    table.put_end("k", v.generation)
    assert table.exists("k") and table.get("k") == v
    assert table.pending_count == 0 and table.object_count == 1 and table.total_bytes == 1000
    assert table.counters.puts == 1 and table.counters.hits == 1 and table.counters.misses == 1
    assert table.objects_on("n1") == 1


def test_options_compression_and_raw_size_are_kept(table):
    options = PutOptions(tier=SSD, pin="soft", pin_ttl_seconds=60, ttl_seconds=30)
    v = table.put_start("k", 400, 9, options=options, compressed=True, raw_size=4000)
    table.put_end("k", v.generation)
    got = table.get("k")
    assert got.options == options and got.compressed and got.raw_size == 4000 and got.size == 400
    # n1 has no SSD tier; the replica still names the tier asked for until the node says otherwise.
    assert got.replicas[0].tier == SSD


@pytest.mark.parametrize("bad", [PutOptions(ttl_seconds=-1), PutOptions(pin_ttl_seconds=float("nan")),
                                 PutOptions(ttl_seconds=float("inf")), PutOptions(tier="tape"),
                                 PutOptions(pin="glue")])
def test_bad_options_are_invalid_argument(table, bad):
    with pytest.raises(InvalidArgumentError):
        table.put_start("k", 10, 1, options=bad)
    assert table.pending_count == 0


def test_raw_size_must_match_an_uncompressed_size(table):
    with pytest.raises(InvalidArgumentError, match="raw_size"):
        table.put_start("k", 10, 1, raw_size=20)
    assert table.put_start("k", 10, 1, raw_size=10).raw_size == 10


def test_raw_size_of_a_compressed_value_is_one_lz4_can_produce(table):
    # A reader decompresses into raw_size bytes: a huge one would make every reader allocate it.
    for lie in (2**40, 10 * 255 + 17, 0):
        with pytest.raises(InvalidArgumentError, match="raw_size"):
            table.put_start(f"lie{lie}", 10, 1, compressed=True, raw_size=lie)
    assert table.put_start("fine", 10, 1, compressed=True, raw_size=10 * 255).raw_size == 2550


def test_second_put_without_overwrite_is_exists(table):
    v = table.put_start("k", 10, 1)
    with pytest.raises(KeyExistsError, match="in progress"):
        table.put_start("k", 10, 1, overwrite=True)
    table.put_end("k", v.generation)
    with pytest.raises(KeyExistsError, match="already exists"):
        table.put_start("k", 10, 1)
    assert table.nodes["n1"].pending == {}  # the refused puts reserved nothing


def test_overwrite_keeps_old_visible_then_swaps_and_frees(table):
    old = put(table, "k", 100)
    new = table.put_start("k", 200, 2, overwrite=True)
    assert new.generation > old.generation
    assert table.get("k") == old  # still the old version while the new one is written
    assert table.take_frees() == []
    table.put_end("k", new.generation)
    assert table.get("k") == new
    assert table.take_frees() == [FreeOrder("127.0.0.1:7000", b"k", old.generation)]
    assert table.total_bytes == 200 and table.object_count == 1


def test_revoke_frees_and_keeps_previous_version(table):
    old = put(table, "k")
    new = table.put_start("k", 100, 2, overwrite=True)
    table.put_revoke("k", new.generation)
    assert table.get("k") == old
    assert [f.generation for f in table.take_frees()] == [new.generation]
    assert table.nodes["n1"].pending == {}
    with pytest.raises(PutExpiredError):
        table.put_end("k", new.generation)
    with pytest.raises(PutExpiredError):
        table.put_revoke("k", 12345)


def test_put_end_with_wrong_generation_is_expired(table):
    v = table.put_start("k", 10, 1)
    with pytest.raises(PutExpiredError):
        table.put_end("k", v.generation + 1)
    table.put_end("k", v.generation)  # the real one still works


def test_reclaim_after_deadline(table, clock):
    v = table.put_start("k", 500, 1)
    clock.now += 9.9
    assert table.reclaim_expired() == []
    clock.now += 0.2
    assert table.reclaim_expired() == ["k"]
    assert table.nodes["n1"].reserved(DRAM) == 0 and table.pending_count == 0
    assert table.counters.reclaimed_puts == 1
    assert [f.generation for f in table.take_frees()] == [v.generation]
    with pytest.raises(PutExpiredError):
        table.put_end("k", v.generation)


def test_late_put_end_fails_even_before_the_reclaim_task_ran(table, clock):
    v = table.put_start("k", 500, 1)
    clock.now += 11
    with pytest.raises(PutExpiredError):
        table.put_end("k", v.generation)
    table.put_start("k", 500, 1)  # the key is free for a new put straight away


def test_remove_and_remove_by_prefix(table):
    for key in ("a/1", "a/2", "b/1"):
        put(table, key)
    table.remove("b/1")
    with pytest.raises(KeyNotFoundError):
        table.remove("b/1")
    assert table.remove_by_prefix("a/") == 2
    assert table.remove_by_prefix("a/") == 0
    assert table.object_count == 0 and table.total_bytes == 0 and table.objects_on("n1") == 0
    assert sorted(f.key for f in table.take_frees()) == [b"a/1", b"a/2", b"b/1"]
    assert table.counters.removes == 3


def test_zero_size_object_has_no_replicas(table):
    v = table.put_start("empty", 0, 0)
    assert v.replicas == ()
    table.put_end("empty", v.generation)
    assert table.get("empty").size == 0 and table.nodes["n1"].reserved(DRAM) == 0


# ----- limits -----

def test_no_nodes_is_no_space(clock):
    t = ObjectTable(clock=clock)
    with pytest.raises(NoSpaceError, match="no storage nodes"):
        t.put_start("k", 1, 0)


def test_too_large_is_about_the_largest_tier_and_a_full_node_still_takes_puts(table):
    with pytest.raises(ValueTooLargeError, match=str(MiB)):
        table.put_start("k", MiB + 1, 0)
    # Full as far as the master knows: the node makes room (or answers NO_SPACE) itself.
    table.apply_report("n1", "i1", report(dram_used=MiB), table.report_mark())
    assert table.put_start("a", MiB, 0).replicas[0].node_id == "n1"
    assert table.put_start("b", MiB, 0).replicas[0].node_id == "n1"
    # A node with a larger SSD tier raises the limit.
    table.upsert_node(record("n2", ssd=4 * MiB, port=7001))
    v = table.put_start("big", 3 * MiB, 0)
    assert [r.node_id for r in v.replicas] == ["n2"]  # n1 cannot hold it at all
    with pytest.raises(ValueTooLargeError):
        table.put_start("huge", 4 * MiB + 1, 0)


def test_configured_max_object_size_is_never_above_the_largest_tier(clock):
    t = ObjectTable(clock=clock, max_object_size=100)
    t.upsert_node(record("n1"))
    with pytest.raises(ValueTooLargeError):
        t.put_start("k", 101, 0)
    t.put_start("k", 100, 0)
    roomy = ObjectTable(clock=clock, max_object_size=10 * MiB)
    roomy.upsert_node(record("n1"))
    assert roomy.max_object_size == MiB


# ----- placement by reported usage -----

def test_placement_follows_reported_usage_and_puts_sent_since(table):
    table.upsert_node(record("n2", port=7001))
    table.apply_report("n1", "i1", report(dram_used=600_000), table.report_mark())
    table.apply_report("n2", "i1", report(dram_used=100_000), table.report_mark())
    # n2 has 500 KB more free: it takes puts until the bytes sent there even that out.
    first = [table.put_start(f"k{i}", 200_000, 0).replicas[0].node_id for i in range(4)]
    assert first == ["n2", "n2", "n2", "n1"]
    assert table.nodes["n2"].reserved(DRAM) == 600_000


def test_a_report_asked_for_after_a_commit_replaces_its_reservation(table):
    node = table.nodes["n1"]
    mark_before = table.report_mark()
    v = put(table, "k", 1000)
    assert node.reserved(DRAM) == 1000
    # A report asked for before the commit may not show the object: the reservation stays.
    table.apply_report("n1", "i1", report(dram_used=0), mark_before)
    assert node.reserved(DRAM) == 1000
    table.apply_report("n1", "i1", report(dram_used=1024), table.report_mark())
    assert node.reserved(DRAM) == 0 and node.used(DRAM) == 1024
    assert node.free_bytes(DRAM) == MiB - 1024
    # A pending put stays reserved across reports until it ends.
    table.put_start("p", 500, 0)
    table.apply_report("n1", "i1", report(dram_used=1024), table.report_mark())
    assert node.reserved(DRAM) == 500
    assert "k" in node.keys and v.key == "k"


def test_ssd_preference_places_by_free_ssd(table):
    table.upsert_node(record("n2", ssd=8 * MiB, port=7001))
    table.upsert_node(record("n3", ssd=8 * MiB, port=7002))
    table.apply_report("n2", "i1", report(dram_used=0, ssd_used=4 * MiB), table.report_mark())
    table.apply_report("n3", "i1", report(dram_used=MiB, ssd_used=0), table.report_mark())
    v = table.put_start("cold", 1000, 0, options=PutOptions(tier=SSD))
    assert [(r.node_id, r.tier) for r in v.replicas] == [("n3", SSD)]
    assert table.nodes["n3"].reserved(SSD) == 1000 and table.nodes["n3"].reserved(DRAM) == 0
    # Without the preference the most free DRAM wins (n1 and n2 tie there; SSD space breaks it).
    assert table.put_start("hot", 1000, 0).replicas[0].node_id == "n2"


def test_replicas_go_to_distinct_nodes_most_free_first(table):
    table.upsert_node(record("n2", dram=2 * MiB, port=7001))
    table.upsert_node(record("n3", dram=MiB // 2, port=7002))
    v = table.put_start("k", 100, 0, replicas=2)
    assert [r.node_id for r in v.replicas] == ["n2", "n1"]
    many = table.put_start("k2", 100, 0, replicas=5)  # best effort: one per node
    assert sorted(r.node_id for r in many.replicas) == ["n1", "n2", "n3"]


# ----- evictions reported by nodes -----

def test_evicted_list_drops_replicas_and_objects_left_without_one(table):
    both, only, only_node, other = one_copy_and_two(table)
    evicted = [("only", only.generation), ("both", both.generation), ("both", both.generation + 999),
               ("unknown", 5), ("garbage",)]
    removed = table.apply_report(only_node, "i1", report(evicted=evicted), table.report_mark())
    assert removed == ["only"]
    assert not table.exists("only")
    assert [r.node_id for r in table.get("both").replicas] == [other]
    assert table.counters.evicted_replicas == 2 and table.counters.evicted_objects == 1
    assert table.take_frees() == []  # the node already dropped them
    assert table.objects_on(only_node) == 0 and table.objects_on(other) == 1
    table.apply_report(other, "i1", report(evicted=[("both", both.generation)]), table.report_mark())
    assert table.object_count == 0 and table.total_bytes == 0


def test_report_from_a_previous_instance_is_ignored(table):
    v = put(table, "k")
    table.upsert_node(record("n1", instance="i2"))  # restarted: its replicas are dropped
    put(table, "k2")
    assert table.apply_report("n1", "i1", report(dram_used=77, evicted=[("k2", v.generation + 1)]),
                              table.report_mark()) == []
    assert table.exists("k2") and table.nodes["n1"].used(DRAM) == 0


def test_evictions_between_reports_drop_replicas_and_leave_usage_alone(table):
    v = put(table, "k")
    put(table, "stays")
    node = table.nodes["n1"]
    reserved = node.reserved(DRAM)
    assert table.apply_evictions("n1", "i1", [["k", v.generation], ["k", v.generation + 7], "garbage"]) == ["k"]
    assert not table.exists("k") and table.exists("stays")
    assert node.reserved(DRAM) == reserved  # usage comes with the next REPORT
    table.put_end("k", table.put_start("k", 100, 0).generation)  # stored again at once
    assert table.apply_evictions("n1", "i0", [["stays", v.generation + 1]]) == []  # an older instance
    assert table.apply_evictions("gone", "i1", [["stays", v.generation + 1]]) == []
    assert table.exists("stays")


def test_one_eviction_list_holds_pending_targets_committed_copies_and_objects_kept_elsewhere(table):
    """A node's list is applied as a whole: a pending put's target stops counting (and its PutEnd
    is refused), a committed copy goes, one of two copies goes while the object stays on the other
    node with a target one lower, and a stale generation leaves the object alone."""
    table.upsert_node(record("n2", port=7001))
    both = put(table, "both", replicas=2)
    gone = put(table, "gone")
    node_id = gone.replicas[0].node_id
    other = "n2" if node_id == "n1" else "n1"
    stale = put(table, "stale")
    pending = table.put_start("pending", 100, 0)
    assert [r.node_id for r in pending.replicas] == [node_id]  # the same node: the emptier one each time
    evicted = [["pending", pending.generation], ["gone", gone.generation], ["both", both.generation],
               ["stale", stale.generation + 1]]
    assert table.apply_evictions(node_id, "i1", evicted) == ["gone"]
    assert table.counters.evicted_replicas == 3 and table.counters.evicted_objects == 1
    assert not table.exists("gone") and table.exists("stale")
    kept = table.get("both")
    assert [r.node_id for r in kept.replicas] == [other] and kept.target_replicas == 1
    assert table.objects_on(node_id) == int(stale.replicas[0].node_id == node_id)
    assert table.total_bytes == 200
    with pytest.raises(KeyNotFoundError, match="evicted by its storage nodes before the put ended"):
        table.put_end("pending", pending.generation)
    assert pending.generation not in table.nodes[node_id].pending


def test_reserved_bytes_follow_puts_and_reports(table):
    node = table.nodes["n1"]
    a = table.put_start("a", 300, 0)
    b = table.put_start("b", 200, 0)
    assert node.reserved(DRAM) == 500
    mark = table.report_mark()
    table.put_end("a", a.generation)  # committed after the report was asked for: still counted
    table.put_revoke("b", b.generation)
    assert node.reserved(DRAM) == 300
    table.apply_report("n1", "i1", report(dram_used=1000), mark)
    assert node.reserved(DRAM) == 300 and node.estimated_use(DRAM) == (4, 1300)
    table.apply_report("n1", "i1", report(dram_used=1300), table.report_mark())
    assert node.reserved(DRAM) == 0 and node.free_bytes(DRAM) == MiB - 1300


def test_evicted_before_put_end_fails_the_put_end(table):
    v = table.put_start("k", 100, 0)
    table.apply_report("n1", "i1", report(evicted=[("k", v.generation)]), table.report_mark())
    with pytest.raises(KeyNotFoundError, match="evicted"):
        table.put_end("k", v.generation)
    assert not table.exists("k") and table.pending_count == 0 and table.nodes["n1"].reserved(DRAM) == 0


def test_drop_replica_after_a_node_denies_holding_it(table):
    table.upsert_node(record("n2", port=7001))
    v = put(table, "k", replicas=2)
    assert table.drop_replica("k", v.generation, "n1") is False
    assert table.drop_replica("k", v.generation + 1, "n2") is False  # another version: untouched
    assert table.drop_replica("k", v.generation, "n2") is True
    assert not table.exists("k")


# ----- ttl -----

def test_ttl_expires_at_the_master(table, clock):
    v = put(table, "k", options=PutOptions(ttl_seconds=5))
    put(table, "forever")
    clock.now += 4.9
    assert table.get("k") == v
    clock.now += 0.2
    assert not table.exists("k")
    with pytest.raises(KeyNotFoundError):
        table.get("k")
    assert table.take_frees() == [FreeOrder("127.0.0.1:7000", b"k", v.generation)]
    assert table.counters.expired == 1 and table.object_count == 1 and table.exists("forever")
    put(table, "k")  # a new put of the key needs no overwrite


def test_expired_objects_are_swept_and_not_removable(table, clock):
    for i in range(3):
        put(table, f"t/{i}", options=PutOptions(ttl_seconds=1 + i))
    clock.now += 2.5
    assert sorted(table.drop_expired()) == ["t/0", "t/1"]
    assert table.object_count == 1 and table.total_bytes == 100
    clock.now += 1
    with pytest.raises(KeyNotFoundError):
        table.remove("t/2")
    assert table.remove_by_prefix("t/") == 0 and table.counters.removes == 0


# ----- inventory of a (re)started node -----

def entry(key, generation, size=100, checksum=1, flags=0, raw_size=None, ttl_ms=0, tiers=("ssd",)):
    bits = (DRAM_BIT if "dram" in tiers else 0) | (SSD_BIT if "ssd" in tiers else 0)
    return Entry(key, generation, size, checksum, flags, size if raw_size is None else raw_size, ttl_ms, bits)


def test_inventory_readopts_known_versions_and_frees_stale_ones(table):
    table.upsert_node(record("n2", ssd=8 * MiB, port=7001))
    kept = put(table, "kept", replicas=2)
    newer = put(table, "newer", replicas=2)
    odd = put(table, "odd", replicas=2)
    table.upsert_node(record("n2", ssd=8 * MiB, instance="i2", port=7003))  # restart: replicas dropped
    assert [r.node_id for r in table.get("kept").replicas] == ["n1"]
    table.apply_report("n1", "i1", report(dram_used=MiB), table.report_mark())  # steer new puts to n2
    overwritten = put(table, "newer", overwrite=True)
    assert overwritten.replicas[0].node_id == "n2"
    assert table.take_frees()  # (FREEs of the old "newer" for n1)
    pending = table.put_start("pending", 100, 1)

    outcome = table.adopt_inventory("n2", "i2", [
        entry("kept", kept.generation),                  # same version: taken back
        entry("newer", newer.generation),                # overwritten since: freed
        entry("pending", pending.generation - 50),       # key known (a put in flight): freed
        entry("odd", odd.generation, size=99),           # same generation, other size: freed
    ])
    assert outcome.adopted == ["kept"] and outcome.created == []
    assert outcome.rejected == ["newer", "pending", "odd"]
    replicas = table.get("kept").replicas
    assert [(r.node_id, r.address, r.tier) for r in replicas] == [("n1", "127.0.0.1:7000", DRAM),
                                                                  ("n2", "127.0.0.1:7003", SSD)]
    assert table.get("newer") == overwritten
    assert sorted((f.address, f.key) for f in table.take_frees()) == [
        ("127.0.0.1:7003", b"newer"), ("127.0.0.1:7003", b"odd"), ("127.0.0.1:7003", b"pending")]
    assert table.objects_on("n2") == 2  # "kept" taken back, and the new "newer"


def test_inventory_creates_unknown_objects_as_the_node_describes_them(clock):
    t = ObjectTable(clock=clock, first_generation=100)  # a fresh master
    t.upsert_node(record("n1", ssd=8 * MiB))
    t.upsert_node(record("n2", ssd=8 * MiB, port=7001))
    flags = int(WriteFlag.COMPRESSED | WriteFlag.HARD_PIN | WriteFlag.PREFER_SSD)
    outcome = t.adopt_inventory("n1", "i1", [entry("z", 5_000, size=300, checksum=9, flags=flags, raw_size=3000,
                                                   ttl_ms=2500),
                                             entry("plain", 4_000, tiers=("dram", "ssd"))])
    assert outcome.created == ["z", "plain"]
    z = t.get("z")
    assert (z.size, z.checksum, z.generation, z.raw_size, z.compressed) == (300, 9, 5_000, 3000, True)
    assert z.options == PutOptions(tier=SSD, pin="hard") and z.replicas[0].tier == SSD
    assert t.get("plain").replicas[0].tier == DRAM and not t.get("plain").compressed
    # The second replica of a version the first node's inventory created is taken back too.
    assert t.adopt_inventory("n2", "i1", [entry("plain", 4_000)]).adopted == ["plain"]
    assert sorted(r.node_id for r in t.get("plain").replicas) == ["n1", "n2"]
    assert t.object_count == 2 and t.total_bytes == 400
    # New generations never collide with adopted ones; the remaining ttl is kept.
    assert t.put_start("fresh", 10, 0).generation > 5_000
    clock.now += 2.6
    assert not t.exists("z") and t.exists("plain")


def test_inventory_of_a_superseded_instance_is_ignored(table):
    table.upsert_node(record("n1", instance="i2"))
    assert table.adopt_inventory("n1", "i1", [entry("k", 5)]).created == []
    assert table.adopt_inventory("gone", "i1", [entry("k", 5)]).created == []
    assert not table.exists("k") and table.take_frees() == []


# ----- node loss -----

def test_drop_node_removes_objects_whose_only_replica_was_there(table):
    both, only, only_node, other = one_copy_and_two(table)
    pending = table.put_start("pending", 100, 0, replicas=2)

    dropped = table.drop_node(only_node)
    assert dropped.removed == ["only"]
    assert dropped.revoked == ["pending"]
    assert not table.exists("only")
    assert [r.node_id for r in table.get("both").replicas] == [other]
    with pytest.raises(PutExpiredError):
        table.put_end("pending", pending.generation)
    # The revoked put's replica on the surviving node is freed there; nothing is sent to the dead node.
    frees = table.take_frees()
    assert [(f.key, f.generation) for f in frees] == [(b"pending", pending.generation)]
    assert frees[0].address == table.nodes[other].address
    assert table.objects_on(other) == 1 and table.nodes[other].pending == {}
    assert "both" in table.nodes[other].keys and both.key == "both"
    assert table.drop_node("nobody").removed == []


def test_a_put_that_needs_fewer_copies_outlives_a_target_node_that_goes(table):
    table.upsert_node(record("n2", port=7001))
    table.upsert_node(record("n3", port=7002))
    spare = table.put_start("spare", 100, 0, replicas=3, min_replicas=2)
    strict = table.put_start("strict", 100, 0, replicas=3)
    dropped = table.drop_node("n3")
    assert dropped.revoked == ["strict"]  # needs every copy: one is gone for good
    # The client names the node it could not write; it is gone, so no longer a target: the rest commit.
    ended = table.put_end("spare", spare.generation, ["n3"])
    assert sorted(r.node_id for r in ended.replicas) == ["n1", "n2"]
    assert table.get("spare").generation == spare.generation
    with pytest.raises(InvalidArgumentError):  # a registered node that was never a target still is an error
        other = table.put_start("other", 100, 0, replicas=1, min_replicas=1)
        table.put_end("other", other.generation, [n for n in ("n1", "n2") if n != other.replicas[0].node_id])


def test_restarted_node_loses_its_replicas(table):
    put(table, "k")
    assert table.upsert_node(record("n1")) is None  # same instance: nothing lost
    assert table.exists("k")
    dropped = table.upsert_node(record("n1", instance="i2", port=7005))
    assert dropped.removed == ["k"]
    assert not table.exists("k")
    node = table.nodes["n1"]
    assert node.address == "127.0.0.1:7005" and node.reserved(DRAM) == 0 and node.reported == {}


def test_generations_are_unique_and_increasing(table):
    gens = []
    for i in range(50):
        v = table.put_start(f"k{i}", 10, 0)
        gens.append(v.generation)
        if i % 2:
            table.put_revoke(f"k{i}", v.generation)
    assert gens == sorted(set(gens))


def test_default_generation_seeded_from_wall_clock(clock):
    before = time.time_ns()
    t = ObjectTable(clock=clock)
    assert t.put_start("k", 0, 0).generation >= before


# ----- stepping down -----

def test_reset_forgets_everything_but_never_reuses_a_generation(table):
    committed = put(table, "a")
    table.put_start("b", 100, 1)
    table.remove("a")  # leaves a FREE and a changed key behind
    table.reset()
    assert table.nodes == {} and table.object_count == 0 and table.pending_count == 0
    assert table.total_bytes == 0 and table.take_frees() == [] and not table.has_changes
    assert not table.exists("a") and not table.exists("b")
    table.upsert_node(record("n1"))
    again = table.put_start("b", 100, 1)  # the pending put of before is gone with the old term
    assert again.generation > committed.generation + 1


def test_replicas_past_the_tables_limit_are_refused():
    table = ObjectTable(max_replicas=3)
    table.upsert_node(record("n1"))
    with pytest.raises(InvalidArgumentError, match="max-replicas"):
        table.put_start("k", 10, 1, replicas=4)
    assert table.put_start("k", 10, 1, replicas=3).target_replicas == 3  # one node now; repair adds the rest
