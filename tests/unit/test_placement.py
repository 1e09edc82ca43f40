from dataclasses import dataclass

from kvpool.master.placement import MostFreeSpace, PlacementPolicy


@dataclass
class Node:
    node_id: str
    free_bytes: int
    largest_free: int


def test_most_free_space_orders_by_free_bytes():
    nodes = [Node("a", 100, 100), Node("b", 300, 300), Node("c", 200, 200)]
    assert [n.node_id for n in MostFreeSpace().choose(nodes, 50, 2)] == ["b", "c"]


def test_skips_nodes_without_a_large_enough_extent():
    # "b" has the most free bytes but they are fragmented into small extents.
    nodes = [Node("a", 100, 100), Node("b", 1000, 64), Node("c", 200, 150)]
    assert [n.node_id for n in MostFreeSpace().choose(nodes, 128, 3)] == ["c"]


def test_returns_fewer_or_none_when_not_enough_fit():
    nodes = [Node("a", 100, 100)]
    assert MostFreeSpace().choose(nodes, 50, 3) == nodes
    assert MostFreeSpace().choose(nodes, 101, 1) == []
    assert MostFreeSpace().choose([], 1, 1) == []


def test_ties_break_by_node_id():
    nodes = [Node("z", 100, 100), Node("a", 100, 100)]
    assert [n.node_id for n in MostFreeSpace().choose(nodes, 1, 1)] == ["a"]


def test_satisfies_protocol():
    policy: PlacementPolicy = MostFreeSpace()
    assert policy.choose([Node("a", 1, 1)], 1, 1)[0].node_id == "a"
