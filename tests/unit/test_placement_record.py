"""The placement record's codec, the change tracking it relies on, and how a new leader
loads the record and checks it against a node's inventory."""

import pytest
from kvpool.master.changes import ChangeTrackingDict
from kvpool.master.objects import ObjectTable, ObjectVersion, PutOptions, Replica
from kvpool.master.placement_record import decode, encode
from kvpool.master.takeover import apply_inventory

from kvpool.cluster_layout import NodeRecord, TierRecord


def node(node_id: str) -> NodeRecord:
    return NodeRecord(node_id, f"{node_id}-i1", "127.0.0.1", 9000 + int(node_id[-1]),
                      tiers={"dram": TierRecord(1 << 30)})


def version(key="k", generation=7, nodes=("n1",), size=100, **extra) -> ObjectVersion:
    replicas = tuple(Replica(n, f"127.0.0.1:{9000 + int(n[-1])}", "dram", size) for n in nodes)
    return ObjectVersion(key, size, 1234, generation, replicas, **extra)


def test_codec_round_trip_keeps_every_field_and_moves_expiry_between_clocks():
    original = version(nodes=("n1", "n2"), options=PutOptions(tier="ssd", pin="soft", pin_ttl_seconds=5,
                                                               ttl_seconds=60),
                       compressed=True, raw_size=300, expires_at=1000.0)
    raw = encode(original, table_now=900.0, wall_now=50_000.0)
    # Read back by a process whose monotonic clock says 10 when the wall clock says 50_030.
    back = decode(raw, table_now=10.0, wall_now=50_030.0)
    assert back.expires_at == pytest.approx(10.0 + 70.0)
    assert back == original.__class__(**{**original.__dict__, "expires_at": back.expires_at})
    assert decode(encode(version(), 0, 0), 0, 0).expires_at is None


def test_decode_rejects_what_is_not_a_record():
    for raw in (b"[1,2]", b'{"key": "k"}', b"not json"):
        with pytest.raises(ValueError):
            decode(raw, 0, 0)


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


def test_table_changes_are_tracked_for_commit_overwrite_and_remove():
    table = ObjectTable()
    table.upsert_node(node("n1"))
    v = table.put_start("k", 10, 1)
    assert table.take_changed_keys() == []  # a pending put is not recorded
    table.put_end("k", v.generation)
    assert table.take_changed_keys() == ["k"]
    table.remove("k")
    assert table.take_changed_keys() == ["k"]


def test_load_record_skips_unknown_nodes_and_marks_what_differs():
    table = ObjectTable(first_generation=1)
    table.upsert_node(node("n1"))
    table.load_record(version("same", 5, ("n1",)))
    table.load_record(version("partly", 6, ("n1", "n2")))
    table.load_record(version("gone", 8, ("n2",)))
    assert table.lookup("same").replicas[0].node_id == "n1"
    assert [r.node_id for r in table.lookup("partly").replicas] == ["n1"]
    assert table.lookup("gone") is None
    assert sorted(table.take_changed_keys()) == ["gone", "partly"]  # records to rewrite / delete
    assert table.put_start("new", 10, 1).generation > 8  # never reuses a recorded generation


def test_inventory_wins_over_the_record():
    table = ObjectTable(first_generation=1)
    table.upsert_node(node("n1"))
    table.load_record(version("held", 5, ("n1",)))
    table.load_record(version("lost", 6, ("n1",)))
    table.take_changed_keys()
    entries = [{"key": "held", "generation": 5, "size": 100, "checksum": 1234},
               {"key": "orphan", "generation": 9, "size": 50, "checksum": 1}]
    dropped = apply_inventory(table, "n1", "n1-i1", entries)
    assert dropped == 1
    assert table.lookup("lost") is None and table.lookup("held") is not None
    assert table.lookup("orphan") is not None  # adopted by the table's inventory rule
    assert sorted(table.take_changed_keys()) == ["lost", "orphan"]
