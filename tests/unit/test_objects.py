"""The master's object table as pure logic: put lifecycle, overwrite, reclaim, node loss."""

import pytest

from kvpool.cluster_layout import NodeRecord, TierRecord
from kvpool.errors import (
    KeyExistsError, KeyNotFoundError, NoSpaceError, PutExpiredError, ValueTooLargeError,
)
from kvpool.master.objects import DRAM, FreeOrder, ObjectTable


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def record(node_id, capacity=1 << 20, instance="i1", port=7000):
    return NodeRecord(node_id=node_id, instance=instance, host="127.0.0.1", data_port=port,
                      tiers={"dram": TierRecord(capacity=capacity)})


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def table(clock):
    t = ObjectTable(put_timeout=10.0, clock=clock, first_generation=100)
    t.upsert_node(record("n1"))
    return t


def used(table, node_id="n1"):
    return table.nodes[node_id].tiers[DRAM].used


def test_put_is_invisible_until_put_end(table):
    v = table.put_start("k", 1000, checksum=7)
    assert v.generation == 100 and v.size == 1000 and v.checksum == 7
    assert [(r.node_id, r.address, r.length) for r in v.replicas] == [("n1", "127.0.0.1:7000", 1000)]
    assert used(table) == 1024  # reserved at PutStart, aligned to 64
    assert not table.exists("k")
    with pytest.raises(KeyNotFoundError):
        table.get("k")
    assert table.pending_count == 1
    table.put_end("k", v.generation)
    assert table.exists("k") and table.get("k") == v
    assert table.pending_count == 0 and table.object_count == 1 and table.total_bytes == 1000
    assert table.counters.puts == 1 and table.counters.hits == 1 and table.counters.misses == 1
    assert table.objects_on("n1") == {DRAM: 1}


def test_second_put_without_overwrite_is_exists(table):
    v = table.put_start("k", 10, 1)
    with pytest.raises(KeyExistsError, match="in progress"):
        table.put_start("k", 10, 1, overwrite=True)
    table.put_end("k", v.generation)
    with pytest.raises(KeyExistsError, match="already exists"):
        table.put_start("k", 10, 1)
    assert used(table) == 64  # the refused puts reserved nothing


def test_overwrite_keeps_old_visible_then_swaps_and_frees(table):
    old = table.put_start("k", 100, 1)
    table.put_end("k", old.generation)
    new = table.put_start("k", 200, 2, overwrite=True)
    assert new.generation > old.generation
    assert table.get("k") == old  # still the old version while the new one is written
    assert table.take_frees() == []
    table.put_end("k", new.generation)
    assert table.get("k") == new
    assert table.take_frees() == [FreeOrder("127.0.0.1:7000", b"k", old.generation, old.replicas[0].offset)]
    assert used(table) == 256 and table.total_bytes == 200 and table.object_count == 1


def test_revoke_frees_and_keeps_previous_version(table):
    old = table.put_start("k", 100, 1)
    table.put_end("k", old.generation)
    new = table.put_start("k", 100, 2, overwrite=True)
    table.put_revoke("k", new.generation)
    assert table.get("k") == old
    assert [f.generation for f in table.take_frees()] == [new.generation]
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
    assert used(table) == 0 and table.pending_count == 0
    assert table.counters.reclaimed_puts == 1
    assert [f.generation for f in table.take_frees()] == [v.generation]
    with pytest.raises(PutExpiredError):
        table.put_end("k", v.generation)


def test_late_put_end_fails_even_before_the_reclaim_task_ran(table, clock):
    v = table.put_start("k", 500, 1)
    clock.now += 11
    with pytest.raises(PutExpiredError):
        table.put_end("k", v.generation)
    assert used(table) == 0
    # ...and the key is free for a new put straight away.
    table.put_start("k", 500, 1)


def test_remove_and_remove_by_prefix(table):
    for key in ("a/1", "a/2", "b/1"):
        table.put_end(key, table.put_start(key, 100, 1).generation)
    table.remove("b/1")
    with pytest.raises(KeyNotFoundError):
        table.remove("b/1")
    assert table.remove_by_prefix("a/") == 2
    assert table.remove_by_prefix("a/") == 0
    assert table.object_count == 0 and used(table) == 0 and table.total_bytes == 0
    assert sorted(f.key for f in table.take_frees()) == [b"a/1", b"a/2", b"b/1"]
    assert table.counters.removes == 3


def test_zero_size_object_has_no_replicas(table):
    v = table.put_start("empty", 0, 0)
    assert v.replicas == ()
    table.put_end("empty", v.generation)
    assert table.get("empty").size == 0 and used(table) == 0


def test_no_nodes_is_no_space(clock):
    t = ObjectTable(clock=clock)
    with pytest.raises(NoSpaceError, match="no storage nodes"):
        t.put_start("k", 1, 0)


def test_too_large_and_no_space(table):
    with pytest.raises(ValueTooLargeError):
        table.put_start("k", (1 << 20) + 1, 0)  # default limit: the largest node's DRAM
    table.put_start("big", (1 << 20) - 64, 0)
    with pytest.raises(NoSpaceError):
        table.put_start("k", 128, 0)
    table.put_start("fits", 64, 0)


def test_configured_max_object_size(clock):
    t = ObjectTable(clock=clock, max_object_size=100)
    t.upsert_node(record("n1"))
    with pytest.raises(ValueTooLargeError):
        t.put_start("k", 101, 0)
    t.put_start("k", 100, 0)


def test_replicas_go_to_distinct_nodes_most_free_first(table):
    table.upsert_node(record("n2", capacity=2 << 20, port=7001))
    table.upsert_node(record("n3", capacity=1 << 19, port=7002))
    v = table.put_start("k", 100, 0, replicas=2)
    assert [r.node_id for r in v.replicas] == ["n2", "n1"]
    many = table.put_start("k2", 100, 0, replicas=5)  # best effort: one per node
    assert sorted(r.node_id for r in many.replicas) == ["n1", "n2", "n3"]


def test_drop_node_removes_objects_whose_only_replica_was_there(table):
    table.upsert_node(record("n2", port=7001))
    both = table.put_start("both", 100, 0, replicas=2)
    table.put_end("both", both.generation)
    only = table.put_start("only", 100, 0, replicas=1)
    table.put_end("only", only.generation)
    only_node = only.replicas[0].node_id
    other = "n2" if only_node == "n1" else "n1"
    pending = table.put_start("pending", 100, 0, replicas=2)

    dropped = table.drop_node(only_node)
    assert dropped.removed == ["only"]
    assert dropped.revoked == ["pending"]
    assert not table.exists("only")
    assert [r.node_id for r in table.get("both").replicas] == [other]
    with pytest.raises(PutExpiredError):
        table.put_end("pending", pending.generation)
    # The revoked put's extent on the surviving node is freed there; nothing is sent to the dead node.
    frees = table.take_frees()
    assert [(f.key, f.generation) for f in frees] == [(b"pending", pending.generation)]
    assert frees[0].address == table.nodes[other].address
    assert table.objects_on(other) == {DRAM: 1}
    assert table.nodes[other].tiers[DRAM].used == 128
    assert table.drop_node("nobody").removed == []


def test_restarted_node_loses_its_replicas(table):
    v = table.put_start("k", 100, 0)
    table.put_end("k", v.generation)
    assert table.upsert_node(record("n1")) is None  # same instance: nothing lost
    assert table.exists("k")
    dropped = table.upsert_node(record("n1", instance="i2", port=7005))
    assert dropped.removed == ["k"]
    assert not table.exists("k")
    assert used(table) == 0 and table.nodes["n1"].address == "127.0.0.1:7005"


def test_generations_are_unique_and_increasing(table):
    gens = []
    for i in range(50):
        v = table.put_start(f"k{i}", 10, 0)
        gens.append(v.generation)
        if i % 2:
            table.put_revoke(f"k{i}", v.generation)
    assert gens == sorted(set(gens))


def test_default_generation_seeded_from_wall_clock(clock):
    import time

    before = time.time_ns()
    t = ObjectTable(clock=clock)
    assert t.put_start("k", 0, 0).generation >= before
