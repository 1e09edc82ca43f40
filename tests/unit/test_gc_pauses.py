"""The collector's pause watcher: a long full collection freezes its survivors and is logged."""

import gc
import logging

import pytest

from kvpool.runtime.gc_pauses import GcPauses

pytestmark = pytest.mark.quick


@pytest.fixture
def pauses():
    watcher = GcPauses(freeze_after_s=0.0, long_pause_s=0.0).install()
    try:
        yield watcher
    finally:
        watcher.uninstall()
        gc.unfreeze()


class Record:
    __slots__ = ("key", "size")

    def __init__(self, key, size):
        self.key, self.size = key, size


def test_a_long_full_collection_freezes_what_survived_it(pauses, caplog):
    before = gc.get_freeze_count()
    kept = [Record(str(i), i) for i in range(50_000)]
    with caplog.at_level(logging.WARNING, logger="kvpool.gc"):
        gc.collect()
    assert pauses.collections[2] >= 1 and pauses.freezes == pauses.collections[2]
    assert gc.get_freeze_count() >= before + len(kept)  # the survivors are out of the next full walk
    assert "generation-2 collection held the process" in caplog.text
    assert not gc.get_objects(2)  # nothing left in the oldest generation to walk again


def test_short_or_young_collections_freeze_nothing():
    watcher = GcPauses(freeze_after_s=60.0, long_pause_s=60.0).install()
    try:
        gc.collect(0)
        gc.collect()
        assert watcher.collections[0] == 1 and watcher.collections[2] == 1
        assert watcher.freezes == 0 and gc.get_freeze_count() == 0
    finally:
        watcher.uninstall()


def test_cyclic_garbage_made_after_a_freeze_is_still_collected(pauses):
    gc.collect()  # freezes what exists now
    watcher = GcPauses(freeze_after_s=60.0).install()  # later collections are short: nothing more frozen
    pauses.uninstall()
    try:
        node = {}
        node["self"] = node  # a cycle made after the freeze
        del node
        assert gc.collect() >= 1
    finally:
        watcher.uninstall()
