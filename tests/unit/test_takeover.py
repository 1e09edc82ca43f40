"""How a new leader rebuilds its table from the nodes' inventories, and the change tracking the
table offers whoever follows it."""

import pytest

from kvpool.errors import PutExpiredError
from kvpool.protocol.inventory import Entry
from kvpool.master.table.change_tracking import ChangeTrackingDict
from kvpool.master.table.objects import ObjectTable

from kvpool.protocol.cluster_layout import NodeRecord, TierRecord


def node(node_id: str) -> NodeRecord:
    return NodeRecord(node_id, f"{node_id}-i1", "127.0.0.1", 9000 + int(node_id[-1]),
                      tiers={"dram": TierRecord(1 << 30)})


def entry(key: str, generation: int, size: int = 100, checksum: int = 1234) -> Entry:
    return Entry(key, generation, size, checksum)


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


def test_a_put_end_asked_again_after_a_takeover_finds_its_version_committed():
    table = two_node_table()
    table.adopt_inventory("n1", "n1-i1", [entry("k", 7)])
    assert table.put_end("k", 7).generation == 7  # the client's PutEnd reached the new leader
    assert table.object_count == 1 and table.take_frees() == []
    with pytest.raises(PutExpiredError):
        table.put_end("k", 6)  # an older generation is not the committed one


def test_placement_counts_pending_and_unreported_bytes_until_a_report_shows_them():
    table = two_node_table()
    started = table.put_start("a", 1000, 1)
    node_id = started.replicas[0].node_id
    node = table.nodes[node_id]
    assert node.reserved("dram") == 1000 and node.estimated_use("dram") == (0, 0)
    mark_before = table.report_mark()
    table.put_end("a", started.generation)
    assert node.reserved("dram") == 1000 and node.estimated_use("dram") == (1, 1000)
    table.apply_report(node_id, f"{node_id}-i1", {"tiers": {"dram": {"used": 0, "objects": 0}}}, mark_before)
    assert node.reserved("dram") == 1000  # that report was asked for before the commit
    table.apply_report(node_id, f"{node_id}-i1", {"tiers": {"dram": {"used": 1000, "objects": 1}}},
                       table.report_mark())
    assert node.reserved("dram") == 0 and node.estimated_use("dram") == (1, 1000)
    revoked = table.put_start("b", 500, 1)
    assert table.nodes[revoked.replicas[0].node_id].reserved("dram") == 500
    table.put_revoke("b", revoked.generation)
    assert all(n.reserved("dram") == 0 for n in table.nodes.values())


def test_change_tracking_dict_marks_every_write_and_delete_once():
    d = ChangeTrackingDict()
    d["a"] = 1
    d["b"] = 2
    d["c"] = 3
    assert d.take_appeared_and_gone() == (["a", "b", "c"], [])
    assert d.take_appeared_and_gone() == ([], []) and not d.has_changes
    del d["a"]
    d.pop("b")
    assert d.pop("missing", None) is None
    d["c"] = 4  # replaced: neither appeared nor gone, but a change
    d.pop("c")
    d["c"] = 5  # gone and back: neither
    assert d.has_changes and d.take_appeared_and_gone() == ([], ["a", "b"])
    d.tracking = False
    d["quiet"] = 1
    d.tracking = True
    assert not d.has_changes


def test_table_changes_are_tracked_only_once_asked_for():
    table = ObjectTable()
    table.upsert_node(node("n1"))
    v = table.put_start("quiet", 10, 1)
    table.put_end("quiet", v.generation)
    assert not table.has_changes  # nobody follows the table: nothing is kept
    table.track_changes()
    v = table.put_start("k", 10, 1)
    assert not table.has_changes  # a pending put is not a change
    table.put_end("k", v.generation)
    assert table.take_appeared_and_gone() == (["k"], [])
    table.remove("k")
    assert table.take_appeared_and_gone() == ([], ["k"])


def test_bulk_adoption_of_inventory_columns_matches_adoption_entry_by_entry():
    from kvpool.protocol.inventory import DRAM_BIT, SSD_BIT, Reply, encode

    def prepared() -> ObjectTable:
        table = ObjectTable(first_generation=1, clock=lambda: 1000.0)  # one clock: equal ttl deadlines
        table.upsert_node(node("n1"))
        table.upsert_node(node("n2"))
        table.adopt_inventory("n1", "n1-i1", [entry("known", 50), entry("older-here", 60), entry("newer-here", 40)])
        table.put_start("pending", 10, 1)
        return table

    held = [entry("new", 70), Entry("new-ssd", 71, 100, 5, tiers=SSD_BIT), Entry("both", 72, 100, 5,
                                                                                 tiers=DRAM_BIT | SSD_BIT),
            Entry("ttl", 73, 100, 5, ttl_ms=60_000), Entry("flags", 74, 100, 5, flags=1, raw_size=900),
            entry("known", 50), entry("older-here", 55), entry("newer-here", 45), entry("pending", 80)]
    for slice_size, entries in ((3, held), (100, held), (100, held + [entry("new", 69)])):
        one_by_one, bulk = prepared(), prepared()
        expected = one_by_one.adopt_inventory("n2", "n2-i1", entries)
        got = [bulk.adopt_columns("n2", "n2-i1", columns) for columns in Reply(encode(entries)).column_slices(slice_size)]
        for name in ("adopted", "created", "rejected"):
            assert sorted(k for part in got for k in getattr(part, name)) == sorted(getattr(expected, name)), name
        for key in {e.key for e in entries}:
            assert bulk.lookup(key) == one_by_one.lookup(key), key
        assert bulk.total_bytes == one_by_one.total_bytes and bulk.object_count == one_by_one.object_count
        assert sorted(map(repr, bulk.take_frees())) == sorted(map(repr, one_by_one.take_frees()))
        assert bulk.nodes["n2"].keys == one_by_one.nodes["n2"].keys
        assert bulk.put_start("after", 1, 1).generation > 74  # above every generation adopted


def test_every_node_knows_exactly_the_committed_copies_it_holds_whatever_happens():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ops = st.lists(st.tuples(st.sampled_from(["put", "put2", "overwrite", "remove", "revoke", "evict", "adopt",
                                              "drop", "rejoin"]),
                             st.sampled_from(["a", "b", "c"]), st.sampled_from(["n1", "n2"])), max_size=40)

    @settings(max_examples=200, deadline=None)
    @given(ops)
    def run(steps):
        table = two_node_table()
        instance = {"n1": 1, "n2": 1}
        for step, (op, key, node_id) in enumerate(steps):
            try:
                if op in ("put", "put2", "overwrite"):
                    started = table.put_start(key, 10, 1, overwrite=op == "overwrite",
                                              replicas=2 if op == "put2" else 1)
                    table.put_end(key, started.generation)
                elif op == "remove":
                    table.remove(key)
                elif op == "revoke":
                    started = table.put_start(key, 10, 1, overwrite=True)
                    table.put_revoke(key, started.generation)
                elif op == "evict" and node_id in table.nodes and (v := table.lookup(key)) is not None:
                    node = table.nodes[node_id]
                    table.apply_report(node_id, node.instance, {"evicted": [[key, v.generation]]},
                                       table.report_mark())
                elif op == "adopt" and node_id in table.nodes:
                    table.adopt_inventory(node_id, table.nodes[node_id].instance, [entry(key, 10**12 + step)])
                elif op == "drop":
                    table.drop_node(node_id)
                elif op == "rejoin":
                    instance[node_id] += 1
                    table.upsert_node(NodeRecord(node_id, f"{node_id}-i{instance[node_id]}", "127.0.0.1",
                                                 9000 + int(node_id[-1]), tiers={"dram": TierRecord(1 << 30)}))
            except Exception as exc:  # noqa: BLE001 - typed refusals are part of the walk
                assert type(exc).__module__ == "kvpool.errors", exc
            for held_by, node in table.nodes.items():
                held = {k for k in table.committed_keys()
                        if any(r.node_id == held_by for r in table.lookup(k).replicas)}
                assert node.keys == held and table.objects_on(held_by) == len(held)
                assert node.pending == {} and node.reserved("dram") >= 0

    run()
