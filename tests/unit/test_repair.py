"""Replication bookkeeping as pure logic: zone-aware placement, partial puts, which objects
repair plans copies for (and which it leaves alone), drains, and the copy-rate throttle."""

import pytest

from kvpool.protocol.cluster_layout import NodeRecord, TierRecord
from kvpool.errors import InvalidArgumentError, NoSpaceError, UnavailableError
from kvpool.master.table.objects import ObjectTable
from kvpool.master.nodes.repair import Throttle, plan

MiB = 1 << 20


def record(node_id, zone="", port=7000, instance="i1", dram=MiB):
    return NodeRecord(node_id=node_id, instance=instance, host="127.0.0.1", data_port=port,
                      tiers={"dram": TierRecord(capacity=dram)}, zone=zone)


def table_with(*nodes) -> ObjectTable:
    table = ObjectTable(put_timeout=10.0, first_generation=100)
    for i, (node_id, zone) in enumerate(nodes):
        table.upsert_node(record(node_id, zone, port=7000 + i))
    return table


def put(table, key, size=100, replicas=2, failed=(), min_replicas=0):
    v = table.put_start(key, size, 1, replicas=replicas, min_replicas=min_replicas)
    return table.put_end(key, v.generation, failed)


def holders(table, key):
    return sorted(r.node_id for r in table.get(key).replicas)


def test_replicas_go_to_distinct_zones_before_sharing_one():
    table = table_with(("a1", "a"), ("a2", "a"), ("b1", "b"))
    for i in range(5):
        zones = {table.nodes[r.node_id].zone for r in put(table, f"k{i}").replicas}
        assert zones == {"a", "b"}
    three = put(table, "k3x", replicas=3)
    assert sorted(r.node_id for r in three.replicas) == ["a1", "a2", "b1"]


def test_min_replicas_is_checked_at_start_and_end():
    table = table_with(("n1", ""), ("n2", ""))
    with pytest.raises(InvalidArgumentError):
        table.put_start("k", 100, 1, replicas=2, min_replicas=3)
    with pytest.raises(NoSpaceError):  # only two nodes can take it
        table.put_start("k", 100, 1, replicas=3, min_replicas=3)
    v = table.put_start("k", 100, 1, replicas=2)  # min 0: every copy must be written
    with pytest.raises(UnavailableError):
        table.put_end("k", v.generation, ["n1"])
    table.put_revoke("k", v.generation)
    table.take_frees()
    v = table.put_start("k", 100, 1, replicas=2, min_replicas=1)
    with pytest.raises(InvalidArgumentError):
        table.put_end("k", v.generation, ["nope"])
    done = table.put_end("k", v.generation, ["n2"])
    assert [r.node_id for r in done.replicas] == ["n1"] and done.target_replicas == 2
    assert table.under_replicated() == 1
    assert [(f.address, f.generation) for f in table.take_frees()] == [("127.0.0.1:7001", v.generation)]


def test_partial_put_is_planned_onto_a_node_without_a_copy():
    table = table_with(("n1", ""), ("n2", ""), ("n3", ""))
    v = table.put_start("k", 100, 1, replicas=2, min_replicas=1)
    written, failed = v.replicas[0].node_id, v.replicas[1].node_id
    table.put_end("k", v.generation, [failed])
    (task,) = plan(table, 10)
    assert task.key == "k" and task.generation == v.generation and task.source.node_id == written
    assert task.destination.node_id != written
    assert table.add_replica("k", v.generation, task.destination.node_id, "dram")
    assert len(table.get("k").replicas) == 2 and table.under_replicated() == 0
    assert plan(table, 10) == [] and not table.repair_keys
    assert table.counters.repairs_done == 1 and table.counters.repair_bytes == 100


def test_lost_node_plans_one_copy_per_object_in_a_zone_not_yet_used():
    table = table_with(("a1", "a"), ("b1", "b"), ("b2", "b"), ("c1", "c"))
    keys = [f"k{i}" for i in range(6)]
    started = [table.put_start(key, 100, 1, replicas=2) for key in keys]
    for version in started:
        table.put_end(version.key, version.generation)
    on_a1 = [k for k in keys if "a1" in holders(table, k)]
    assert on_a1
    table.drop_node("a1")
    tasks = plan(table, 100)
    assert sorted(t.key for t in tasks) == sorted(on_a1)
    for task in tasks:
        survivor_zone = table.nodes[task.source.node_id].zone
        assert task.destination.zone not in (survivor_zone, "a")
    assert len(plan(table, 2, skip={tasks[0].key})) == min(2, len(tasks) - 1)


def test_evicted_copies_are_not_repaired():
    table = table_with(("n1", ""), ("n2", ""), ("n3", ""))
    v = put(table, "k")
    victim = v.replicas[0]
    table.apply_report(victim.node_id, "i1", {"tiers": {}, "evicted": [["k", v.generation]]},
                       table.report_mark())
    assert len(table.get("k").replicas) == 1
    assert table.under_replicated() == 0 and plan(table, 10) == []


def test_object_without_room_anywhere_waits_in_the_repair_set():
    table = table_with(("n1", ""), ("n2", ""))
    put(table, "k")
    table.drop_node("n2")
    assert plan(table, 10) == [] and table.repair_keys == {"k"}
    table.upsert_node(record("n3", port=7009))
    (task,) = plan(table, 10)
    assert task.destination.node_id == "n3"


def test_drain_copies_everything_off_then_frees_the_drained_copies():
    table = table_with(("n1", ""), ("n2", ""), ("n3", ""))
    put(table, "one", replicas=1)
    put(table, "two", replicas=2)
    drained = holders(table, "one")[0]
    assert table.start_drain(drained) == len([k for k in ("one", "two") if drained in holders(table, k)])
    assert table.nodes[drained].draining
    for _ in range(3):
        for task in plan(table, 10):
            assert task.destination.node_id != drained
            table.add_replica(task.key, task.generation, task.destination.node_id, "dram")
    assert drained not in holders(table, "one") + holders(table, "two")
    assert len(holders(table, "two")) == 2 and table.objects_on(drained) == 0
    assert table.nodes[drained].address in {f.address for f in table.take_frees()}
    assert table.under_replicated() == 0
    v = table.put_start("new", 100, 1, replicas=3)
    assert drained not in [r.node_id for r in v.replicas]


def test_a_copy_of_a_replaced_version_is_freed_not_added():
    table = table_with(("n1", ""), ("n2", ""), ("n3", ""))
    old = put(table, "k", replicas=1)
    v = table.put_start("k", 100, 1, overwrite=True)
    table.put_end("k", v.generation)
    table.take_frees()
    assert not table.add_replica("k", old.generation, "n3", "dram")
    assert [(f.address, f.generation) for f in table.take_frees()] == [("127.0.0.1:7002", old.generation)]


def test_drain_of_an_unknown_node_is_not_found():
    from kvpool.errors import KeyNotFoundError

    with pytest.raises(KeyNotFoundError):
        table_with(("n1", "")).start_drain("ghost")


def test_throttle_paces_starts_to_the_rate():
    now = [0.0]
    throttle = Throttle(rate=100.0, clock=lambda: now[0])
    assert throttle.delay_for(50) == 0.0
    assert throttle.delay_for(100) == pytest.approx(0.5)
    assert throttle.delay_for(10) == pytest.approx(1.5)
    now[0] = 10.0  # idle time does not bank a burst
    assert throttle.delay_for(100) == 0.0 and throttle.delay_for(1) == pytest.approx(1.0)
