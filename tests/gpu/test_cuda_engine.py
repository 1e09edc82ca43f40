"""CudaCopyEngine and the client with CUDA tensors, on a real GPU (skipped where torch sees none).

The same pipeline runs on every machine with client.device.cpu.CpuCopyEngine; these tests are what only a GPU
shows: torch's streams and events, pinned staging, cudaHostRegister of a node's segment (the shm path's one
DMA), and ordering against the caller's stream, which the copies must respect without the host waiting.
"""

import uuid

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: torch.cuda.is_available() is False")

MIB = 1024 * 1024
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1-0.2 s of one GPU thread spinning


def _key(name: str) -> str:
    return f"gpu-test/{name}/{uuid.uuid4().hex}"


def _random(nbytes: int, seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


@pytest.fixture(params=["shm", "tcp"])
def transport(request):
    return request.param


@pytest.fixture
def gpu_client(cluster, transport):
    from kvpool import Client

    with Client(cluster.master_address, transports=transport) as client:
        yield client


# -- the engine alone

def test_engine_claims_cuda_tensors_only():
    from kvpool.client.device.cuda import CudaCopyEngine, looks_like_cuda

    engine = CudaCopyEngine()
    assert engine.claims(torch.zeros(4, device="cuda"))
    assert not engine.claims(torch.zeros(4))
    assert not engine.claims(bytearray(4))
    assert looks_like_cuda(torch.zeros(4, device="cuda"))


def test_engine_region_is_the_tensors_bytes_and_refuses_non_contiguous():
    from kvpool.errors import InvalidArgumentError
    from kvpool.client.device.cuda import CudaCopyEngine

    engine = CudaCopyEngine()
    tensor = torch.zeros((3, 5), dtype=torch.bfloat16, device="cuda")
    region = engine.region(tensor, "value", writable=False)
    assert region.nbytes == tensor.nbytes
    assert region.slice(2, 6).nbytes == 6
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        engine.region(torch.zeros((8, 8), device="cuda")[:, ::2], "value", writable=False)


def test_engine_copies_through_pinned_memory_on_its_own_stream():
    from kvpool.client.device.cuda import CudaCopyEngine

    engine = CudaCopyEngine()
    source = _random(3 * MIB + 17, seed=1)
    region = engine.region(source, "value", writable=False)
    assert engine._stream is not None and engine._stream != torch.cuda.current_stream()
    staging = engine.pinned(len(source))
    engine.copy_after_caller()
    engine.to_host(region, staging)
    event = engine.record()
    engine.wait(event)
    assert engine.done(event)
    assert bytes(staging) == source.cpu().numpy().tobytes()

    dest = torch.zeros_like(source)  # zeroed on the caller's stream: the copy below must come after it
    engine.copy_after_caller()
    engine.to_device(staging, engine.region(dest, "buffer", writable=True))
    event = engine.record()
    engine.caller_after(event)
    assert torch.equal(dest, source)  # on the current stream, after the copy (caller_after)


# -- the client

@pytest.mark.parametrize("nbytes", [1, 64 * 1024 + 3, 4 * MIB, 9 * MIB + 5])
def test_put_from_and_get_into_round_trip(gpu_client, transport, nbytes):
    key = _key(f"round-{transport}-{nbytes}")
    source = _random(nbytes, seed=nbytes)
    gpu_client.put_from(key, source)
    dest = torch.bitwise_not(source)
    assert gpu_client.get_into(key, dest) == nbytes
    assert torch.equal(dest, source)
    assert gpu_client.get(key) == source.cpu().numpy().tobytes()  # stored as the plain bytes


def test_shaped_tensors_go_as_their_bytes(gpu_client, transport):
    key = _key(f"shaped-{transport}")
    source = torch.randn((4, 16, 8, 128), device="cuda").to(torch.bfloat16)
    gpu_client.put_from(key, source)
    dest = torch.empty_like(source)
    assert gpu_client.get_into(key, dest) == source.nbytes
    assert torch.equal(dest.view(torch.uint8), source.view(torch.uint8))
    host = torch.empty(source.nbytes, dtype=torch.uint8)  # a CPU tensor reads the same value
    assert gpu_client.get_into(key, host) == source.nbytes
    assert torch.equal(host, source.view(-1).view(torch.uint8).cpu())


def test_bytes_by_transport_names_the_device_path(cluster, transport):
    from kvpool import Client

    with Client(cluster.master_address, transports=transport) as client:
        key = _key(f"paths-{transport}")
        source = _random(2 * MIB, seed=3)
        client.put_from(key, source)
        dest = torch.empty_like(source)
        client.get_into(key, dest)
        assert torch.equal(dest, source)
        moved = client.bytes_by_transport()
        assert moved.get(transport, 0) >= 2 * source.nbytes, moved
        if transport == "shm":  # one DMA each way between the GPU and the node's mapping
            assert moved.get("cuda:direct", 0) == 2 * source.nbytes, moved
        else:
            assert moved.get("cuda:staged", 0) == 2 * source.nbytes, moved
            assert "cuda:direct" not in moved, moved
        memory = client.device_memory()
        assert memory["engine"] == "cuda"
        assert memory["allocated_bytes"] == memory["pool_bytes"] > 0
        assert memory["in_use_bytes"] == 0


def test_parts_gather_and_scatter(gpu_client, transport):
    from kvpool.errors import InvalidArgumentError

    key = _key(f"parts-{transport}")
    parts = [_random(size, seed=size) for size in (5000, 1 * MIB, 3, 2 * MIB + 1)]
    gpu_client.put_parts(key, parts)
    whole = torch.cat(parts)
    dest = [torch.zeros_like(part) for part in parts]
    assert gpu_client.get_into_parts(key, dest) == whole.numel()
    for got, part in zip(dest, parts):
        assert torch.equal(got, part)
    flat = torch.zeros_like(whole)
    assert gpu_client.get_into(key, flat) == whole.numel()
    assert torch.equal(flat, whole)
    with pytest.raises(InvalidArgumentError, match="all be device memory or all host memory"):
        gpu_client.put_parts(_key("mixed"), [parts[0], bytearray(10)])


def test_batches_with_offsets_into_one_tensor(gpu_client, transport):
    keys = [_key(f"batch-{transport}-{i}") for i in range(6)]
    sizes = [256 * 1024, 1 * MIB, 7, 3 * MIB, 512 * 1024 + 1, 64 * 1024]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    source = _random(sum(sizes), seed=6)
    gpu_client.batch_put_from(keys, source, offsets=offsets, sizes=sizes)
    dest = torch.bitwise_not(source)
    assert gpu_client.batch_get_into(keys, dest, offsets=offsets, sizes=sizes) == sizes
    assert torch.equal(dest, source)
    one_each = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in sizes]
    assert gpu_client.batch_get_into(keys, one_each) == sizes
    for got, at, size in zip(one_each, offsets, sizes):
        assert torch.equal(got, source[at:at + size])
    assert gpu_client.batch_get_into([keys[0], _key("missing")], one_each[:2]) == [sizes[0], None]


def test_batch_larger_than_half_the_pool_goes_in_waves(cluster, transport):
    from kvpool import Client

    with Client(cluster.master_address, transports=transport, device_pool_size=8 * MIB,
                device_chunk_size=1 * MIB) as client:
        keys = [_key(f"waves-{transport}-{i}") for i in range(10)]
        values = [_random(2 * MIB, seed=i) for i in range(10)]
        client.batch_put_from(keys, values)
        dests = [torch.zeros_like(value) for value in values]
        assert client.batch_get_into(keys, dests) == [2 * MIB] * 10
        for got, value in zip(dests, values):
            assert torch.equal(got, value)
        memory = client.device_memory()
        assert memory["pool_bytes"] == 8 * MIB and memory["peak_bytes"] <= 8 * MIB and memory["in_use_bytes"] == 0


def test_value_larger_than_the_pool_is_refused(cluster):
    from kvpool import Client
    from kvpool.errors import InvalidArgumentError

    with Client(cluster.master_address, device_pool_size=4 * MIB, device_chunk_size=1 * MIB) as client:
        with pytest.raises(InvalidArgumentError, match="device_pool_size"):
            client.put_from(_key("too-large"), torch.zeros(5 * MIB, dtype=torch.uint8, device="cuda"))


def test_non_contiguous_cuda_tensor_is_refused(gpu_client, transport):
    from kvpool.errors import InvalidArgumentError

    strided = torch.zeros((64, 64), dtype=torch.uint8, device="cuda")[:, ::2]
    assert not strided.is_contiguous()
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        gpu_client.put_from(_key(f"strided-{transport}"), strided)
    key = _key(f"for-strided-{transport}")
    gpu_client.put_from(key, torch.zeros(64 * 32, dtype=torch.uint8, device="cuda"))
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        gpu_client.get_into(key, strided)
    gpu_client.put_from(_key(f"made-contiguous-{transport}"), strided.contiguous())


def test_put_copies_wait_for_the_callers_stream(gpu_client, transport):
    """A value written by a kernel still queued on the caller's stream is stored as that kernel leaves it:
    the copy stream waits for the caller's stream device-side."""
    key = _key(f"order-put-{transport}")
    value = torch.zeros(4 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream is busy ...
    value.fill_(0x5A)  # ... and writes the value after that
    gpu_client.put_from(key, value)
    assert gpu_client.get(key) == b"\x5a" * value.numel()


def test_get_copies_wait_for_the_callers_stream_and_it_for_them(gpu_client, transport):
    """A get's copies to the device come after the caller's queued work on the destination, and the caller's
    later kernels see the value (caller_after), with no host wait in between."""
    key = _key(f"order-get-{transport}")
    source = _random(4 * MIB, seed=9)
    gpu_client.put_from(key, source)
    dest = torch.empty_like(source)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    dest.fill_(0)  # queued before the get: must not overwrite what the get brings
    assert gpu_client.get_into(key, dest) == source.numel()
    after = dest.clone()  # queued on the caller's stream after the get
    assert torch.equal(after, source)


def test_no_host_wait_on_the_callers_stream(gpu_client, transport, monkeypatch):
    """The pipeline waits for its own copy stream's events only: a host wait on the device or on the caller's
    (or any) stream would stall the engine's queued kernels."""
    key = _key(f"no-sync-{transport}")
    source = _random(6 * MIB, seed=11)
    dest = torch.empty_like(source)
    torch.cuda.synchronize()

    def refused(*args, **kwargs):
        raise AssertionError("host wait on a CUDA stream during a kvpool call")

    monkeypatch.setattr(torch.cuda, "synchronize", refused)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", refused)
    gpu_client.put_from(key, source)
    gpu_client.get_into(key, dest)
    gpu_client.batch_put_from([key + "-b"], [source])
    gpu_client.batch_get_into([key + "-b"], [dest])
    monkeypatch.undo()
    assert torch.equal(dest, source)


def test_paged_blocks_save_and_load_into_other_ids(gpu_client, transport):
    """The vLLM connector's block store gathers blocks on the GPU, stores them, and scatters them back."""
    from kvpool.connectors.block_keys import BlockNamespace
    from kvpool.connectors.block_store import KVBlockStore

    generator = torch.Generator(device="cuda").manual_seed(5)
    caches = [torch.randint(0, 256, (2, 40, 16, 8, 256), dtype=torch.uint8, device="cuda", generator=generator)
              .view(torch.bfloat16) for _ in range(4)]
    store = KVBlockStore(gpu_client, BlockNamespace(f"gpu-test-{uuid.uuid4().hex}", "bfloat16", "vllm-nhd", 16))
    hashes = [f"{i:064x}" for i in range(1, 11)]
    sources, dests = list(range(0, 10)), list(range(20, 30))
    assert store.save(hashes, sources, caches) == 10
    assert store.lookup(hashes) == 10
    assert store.load(hashes, dests, caches) == 10
    for cache in caches:
        raw = cache.view(torch.uint8)
        assert torch.equal(raw[:, sources], raw[:, dests])


def test_multiple_gpus_need_one_client_each(cluster):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from kvpool import Client
    from kvpool.errors import InvalidArgumentError

    with Client(cluster.master_address) as client:
        client.put_from(_key("gpu0"), torch.zeros(1024, dtype=torch.uint8, device="cuda:0"))
        with pytest.raises(InvalidArgumentError, match="one client per GPU"):
            client.put_from(_key("gpu1"), torch.zeros(1024, dtype=torch.uint8, device="cuda:1"))
