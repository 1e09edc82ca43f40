"""The client's bounded LRU of placements."""

import pytest

from kvpool.client.placement_cache import PlacementCache
from kvpool.proto import kvpool_pb2 as pb


def info(generation: int) -> pb.ObjectInfo:
    return pb.ObjectInfo(generation=generation, replicas=[pb.Replica(node_id="n", address="h:1")])


def generation(entry) -> int | None:
    return None if entry is None else entry.generation


def test_get_put_and_miss():
    cache = PlacementCache(4)
    cache.put("a", info(1))
    assert generation(cache.get("a")) == 1
    assert cache.get("b") is None
    cache.put("a", info(2))
    assert generation(cache.get("a")) == 2 and len(cache) == 1


def test_least_recently_used_is_evicted():
    cache = PlacementCache(2)
    cache.put("a", info(1))
    cache.put("b", info(2))
    cache.get("a")  # b is now the oldest
    cache.put("c", info(3))
    assert "b" not in cache
    assert generation(cache.get("a")) == 1 and generation(cache.get("c")) == 3


def test_invalidate_and_prefix():
    cache = PlacementCache(10)
    for key in ("run1/a", "run1/b", "run2/a"):
        cache.put(key, info(1))
    cache.invalidate("missing")  # no error
    cache.invalidate("run2/a")
    assert cache.invalidate_prefix("run1/") == 2
    assert len(cache) == 0


def test_zero_capacity_caches_nothing():
    cache = PlacementCache(0)
    cache.put("a", info(1))
    assert cache.get("a") is None


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError):
        PlacementCache(-1)
