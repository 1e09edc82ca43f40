"""The packed committed versions and the binary INVENTORY: what goes in comes out the same."""

import pytest

from kvpool.errors import ProtocolError
from kvpool.protocol.inventory import DRAM_BIT, SSD_BIT, Entry, Reply, decode, encode
from kvpool.master.table.version_store import VersionStore
from kvpool.master.table.versions import NO_OPTIONS, ObjectVersion, PutOptions, Replica

A = Replica("n1", "127.0.0.1:1", "dram")
B = Replica("n2", "127.0.0.1:2", "ssd")


def test_versions_come_back_equal_with_or_without_their_rare_fields():
    store = VersionStore()
    plain = ObjectVersion("k", 1024, 2**64 - 1, 2**63 + 5, (A,), raw_size=1024)
    rich = ObjectVersion("r", 300, 7, 9, (A, B), options=PutOptions(tier="ssd", pin="soft", pin_ttl_seconds=2.5,
                                                                       ttl_seconds=60),
                         compressed=True, raw_size=3000, expires_at=1234.5, target_replicas=3)
    store["k"], store["r"] = plain, rich
    assert store["k"] == plain and store.get("r") == rich and store.get("none") is None
    assert store["k"].options is NO_OPTIONS and len(store) == 2 and set(store) == {"k", "r"}
    assert store.expiring == {"r": 1234.5}
    store["r"] = ObjectVersion("r", 1, 1, 10, (B,), raw_size=1)  # replaced without a ttl
    assert store.expiring == {} and store.pop("r").generation == 10 and "r" not in store
    assert store.pop("r") is None


def test_equal_replica_sets_are_stored_once():
    store = VersionStore()
    for i in range(1000):
        store[f"k{i}"] = ObjectVersion(f"k{i}", 10, i, i, (Replica("n1", "127.0.0.1:1", "dram"),), raw_size=10)
    assert store["k1"].replicas is store["k999"].replicas
    store.add_plain("p", 5, 6, 7, (A, B))
    assert store["p"] == ObjectVersion("p", 7, 6, 5, (A, B), raw_size=7, target_replicas=2)


def test_options_a_client_makes_up_are_kept_whole_and_nothing_outlives_their_objects():
    import gc
    import tracemalloc

    store = VersionStore()
    for i in range(20_000):  # warm up: the table's dict and the options cache reach their sizes
        store[f"k{i}"] = ObjectVersion(f"k{i}", 10, i, i, (A,), options=PutOptions(ttl_seconds=1 + i / 7), raw_size=10)
        store[f"k{i}"]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(20_000):  # every put with options of its own
        options = PutOptions(tier="ssd", pin="soft", pin_ttl_seconds=i + 0.25, ttl_seconds=10 + i / 1000)
        store[f"k{i}"] = ObjectVersion(f"k{i}", 10, i, i, (A,), options=options, raw_size=10)
        assert store[f"k{i}"].options == options
    for i in range(20_000):
        del store[f"k{i}"]
    gc.collect()
    left = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert left < 1_000_000, f"{left} bytes outlive 20,000 removed objects with distinct options"


def test_changes_are_tracked_only_once_asked_for():
    store = VersionStore()
    store["a"] = ObjectVersion("a", 1, 1, 1, (A,), raw_size=1)
    store.tracking = True
    store["b"] = ObjectVersion("b", 1, 1, 2, (A,), raw_size=1)
    del store["a"]
    assert store.has_changes and store.take_appeared_and_gone() == (["b"], ["a"])
    assert not store.has_changes


def test_an_inventory_round_trips_in_slices_and_damage_is_a_protocol_error():
    entries = [Entry(f"key/{i}é", 2**63 - 50 + i, i, 2**64 - 1 - i, i % 3, i * 2, i * 7,
                     DRAM_BIT | SSD_BIT * (i % 2)) for i in range(50)]
    body = encode(entries)
    assert decode(body) == entries and list(Reply(body)) == entries and len(Reply(body)) == 50
    assert [len(part) for part in Reply(body).slices(20)] == [20, 20, 10]
    assert decode(encode([])) == []
    for damaged in (body[:3], body[:40], body[:-1], body + b"x"):
        with pytest.raises(ProtocolError):
            decode(damaged)
    with pytest.raises(ProtocolError, match="generation beyond"):  # its successor would not fit 64 bits
        decode(encode([Entry("k", 2**63, 1, 1)]))
    assert not Entry("k", 1, 1, 1, tiers=SSD_BIT).in_dram
