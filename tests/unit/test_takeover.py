"""How a new leader rebuilds its table from the nodes' inventories, and the change tracking the
table offers whoever follows it."""

from kvpool.master.changes import ChangeTrackingDict
from kvpool.master.objects import ObjectTable

from kvpool.cluster_layout import NodeRecord, TierRecord


def node(node_id: str) -> NodeRecord:
    return NodeRecord(node_id, f"{node_id}-i1", "127.0.0.1", 9000 + int(node_id[-1]),
                      tiers={"dram": TierRecord(1 << 30)})


def entry(key: str, generation: int, size: int = 100, checksum: int = 1234, **extra) -> dict:
    return {"key": key, "generation": generation, "size": size, "checksum": checksum, **extra}


def two_node_table() -> ObjectTable:
    table = ObjectTable(first_generation=1)
    table.upsert_node(node("n1"))
    table.upsert_node(node("n2"))
    return table


def test_the_newest_generation_wins_whichever_node_answers_first():
    for order in (("n1", "n2"), ("n2", "n1")):
        table = two_node_table()
        held = {"n1": [entry("k", 5, size=10)], "n2": [entry("k", 9, size=30)]}
        for node_id in order:
            table.adopt_inventory(node_id, f"{node_id}-i1", held[node_id])
        version = table.lookup("k")
        assert version.generation == 9 and [r.node_id for r in version.replicas] == ["n2"]
        assert table.total_bytes == 30 and table.object_count == 1
        # The older copy is freed on its node, whichever came first.
        assert [(f.address, f.key, f.generation) for f in table.take_frees()] == [("127.0.0.1:9001", b"k", 5)]


def test_one_version_on_two_nodes_is_one_object_with_two_copies_kept():
    table = two_node_table()
    table.adopt_inventory("n1", "n1-i1", [entry("k", 7)])
    table.adopt_inventory("n2", "n2-i1", [entry("k", 7)])
    version = table.lookup("k")
    assert sorted(r.node_id for r in version.replicas) == ["n1", "n2"]
    assert version.target_replicas == 2  # repair restores the second copy if a node is lost later
    assert table.total_bytes == 100 and table.take_frees() == []


def test_a_same_generation_with_other_contents_is_freed_not_served():
    table = two_node_table()
    table.adopt_inventory("n1", "n1-i1", [entry("k", 7, checksum=1)])
    outcome = table.adopt_inventory("n2", "n2-i1", [entry("k", 7, checksum=2)])
    assert outcome.rejected == ["k"]
    assert [r.node_id for r in table.lookup("k").replicas] == ["n1"]


def test_generations_handed_out_after_a_rebuild_are_newer_than_any_held():
    table = two_node_table()
    table.adopt_inventory("n1", "n1-i1", [entry("k", 10**18)])
    assert table.put_start("new", 10, 1).generation > 10**18


def test_an_older_generation_than_a_pending_put_is_not_adopted_over_it():
    table = two_node_table()
    pending = table.put_start("k", 10, 1)
    outcome = table.adopt_inventory("n1", "n1-i1", [entry("k", pending.generation + 1)])
    assert outcome.rejected == ["k"] and table.lookup("k") is None


def test_change_tracking_dict_marks_every_write_and_delete_once():
    d = ChangeTrackingDict()
    d["a"] = 1
    d["b"] = 2
    del d["a"]
    d.pop("b")
    assert d.pop("missing", None) is None
    assert sorted(d.take_changed()) == ["a", "b"]
    assert d.take_changed() == [] and not d.has_changes
    d.tracking = False
    d["quiet"] = 1
    d.tracking = True
    assert not d.has_changes
    for key in "xyz":
        d[key] = 0
    assert len(d.take_changed(limit=2)) == 2 and len(d.take_changed()) == 1


def test_table_changes_are_tracked_only_once_asked_for():
    table = ObjectTable()
    table.upsert_node(node("n1"))
    v = table.put_start("quiet", 10, 1)
    table.put_end("quiet", v.generation)
    assert table.take_changed_keys() == []  # nobody follows the table: nothing is kept
    table.track_changes()
    v = table.put_start("k", 10, 1)
    assert table.take_changed_keys() == []  # a pending put is not a change
    table.put_end("k", v.generation)
    assert table.take_changed_keys() == ["k"]
    table.remove("k")
    assert table.take_changed_keys() == ["k"]
