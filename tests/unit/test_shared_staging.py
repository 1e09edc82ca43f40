"""A node's WRITE that must make room with an object of its last tier, when the node mounts a shared tier: the
victim's bytes are kept (staged) and written there by the sweep instead of being lost; read from memory
meanwhile; a FREE of it meanwhile keeps it from being written (or removes its file), on real segments and a
real directory."""

import asyncio

import pytest

from kvpool.errors import KeyNotFoundError
from kvpool.protocol.checksum import checksum
from kvpool.sharedfs.files import SharedDir
from kvpool.storenode.background.shared_tier import SharedTier
from small_store import make_store  # noqa: F401 (a fixture)


def put(store, key: bytes, size: int, generation: int = 1) -> bytes:
    data = (key * (size // len(key) + 1))[:size]
    res = store.reserve(key, size, 0)
    res.tier.segment.view(res.offset, size)[:] = data
    store.commit(res, store.new_record(key, generation, size, checksum(data), 0, 0, 0, 0))
    return data


@pytest.fixture
def staged(make_store, tmp_path):  # noqa: F811
    store = make_store(dram=64 * 1024)
    shared = SharedTier(SharedDir(str(tmp_path), "c", "node-1-x"), store, capacity=1 << 30)
    shared.staging_limit = 40 * 1024
    return store, shared


def test_a_writes_victims_are_kept_served_and_written_instead_of_lost(staged):
    store, shared = staged
    values = {f"k{i}".encode(): put(store, f"k{i}".encode(), 10 * 1024) for i in range(9)}
    # DRAM is full: these WRITEs make room with the coldest; 40 KiB of them are kept, the rest lost.
    values |= {f"n{i}".encode(): put(store, f"n{i}".encode(), 10 * 1024) for i in range(6)}
    dropped = store.take_dropped()
    assert dropped and all(len(entry) == 2 for entry in dropped)  # past the staging limit: evicted, said so
    lost = {entry[0].encode() for entry in dropped}
    kept = [k for k in values if not store.index.has_key(k) and k not in lost]
    assert len(kept) == 4
    for key in kept:  # served from memory before any file exists
        obj, payload = asyncio.run(shared.read(key, 1, 10 * 1024))
        assert payload == values[key]
    assert store.free(kept[0], 1)  # the master freed one meanwhile: never written
    asyncio.run(shared.write_staged())
    assert sorted(store.take_dropped()) == sorted([k.decode(), 1, "shared"] for k in kept[1:])
    for key in kept[1:]:
        assert shared.dir.read(key, 1)[1] == values[key]
    with pytest.raises(KeyNotFoundError):
        shared.dir.read(kept[0], 1)
