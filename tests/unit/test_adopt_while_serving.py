"""A new leader serves while it adopts the nodes' inventories (master/table/unadopted.py, ObjectTable.start_adopting):
a call naming a key adopts that key's entries first, so no lookup answers "missing" for a key a node holds,
an overwrite or remove during adoption wins over the version adopted later, and no generation handed out
is below one a node holds. The node's side: a new term's INVENTORY reconciles it (storenode/serving/read_grant.py)."""

import numpy as np
import pytest

from kvpool.errors import KeyExistsError, KeyNotFoundError, UnavailableError
from kvpool.master.table.objects import ObjectTable
from kvpool.master.table.unadopted import hashes_of, key_hashes
from kvpool.protocol import inventory
from kvpool.protocol.inventory import Entry
from kvpool.storenode.serving.read_grant import ReadGrant

from test_read_grant import Clock
from test_takeover import node

HELD = 1000  # entries per node


def reply(entries: list[Entry]) -> inventory.Reply:
    return inventory.Reply(inventory.encode(entries))


def adopting_table(n2_extra=()) -> ObjectTable:
    """Two nodes, each holding HELD keys (n1: a/0.., n2: b/0..) at generations 1000.., none adopted yet."""
    table = ObjectTable(first_generation=1)
    table.upsert_node(node("n1"))
    table.upsert_node(node("n2"))
    n1 = [Entry(f"a/{i}", 1000 + i, 10, i) for i in range(HELD)]
    n2 = [Entry(f"b/{i}", 5000 + i, 10, i) for i in range(HELD)] + list(n2_extra)
    table.take_inventory("n1", "n1-i1", reply(n1))
    table.take_inventory("n2", "n2-i1", reply(n2))
    left = table.start_adopting()
    assert left == len(n1) + len(n2) - 2 * len(n2_extra)  # a disputed key is adopted at once
    return table


def adopt_rest(table: ObjectTable) -> None:
    while table.adopt_next(100) is not None:
        pass
    assert table.adopting == 0


def frees(table: ObjectTable) -> list:
    return sorted((f.address, f.key, f.generation) for f in table.take_frees())


def test_a_key_not_adopted_yet_is_found_by_every_lookup():
    table = adopting_table()
    assert table.object_count < 2 * HELD  # nothing adopted in the background yet
    assert table.get("a/7").generation == 1007
    assert table.lookup("b/8").generation == 5008
    assert table.exists("a/9")
    assert table.exists_many(["a/10", "b/11", "c/1"]) == [True, True, False]
    with pytest.raises(KeyNotFoundError):
        table.get("a/nope")
    adopt_rest(table)
    assert table.object_count == 2 * HELD and table.take_frees() == []


def test_a_put_of_a_key_not_adopted_yet_is_refused_unless_it_overwrites_and_the_overwrite_wins():
    table = adopting_table()
    with pytest.raises(KeyExistsError):
        table.put_start("a/1", 10, 1)
    assert table.put_start_many(["a/2", "new/1"], [10, 10], [1, 1])[0].__class__ is KeyExistsError
    started = table.put_start("a/3", 20, 2, overwrite=True)
    assert started.generation > 5000 + HELD  # above every generation a node holds
    table.put_end("a/3", started.generation)
    assert frees(table) == [("127.0.0.1:9001", b"a/3", 1003)]  # the replaced version freed
    adopt_rest(table)  # the background adoption does not bring the older version back
    version = table.get("a/3")
    assert (version.generation, version.size) == (started.generation, 20)
    assert table.take_frees() == [] and table.object_count == 2 * HELD  # new/1 is still pending
    assert table.total_bytes == 2 * HELD * 10 - 10 + 20


def test_a_key_removed_while_adopting_stays_removed():
    table = adopting_table()
    table.remove("b/5")
    assert frees(table) == [("127.0.0.1:9002", b"b/5", 5005)]
    adopt_rest(table)
    assert not table.exists("b/5") and table.object_count == 2 * HELD - 1


def test_an_eviction_of_a_key_not_adopted_yet_is_not_undone_by_adopting_it_later():
    table = adopting_table()
    assert table.apply_evictions("n1", "n1-i1", [["a/4", 1004]]) == ["a/4"]
    adopt_rest(table)
    assert not table.exists("a/4")


def test_a_key_held_at_two_generations_is_settled_before_serving_newest_wins_older_freed():
    table = adopting_table(n2_extra=[Entry("a/6", 900, 10, 6), Entry("a/8", 99999, 30, 8)])
    assert frees(table) == [("127.0.0.1:9001", b"a/8", 1008), ("127.0.0.1:9002", b"a/6", 900)]
    assert table.lookup("a/8").generation == 99999 and table.lookup("a/6").generation == 1006
    assert table.put_start("x", 1, 1).generation > 99999
    adopt_rest(table)
    assert table.take_frees() == [] and table.object_count == 2 * HELD


def test_whole_table_changes_wait_for_the_adoption():
    table = adopting_table()
    with pytest.raises(UnavailableError, match="still adopting"):
        table.remove_by_prefix("a/")
    adopt_rest(table)
    assert table.remove_by_prefix("a/") == HELD


def test_a_node_restarted_while_adopting_has_its_old_entries_dropped():
    table = adopting_table()
    restarted = node("n1")
    restarted.instance = "n1-i2"
    table.upsert_node(restarted)
    assert not table.exists("a/1")
    adopt_rest(table)
    assert table.object_count == HELD


def test_key_hashes_match_over_a_reply_and_over_keys_of_any_length_and_text():
    keys = ["k", "key/2", "ключ/3", "x" * 300, "a", "key/2 "] + [f"s/{i:05d}" for i in range(200)]
    raw = [k.encode("utf-8", "surrogateescape") for k in keys]
    whole = key_hashes(b"".join(raw), np.cumsum([len(k) for k in raw]))
    assert (whole == hashes_of(keys)).all()
    assert len(set(whole.tolist())) == len(keys)
    fixed = [k for k in keys if k.startswith("s/")]  # one length: the matrix path
    assert (hashes_of(fixed) == whole[6:]).all()


def test_a_new_terms_inventory_before_the_old_grant_lapsed_lets_the_first_report_renew_it():
    clock = Clock()
    grant = ReadGrant(period=3.0, clock=clock)
    assert grant.reported()  # the old leader's last REPORT
    clock.now += 1.0
    grant.inventoried(new_term=True)  # the new leader's INVENTORY, while the old grant holds
    clock.now += 2.5  # lapsed before the new leader's first REPORT
    assert grant.reported()
    grant.check()
    # Within a term, an INVENTORY before a lapse does not excuse it (a REPORT sent long ago may arrive).
    clock.now += 1.0
    grant.inventoried()
    clock.now += 3.0
    assert not grant.reported()
