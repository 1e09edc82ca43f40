"""SGLang's own `mooncake` HiCache storage backend, unchanged, on kvpool: SGLang's StorageBackendFactory builds its
MooncakeStore, whose `from mooncake.store import MooncakeDistributedStore` finds kvpool's package
(compat/mooncake_store, installed in the SGLang venv); pages of SGLang's real host pools go to a real kvpool cluster
through Mooncake's zero-copy calls on the registered pool, and come back byte-exact into other pools' other slots.
SGLang's own test of that backend (test_mooncake_store.py, shipped with SGLang) runs too, as it is.

Run from the repository root: .venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/engines/in_sglang_mooncake.py
"""

import torch  # noqa: I001  (in_sglang puts the torchvision stand-in on the path before SGLang is imported)
import pytest

from in_sglang import hashes, mamba_host, mha_host, mla_host, page, starts, state_of, trailing_state  # noqa: E402

import mooncake.store  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName  # noqa: E402
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store import test_mooncake_store as sglang_own  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore  # noqa: E402

from kvpool import Client  # noqa: E402


@pytest.fixture
def mooncake_env(cluster, monkeypatch):
    """How a Mooncake user points SGLang at the store: the master's address, TCP (SGLang's default is RDMA)."""
    monkeypatch.setenv("MOONCAKE_MASTER", cluster.master_address)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "0")
    return cluster


def config(model: str, layout: str = "page_first", *, mla: bool = False, tp_rank: int = 0,
           tp_size: int = 1, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model,
                                extra_config={"interface_v1": 1, **extra})


def test_mooncake_store_here_is_kvpools():
    assert mooncake.store.BACKEND == "kvpool"


def test_sglang_own_mooncake_store_test_passes_on_kvpool(mooncake_env):
    sglang_own.test_single_operation()
    for mla, tp_rank, tp_size in ((False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)):
        sglang_own.test_batch_operation(sglang_own.make_hicache_storage_config(is_mla_model=mla, tp_rank=tp_rank,
                                                                               tp_size=tp_size))


# SGLang's mooncake backend takes MHA pools in the page_first layouts only (it raises for layer_first); MLA's
# layer_first pages are several buffers per key (batch_put_from_multi_buffers / batch_get_into_multi_buffers).
@pytest.mark.parametrize("layout, mla", [("page_first", False), ("page_first_direct", False), ("page_first", True),
                                         ("page_first_direct", True), ("layer_first", True)])
def test_pages_of_real_host_pools_come_back_into_other_slots(mooncake_env, layout, mla):
    make = mla_host if mla else mha_host
    writer_pool, reader_pool = make(layout, seed=7), make(layout)
    model = f"mc-{layout}-{'mla' if mla else 'mha'}"
    extra = {"master_server_address": mooncake_env.master_address, "protocol": "tcp", "global_segment_size": 0}
    writer = StorageBackendFactory.create_backend("mooncake", config(model, layout, mla=mla, **extra), writer_pool)
    reader = StorageBackendFactory.create_backend("mooncake", config(model, layout, mla=mla, **extra), reader_pool)
    assert isinstance(writer, MooncakeStore)
    writer.register_mem_pool_host(writer_pool)
    reader.register_mem_pool_host(reader_pool)
    keys = hashes(model, 3)
    written = writer_pool.alloc(3 * 8)
    assert writer.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, written) == [True] * 3
    assert writer.batch_set_v1(keys, written) == [True] * 3  # stored already: skipped, still a success
    assert reader.batch_exists(keys + ["not-stored"]) == 3
    reader_pool.alloc(2 * 8)
    landing = reader_pool.alloc(3 * 8)
    assert starts(landing) != starts(written)
    assert reader.batch_get_v1(keys, landing) == [True] * 3
    for mine, theirs in zip(starts(landing), starts(written)):
        assert torch.equal(page(reader_pool, mine), page(writer_pool, theirs))
    # one object per page and per K / V (MHA: "<hash>_<rank>_k", "_v"; MLA: "<hash>__k"), as Mooncake stores them
    with Client(mooncake_env.master_address) as client:
        named = [f"{model}_{keys[0]}_{'_k' if mla else '0_k'}"]
        assert client.batch_exists(named) == [True]
    missing = reader_pool.alloc(8)
    assert reader.batch_get_v1(["never-stored"], missing) == [False]
    writer.clear()  # SGLang's clear(): Mooncake's remove_all
    assert reader.batch_exists(keys) == 0


def test_a_hybrid_models_state_pool_goes_through_the_mooncake_backends_v2_calls(mooncake_env):
    """Mamba state beside the KV pages (SGLang's v2 interface of its mooncake backend): stored, looked up by the
    hit policy, loaded byte-exact into another pool's slot."""
    extra = {"master_server_address": mooncake_env.master_address, "protocol": "tcp", "global_segment_size": 0}

    def backend(kv_pool, state_pool):
        """Attached as SGLang's hybrid cache controller attaches it: built on the group's anchor (the KV pool),
        which registers first, then every pool of the group by name."""
        group = HostPoolGroup([PoolEntry(PoolName.KV, kv_pool, None, lambda layer: layer,
                                         is_primary_index_anchor=True),
                               PoolEntry(PoolName.MAMBA, state_pool, None, lambda layer: layer)])
        anchor = group.anchor_entry.host_pool
        made = StorageBackendFactory.create_backend("mooncake", config("mc-hybrid", **extra), anchor)
        made.register_mem_pool_host(anchor)
        for entry in group.entries:
            made.register_mem_host_pool_v2(entry.host_pool, entry.name)
        made.on_host_pools_registered()
        return made

    kv_writer, state_writer = mha_host("page_first", seed=11), mamba_host(seed=12)
    kv_reader, state_reader = mha_host("page_first"), mamba_host()
    writer, reader = backend(kv_writer, state_writer), backend(kv_reader, state_reader)
    keys = hashes("mc-hybrid", 4)
    pages, slots = kv_writer.alloc(4 * 8), state_writer.alloc(2)
    # This backend moves the KV pages through its v1 calls and the side pools through v2 (SGLang's controller
    # calls both); a state is kept after pages 2 and 4.
    assert writer.batch_set_v1(keys, pages) == [True] * 4
    assert writer.batch_set_v2([trailing_state([keys[1], keys[3]], slots)]) == {PoolName.MAMBA: [True, True]}
    hit = reader.batch_exists_v2(keys + ["not-stored"], [trailing_state([keys[3]])])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [2, 4])
    landing_pages, landing_slot = kv_reader.alloc(4 * 8), state_reader.alloc(2)[1:]
    assert reader.batch_get_v1(keys, landing_pages) == [True] * 4
    assert reader.batch_get_v2([trailing_state([keys[3]], landing_slot)]) == {PoolName.MAMBA: [True]}
    for source, target in zip(starts(pages), starts(landing_pages)):
        assert torch.equal(page(kv_reader, target), page(kv_writer, source))
    for stored, loaded in zip(state_of(state_writer, int(slots[1])), state_of(state_reader, int(landing_slot[0]))):
        assert torch.equal(stored, loaded)
