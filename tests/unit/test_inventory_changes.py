"""A node's inventory read again as what changed since (InventoryColumns.changes_parts, INVENTORY_CHANGES):
each slot's last change is numbered, a reader asks for the slots changed after the number it reached."""

import numpy as np
import pytest

from kvpool.errors import ProtocolError
from kvpool.protocol import inventory
from kvpool.protocol.inventory import DRAM_BIT, SSD_BIT, Changes, Entry
from kvpool.storenode.storage.index import ObjectIndex, ObjectRecord

pytestmark = pytest.mark.quick


def changes(index: ObjectIndex, since: int, now: float = 0.0) -> Changes:
    return Changes(b"".join(index.columns.changes_parts(now, since)))


def by_slot(found: Changes) -> dict:
    return dict(zip(found.slots.tolist(), (entry.key for entry in found.reply)))


def test_since_zero_is_every_live_object_with_its_slot():
    index = ObjectIndex()
    records = [ObjectRecord(f"k{i}".encode(), i + 1, 10, i) for i in range(5)]
    for rec in records:
        index.add(rec)
    index.remove(records[2])
    found = changes(index, 0)
    assert found.series == index.columns.series and found.changes == index.columns.changes == 6
    assert by_slot(found) == {0: "k0", 1: "k1", 3: "k3", 4: "k4"}
    assert found.gone.tolist() == [2]  # changed since 0, holds nothing now
    assert [e.generation for e in found.reply] == [1, 2, 4, 5]


def test_only_what_changed_after_the_number_comes_back():
    index = ObjectIndex()
    a, b, c, d = (ObjectRecord(key, n, 10, n) for n, key in enumerate((b"a", b"b", b"c", b"d"), 1))
    for rec in (a, b, c, d):
        index.add(rec)
    reached = changes(index, 0).changes
    assert changes(index, reached).slots.size == 0 and changes(index, reached).gone.size == 0
    index.remove(a)                        # slot 0: gone ...
    index.add(e := ObjectRecord(b"e", 9, 10, 9))  # ... and taken again by e
    index.columns.join(b, SSD_BIT)         # slot 1: a tier copy made
    index.remove(c)                        # slot 2: gone
    found = changes(index, reached)
    assert by_slot(found) == {0: "e", 1: "b"}
    assert found.gone.tolist() == [2]
    tiers = {entry.key: entry.tiers for entry in found.reply}
    assert tiers["b"] == SSD_BIT and e.slot == 0
    assert changes(index, found.changes).slots.size == 0  # nothing since


def test_a_ttl_run_out_is_gone_once_its_slot_changes_and_left_to_the_reader_before():
    index = ObjectIndex()
    short = ObjectRecord(b"short", 1, 10, 1, expires_at=100.0)
    index.add(short)
    index.add(ObjectRecord(b"long", 2, 10, 2))
    assert by_slot(changes(index, 0, now=50.0)) == {0: "short", 1: "long"}
    assert [e.ttl_ms for e in changes(index, 0, now=50.0).reply] == [50_000, 0]
    found = changes(index, 0, now=150.0)
    assert by_slot(found) == {1: "long"} and found.gone.tolist() == [0]


def test_the_reply_has_a_golden_encoding():
    slots, gone = np.array([3], dtype=np.uint32), np.array([1, 2], dtype=np.uint32)
    body = b"".join(inventory.encode_changes("ab12", 7, slots, gone,
                                             [inventory.encode([Entry("k", 5, 6, 7, 0, 6, 0, DRAM_BIT)])]))
    assert body.hex() == (
        "0700000000000000" "01000000" "02000000" "04" "61623132"   # changes, live, gone, series
        "03000000" "01000000" "02000000"                            # slots, gone
        "01000000" "0500000000000000" "0600000000000000" "0700000000000000" "0600000000000000"
        "0000000000000000" "00000000" "0100" "01" "6b")             # the INVENTORY reply of one entry
    found = Changes(body)
    assert (found.series, found.changes, found.slots.tolist(), found.gone.tolist()) == ("ab12", 7, [3], [1, 2])


@pytest.mark.parametrize("cut", [3, 17, 25, 30])
def test_a_short_or_inconsistent_reply_is_refused(cut):
    body = b"".join(inventory.encode_changes("ab12", 7, np.array([3], dtype=np.uint32), np.array([], dtype=np.uint32),
                                             [inventory.encode([Entry("k", 5, 6, 7)])]))
    with pytest.raises(ProtocolError):
        Changes(body[:cut])
