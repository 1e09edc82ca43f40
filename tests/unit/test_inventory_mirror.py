"""A standby's copy of a node's inventory (master/leadership/inventory_mirror.py): layers of what changed,
completed at takeover by what changed since, adopt into the same table as the node's whole INVENTORY."""

import random

import numpy as np
import pytest

from kvpool.master.leadership.inventory_mirror import MERGE_AT, Layer, NodeCopy, find_disputes
from kvpool.master.table.objects import ObjectTable
from kvpool.master.table.unadopted import NodeEntries
from kvpool.protocol import inventory
from kvpool.protocol.inventory import Changes
from kvpool.storenode.storage.index import ObjectIndex, ObjectRecord

from test_takeover import node

pytestmark = pytest.mark.quick


def read(index: ObjectIndex, copy: NodeCopy, now: float) -> None:
    since = copy.since()
    changes = Changes(b"".join(index.columns.changes_parts(now, since)))
    assert copy.apply(changes, since, Layer(changes, now))
    copy.merge()


def adopted(table: ObjectTable) -> ObjectTable:
    while table.adopt_next(1000) is not None:
        pass
    return table


def held(table: ObjectTable, keys) -> dict:
    found = {}
    for key in keys:
        version = table.lookup(key)
        if version is not None:
            found[key] = (version.generation, version.size, version.checksum)
    return found


def whole(index: ObjectIndex, now: float) -> ObjectTable:
    table = ObjectTable(first_generation=1)
    table.upsert_node(node("n1"))
    table.take_inventory("n1", "n1-i1", inventory.Reply(index.columns.reply(now)))
    table.start_adopting()
    return adopted(table)


def from_copy(copy: NodeCopy, now: float) -> ObjectTable:
    table = ObjectTable(first_generation=1)
    table.upsert_node(node("n1"))
    table.take_entries("n1", "n1-i1", copy.masks(now))
    table.start_adopting()
    return adopted(table)


@pytest.mark.parametrize("seed", range(6))
def test_a_copy_kept_through_changes_adopts_as_the_whole_inventory(seed):
    rng = random.Random(seed)
    index, copy, now = ObjectIndex(), NodeCopy("n1", "n1-i1", "127.0.0.1:9001"), 1000.0
    live: dict[bytes, ObjectRecord] = {}
    generation = 0
    for round_ in range(40):
        for _ in range(rng.randrange(1, 30)):
            key = f"k{rng.randrange(60)}".encode()
            action = rng.random()
            if key in live and action < 0.3:
                index.remove(live.pop(key))
            elif key in live and action < 0.45:
                index.columns.join(live[key], inventory.SSD_BIT)
            elif key in live and action < 0.55:  # an overwrite: the old generation stays until freed
                generation += 1
                newer = ObjectRecord(key, generation, 10 + generation, generation)
                index.add(newer)
                if rng.random() < 0.7:
                    index.remove(live[key])
                live[key] = newer
            elif key not in live:
                generation += 1
                ttl = now + rng.choice([0, 0, 0, 5, 50])
                live[key] = ObjectRecord(key, generation, 10 + generation, generation, expires_at=ttl if ttl > now else 0)
                index.add(live[key])
        now += 1.0
        if round_ % 3 == 0:
            read(index, copy, now)
    read(index, copy, now + 0.5)  # what the takeover asks: everything since the copy
    assert len(copy.layers) <= MERGE_AT
    keys = [f"k{i}" for i in range(60)]
    assert held(from_copy(copy, now + 2.0), keys) == held(whole(index, now + 2.0), keys)


def test_the_copy_reads_it_whole_again_when_the_changes_since_outgrow_it():
    index, copy = ObjectIndex(), NodeCopy("n1", "n1-i1", "a")
    records = [ObjectRecord(f"k{i}".encode(), i + 1, 10, i) for i in range(10)]
    for rec in records:
        index.add(rec)
    read(index, copy, 0.0)
    assert copy.since() == copy.reached  # one layer: ask what changed since
    for rec in records[:6]:
        index.remove(rec)
    read(index, copy, 0.0)
    assert copy.since() == 0 and len(copy.layers) == 2  # 6 changed of 10: the next read is whole
    read(index, copy, 0.0)
    assert len(copy.layers) == 1 and len(copy.layers[0].slots) == 4


def test_another_numbering_is_not_followed():
    index, other, copy = ObjectIndex(), ObjectIndex(), NodeCopy("n1", "n1-i1", "a")
    index.add(ObjectRecord(b"k", 1, 10, 1))
    other.add(ObjectRecord(b"j", 2, 10, 1))
    read(index, copy, 0.0)
    from_other = Changes(b"".join(other.columns.changes_parts(0.0, copy.reached)))
    assert not copy.apply(from_other, copy.reached, Layer(from_other, 0.0))  # a restarted node's slots mean something else


def test_ttls_count_from_when_the_layer_was_read():
    index, copy = ObjectIndex(), NodeCopy("n1", "n1-i1", "a")
    index.add(ObjectRecord(b"short", 1, 10, 1, expires_at=110.0))
    index.add(ObjectRecord(b"long", 2, 10, 2, expires_at=1000.0))
    read(index, copy, 100.0)
    (entries, taken), = copy.masks(120.0)  # read at 100 with 10 s left: run out by 120
    assert taken.tolist() == [True, False]
    assert entries.reply.records["ttl_ms"].tolist()[1] == 880_000


def test_disputes_found_ahead_are_the_ones_found_at_takeover():
    def entries(pairs):
        return NodeEntries(inventory.Reply(inventory.encode([inventory.Entry(k, g, 10, 1) for k, g in pairs])))
    a, b, c = entries([("x", 1), ("y", 2)]), entries([("x", 3), ("y", 2)]), entries([("z", 4)])
    found = find_disputes([a, b, c], {})
    assert set(found) == {(a.ident, b.ident), (a.ident, c.ident), (b.ident, c.ident)}
    assert [len(found[pair]) for pair in sorted(found)] == [1, 0, 0]  # only x, at 1 and 3
    assert find_disputes([a, c], found) == {(a.ident, c.ident): found[(a.ident, c.ident)]}
    table = ObjectTable(first_generation=1)
    table.upsert_node(node("n1"))
    table.upsert_node(node("n2"))
    table.take_entries("n1", "n1-i1", [(a, np.zeros(2, dtype=bool))])
    table.take_entries("n2", "n2-i1", [(b, np.zeros(2, dtype=bool))])
    left = table.start_adopting(found)
    assert left == 2 and table.lookup("x").generation == 3  # the disputed key adopted before serving


def test_layers_past_the_limit_merge_into_one_that_adopts_the_same():
    index, copy, now = ObjectIndex(), NodeCopy("n1", "n1-i1", "a"), 100.0
    records = {}
    for i in range(1000):
        records[i] = ObjectRecord(f"k{i}".encode(), i + 1, 10, i)
        index.add(records[i])
    read(index, copy, now)
    generation, merges = 5000, 0
    for round_ in range(2 * MERGE_AT):
        now += 1.0
        # five keys changed once, each with a TTL of 3.5 s; "k999" overwritten every round (its older
        # versions superseded in the older layers); one key put in each round, removed in the next
        for i in [*range(round_ * 5, round_ * 5 + 5), 999]:
            index.remove(records.pop(i))
            generation += 1
            records[i] = ObjectRecord(f"k{i}".encode(), generation, 10, i, expires_at=0.0 if i == 999 else now + 3.5)
            index.add(records[i])
        if round_:
            index.remove(records.pop(f"brief{round_ - 1}"))
        records[f"brief{round_}"] = ObjectRecord(f"brief{round_}".encode(), generation, 10, 0)
        index.add(records[f"brief{round_}"])
        layers = len(copy.layers)
        read(index, copy, now)
        merges += len(copy.layers) <= layers
        assert len(copy.layers) <= MERGE_AT
        assert all(np.unique(layer.slots).size == layer.slots.size for layer in copy.layers)  # a slot once
    assert merges >= 2
    keys = [f"k{i}" for i in range(1000)] + [f"brief{r}" for r in range(2 * MERGE_AT)]
    for later in (now + 0.5, now + 1.0):  # TTLs counted from each layer's read, merged or not
        from_layers, from_whole = held(from_copy(copy, later), keys), held(whole(index, later), keys)
        assert from_layers == from_whole
        assert from_layers["k999"][0] == generation and len(from_layers) < 1000  # some ran out
