"""kvpool as SGLang's HiCache storage, inside SGLang's venv: the backend is built by SGLang's own
StorageBackendFactory through its "dynamic" option and attached to SGLang's real host memory pools (over real
device pools on CPU); pages go to a real kvpool cluster and come back into other pools and other slots byte-exact.

Run from the repository root: .venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/engines/in_sglang.py
"""

import importlib.util
import sys
from pathlib import Path

from transformers.utils import import_utils

# SGLang's memory-pool modules import torchvision (for image preprocessing they never run here), and no PyPI
# torchvision imports beside the CPU torch: put a stand-in on the path, but only after transformers has recorded
# that torchvision is not installed, so transformers keeps its torchvision-free code paths.
if importlib.util.find_spec("torchvision") is None:
    assert not import_utils.is_torchvision_available()
    sys.path.insert(0, str(Path(__file__).resolve().parent / "stand_ins"))

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageConfig, PoolHitPolicy, PoolName,  # noqa: E402
                                                  PoolTransfer)
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvpool import Client  # noqa: E402
from kvpool.connectors.sglang import KvpoolHiCacheStorage  # noqa: E402
from kvpool.errors import InvalidArgumentError, InvalidKeyError  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS = 3, 4, 16, 8, 64
DYNAMIC = {"backend_name": "kvpool", "module_path": "kvpool.connectors.sglang", "class_name": "KvpoolHiCacheStorage"}


def mha_host(layout: str, seed: int | None = None, heads: int = HEADS) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, heads, HEAD_DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer, write_back_staging=device.hicache_write_back_staging)
    return fill(host, seed)


def mla_host(layout: str, seed: int | None = None) -> MLATokenToKVPoolHost:
    device = MLATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, 32, 16, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS)
    host = MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer, target_layer_num=device.layer_num,
                                override_kv_cache_dim=device.kv_cache_dim)
    return fill(host, seed)


def fill(host, seed: int | None):
    """Random KV in the whole host pool (seed given), else the zeros it starts with."""
    if seed is not None:
        noise = torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(seed))
        host.kv_buffer.copy_(noise.to(host.kv_buffer.dtype))
    return host


def storage_config(model: str, layout: str = "page_first", *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   tp_lcm_size: int | None = None, **extra) -> HiCacheStorageConfig:
    """What SGLang's cache controller hands a storage backend (its _generate_storage_config)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=layout == "page_first", model_name=model,
        tp_lcm_size=tp_lcm_size, should_split_heads=bool(tp_lcm_size and tp_lcm_size > tp_size),
        extra_config={**DYNAMIC, "interface_v1": 1, **extra})


@pytest.fixture
def attach(cluster):
    """Attach a backend as SGLang's cache controller does: the factory builds it, then the host pool registers."""
    built = []

    def make(config: HiCacheStorageConfig, host):
        if "master" not in config.extra_config and "etcd" not in config.extra_config:
            config.extra_config["master"] = cluster.master_address
        backend = StorageBackendFactory.create_backend("dynamic", config, host)
        backend.register_mem_pool_host(host)
        built.append(backend)
        return backend

    yield make
    for backend in built:
        backend.close()


def page(host, index: int) -> torch.Tensor:
    """The bytes of the page at host index `index`, K of every layer then V (SGLang's flat page)."""
    return host.get_data_page(index, flat=True).view(torch.uint8)


def starts(indices: torch.Tensor) -> list[int]:
    return indices[::PAGE].tolist()


def hashes(name: str, count: int) -> list[str]:
    return [f"{name}-{i:04d}" for i in range(count)]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_zero_copy_pages_come_back_into_other_slots_of_another_pool(attach, layout):
    writer_pool, reader_pool = mha_host(layout, seed=1), mha_host(layout)
    writer = attach(storage_config(f"zc-{layout}", layout), writer_pool)
    reader = attach(storage_config(f"zc-{layout}", layout), reader_pool)
    assert isinstance(writer, KvpoolHiCacheStorage)
    keys = hashes("prefix", 3)
    written = writer_pool.alloc(3 * PAGE)
    assert writer.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, written) == [True, True, True]
    assert writer.batch_set_v1(keys, written) == [True, True, True]  # stored already: still a success
    assert reader.batch_exists(keys + ["not-stored"]) == 3

    reader_pool.alloc(2 * PAGE)  # so the reader's pages land at other host indices
    landing = reader_pool.alloc(3 * PAGE)
    assert starts(landing) != starts(written)
    assert reader.batch_get_v1(keys, landing) == [True, True, True]
    for source, target in zip(starts(written), starts(landing)):
        assert torch.equal(page(reader_pool, target), page(writer_pool, source))
    # Nothing outside those pages was written.
    others = [p for p in range(0, reader_pool.size, PAGE) if p not in starts(landing)]
    assert all(torch.count_nonzero(page(reader_pool, p)) == 0 for p in others)

    # A missing page fails alone; the stored ones around it are read.
    again = reader_pool.alloc(3 * PAGE)
    assert reader.batch_get_v1([keys[0], "not-stored", keys[2]], again) == [True, False, True]
    assert torch.equal(page(reader_pool, starts(again)[2]), page(writer_pool, starts(written)[2]))
    assert torch.count_nonzero(page(reader_pool, starts(again)[1])) == 0


def test_flat_pages_through_get_set_and_batches(attach):
    """SGLang's generic path (no interface_v1): flat pages copied out of and into the host pool."""
    source_pool, target_pool = mha_host("layer_first", seed=2), mha_host("layer_first")
    writer = attach(storage_config("flat", "layer_first", interface_v1=0), source_pool)
    reader = attach(storage_config("flat", "layer_first", interface_v1=0), target_pool)
    indices = starts(source_pool.alloc(4 * PAGE))
    keys = hashes("flat", 4)
    assert writer.set(keys[0], source_pool.get_data_page(indices[0]))
    assert writer.batch_set(keys[1:], [source_pool.get_data_page(i) for i in indices[1:]])
    assert writer.exists(keys[3]) and not writer.exists("not-stored")

    got = reader.get(keys[0], target_pool.get_dummy_flat_data_page())
    assert torch.equal(got.view(torch.uint8), page(source_pool, indices[0]))
    assert torch.equal(reader.get(keys[1]).view(torch.uint8), page(source_pool, indices[1]))  # a new page
    assert reader.get("not-stored", target_pool.get_dummy_flat_data_page()) is None

    # As SGLang's _generic_page_get does: read into dummy pages, then copy each into the host pool.
    dummies = [target_pool.get_dummy_flat_data_page() for _ in range(3)]
    pages = reader.batch_get([keys[2], "not-stored", keys[3]], dummies)
    assert pages[0] is dummies[0] and pages[1] is None and pages[2] is dummies[2]
    slots = starts(target_pool.alloc(2 * PAGE))
    target_pool.set_from_flat_data_page(slots[0], pages[0])
    target_pool.set_from_flat_data_page(slots[1], pages[2])
    assert torch.equal(page(target_pool, slots[0]), page(source_pool, indices[2]))
    assert torch.equal(page(target_pool, slots[1]), page(source_pool, indices[3]))


def test_both_interfaces_store_the_same_objects(attach):
    pool = mha_host("page_first", seed=3)
    backend = attach(storage_config("both"), pool)
    written = starts(pool.alloc(2 * PAGE))
    assert backend.batch_set_v1(["by-v1"], torch.arange(written[0], written[0] + PAGE)) == [True]
    assert backend.set("by-flat", pool.get_data_page(written[1]))

    assert torch.equal(backend.get("by-v1").view(torch.uint8), page(pool, written[0]))
    slot = pool.alloc(PAGE)
    assert backend.batch_get_v1(["by-flat"], slot) == [True]
    assert torch.equal(page(pool, starts(slot)[0]), page(pool, written[1]))


def test_prefix_lengths_count_leading_stored_pages(attach):
    pool = mha_host("page_first", seed=4)
    backend = attach(storage_config("prefix"), pool)
    keys = hashes("p", 5)
    indices = pool.alloc(5 * PAGE)
    assert backend.batch_set_v1([keys[0], keys[1], keys[3]],
                                torch.cat([indices[:2 * PAGE], indices[3 * PAGE:4 * PAGE]])) == [True] * 3
    assert backend.batch_exists(keys) == 2  # the third page is missing: the fourth does not count
    assert backend.batch_exists(keys[3:]) == 1
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists([]) == 0
    assert [backend.exists(k) for k in keys] == [True, True, False, True, False]


def test_half_a_page_is_not_a_page(attach, cluster):
    """A page whose V is missing (or whose stored object does not fit) is a miss, never half-loaded data."""
    pool = mha_host("page_first", seed=5)
    backend = attach(storage_config("half"), pool)
    indices = pool.alloc(2 * PAGE)
    assert backend.batch_set_v1(["whole", "half"], indices) == [True, True]
    k_name, v_name = backend._page_keys("half")
    with Client(cluster.master_address) as client:
        assert client.remove(v_name)
        assert backend.batch_exists(["whole", "half"]) == 1
        assert backend.batch_get_v1(["whole", "half"], indices) == [True, False]
        # Another writer's object of the wrong size under this page's name: kvpool refuses it, a miss here.
        client.put(v_name, b"not a V block")
        assert backend.batch_exists(["half"]) == 1
        assert backend.batch_get_v1(["half"], indices[PAGE:]) == [False]
        assert backend.get("half") is None


def test_tp_ranks_keep_their_own_heads_and_mla_pages_are_shared(attach):
    mha_pool = mha_host("page_first", seed=6)
    rank0 = attach(storage_config("tp", tp_rank=0, tp_size=2), mha_pool)
    rank1 = attach(storage_config("tp", tp_rank=1, tp_size=2), mha_host("page_first"))
    assert rank0.batch_set_v1(["shared-prefix"], mha_pool.alloc(PAGE)) == [True]
    assert rank0.batch_exists(["shared-prefix"]) == 1
    assert rank1.batch_exists(["shared-prefix"]) == 0  # rank 1's heads were never stored

    mla_writer_pool, mla_reader_pool = mla_host("page_first", seed=7), mla_host("page_first")
    mla0 = attach(storage_config("tp", mla=True, tp_rank=0, tp_size=2), mla_writer_pool)
    mla1 = attach(storage_config("tp", mla=True, tp_rank=1, tp_size=2), mla_reader_pool)
    assert mla1.batch_exists(["shared-prefix"]) == 0  # the MHA pages are not MLA pages
    written = mla_writer_pool.alloc(PAGE)
    assert mla0.batch_set_v1(["shared-prefix"], written) == [True]
    landing = mla_reader_pool.alloc(2 * PAGE)[PAGE:]
    assert mla1.batch_get_v1(["shared-prefix"], landing) == [True]  # the latent cache is the same on every rank
    assert torch.equal(page(mla_reader_pool, starts(landing)[0]), page(mla_writer_pool, starts(written)[0]))


def test_heads_split_for_another_tp_size_are_shared(attach):
    """tp_lcm_size: a TP-2 engine stores each rank's heads in the halves a TP-4 engine's ranks read."""
    tp2_pool = mha_host("page_head", seed=8, heads=HEADS)
    tp4_pool = mha_host("page_head", heads=HEADS // 2)
    tp2_rank0 = attach(storage_config("lcm", "page_head", tp_rank=0, tp_size=2, tp_lcm_size=4), tp2_pool)
    tp4_rank1 = attach(storage_config("lcm", "page_head", tp_rank=1, tp_size=4, tp_lcm_size=4), tp4_pool)
    written = tp2_pool.alloc(PAGE)
    assert tp2_rank0.batch_set_v1(["split"], written) == [True]
    landing = tp4_pool.alloc(PAGE)
    assert tp4_rank1.batch_get_v1(["split"], landing) == [True]
    # page_head pools are (K/V, page, head, token, layer, dim): TP-4 rank 1 holds TP-2 rank 0's heads 2 and 3.
    source = tp2_pool.kv_buffer[:, starts(written)[0] // PAGE, HEADS // 2:]
    assert torch.equal(tp4_pool.kv_buffer[:, starts(landing)[0] // PAGE], source)


def test_bad_input_is_a_typed_error(attach, cluster):
    pool = mha_host("page_first", seed=9)
    backend = attach(storage_config("bad"), pool)
    with pytest.raises(InvalidArgumentError):
        backend.batch_set_v1(["a", "b"], pool.alloc(PAGE))  # two pages, one page of indices
    with pytest.raises(InvalidArgumentError):
        backend.batch_get_v1(["a"], torch.arange(pool.size, pool.size + PAGE))  # off the pool
    with pytest.raises(InvalidArgumentError):
        backend.batch_get_v1(["a"], torch.arange(1, 1 + PAGE))  # not a whole page
    with pytest.raises(InvalidKeyError):
        backend.batch_exists(["a", None])
    with pytest.raises(InvalidArgumentError):
        backend.set("a", torch.zeros(3, dtype=torch.bfloat16))  # not a page
    with pytest.raises(InvalidArgumentError):
        backend.batch_get(["a"], [torch.zeros(3)])
    with pytest.raises(InvalidArgumentError):  # neither "master" nor "etcd"
        StorageBackendFactory.create_backend("dynamic", storage_config("bad", etcd=None), pool)
    with pytest.raises(InvalidArgumentError):  # the MLA backend cannot take an MHA pool
        attach(storage_config("bad", mla=True, master=cluster.master_address), pool)
    assert backend.batch_exists(["a"]) == 0  # and the backend still works


def test_found_through_etcd_cleared_and_closed(attach, cluster):
    pool = mha_host("page_first_direct", seed=10)
    backend = attach(storage_config("lifecycle", "page_first_direct", etcd=cluster.etcd_endpoint), pool)
    keys = hashes("life", 2)
    assert backend.batch_set_v1(keys, pool.alloc(2 * PAGE)) == [True, True]
    assert backend.batch_exists(keys) == 2
    assert backend.clear()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, pool.alloc(2 * PAGE)) == [True, True]
    assert backend.batch_set_v1([], torch.zeros(0, dtype=torch.int64)) == []
    assert backend.batch_get_v1([], torch.zeros(0, dtype=torch.int64)) == []
    backend.close()
    # Closed: nothing is found, stored or read, and no call raises into SGLang's storage threads.
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(["after-close"], pool.alloc(PAGE)) == [False]
    assert backend.batch_get_v1(keys, pool.alloc(2 * PAGE)) == [False, False]
    assert backend.get(keys[0]) is None
    assert not backend.clear()


def mamba_host(seed: int | None = None) -> MambaPoolHost:
    """A Mamba state pool (2 layers: an SSM state of 4 x 8 x 8 float32 and a conv state of 24 x 3 bf16 a slot)."""
    slots = 16
    info = MambaStateBufferInfo(temporal=torch.zeros(2, slots, 4, 8, 8),
                                conv=(torch.zeros(2, slots, 24, 3, dtype=torch.bfloat16),))
    host = MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, layout="page_first")
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        for buffer in [host.temporal_buffer, *host.conv_buffer]:
            buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype))
    return host


def hybrid(attach, kv_pool, state_pool):
    """A backend attached to a hybrid model's pools as SGLang's hybrid cache controller attaches it: the host
    pool group first, then every pool by name."""
    group = HostPoolGroup([PoolEntry(PoolName.KV, kv_pool, None, lambda layer: layer, is_primary_index_anchor=True),
                           PoolEntry(PoolName.MAMBA, state_pool, None, lambda layer: layer)])
    backend = attach(storage_config("hybrid-mamba"), group)
    backend.register_mem_host_pool_v2(kv_pool, PoolName.KV)
    backend.register_mem_host_pool_v2(state_pool, PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend


def state_of(host, slot: int) -> list[torch.Tensor]:
    return [host.temporal_buffer[slot].clone(), *(buffer[slot].clone() for buffer in host.conv_buffer)]


def trailing_state(keys, host_indices=None) -> PoolTransfer:
    return PoolTransfer(PoolName.MAMBA, host_indices=host_indices, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES)


def test_a_hybrid_models_state_pool_is_stored_beside_its_kv_and_bounds_the_hit(attach):
    kv_writer, state_writer = mha_host("page_first", seed=4), mamba_host(seed=5)
    writer = hybrid(attach, kv_writer, state_writer)
    kv_reader, state_reader = mha_host("page_first"), mamba_host()
    reader = hybrid(attach, kv_reader, state_reader)
    keys = hashes("hybrid", 4)
    pages = kv_writer.alloc(4 * PAGE)
    slots = state_writer.alloc(2)  # states kept at two page boundaries: after pages 2 and 4
    written = writer.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=pages, keys=keys),
                                   trailing_state([keys[1], keys[3]], slots)])
    assert written == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True, True]}

    # Every KV page is there, a state only after pages 2 and 4: a hit may end there and nowhere else.
    hit = reader.batch_exists_v2(keys + ["not-stored"], [trailing_state([keys[3]])])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [2, 4])
    assert hit.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.MAMBA: 4}
    assert reader.batch_exists_v2(keys[:3], [trailing_state([keys[2]])]).kv_hit_pages == 2

    landing_pages, landing_slot = kv_reader.alloc(4 * PAGE), state_reader.alloc(2)[1:]
    got = reader.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=landing_pages, keys=keys),
                               trailing_state([keys[3]], landing_slot)])
    assert got == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True]}
    for source, target in zip(starts(pages), starts(landing_pages)):
        assert torch.equal(page(kv_reader, target), page(kv_writer, source))
    for stored, loaded in zip(state_of(state_writer, int(slots[1])), state_of(state_reader, int(landing_slot[0]))):
        assert torch.equal(stored, loaded)
    # A state never stored is a miss for that page alone; a slot outside the pool is refused, never read.
    assert reader.batch_get_v2([trailing_state(["not-stored"], landing_slot)]) == {PoolName.MAMBA: [False]}
    with pytest.raises(InvalidArgumentError, match="outside the pool"):
        reader.batch_get_v2([trailing_state([keys[3]], torch.tensor([state_reader.size + 5]))])
    with pytest.raises(InvalidArgumentError, match="never registered"):
        reader.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=landing_slot, keys=[keys[3]])])
