"""The eviction and promotion rules of storenode/storage/policy.py, on plain records."""

from dataclasses import dataclass

import pytest

from kvpool.storenode.storage import policy
from kvpool.storenode.storage.eviction_order import LfuOrder, LruOrder, new_order

NOW = 1_000_000.0


@dataclass(eq=False)
class Rec:
    name: str
    size: int = 100
    last_access: float = 0.0
    hits: int = 0
    expires_at: float = 0.0
    soft_pin_until: float = 0.0
    hold_until: float = 0.0
    hard_pin: bool = False
    refcount: int = 0
    window_start: float = 0.0
    window_hits: int = 0


def names(records):
    return [r.name for r in records]


def ordered(recs, mode=policy.LRU):
    """A tier's order after the records were last used in last_access order (with their hits counted)."""
    order = new_order(mode)
    for rec in sorted(recs, key=lambda r: r.last_access):
        order.add(rec)
    return order


@pytest.mark.parametrize("used,state", [(0, "low"), (75, "low"), (76, "normal"), (90, "normal"), (91, "high")])
def test_watermark_states(used, state):
    assert policy.watermark(used, 100, high=0.9, low=0.75) == state


def test_excess_is_down_to_low_and_only_above_high():
    assert policy.excess(90, 100, 0.9, 0.75) == 0
    assert policy.excess(91, 100, 0.9, 0.75) == 16
    assert policy.excess(100, 100, 0.9, 0.75) == 25
    assert policy.excess(5, 0, 0.9, 0.75) == 0


def test_lru_order_coldest_first():
    recs = [Rec("warm", last_access=50), Rec("cold", last_access=10), Rec("hot", last_access=90)]
    assert names(policy.victims(ordered(recs), NOW)) == ["cold", "warm", "hot"]


def test_lru_order_follows_accesses():
    a, b, c = Rec("a"), Rec("b"), Rec("c")
    order = LruOrder()
    for rec in (a, b, c):
        order.add(rec)
    order.touch(a)
    assert names(order) == ["b", "c", "a"]
    order.discard(c)
    order.touch(c)  # no longer a member: stays out
    assert names(order) == ["b", "a"] and len(order) == 2 and c not in order


def test_lfu_order_fewest_hits_first_then_oldest():
    recs = [Rec("popular", hits=9, last_access=1), Rec("rare-new", hits=1, last_access=80),
            Rec("rare-old", hits=1, last_access=20)]
    assert names(policy.victims(ordered(recs, policy.LFU), NOW)) == ["rare-old", "rare-new", "popular"]


def test_lfu_order_moves_a_record_up_on_each_hit():
    a, b, c = Rec("a"), Rec("b"), Rec("c")
    order = LfuOrder()
    for rec in (a, b, c):
        order.add(rec)
    b.hits += 1
    order.touch(b)
    a.hits += 1
    order.touch(a)  # same count as b, and more recent
    assert names(order) == ["c", "b", "a"]
    c.hits += 2
    order.touch(c)
    assert names(order) == ["b", "a", "c"]
    order.discard(b)
    assert names(order) == ["a", "c"] and len(order) == 2


def test_unpinned_and_expired_then_soft_pinned():
    # Expired ones the node drops first from its expiry queue (test_index); one still here ranks as unpinned.
    recs = [Rec("soft", last_access=1, soft_pin_until=NOW + 10),
            Rec("plain-hot", last_access=99),
            Rec("expired-soft", last_access=100, expires_at=NOW - 1, soft_pin_until=NOW + 10),
            Rec("plain-cold", last_access=5),
            Rec("lapsed-soft", last_access=50, soft_pin_until=NOW - 1)]  # a lapsed pin counts as none
    assert names(policy.victims(ordered(recs), NOW)) == [
        "plain-cold", "lapsed-soft", "plain-hot", "expired-soft", "soft"]


def test_hard_pinned_held_and_busy_are_never_victims():
    recs = [Rec("hard", hard_pin=True), Rec("held", hold_until=NOW + 1), Rec("busy", refcount=1),
            Rec("free")]
    assert names(policy.victims(ordered(recs), NOW)) == ["free"]
    # A lapsed hold protects nothing.
    assert names(policy.victims(ordered([Rec("was-held", hold_until=NOW - 0.001)]), NOW)) == ["was-held"]


def test_expired_goes_even_if_pinned_or_held_but_not_while_busy():
    recs = [Rec("hard", hard_pin=True, expires_at=NOW), Rec("held", hold_until=NOW + 5, expires_at=NOW - 1),
            Rec("busy", refcount=2, expires_at=NOW - 1)]
    assert names(policy.victims(ordered(recs), NOW)) == ["hard", "held"]


def test_pick_stops_once_enough_and_reaches_soft_pins_only_when_needed():
    recs = [Rec("a", size=100, last_access=1), Rec("b", size=100, last_access=2),
            Rec("soft", size=100, last_access=0, soft_pin_until=NOW + 60)]
    order = ordered(recs)
    assert names(policy.pick(order, 150, NOW)) == ["a", "b"]
    assert names(policy.pick(order, 250, NOW)) == ["a", "b", "soft"]
    assert names(policy.pick(order, 10_000, NOW)) == ["a", "b", "soft"]  # all there is
    assert names(policy.pick(order, 10_000, NOW, limit=1)) == ["a"]
    assert policy.pick(order, 0, NOW) == []
    assert names(policy.pick(order, 150, NOW, size=lambda r: 1000)) == ["a"]


def test_taking_a_few_victims_reads_only_the_cold_end_of_a_big_tier():
    order = ordered([Rec(str(i), last_access=i) for i in range(100_000)])
    read = []

    def watched():
        for rec in order:
            read.append(rec)
            yield rec
    assert names(policy.victims(watched(), NOW, limit=3)) == ["0", "1", "2"]
    assert len(read) == 3


def test_promotion_needs_enough_hits_inside_the_window():
    rec = Rec("r")
    assert not policy.count_hit_for_promotion(rec, 100.0, window=60, after=2)
    assert policy.count_hit_for_promotion(rec, 130.0, window=60, after=2)
    slow = Rec("slow")
    assert not policy.count_hit_for_promotion(slow, 100.0, window=60, after=2)
    assert not policy.count_hit_for_promotion(slow, 200.0, window=60, after=2)  # window lapsed: starts over
    assert policy.count_hit_for_promotion(slow, 210.0, window=60, after=2)
    assert policy.count_hit_for_promotion(Rec("eager"), 0.0, window=60, after=1)


def test_hard_pin_quota():
    assert policy.hard_pin_fits(0, 100, 100)
    assert policy.hard_pin_fits(60, 40, 100)
    assert not policy.hard_pin_fits(60, 41, 100)
    assert not policy.hard_pin_fits(0, 1, 0)
