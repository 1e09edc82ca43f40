"""An ObjectStore on real, small, temporary DRAM (and SSD) segments, for the store's unit tests."""

import pytest

from kvpool.storenode.storage.dram import DramSegment
from kvpool.storenode.storage.ssd import SsdSegment
from kvpool.storenode.storage.store import ObjectStore
from kvpool.storenode.storage.tiers import StorageTier


class Clock:
    def __init__(self):
        self.now = 1_000.0

    def __call__(self):
        return self.now


@pytest.fixture
def make_store(tmp_path):
    made = []

    def make(dram=64 * 1024, ssd=0, **options):
        dram_tier = StorageTier(DramSegment(dram, f"t-{len(made)}", directory=str(tmp_path)), 0.9, 0.75)
        ssd_tier = StorageTier(SsdSegment(str(tmp_path / f"ssd{len(made)}"), ssd), 0.9, 0.75) if ssd else None
        options.setdefault("hard_pin_quota", dram // 2)
        store = ObjectStore(dram_tier, ssd_tier, clock=options.pop("clock", Clock()), **options)
        made.append(store)
        return store

    yield make
    for store in made:
        for tier in store.tiers:
            tier.segment.close()
