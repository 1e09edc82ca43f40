"""Device memory in every buffer call, end to end: a real cluster, the client's device pipeline run by the
host-memory copy engine (client/device/cpu.py), whose buffers offer no buffer protocol, so every byte that
reaches or leaves them went through the pipeline's copies.

Sizes: chunks of 64 KiB (the least allowed); a pool of 16 chunks unless a test needs the pool small (4 chunks:
waves of 2 chunks, back-pressure).
"""

import asyncio
import os
import threading
import time
import uuid

import pytest

from kvpool import AsyncClient, Client
from kvpool.client.device.cpu import CpuCopyEngine
from kvpool.client.shm import _SAFE_COPY_SECONDS
from kvpool.errors import (
    BatchError, DeadlineExceededError, DeviceCopyError, InvalidArgumentError, KeyNotFoundError,
)

CHUNK = 64 * 1024
POOL = 16 * CHUNK
SMALL_POOL = 4 * CHUNK  # waves of at most 2 chunks
ODD = 300_000  # spans 5 chunks, the last one partial
TRANSPORTS = pytest.mark.parametrize("transport", ["tcp", "shm"])
WAIT = 5.0  # seconds any condition a test waits for gets


def fresh(name: str) -> str:
    return f"device-test/{uuid.uuid4().hex[:10]}/{name}"


def data(size: int) -> bytes:
    return os.urandom(size)


def device_client(cluster, transport: str, engine: CpuCopyEngine, pool: int = POOL, **options) -> Client:
    return Client(cluster.master_address, transports=transport, copy_engine=engine, device_pool_size=pool,
                  device_chunk_size=CHUNK, **options)


def async_device_client(cluster, transport: str, engine: CpuCopyEngine, pool: int = POOL) -> AsyncClient:
    return AsyncClient(cluster.master_address, transports=transport, copy_engine=engine, device_pool_size=pool,
                       device_chunk_size=CHUNK)


def chunked(direction: str, size: int) -> list:
    """The copies a value of `size` bytes takes through 64 KiB chunks."""
    return [(direction, min(CHUNK, size - at)) for at in range(0, size, CHUNK)]


def in_use(client) -> int:
    return client.device_memory().get("in_use_bytes", 0)  # absent before the pool is made (see below)


def staged_bytes(client) -> int:
    """Value bytes moved through staging so far: a get's are counted as its copies to the device are enqueued."""
    return client.bytes_by_transport().get("cpu-device:staged", 0)


async def until(condition, seconds: float = WAIT) -> None:
    """Return once condition() holds; fail if it has not within `seconds` (no sleep as synchronisation)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)


# -- byte-exact round trips


@TRANSPORTS
def test_a_value_of_several_chunks_goes_from_device_memory_and_back(cluster, transport):
    engine = CpuCopyEngine()
    value, key = data(ODD), fresh("odd")
    with device_client(cluster, transport, engine) as client:
        client.put_from(key, engine.buffer(value))
        assert client.get(key) == value  # stored as the device held it
        exact = engine.buffer(ODD)
        assert client.get_into(key, exact) == ODD
        assert exact.read() == value
        larger = engine.buffer(b"\xee" * (ODD + 70_000))  # a value smaller than its destination: its front
        assert client.get_into(key, larger) == ODD
        assert larger.read() == value + b"\xee" * 70_000
        with pytest.raises(InvalidArgumentError, match="too small"):
            client.get_into(key, engine.buffer(ODD - 1))
        # Host bytes into device memory: either side may be device memory.
        other = fresh("host")
        client.put(other, value[::-1])
        assert client.get_into(other, exact) == ODD and exact.read() == value[::-1]
        # Two copies (one per node), each filled from the same staged bytes; read back from either.
        client.put_from(other, engine.buffer(value), overwrite=True, replicas=2)
        assert client.get(other) == value
        assert client.get_into(other, exact) == ODD and exact.read() == value
        assert in_use(client) == 0


@TRANSPORTS
def test_a_value_is_copied_in_chunks_of_at_most_the_chunk_size(cluster, transport):
    engine = CpuCopyEngine()
    value, key = data(ODD), fresh("chunks")
    with device_client(cluster, transport, engine) as client:
        client.put_from(key, engine.buffer(value))
        staged = chunked("to_host", ODD)
        assert len(staged) == -(-ODD // CHUNK) == 5
        # Same host, the node's extent is filled from the device again, by DMA, in the same chunks.
        assert engine.copied == (staged if transport == "tcp" else staged + staged)
        del engine.copied[:]
        assert client.get_into(key, engine.buffer(ODD)) == ODD
        assert engine.copied == chunked("to_device", ODD)


@TRANSPORTS
def test_parts_of_device_memory_are_one_value(cluster, transport):
    engine = CpuCopyEngine()
    sizes = (70_000, 1_000, 130_000)
    pieces = [data(n) for n in sizes]
    whole, key = b"".join(pieces), fresh("parts")
    with device_client(cluster, transport, engine) as client:
        client.put_parts(key, [engine.buffer(p) for p in pieces])
        assert client.get(key) == whole
        # Scattered back into another layout of device buffers of the same total.
        into = [engine.buffer(100_000), engine.buffer(101_000)]
        assert client.get_into_parts(key, into) == len(whole)
        assert b"".join(b.read() for b in into) == whole
        with pytest.raises(InvalidArgumentError, match="do not match"):
            client.get_into_parts(key, [engine.buffer(100_000), engine.buffer(100_000)])
        assert in_use(client) == 0


@TRANSPORTS
def test_batches_of_device_buffers_and_of_one_buffer_with_offsets(cluster, transport):
    engine = CpuCopyEngine()
    values = [data(n) for n in (CHUNK, 1, 100_000, 2 * CHUNK + 7)]
    with device_client(cluster, transport, engine) as client:
        keys = [fresh(f"batch{i}") for i in range(len(values))]
        client.batch_put_from(keys, [engine.buffer(v) for v in values])
        assert client.batch_get(keys) == values
        dests = [engine.buffer(len(v) + 3) for v in values]  # each a little larger than its value
        missing = fresh("missing")
        assert client.batch_get_into(keys + [missing], dests + [engine.buffer(10)]) == \
            [len(v) for v in values] + [None]
        assert [d.read()[:len(v)] for d, v in zip(dests, values)] == values

        # One device buffer, each key at its offset (how a KV cache is laid out), with a gap between.
        offsets, at = [], 0
        for value in values:
            offsets.append(at)
            at += len(value) + 11
        slab = bytearray(at)
        for offset, value in zip(offsets, values):
            slab[offset:offset + len(value)] = value
        sliced = [fresh(f"sliced{i}") for i in range(len(values))]
        client.batch_put_from(sliced, engine.buffer(bytes(slab)), offsets=offsets, sizes=[len(v) for v in values])
        assert client.batch_get(sliced) == values
        target = engine.buffer(at)
        assert client.batch_get_into(sliced, target, offsets=offsets, sizes=[len(v) for v in values]) == \
            [len(v) for v in values]
        assert target.read() == bytes(slab)  # the gaps untouched (zero)

        # Host and device values in one batch, and host and device destinations.
        mixed = [fresh(f"mixed{i}") for i in range(len(values))]
        client.batch_put_from(mixed, [values[0], engine.buffer(values[1]), bytearray(values[2]),
                                      engine.buffer(values[3])])
        assert client.batch_get(mixed) == values
        into = [engine.buffer(len(values[0])), bytearray(len(values[1])), engine.buffer(len(values[2])),
                bytearray(len(values[3]))]
        assert client.batch_get_into(mixed, into) == [len(v) for v in values]
        assert [into[0].read(), bytes(into[1]), into[2].read(), bytes(into[3])] == values

        # Batches of parts.
        parted = [fresh(f"parted{i}") for i in range(2)]
        client.batch_put_parts(parted, [[engine.buffer(values[0]), engine.buffer(values[2])],
                                        [engine.buffer(values[3])]])
        assert client.batch_get(parted) == [values[0] + values[2], values[3]]
        back = [[engine.buffer(len(values[0])), engine.buffer(len(values[2]))], [engine.buffer(len(values[3]))]]
        assert client.batch_get_into_parts(parted, back) == [len(values[0]) + len(values[2]), len(values[3])]
        assert [b"".join(b.read() for b in parts) for parts in back] == [values[0] + values[2], values[3]]
        assert in_use(client) == 0


@TRANSPORTS
def test_a_zero_length_value_into_device_memory(cluster, transport):
    engine = CpuCopyEngine()
    key = fresh("empty")
    with device_client(cluster, transport, engine) as client:
        client.put(key, b"")
        dest = engine.buffer(b"\xab" * 10)
        assert client.get_into(key, dest) == 0
        assert dest.read() == b"\xab" * 10
        assert client.batch_get_into([key], [dest]) == [0]
        assert in_use(client) == 0


@TRANSPORTS
def test_a_zero_length_device_buffer(cluster, transport):
    engine = CpuCopyEngine()
    key = fresh("empty-device")
    with device_client(cluster, transport, engine) as client:
        client.put_from(key, engine.buffer(0))
        assert client.get(key) == b""
        assert client.get_into(key, engine.buffer(0)) == 0


@TRANSPORTS
def test_a_compressed_value_into_device_parts_and_a_compressed_put_from_device_memory(cluster, transport):
    engine = CpuCopyEngine()
    value = (b"kv-block " * 40_000)[:ODD]  # compresses well
    key, packed = fresh("compressed"), fresh("packed")
    with device_client(cluster, transport, engine) as client:
        client.put(key, value, compress=True)
        into = [engine.buffer(100_000), engine.buffer(ODD - 100_000)]
        assert client.get_into_parts(key, into) == ODD
        assert b"".join(b.read() for b in into) == value
        client.put_from(packed, engine.buffer(value), compress=True)
        assert client.get(packed) == value
        assert in_use(client) == 0


@TRANSPORTS
def test_a_compressed_value_into_one_device_buffer(cluster, transport):
    engine = CpuCopyEngine()
    value = (b"kv-block " * 40_000)[:ODD]
    key = fresh("compressed-one")
    with device_client(cluster, transport, engine) as client:
        client.put(key, value, compress=True)
        dest = engine.buffer(ODD + 10)
        assert client.get_into(key, dest) == ODD
        assert dest.read()[:ODD] == value


# -- ordering against the caller's stream


@TRANSPORTS
def test_a_put_waits_device_side_for_the_kernel_writing_its_value(cluster, transport):
    engine = CpuCopyEngine()
    written = data(3 * CHUNK)
    source = engine.buffer(3 * CHUNK)  # zeros until the kernel runs
    gate = threading.Event()
    key = fresh("after-kernel")

    def kernel():  # a slow kernel writing the value: it ends only once the test let it
        assert gate.wait(WAIT)
        source._bytes[:] = memoryview(written)  # the kernel's own write into device memory

    async def scenario():
        async with async_device_client(cluster, transport, engine) as client:
            engine.launch(kernel)
            put = asyncio.ensure_future(client.put_from(key, source))
            try:
                await until(lambda: in_use(client) > 0)  # staged: its copies are enqueued
                assert engine.copied == []  # they wait for the kernel, on the copy stream
                assert not put.done()
            finally:
                gate.set()
            await put
            assert await client.get(key) == written

    asyncio.run(scenario())


def test_a_load_waits_for_earlier_kernels_and_later_ones_see_it(cluster):
    """Over TCP (staging): the copies into the destination wait device-side for the kernels launched before
    (one still reading its old bytes); kernels launched after the call see the loaded bytes."""
    engine = CpuCopyEngine()
    old, new = data(2 * CHUNK), data(2 * CHUNK)
    dest = engine.buffer(old)
    gate = threading.Event()
    seen = {}
    key = fresh("load-order")

    def reader(name):
        def kernel():
            if name == "before":
                assert gate.wait(WAIT)
            seen[name] = dest._bytes.tobytes()
        return kernel

    async def scenario():
        async with async_device_client(cluster, "tcp", engine) as client:
            await client.put(key, new)
            engine.launch(reader("before"))
            load = asyncio.ensure_future(client.get_into(key, dest))
            # Read from the node and its copies to the device enqueued (counted as they are).
            try:
                await until(lambda: staged_bytes(client) >= len(new))
            finally:
                gate.set()
            assert await load == len(new)
            engine.launch(reader("after"))

    asyncio.run(scenario())
    engine.settle()
    assert seen["before"] == old  # not overwritten under the earlier kernel
    assert seen["after"] == new


@TRANSPORTS
def test_kernels_launched_after_a_slow_load_see_its_bytes(cluster, transport):
    engine = CpuCopyEngine(copy_delay=0.02)
    value, key = data(3 * CHUNK), fresh("slow-load")
    dest = engine.buffer(3 * CHUNK)
    seen = []
    with device_client(cluster, transport, engine) as client:
        client.put(key, value)
        assert client.get_into(key, dest) == len(value)
        engine.launch(lambda: seen.append(dest._bytes.tobytes()))
        engine.settle()
    assert seen == [value]


def test_a_load_over_shm_does_not_block_the_loop_on_the_callers_stream(cluster):
    engine = CpuCopyEngine()
    gate = threading.Event()
    opened = []
    key = fresh("loop-free")

    def kernel():
        opened.append(gate.wait(1.0))  # False: nobody could open it (the loop was blocked)

    async def scenario():
        async with async_device_client(cluster, "shm", engine) as client:
            await client.put(key, data(CHUNK))
            engine.launch(kernel)
            load = asyncio.ensure_future(client.get_into(key, engine.buffer(CHUNK)))
            try:
                await until(lambda: engine.registered)  # its direct copy began (the mapping registered)
            finally:
                gate.set()
            await load

    asyncio.run(scenario())
    assert opened == [True]


# -- failed copies


@pytest.mark.parametrize("transport, failing", [("tcp", "staging"), ("shm", "staging"), ("shm", "direct")])
def test_a_failed_copy_fails_the_put_and_stores_nothing(cluster, transport, failing):
    staged = len(chunked("to_host", ODD))
    engine = CpuCopyEngine(fail_copy=1 if failing == "staging" else staged + 1)
    value, key = data(ODD), fresh("failed-put")
    with device_client(cluster, transport, engine) as client:
        with pytest.raises(DeviceCopyError):
            client.put_from(key, engine.buffer(value))
        assert in_use(client) == 0
        with pytest.raises(KeyNotFoundError):
            client.get(key)
        client.put_from(key, engine.buffer(value))  # the next call succeeds
        assert client.get(key) == value
        assert in_use(client) == 0


@TRANSPORTS
def test_a_failed_copy_fails_the_get_into(cluster, transport):
    engine = CpuCopyEngine(fail_copy=2)
    value, key = data(ODD), fresh("failed-get")
    with device_client(cluster, transport, engine) as client:
        client.put(key, value)
        dest = engine.buffer(ODD)
        with pytest.raises(DeviceCopyError):
            client.get_into(key, dest)
        assert in_use(client) == 0
        assert client.get_into(key, dest) == ODD
        assert dest.read() == value
        assert in_use(client) == 0


# -- waves


@TRANSPORTS
def test_a_batch_larger_than_the_pool_goes_in_waves(cluster, transport):
    engine = CpuCopyEngine()
    values = [data(CHUNK - 5 * i) for i in range(12)]  # three times the pool
    keys = [fresh(f"wave{i}") for i in range(len(values))]
    with device_client(cluster, transport, engine, pool=SMALL_POOL) as client:
        client.batch_put_from(keys, [engine.buffer(v) for v in values])
        assert in_use(client) == 0
        assert client.batch_get(keys) == values
        dests = [engine.buffer(CHUNK) for _ in values]
        assert client.batch_get_into(keys, dests) == [len(v) for v in values]
        assert [d.read()[:len(v)] for d, v in zip(dests, values)] == values
        memory = client.device_memory()
        assert memory["in_use_bytes"] == 0
        assert memory["peak_bytes"] <= memory["pool_bytes"] == SMALL_POOL


@TRANSPORTS
def test_a_failed_copy_fails_only_its_waves_puts(cluster, transport):
    engine = CpuCopyEngine(fail_copy=2)  # the first copy of the second wave (two values of one chunk each)
    values = [data(CHUNK) for _ in range(6)]
    keys = [fresh(f"failed-wave{i}") for i in range(len(values))]
    with device_client(cluster, transport, engine, pool=SMALL_POOL) as client:
        with pytest.raises(BatchError) as caught:
            client.batch_put_from(keys, [engine.buffer(v) for v in values])
        assert set(caught.value.errors) == {keys[2], keys[3]}
        assert all(isinstance(e, DeviceCopyError) for e in caught.value.errors.values())
        assert in_use(client) == 0
        assert client.batch_exists(keys) == [True, True, False, False, True, True]
        kept = [0, 1, 4, 5]
        assert client.batch_get([keys[i] for i in kept]) == [values[i] for i in kept]


def test_a_failed_copy_fails_only_its_waves_reads(cluster):
    """Over TCP a wave's landings go to the device together: a failed copy fails that wave's keys."""
    engine = CpuCopyEngine(fail_copy=2)
    values = [data(CHUNK) for _ in range(6)]
    keys = [fresh(f"failed-read{i}") for i in range(len(values))]
    with device_client(cluster, "tcp", engine, pool=SMALL_POOL) as client:
        client.batch_put(keys, values)
        dests = [engine.buffer(CHUNK) for _ in values]
        with pytest.raises(BatchError) as caught:
            client.batch_get_into(keys, dests)
        assert set(caught.value.errors) == {keys[2], keys[3]}
        assert caught.value.results[:2] == [CHUNK, CHUNK] and caught.value.results[4:] == [CHUNK, CHUNK]
        assert [dests[i].read() for i in (0, 1, 4, 5)] == [values[i] for i in (0, 1, 4, 5)]
        assert in_use(client) == 0
        assert client.batch_get_into(keys, dests) == [CHUNK] * 6
        assert [d.read() for d in dests] == values


def _node_of(client: Client, key: str) -> str:
    """The node holding `key`, from the placement this client cached when it stored it (no API says)."""
    return client._core.cache.get(key).replicas[0].address


def test_a_failed_direct_copy_fails_only_its_key_in_a_batch(cluster):
    engine = CpuCopyEngine(fail_copy=0)
    with device_client(cluster, "shm", engine) as client:
        by_node: dict = {}
        for i in range(8):  # two keys on one node: read together, in one read_many
            key, value = fresh(f"same-node{i}"), data(CHUNK)
            client.put(key, value)
            by_node.setdefault(_node_of(client, key), []).append((key, value))
        [(first, _), (second, value)] = next(pairs for pairs in by_node.values() if len(pairs) >= 2)[:2]
        dests = [engine.buffer(CHUNK), engine.buffer(CHUNK)]
        with pytest.raises(BatchError) as caught:
            client.batch_get_into([first, second], dests)
        assert set(caught.value.errors) == {first}
        assert dests[1].read() == value


# -- cancelled and timed-out calls


def test_a_cancelled_load_gives_its_staging_back_only_once_its_copies_ended(cluster):
    engine = CpuCopyEngine(copy_delay=0.1)
    value, key = data(3 * CHUNK), fresh("cancelled-load")
    dest = engine.buffer(3 * CHUNK)

    async def scenario():
        async with async_device_client(cluster, "tcp", engine) as client:
            await client.put(key, value)
            load = asyncio.ensure_future(client.get_into(key, dest))
            await until(lambda: staged_bytes(client) >= len(value))  # read, its copies to the device enqueued
            load.cancel()
            with pytest.raises(asyncio.CancelledError):
                await load
            assert in_use(client) == 0
            # The staging went back after the copies out of it ran: all of them had (nothing still reads it).
            assert len(engine.copied) == 3 and dest._bytes.tobytes() == value
            engine.copy_delay = 0
            again = engine.buffer(3 * CHUNK)
            assert await client.get_into(key, again) == len(value)
            assert again.read() == value
            assert in_use(client) == 0

    asyncio.run(scenario())


def test_a_timed_out_put_gives_its_staging_back_only_once_its_copies_ended(cluster):
    engine = CpuCopyEngine(copy_delay=0.1)
    key, other = fresh("timed-out-put"), fresh("read-after")
    other_value = data(3 * CHUNK)

    async def scenario():
        async with async_device_client(cluster, "tcp", engine) as client:
            await client.put(other, other_value)
            with pytest.raises(DeadlineExceededError):
                await client.put_from(key, engine.buffer(data(3 * CHUNK)), timeout=0.05)
            assert in_use(client) == 0
            # Staging given back while the put's copies still wrote into it would be overwritten under the
            # next call that lands there: this read (still slow copies, so it would be).
            dest = engine.buffer(3 * CHUNK)
            assert await client.get_into(other, dest) == len(other_value)
            assert dest.read() == other_value
            with pytest.raises(KeyNotFoundError):
                await client.get(key)
            assert in_use(client) == 0

    asyncio.run(scenario())


def test_a_timed_out_batch_put_gives_every_waves_staging_back_once_its_copies_ended(cluster):
    """Cancelled while one wave is being sent and the next one's copies run: both waves' staging comes back,
    each once its copies ended."""
    engine = CpuCopyEngine(copy_delay=0.1)
    keys = [fresh(f"timed-out-batch{i}") for i in range(4)]  # two waves of two chunks
    other, other_value = fresh("read-after-batch"), data(3 * CHUNK)

    async def scenario():
        async with async_device_client(cluster, "tcp", engine, pool=SMALL_POOL) as client:
            await client.put(other, other_value)
            with pytest.raises(DeadlineExceededError):
                await client.batch_put_from(keys, [engine.buffer(data(CHUNK)) for _ in keys], timeout=0.05)
            assert in_use(client) == 0
            assert len(engine.copied) == 4  # both waves' copies had been enqueued, and ran
            assert await client.batch_exists(keys) == [False] * 4
            dest = engine.buffer(3 * CHUNK)  # through staging, its copies still slow: see the single put's test
            assert await client.get_into(other, dest) == len(other_value)
            assert dest.read() == other_value
            assert in_use(client) == 0

    asyncio.run(scenario())


def test_a_cancelled_batch_load_gives_every_waves_staging_back_once_its_copies_ended(cluster):
    engine = CpuCopyEngine(copy_delay=0.1)
    values = [data(CHUNK) for _ in range(4)]  # two waves of two chunks
    keys = [fresh(f"cancelled-batch{i}") for i in range(len(values))]
    dests = [engine.buffer(CHUNK) for _ in values]

    async def scenario():
        async with async_device_client(cluster, "tcp", engine, pool=SMALL_POOL) as client:
            await client.batch_put(keys, values)
            load = asyncio.ensure_future(client.batch_get_into(keys, dests))
            # Both waves read: the first one landing on the device, the second one's copies enqueued behind it.
            await until(lambda: staged_bytes(client) >= len(values) * CHUNK)
            load.cancel()
            with pytest.raises(asyncio.CancelledError):
                await load
            assert in_use(client) == 0
            returned = [d._bytes.tobytes() for d in dests]  # as the call left them
            assert [d.read() for d in dests] == returned  # no copy still wrote into them after it returned
            assert len(engine.copied) == 4 and returned == values
            engine.copy_delay = 0
            again = [engine.buffer(CHUNK) for _ in values]
            assert await client.batch_get_into(keys, again) == [CHUNK] * 4
            assert [d.read() for d in again] == values
            assert in_use(client) == 0

    asyncio.run(scenario())


# -- the pool: back-pressure and its bound


@TRANSPORTS
def test_calls_beyond_the_pool_wait_for_room_and_all_succeed(cluster, transport):
    engine = CpuCopyEngine()
    values = [data(3 * CHUNK - i) for i in range(4)]  # three chunks each, four at once: 12 of a 4-chunk pool
    keys = [fresh(f"pressure{i}") for i in range(len(values))]

    async def scenario():
        async with async_device_client(cluster, transport, engine, pool=SMALL_POOL) as client:
            await asyncio.gather(*(client.put_from(k, engine.buffer(v)) for k, v in zip(keys, values)))
            assert await client.batch_get(keys) == values
            put_waits = client.device_memory()["waits"]
            dests = [engine.buffer(3 * CHUNK) for _ in values]
            sizes = await asyncio.gather(*(client.get_into(k, d) for k, d in zip(keys, dests)))
            assert sizes == [len(v) for v in values]
            assert [d.read()[:len(v)] for d, v in zip(dests, values)] == values
            return put_waits, client.device_memory()

    put_waits, memory = asyncio.run(scenario())
    assert put_waits > 0 and memory["waits"] > put_waits  # puts and gets both waited for room
    assert memory["peak_bytes"] <= memory["pool_bytes"] == SMALL_POOL
    assert memory["in_use_bytes"] == 0


def test_a_call_waiting_for_room_past_its_deadline_fails_and_holds_nothing(cluster):
    engine = CpuCopyEngine(copy_delay=0.1)
    first, second = fresh("holds-the-pool"), fresh("waits-for-room")
    values = [data(3 * CHUNK), data(3 * CHUNK)]

    async def scenario():
        async with async_device_client(cluster, "tcp", engine, pool=SMALL_POOL) as client:
            holding = asyncio.ensure_future(client.put_from(first, engine.buffer(values[0])))
            await until(lambda: in_use(client) > 0)
            with pytest.raises(DeadlineExceededError):
                await client.put_from(second, engine.buffer(values[1]), timeout=0.05)  # 3 of 4 chunks taken
            await holding
            memory = client.device_memory()
            assert memory["waits"] == 1 and memory["in_use_bytes"] == 0
            engine.copy_delay = 0
            await client.put_from(second, engine.buffer(values[1]))
            assert await client.batch_get([first, second]) == values

    asyncio.run(scenario())


@TRANSPORTS
def test_a_value_larger_than_the_pool_is_refused(cluster, transport):
    engine = CpuCopyEngine()
    key = fresh("too-large")
    with device_client(cluster, transport, engine, pool=SMALL_POOL) as client:
        with pytest.raises(InvalidArgumentError, match="device_pool_size"):
            client.put_from(key, engine.buffer(SMALL_POOL + 1))
        assert client.batch_exists([key]) == [False]
        with pytest.raises(InvalidArgumentError, match="device_pool_size"):
            client.batch_put_from([key], [engine.buffer(SMALL_POOL + 1)])
        client.put(key, b"x" * 10)
        with pytest.raises(InvalidArgumentError, match="device_pool_size"):
            client.get_into(key, engine.buffer(SMALL_POOL + 1))
        assert in_use(client) == 0
        assert client.get_into(key, engine.buffer(SMALL_POOL)) == 10  # the pool's size itself fits


# -- which path


def test_shm_copies_between_device_memory_and_the_nodes_mapping_directly(cluster):
    engine = CpuCopyEngine()
    value, key = data(ODD), fresh("direct")
    with device_client(cluster, "shm", engine) as client:
        client.put_from(key, engine.buffer(value))
        dest = engine.buffer(ODD)
        assert client.get_into(key, dest) == ODD and dest.read() == value
        moved = client.bytes_by_transport()
        assert moved["cpu-device:direct"] == 2 * ODD  # the put's and the get's
        assert "cpu-device:staged" not in moved
        assert engine.registered  # the nodes' mappings, made reachable by DMA
        assert client.device_memory()["engine"] == "cpu-device"


def test_device_memory_reports_every_figure_before_the_first_transfer(cluster):
    with device_client(cluster, "tcp", CpuCopyEngine()) as client:
        memory = client.device_memory()
        assert {name: memory[name] for name in ("pool_bytes", "chunk_bytes", "allocated_bytes", "in_use_bytes",
                                                "peak_bytes", "waits", "engine")} == {
            "pool_bytes": POOL, "chunk_bytes": CHUNK, "allocated_bytes": 0, "in_use_bytes": 0, "peak_bytes": 0,
            "waits": 0, "engine": "cpu-device"}


def test_tcp_moves_device_memory_through_staging(cluster):
    engine = CpuCopyEngine()
    value, key = data(ODD), fresh("staged")
    with device_client(cluster, "tcp", engine) as client:
        client.put_from(key, engine.buffer(value))
        assert client.get_into(key, engine.buffer(ODD)) == ODD
        moved = client.bytes_by_transport()
        assert moved["cpu-device:staged"] == 2 * ODD and "cpu-device:direct" not in moved
        assert moved["tcp"] >= 2 * ODD
        assert engine.registered == set()
        memory = client.device_memory()
        assert memory["allocated_bytes"] == memory["pool_bytes"] == POOL and memory["chunk_bytes"] == CHUNK


def test_a_direct_copy_past_the_locate_lease_is_read_again_into_staging(cluster):
    """A direct copy that ends after half the node's pin (the caller's stream held it back) may have copied
    an extent the node reused: the value is read again over the socket, and that is what reaches the device."""
    engine = CpuCopyEngine()
    value, key = data(CHUNK), fresh("lapsed")
    dest = engine.buffer(CHUNK)
    with device_client(cluster, "shm", engine) as client:
        client.put(key, value)
        # Simulated work on the caller's stream (not synchronisation): the direct copy waits for it.
        engine.launch(lambda: time.sleep(_SAFE_COPY_SECONDS + 0.5))
        assert client.get_into(key, dest) == CHUNK
        assert dest.read() == value
        moved = client.bytes_by_transport()
        assert moved["cpu-device:staged"] == CHUNK and "cpu-device:direct" not in moved
        assert engine.copied == [("to_device", CHUNK), ("to_device", CHUNK)]  # direct, then from staging


# -- what is refused


@TRANSPORTS
def test_host_and_device_parts_do_not_mix(cluster, transport):
    engine = CpuCopyEngine()
    key = fresh("mixed")
    with device_client(cluster, transport, engine) as client:
        with pytest.raises(InvalidArgumentError, match="all be device memory or all host memory"):
            client.put_parts(key, [engine.buffer(b"abc"), b"def"])
        with pytest.raises(InvalidArgumentError, match="all be device memory or all host memory"):
            client.batch_put_parts([key], [[b"abc", engine.buffer(b"def")]])
        client.put(key, b"abcdef")
        with pytest.raises(InvalidArgumentError, match="all be device memory or all host memory"):
            client.get_into_parts(key, [bytearray(3), engine.buffer(3)])
        assert client.get(key) == b"abcdef"


def test_a_non_contiguous_cpu_tensor_is_still_refused(cluster):
    torch = pytest.importorskip("torch")
    engine = CpuCopyEngine()
    key = fresh("strided")
    strided = torch.arange(64, dtype=torch.float32).reshape(8, 8).t()
    with device_client(cluster, "tcp", engine) as client:
        with pytest.raises(InvalidArgumentError, match="not contiguous"):
            client.put_from(key, strided)
        client.put(key, b"\0" * strided.nbytes)
        with pytest.raises(InvalidArgumentError, match="not contiguous"):
            client.get_into(key, torch.zeros(8, 8).t())
        assert engine.copied == []  # a CPU tensor is host memory: never the engine's


# -- KV blocks of torch CPU caches (kvpool.connectors): gathered, stored, scattered back


LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 8, 4, 2, 8
# sha256 of the object stored for block 5 of golden_caches(kv_first): the on-pool format of a block, which
# engines that stored blocks earlier rely on; it must not change. Worked out from the caches' bytes alone:
# per layer K then V of the block (kv-first), or the block's one slab per layer (block-first), layers in order.
GOLDEN = {
    True: "f0caa6730e26febe14a2f588c118ec6bcfbfb83a0e68ed07ca339ada80f30cc7",
    False: "521aefb2454953512551ac3237cf20c2d624cec8482732df6f794f254ada6000",
}


def golden_caches(kv_first: bool, seed: int | None = None):
    """bfloat16 caches, (2, num_blocks, block_size, heads, head_dim) per layer, or block-first
    (num_blocks, heads, block_size, 2 x head_dim); bytes counting up (golden), random (seed) or zero."""
    torch = pytest.importorskip("torch")
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM) if kv_first else (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    count = 2 * BLOCKS * BLOCK_SIZE * HEADS * HEAD_DIM
    layers = []
    for layer in range(LAYERS):
        if seed is None:
            raw = (torch.arange(2 * count, dtype=torch.int64) * 7 + layer) % 251
        else:
            raw = torch.randint(0, 256, (2 * count,), generator=torch.Generator().manual_seed(seed + layer))
        layers.append(raw.to(torch.uint8).view(torch.bfloat16).reshape(shape))
    return layers


def raw_bytes(tensor) -> bytes:
    import torch
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@TRANSPORTS
@pytest.mark.parametrize("kv_first", [True, False], ids=["kv-first", "block-first"])
def test_kv_blocks_of_cpu_caches_round_trip_in_the_block_parts_format(cluster, transport, kv_first):
    import hashlib

    from kvpool.connectors import BlockNamespace, KVBlockStore, block_hashes, block_parts

    torch = pytest.importorskip("torch")
    engine = CpuCopyEngine()
    namespace = BlockNamespace("device-test", "bfloat16", f"layout-{kv_first}-{uuid.uuid4().hex[:8]}", BLOCK_SIZE)
    producer = golden_caches(kv_first)
    hashes = block_hashes(list(range(4 * BLOCK_SIZE)), BLOCK_SIZE)
    saved_at = [5, 2, 7, 0]
    with device_client(cluster, transport, engine) as client:
        store = KVBlockStore(client, namespace, kv_first=kv_first)
        assert store.save(hashes, saved_at, producer) == 4
        for block_hash, block in zip(hashes, saved_at):
            stored = client.get(namespace.key(block_hash))
            assert stored == b"".join(raw_bytes(part) for part in block_parts(producer, block, kv_first))
        assert hashlib.sha256(client.get(namespace.key(hashes[0]))).hexdigest() == GOLDEN[kv_first]

        consumer = [torch.zeros_like(layer) for layer in producer]
        assert store.load(hashes, [1, 6, 3, 4], consumer) == 4
        for slot, block in zip([1, 6, 3, 4], saved_at):
            for layer in range(LAYERS):
                if kv_first:
                    assert torch.equal(consumer[layer][:, slot].view(torch.uint8),
                                       producer[layer][:, block].view(torch.uint8))
                else:
                    assert torch.equal(consumer[layer][slot].view(torch.uint8),
                                       producer[layer][block].view(torch.uint8))
        untouched = [0, 2, 5, 7]
        for layer in consumer:
            rows = layer[:, untouched] if kv_first else layer[untouched]
            assert torch.count_nonzero(rows.view(torch.uint8)) == 0
        assert engine.copied == []  # CPU tensors are host memory: the device pipeline stays out of it
        client.remove_prefix(namespace.prefix())


@pytest.mark.parametrize("kv_first", [True, False], ids=["kv-first", "block-first"])
def test_kv_blocks_of_permuted_caches_are_stored_as_they_lie_in_memory(cluster, kv_first):
    """Caches an engine allocates heads before tokens and shows permuted (vLLM's HND stride order): each block
    is still one contiguous range, stored as it lies in memory and scattered back into the same layout."""
    from kvpool.connectors import BlockNamespace, KVBlockStore, block_hashes

    torch = pytest.importorskip("torch")
    # In memory (2, blocks, heads, tokens, dim) / (blocks, heads, tokens, 2 dim); shown with tokens first.
    swap = (0, 1, 3, 2, 4) if kv_first else (0, 2, 1, 3)
    memory = [layer.reshape((2, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM) if kv_first
                            else (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)) for layer in golden_caches(kv_first)]
    shown = [layer.permute(swap) for layer in memory]
    assert not shown[0].is_contiguous()
    namespace = BlockNamespace("device-test", "bfloat16", f"permuted-{kv_first}-{uuid.uuid4().hex[:8]}", BLOCK_SIZE)
    hashes = block_hashes(list(range(2 * BLOCK_SIZE)), BLOCK_SIZE)
    with Client(cluster.master_address, transports="tcp") as client:
        store = KVBlockStore(client, namespace, kv_first=kv_first)
        assert store.save(hashes, [6, 1], shown) == 2
        for block_hash, block in zip(hashes, [6, 1]):
            halves = (lambda layer: (layer[0, block], layer[1, block])) if kv_first else (lambda layer: (layer[block],))
            assert client.get(namespace.key(block_hash)) == b"".join(
                raw_bytes(half) for layer in memory for half in halves(layer))
        consumer_memory = [torch.zeros_like(layer) for layer in memory]
        consumer = [layer.permute(swap) for layer in consumer_memory]
        assert store.load(hashes, [2, 7], consumer) == 2
        for slot, block in zip([2, 7], [6, 1]):
            for layer in range(LAYERS):
                got = consumer[layer][:, slot] if kv_first else consumer[layer][slot]
                want = shown[layer][:, block] if kv_first else shown[layer][block]
                assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
        # A layout where a block is not one range (the block index not leading) is refused, not mangled.
        scrambled = [layer.transpose(0, 1) for layer in golden_caches(kv_first)]
        with pytest.raises(InvalidArgumentError, match="not one contiguous range"):
            store.save(block_hashes(list(range(100, 100 + BLOCK_SIZE)), BLOCK_SIZE), [0], scrambled)
        client.remove_prefix(namespace.prefix())
