"""put_from / get_into on caller buffers, one buffer with offsets, and values made of parts, per transport."""

import numpy as np
import pytest

from kvpool import Client
from kvpool.errors import InvalidArgumentError

pytestmark = pytest.mark.quick  # among the fastest end-to-end tests (tests/tiers.py)

torch = pytest.importorskip("torch")

LAYERS, BLOCK = 4, (16, 8, 64)  # a KV block: per layer, K and V of 16 tokens x 8 heads x 64 dims


@pytest.fixture(params=["shm", "tcp"])
def client(cluster, request):
    with Client(cluster.master_address, transports=request.param) as c:
        yield c
        assert set(c.bytes_by_transport()) == {request.param}
        c.remove_prefix("zc/")


def test_tensors_go_out_and_come_back_in_place(client):
    source = torch.randn(1024, 256, dtype=torch.float16)
    client.put_from("zc/t", source)
    target = torch.empty_like(source)
    pointer = target.data_ptr()
    assert client.get_into("zc/t", target) == source.numel() * 2
    assert torch.equal(source, target) and target.data_ptr() == pointer


def test_one_buffer_with_offsets_as_kv_caches_lay_it_out(client):
    block = 96 * 1024
    pool = np.random.default_rng(1).integers(0, 256, 10 * block, dtype=np.uint8)
    keys = [f"zc/page/{i}" for i in range(10)]
    offsets = [i * block for i in range(10)]
    client.batch_put_from(keys, pool, offsets=offsets, sizes=[block] * 10)
    landing = np.zeros_like(pool)
    # Into a shuffled layout, default sizes (up to the next offset).
    order = [3, 0, 9, 1, 8, 2, 7, 4, 6, 5]
    assert client.batch_get_into([keys[i] for i in order], landing, offsets=offsets) == [block] * 10
    for slot, i in enumerate(order):
        assert np.array_equal(landing[slot * block:(slot + 1) * block], pool[i * block:(i + 1) * block])
    with pytest.raises(InvalidArgumentError, match="outside"):
        client.batch_get_into(keys[:1], landing, offsets=[9 * block + 1], sizes=[block])


def _kv_block(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*BLOCK, generator=generator, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]


@pytest.mark.parametrize("compress", [False, True])
def test_a_block_of_every_layer_is_gathered_into_one_object_and_scattered_back(client, compress):
    blocks = {f"zc/kv/{compress}/{i}": _kv_block(i) for i in range(6)}
    keys = list(blocks)
    client.put_parts(keys[0], blocks[keys[0]], compress=compress)
    client.batch_put_parts(keys[1:], [blocks[k] for k in keys[1:]], compress=compress)
    size = sum(t.numel() * 2 for t in blocks[keys[0]])
    # Stored as one object: a plain get returns the parts back to back.
    assert client.get(keys[0]) == b"".join(t.view(torch.uint8).numpy().tobytes() for t in blocks[keys[0]])
    landing = [torch.empty(*BLOCK, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    assert client.get_into_parts(keys[0], landing) == size
    assert all(torch.equal(a, b) for a, b in zip(landing, blocks[keys[0]]))
    landings = [[torch.empty(*BLOCK, dtype=torch.bfloat16) for _ in range(2 * LAYERS)] for _ in keys]
    assert client.batch_get_into_parts(keys, landings) == [size] * len(keys)
    for key, landed in zip(keys, landings):
        assert all(torch.equal(a, b) for a, b in zip(landed, blocks[key]))
    with pytest.raises(InvalidArgumentError, match="do not match"):
        client.get_into_parts(keys[0], landing[:-1])  # one layer short
