"""The master's object table and the shared tier, as pure logic (master/table/shared_tier.py): a node's MOVED and
promoted entries, lookups naming the tier at a node that mounts it, the leader's evictions at capacity, the
FREEs of files, and the tier's scan adopted as the pseudo-node's inventory."""

from kvpool.master.table.objects import ObjectTable
from kvpool.master.table.shared_tier import SHARED_NODE, SharedKeys, with_copy
from kvpool.master.table.versions import DRAM, SHARED, Replica
from kvpool.protocol import inventory
from kvpool.protocol.cluster_layout import NodeRecord, TierRecord
from kvpool.protocol.inventory import SHARED_BIT, Entry

MiB = 1 << 20


def record(node_id, port, shared_capacity=None):
    tiers = {"dram": TierRecord(capacity=64 * MiB)}
    if shared_capacity is not None:
        tiers["shared"] = TierRecord(capacity=shared_capacity, path="/mnt/kv")
    return NodeRecord(node_id=node_id, instance="i1", host="127.0.0.1", data_port=port, tiers=tiers)


def table_with(*records) -> ObjectTable:
    table = ObjectTable(put_timeout=10.0, clock=lambda: 1000.0, first_generation=100)
    for r in records:
        table.upsert_node(r)
    return table


def put(table, key, size=MiB):
    v = table.put_start(key, size, 1)
    return table.put_end(key, v.generation)


def moved(table, node_id, key, generation):
    return table.apply_evictions(node_id, "i1", [[key, generation, "shared"]])


def test_a_moved_copy_becomes_the_tiers_named_at_a_node_that_mounts_it():
    table = table_with(record("n1", 7001, shared_capacity=10 * MiB), record("n2", 7002))
    v = put(table, "k")
    node = v.replicas[0].node_id
    moved(table, node, "k", v.generation)
    got = table.get("k")
    assert got.replicas == (Replica(SHARED_NODE, "127.0.0.1:7001", SHARED),)
    assert "k" not in table.nodes[node].keys and "k" in table.shared.keys
    assert table.shared.keys.bytes == MiB and table.live_count(got) == 1
    # No placement, repair or report ever picks the pseudo-node; it is no registered node either.
    assert all(r.node_id != SHARED_NODE for _ in range(20) for r in table.put_start(f"p{_}", 10, 1).replicas)
    assert table.max_object_size == 64 * MiB
    table.drop_node(SHARED_NODE)  # membership never drops it
    assert table.get("k").replicas[0].node_id == SHARED_NODE


def test_a_put_moved_on_before_its_end_commits_with_the_shared_copy():
    """put(tier="shared"): the node writes the object on to the tier as soon as it is stored, and its word can
    reach the leader before the client's PutEnd. The put then ends with the tier's copy, not the node's."""
    table = table_with(record("n1", 7001, shared_capacity=10 * MiB))
    v = table.put_start("k", MiB, 1)
    moved(table, "n1", "k", v.generation)
    assert table.take_frees() == []  # the file is the put's: kept
    table.put_end("k", v.generation)
    assert table.get("k").replicas == (Replica(SHARED_NODE, "127.0.0.1:7001", SHARED),)
    assert "k" not in table.nodes["n1"].keys and "k" in table.shared.keys
    assert table.shared.keys.bytes == MiB


def test_a_version_replaced_while_it_moved_has_its_file_freed():
    table = table_with(record("n1", 7001, shared_capacity=10 * MiB))
    old = put(table, "k")
    table.take_frees()
    v = table.put_start("k", MiB, 2, overwrite=True)
    table.put_end("k", v.generation)
    table.take_frees()
    moved(table, "n1", "k", old.generation)
    [free] = table.take_frees()
    assert (free.address, free.key, free.generation, free.shared) == ("127.0.0.1:7001", b"k", old.generation, True)
    assert table.get("k").replicas[0].tier == DRAM


def test_an_overwrite_or_remove_frees_the_file_at_the_node_serving_the_tier_now():
    table = table_with(record("n1", 7001, shared_capacity=10 * MiB))
    v = put(table, "k")
    moved(table, "n1", "k", v.generation)
    table.take_frees()
    table.drop_node("n1")
    table.upsert_node(record("n3", 7003, shared_capacity=10 * MiB))
    table.remove("k")
    [free] = table.take_frees()
    assert (free.address, free.shared) == ("127.0.0.1:7003", True)
    assert len(table.shared.keys) == 0 and table.shared.keys.bytes == 0


def test_a_free_ordered_while_no_node_mounts_the_tier_waits_for_one():
    table = table_with(record("n1", 7001, shared_capacity=10 * MiB), record("n2", 7002))
    v = put(table, "k")
    moved(table, v.replicas[0].node_id, "k", v.generation)
    table.drop_node("n1")
    table.take_frees()
    table.remove("k")
    assert table.take_frees() == []
    table.upsert_node(record("n4", 7004, shared_capacity=10 * MiB))
    [free] = table.take_frees()
    assert (free.address, free.key, free.shared) == ("127.0.0.1:7004", b"k", True)


def test_a_promoted_copy_goes_before_the_shared_one():
    table = table_with(record("n1", 7001, shared_capacity=10 * MiB), record("n2", 7002, shared_capacity=10 * MiB))
    v = put(table, "k")
    moved(table, v.replicas[0].node_id, "k", v.generation)
    table.apply_evictions("n2", "i1", [["k", v.generation, "promoted"]])
    replicas = table.get("k").replicas
    assert [r.node_id for r in replicas] == ["n2", SHARED_NODE] and replicas[0].tier == DRAM
    assert "k" in table.nodes["n2"].keys


def test_the_leader_evicts_the_coldest_at_capacity_and_lookups_warm_them():
    table = table_with(record("n1", 7001, shared_capacity=10 * MiB))
    for i in range(9):
        v = put(table, f"k{i}")
        moved(table, "n1", f"k{i}", v.generation)
    assert table.evict_shared() == []  # 9 MiB of 10: below the high watermark (0.95)
    table.get("k0")  # read: the warmest now
    for key in ("k9", "k10"):
        v = put(table, key)
        moved(table, "n1", key, v.generation)
    table.take_frees()
    gone = table.evict_shared()  # 11 MiB: down to 9 (0.9 of the capacity)
    assert gone == ["k1", "k2"]
    assert table.shared.keys.bytes == 9 * MiB and table.lookup("k0") is not None
    assert sorted((f.key, f.shared) for f in table.take_frees()) == [(b"k1", True), (b"k2", True)]


def test_the_tiers_scan_is_adopted_as_the_pseudo_nodes_inventory():
    table = table_with(record("n1", 7001, shared_capacity=10 * MiB))
    entries = [Entry("a", 500, 10, 1, tiers=SHARED_BIT), Entry("b", 501, 20, 2, tiers=SHARED_BIT)]
    table.take_inventory(SHARED_NODE, "shared", inventory.Reply(inventory.encode(entries)))
    table.start_adopting()
    while table.adopt_next(1000) is not None:
        pass
    assert table.get("a").replicas == (Replica(SHARED_NODE, "127.0.0.1:7001", SHARED),)
    assert table.get("b").size == 20 and len(table.shared.keys) == 2 and table.shared.keys.bytes == 30
    v = table.put_start("c", 5, 1)
    assert v.generation > 501  # generations the tier holds are never handed out again


def test_shared_keys_keep_order_and_sizes_and_with_copy_keeps_the_shared_copy_last():
    sizes = {"a": 1, "b": 2, "c": 3}
    keys = SharedKeys(sizes.__getitem__)
    keys.update(["a", "b", "c"])
    keys.touch("a")
    assert list(keys.coldest()) == ["b", "c", "a"] and keys.bytes == 6
    keys.difference_update(["b", "x"])
    assert list(keys) == ["c", "a"] and keys.bytes == 4 and len(keys) == 2
    shared = (Replica(SHARED_NODE, "h:1", SHARED),)
    dram = (Replica("n1", "h:2", DRAM),)
    assert with_copy(shared, dram) == dram + shared
    assert with_copy(dram, shared) == dram + shared


def test_a_files_free_goes_to_every_node_that_mounts_the_tier():
    table = table_with(record("n1", 7001, shared_capacity=10 * MiB), record("n2", 7002, shared_capacity=10 * MiB),
                       record("n3", 7003))
    v = put(table, "k")
    moved(table, v.replicas[0].node_id, "k", v.generation)
    table.take_frees()
    table.remove("k")  # either could serve the file under its read grant: each must see it gone
    frees = table.take_frees()
    assert sorted((f.address, f.shared) for f in frees) == [("127.0.0.1:7001", True), ("127.0.0.1:7002", True)]
