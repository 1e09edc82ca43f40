"""The committed keys in order (master/table/key_order.py) and a page of them (ObjectTable.list_keys): every key
listed once in byte order whatever adds and drops come between pages, scopes and prefixes kept, and a
page that reads about as many keys as it gives."""

import random

import pytest

from kvpool.master.table import key_order
from kvpool.master.table.key_order import KeyOrder, page
from kvpool.master.table.objects import ObjectTable
from kvpool.master.table.versions import PutOptions
from kvpool.protocol.cluster_layout import NodeRecord, TierRecord
from kvpool.errors import UnavailableError
from kvpool.protocol.tenants import CLIENT_SCOPE, scope_of

from test_adopt_while_serving import HELD, adopt_rest, adopting_table

NEVER = lambda _key: False  # noqa: E731


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(key_order, "LOAD", 8)  # cuts and joins after a few keys


class Held(set):
    """A set whose order (master/table/key_order.py) is kept as ChangeTrackingDict keeps its own."""

    def __init__(self, keys=()):
        keys = list(keys)
        super().__init__(keys)
        self.order = KeyOrder()
        self.order.add_many(set(keys))

    def add(self, key):
        if key not in self:
            super().add(key)
            self.order.add(key)

    def discard(self, key):
        super().discard(key)
        self.order.discard(key)

    def update(self, keys):
        new = set(keys) - self
        super().update(new)
        self.order.add_many(new)


def listed(order: KeyOrder, prefix="", limit=7, scope=None, hidden=NEVER) -> list[str]:
    keys, cursor = page(order, prefix, limit, "", scope, hidden)
    while cursor:
        more, cursor = page(order, prefix, limit, cursor, scope, hidden)
        keys += more
    return keys


def test_random_adds_and_drops_keep_every_key_in_order(small_buckets):
    rng = random.Random(7)
    held = Held()
    order = held.order
    for step in range(5000):
        key = f"k{rng.randrange(400):03d}"
        if rng.random() < 0.02:  # a batch at once (a slice of an inventory adopted)
            held.update(f"k{rng.randrange(400):03d}" for _ in range(rng.randrange(60)))
        elif rng.random() < 0.55:
            held.add(key)
        else:
            held.discard(key)
        if step % 97 == 0:
            assert list(order.after("", True)) == sorted(held)
            assert len(order._bounds) <= 4 * len(held) // key_order.LOAD + 2  # joins keep buckets few
    assert listed(order) == sorted(held)
    assert list(order.after("k200")) == sorted(k for k in held if k > "k200")
    assert list(order.after("k200", True)) == sorted(k for k in held if k >= "k200")


def test_built_at_once_then_changed(small_buckets):
    keys = [f"{i:04d}" for i in range(0, 200, 2)]
    held = Held(reversed(keys))
    order = held.order
    assert list(order.after("", True)) == keys
    held.add("0051")
    held.discard("0010")
    held.add("0300")  # above every bound
    expected = sorted(set(keys) - {"0010"} | {"0051", "0300"})
    assert list(order.after("", True)) == expected
    assert len(order) == len(expected)


def test_pages_list_each_key_that_stays_once_whatever_changes_between_them(small_buckets):
    rng = random.Random(3)
    stays = {f"s{i:03d}" for i in range(100)}
    held = Held(stays)
    order = held.order
    seen, cursor = [], ""
    while True:
        keys, cursor = page(order, "", 6, cursor, None, NEVER)
        seen += keys
        if not cursor:
            break
        for _ in range(5):  # others come and go between pages, before and after the cursor
            other = f"s{rng.randrange(100):03d}x"
            (held.add if rng.random() < 0.6 else held.discard)(other)
    stayed = [k for k in seen if k in stays]
    assert stayed == sorted(stays)
    assert len(seen) == len(set(seen)) and seen == sorted(seen)


def test_prefix_limit_and_the_end():
    order = Held(["a", "ab/1", "ab/2", "ab/3", "ac", "b"]).order
    assert page(order, "ab/", 2, "", None, NEVER) == (["ab/1", "ab/2"], "ab/2")
    assert page(order, "ab/", 2, "ab/2", None, NEVER) == (["ab/3"], "")
    assert page(order, "ab/", 3, "", None, NEVER) == (["ab/1", "ab/2", "ab/3"], "")  # full, but nothing left
    assert page(order, "zz", 3, "", None, NEVER) == ([], "")
    assert page(order, "a", 10, "", None, lambda k: k == "ab/2") == (["a", "ab/1", "ab/3", "ac"], "")


def test_scopes():
    mine = ["\x01t\x01a", "\x01t\x01b"]
    theirs = ["\x01u\x01a", "\x01tt\x01a"]
    plain = ["0", "a", "z"]
    order = Held(mine + theirs + plain).order
    t = scope_of("t")
    assert listed(order, scope=t, limit=1) == mine
    assert listed(order, "\x01t\x01b", scope=t) == ["\x01t\x01b"]
    assert listed(order, "\x01u", scope=t) == []  # another tenant's prefix: nothing
    assert listed(order, "\x01", scope=t) == mine  # a prefix of its own scope: its keys only
    assert listed(order, scope=CLIENT_SCOPE, limit=1) == sorted(plain)
    assert listed(order, "\x01", scope=CLIENT_SCOPE) == []
    assert listed(order) == sorted(mine + theirs + plain)  # a member: every key


def test_the_client_scope_passes_the_tenants_keys_without_reading_them():
    order = Held([f"\x01t\x01{i:06d}" for i in range(50_000)] + ["a", "b"]).order
    read = []
    hidden = lambda key: read.append(key) or False  # noqa: E731 - counts the keys the page looked at
    assert page(order, "", 10, "", CLIENT_SCOPE, hidden) == (["a", "b"], "")
    assert read == ["a", "b"]


def test_a_page_reads_about_the_keys_it_gives():
    held = Held([f"{i:07d}" for i in range(200_000)])
    order = held.order
    for i in range(0, 200_000, 500):  # a change in every bucket: none is in order any more
        held.add(f"{i:07d}x")
        held.discard(f"{i:07d}x")
    read = []
    hidden = lambda key: read.append(key) or False  # noqa: E731
    keys, cursor = page(order, "", 100, "0100000", None, hidden)
    assert keys == [f"{i:07d}" for i in range(100_001, 100_101)] and cursor == keys[-1]
    assert len(read) == 101  # the page and one more, to tell whether another page follows
    assert sum(ordered is not None for ordered in order._sorted) <= 2  # only the page's buckets were sorted


def _table(clock=None) -> ObjectTable:
    table = ObjectTable(first_generation=1, **({"clock": clock} if clock else {}))
    table.upsert_node(NodeRecord(node_id="n1", instance="i", host="127.0.0.1", data_port=7000,
                                 tiers={"dram": TierRecord(capacity=1 << 30)}))
    return table


def _put(table, key, **options):
    version = table.put_start(key, 10, 1, **options)
    table.put_end(key, version.generation)


def test_the_table_lists_committed_keys_only():
    table = _table()
    for key in ("a", "b", "c"):
        _put(table, key)
    table.put_start("pending", 10, 1)
    table.remove("b")
    started = table.put_start_many(["x", "y"], [10, 10], [1, 1])
    table.put_end_many(["x", "y"], [v.generation for v in started])
    assert table.list_keys("", 100) == (["a", "c", "x", "y"], "")
    for version in table.put_start_many(["a", "z"], [10, 10], [1, 1], overwrite=True):  # an overwrite and a new key
        table.put_end(version.key, version.generation)
    assert table.list_keys("", 100) == (["a", "c", "x", "y", "z"], "")
    table.reset()
    assert table.list_keys("", 100) == ([], "")


def test_keys_adopted_at_takeover_are_listed_once_adopted_and_lost_ones_go():
    table = adopting_table()
    with pytest.raises(UnavailableError, match="adopting"):
        table.list_keys("", 10)  # a key not adopted yet may lie anywhere: no page until every one is
    adopt_rest(table)
    everything = sorted([f"a/{i}" for i in range(HELD)] + [f"b/{i}" for i in range(HELD)])
    assert table.list_keys("", 10_000) == (everything, "")
    table.drop_node("n2")  # its keys had no other copy
    assert table.list_keys("", 10_000) == (sorted(f"a/{i}" for i in range(HELD)), "")
    assert table.list_keys("b/", 10) == ([], "")


def test_the_order_holds_what_the_table_holds_through_every_change():
    table = _table()
    table.upsert_node(NodeRecord(node_id="n2", instance="i", host="127.0.0.1", data_port=7001,
                                 tiers={"dram": TierRecord(capacity=1 << 30)}))
    for i in range(300):
        _put(table, f"k/{i:03d}", replicas=2 if i % 3 == 0 else 1)
    for i in range(0, 300, 7):
        table.remove(f"k/{i:03d}")
    committed = table._ledger.committed
    evicted = [[key, committed[key].generation] for key in list(committed.keys())[:40]
               if any(r.node_id == "n1" for r in committed[key].replicas)]
    assert evicted
    table.apply_evictions("n1", "i", evicted)
    table.drop_node("n2")
    assert sorted(committed.keys()) == list(committed.order.after("", True))
    assert table.list_keys("k/", 10_000)[0] == sorted(committed.keys())


def test_an_object_past_its_ttl_is_not_listed_before_it_is_swept():
    now = [1000.0]
    table = _table(lambda: now[0])
    _put(table, "a")
    _put(table, "b", options=PutOptions(ttl_seconds=5))
    _put(table, "c", options=PutOptions(ttl_seconds=50))
    assert table.list_keys("", 10) == (["a", "b", "c"], "")
    now[0] += 6
    assert table.list_keys("", 10) == (["a", "c"], "")
    assert table.list_keys("", 1) == (["a"], "a")
    assert table.list_keys("", 1, "a") == (["c"], "")  # the hidden key neither counts nor ends the page
    assert table.object_count == 3  # listing changed nothing: the sweep drops it
