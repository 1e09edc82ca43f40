"""The client's bounded LRU of placements."""

import pytest

from kvpool.client.placement_cache import PlacementCache


def test_get_put_and_miss():
    cache = PlacementCache(4)
    cache.put("a", 1)
    assert cache.get("a") == 1
    assert cache.get("b") is None
    cache.put("a", 2)
    assert cache.get("a") == 2 and len(cache) == 1


def test_least_recently_used_is_evicted():
    cache = PlacementCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")  # b is now the oldest
    cache.put("c", 3)
    assert "b" not in cache
    assert cache.get("a") == 1 and cache.get("c") == 3


def test_invalidate_and_prefix():
    cache = PlacementCache(10)
    for key in ("run1/a", "run1/b", "run2/a"):
        cache.put(key, key)
    cache.invalidate("missing")  # no error
    cache.invalidate("run2/a")
    assert cache.invalidate_prefix("run1/") == 2
    assert len(cache) == 0


def test_zero_capacity_caches_nothing():
    cache = PlacementCache(0)
    cache.put("a", 1)
    assert cache.get("a") is None


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError):
        PlacementCache(-1)
