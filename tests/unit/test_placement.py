"""Placement as pure logic: most free space in the preferred tier, then the other tier."""

from dataclasses import dataclass, field

from kvpool.master.table.placement import MostFreeSpace, PlacementPolicy


@dataclass
class Node:
    node_id: str
    dram: int
    ssd: int = 0
    capacity: dict = field(default_factory=lambda: {"dram": 1000})
    zone: str = ""

    def free_bytes(self, tier: str) -> int:
        return {"dram": self.dram, "ssd": self.ssd}[tier]

    @property
    def largest_tier(self) -> int:
        return max(self.capacity.values())


def ids(nodes):
    return [n.node_id for n in nodes]


def test_orders_by_free_dram():
    nodes = [Node("a", 100), Node("b", 300), Node("c", 200)]
    assert ids(MostFreeSpace().choose(nodes, 50, 2)) == ["b", "c"]


def test_free_ssd_breaks_dram_ties():
    nodes = [Node("a", 100, ssd=10), Node("b", 100, ssd=500), Node("c", 90, ssd=10_000)]
    assert ids(MostFreeSpace().choose(nodes, 50, 3)) == ["b", "a", "c"]


def test_ssd_preference_orders_by_free_ssd_first():
    nodes = [Node("a", 900, ssd=10), Node("b", 100, ssd=500), Node("c", 200, ssd=500)]
    assert ids(MostFreeSpace().choose(nodes, 50, 3, tier="ssd")) == ["c", "b", "a"]


def test_a_full_node_is_still_a_candidate_but_a_too_small_one_is_not():
    # Free space may be negative (reported use plus puts sent since): the node evicts to make room.
    nodes = [Node("full", -20), Node("small", 900, capacity={"dram": 40})]
    assert ids(MostFreeSpace().choose(nodes, 50, 2)) == ["full"]
    # The SSD tier counts: an object larger than DRAM may go to a node with a larger SSD.
    big_ssd = Node("big", 0, ssd=5000, capacity={"dram": 40, "ssd": 5000})
    assert ids(MostFreeSpace().choose([big_ssd], 1000, 1)) == ["big"]


def test_returns_fewer_or_none_when_not_enough_fit():
    nodes = [Node("a", 100)]
    assert MostFreeSpace().choose(nodes, 50, 3) == nodes
    assert MostFreeSpace().choose(nodes, 1001, 1) == []
    assert MostFreeSpace().choose([], 1, 1) == []
    assert MostFreeSpace().choose(nodes, 1, 0) == []


def test_ties_break_by_node_id():
    nodes = [Node("z", 100), Node("a", 100)]
    assert ids(MostFreeSpace().choose(nodes, 1, 1)) == ["a"]


def test_satisfies_protocol():
    policy: PlacementPolicy = MostFreeSpace()
    assert ids(policy.choose([Node("a", 1)], 1, 1)) == ["a"]


def test_one_at_a_time_picks_what_choose_would_for_each_put_in_turn():
    import random

    rng = random.Random(5)
    for tier in ("dram", "ssd"):
        nodes = [Node(f"n{i}", rng.randrange(0, 5000), ssd=rng.randrange(0, 5000),
                      capacity={"dram": rng.choice([800, 5000])}) for i in range(5)]
        twins = [Node(n.node_id, n.dram, n.ssd, dict(n.capacity)) for n in nodes]
        pick = MostFreeSpace().one_at_a_time(twins, tier)
        for _ in range(300):
            size = rng.choice([1, 10, 300, 900, 6000])
            expected = MostFreeSpace().choose(nodes, size, 1, tier)
            got = pick(size)
            assert ids(expected) == ([got.node_id] if got is not None else [])
            for n in expected:  # the put reserves its size in the preferred tier
                setattr(n, tier, getattr(n, tier) - size)
