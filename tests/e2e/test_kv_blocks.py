"""KV blocks of vLLM-shaped paged caches go to kvpool and come back into other block slots, byte-exact."""

import pytest

from kvpool import Client
from kvpool.connectors import BlockNamespace, KVBlockStore, block_hashes, block_parts
from kvpool.errors import InvalidArgumentError

pytestmark = pytest.mark.quick  # among the fastest end-to-end tests (tests/tiers.py)

torch = pytest.importorskip("torch")

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 16, 16, 2, 32


def caches(seed: int | None = None):
    """One tensor per layer, shaped as vLLM's (2, num_blocks, block_size, heads, head_dim)."""
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.bfloat16) for _ in range(LAYERS)]


@pytest.fixture(params=["shm", "tcp"])
def store(cluster, request):
    namespace = BlockNamespace("tiny-test", "bfloat16", f"vllm-nhd-{request.param}", BLOCK_SIZE)
    with Client(cluster.master_address, transports=request.param) as client:
        yield KVBlockStore(client, namespace)
        client.remove_prefix(namespace.prefix())


def test_prefill_blocks_are_loaded_into_another_engines_slots(store):
    prompt = list(range(1000, 1000 + 5 * BLOCK_SIZE + 3))  # 5 full blocks and a partial one
    hashes = block_hashes(prompt, BLOCK_SIZE)
    producer = caches(seed=1)
    assert store.lookup(hashes) == 0
    assert store.save(hashes, [3, 7, 1, 12, 5], producer) == 5
    assert store.save(hashes, [3, 7, 1, 12, 5], producer) == 0  # already there: nothing written again
    # A consumer with a longer prompt of the same prefix finds the 5 blocks, in one call.
    longer = block_hashes(prompt + list(range(2 * BLOCK_SIZE)), BLOCK_SIZE)
    assert store.lookup(longer, hold=30) == 5
    consumer = caches()
    assert store.load(longer[:5], [0, 1, 2, 3, 4], consumer) == 5
    for slot, block in zip([0, 1, 2, 3, 4], [3, 7, 1, 12, 5]):
        for layer in range(LAYERS):
            assert torch.equal(consumer[layer][:, slot], producer[layer][:, block])
    assert torch.count_nonzero(consumer[0][:, 5:]) == 0  # nothing else written


def test_another_model_or_prefix_finds_nothing(store, cluster):
    hashes = block_hashes(list(range(4 * BLOCK_SIZE)), BLOCK_SIZE)
    store.save(hashes, [0, 1, 2, 3], caches(seed=2))
    other = KVBlockStore(store.client, BlockNamespace("another-model", "bfloat16", store.namespace.layout,
                                                      BLOCK_SIZE))
    assert other.lookup(hashes) == 0
    diverged = block_hashes(list(range(2 * BLOCK_SIZE)) + [7] * (2 * BLOCK_SIZE), BLOCK_SIZE)
    assert store.lookup(diverged) == 2  # the shared first two blocks only
    assert store.load(diverged, [4, 5, 6, 7], caches()) == 2


def test_block_parts_are_views_not_copies():
    layers = caches(seed=3)
    parts = block_parts(layers, 9)
    assert len(parts) == 2 * LAYERS
    assert parts[0].data_ptr() == layers[0][0, 9].data_ptr() and parts[3].data_ptr() == layers[1][1, 9].data_ptr()
    with pytest.raises(InvalidArgumentError):
        block_parts(layers, BLOCKS)
    blocks_first = [layer.transpose(0, 1).contiguous() for layer in layers]  # (num_blocks, 2, ...)
    slabs = block_parts(blocks_first, 9, kv_first=False)  # one view per layer: its K then its V
    assert len(slabs) == LAYERS and slabs[1].data_ptr() == blocks_first[1][9].data_ptr()
    assert all(torch.equal(slab, torch.stack(parts[2 * i:2 * i + 2])) for i, slab in enumerate(slabs))


def test_a_router_sees_blocks_stored_and_removed(cluster):
    import asyncio

    from kvpool.connectors import REMOVED, STORED, block_events

    namespace = BlockNamespace("router-test", "bfloat16", "vllm-nhd", BLOCK_SIZE)
    hashes = block_hashes(list(range(3 * BLOCK_SIZE)), BLOCK_SIZE)
    noise = BlockNamespace("router-other", "bfloat16", "vllm-nhd", BLOCK_SIZE)
    with Client(cluster.master_address) as client:
        store = KVBlockStore(client, namespace)
        store.save(hashes[:1], [0], caches(seed=4))  # there before the router subscribes

        async def follow():
            seen = []
            stream = block_events(namespace, cluster.master_address)
            async with asyncio.timeout(30):
                async for event in stream:
                    seen.append(event)
                    if len(seen) == 1:  # the snapshot: now change things
                        await asyncio.to_thread(store.save, hashes, [0, 1, 2], caches(seed=4))
                        await asyncio.to_thread(KVBlockStore(client, noise).save, hashes, [0, 1, 2],
                                                caches(seed=4))
                        await asyncio.to_thread(client.remove, namespace.key(hashes[0]))
                    if len(seen) == 4:
                        await stream.aclose()
                        return seen

        seen = asyncio.run(follow())
        client.remove_prefix("kv/router-")
    assert seen[0] == (STORED, hashes[0])
    assert sorted(seen[1:3]) == sorted([(STORED, hashes[1]), (STORED, hashes[2])])
    assert seen[3] == (REMOVED, hashes[0])  # and nothing of the other namespace
