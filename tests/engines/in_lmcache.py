"""kvpool as LMCache's remote storage, driven through LMCache's own LocalCPUBackend and RemoteBackend.

Runs in the LMCache venv (python3 examples/engine_venvs.py lmcache), from the repository root:
    .venv-lmcache/bin/python -m pytest -q -p no:cacheprovider tests/engines/in_lmcache.py
"""

import asyncio
import threading
from pathlib import Path

import pytest
import torch
import yaml
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from kvpool import Client
from kvpool.connectors.lmcache import KvpoolConnector
from kvpool.errors import InvalidArgumentError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lmcache" / "kvpool.yaml"
MODEL = "tiny-llama"
LAYERS, CHUNK, KV_HEADS, HEAD_DIM = 4, 32, 4, 32
CHUNK_BYTES = 2 * LAYERS * CHUNK * KV_HEADS * HEAD_DIM * 2  # K and V of every layer, bfloat16
WAIT = 20.0  # seconds any one LMCache future may take


def key(chunk_hash: int, model: str = MODEL) -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, chunk_hash, torch.bfloat16)


class Engine:
    """What one LMCache worker holds: config, metadata, its CPU buffer, and a RemoteBackend on plugin://kvpool
    served by an event loop thread of its own (as LMCache's storage manager runs it)."""

    def __init__(self, master: str, key_prefix: str, **extra):
        settings = yaml.safe_load(EXAMPLE.read_text())  # the documented configuration, pointed at the test cluster
        settings["chunk_size"] = CHUNK
        settings["max_local_cpu_size"] = 0.01  # GB
        settings["extra_config"].update({"remote_storage_plugin.kvpool.master": master,
                                         "remote_storage_plugin.kvpool.key_prefix": key_prefix, **extra})
        self.config = LMCacheEngineConfig.from_defaults(**settings)
        self.metadata = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                                        local_worker_id=0, kv_dtype=torch.bfloat16,
                                        kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM), chunk_size=CHUNK)
        self.cpu = LocalCPUBackend(self.config, self.metadata)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lmcache-storage-loop", daemon=True)
        self.thread.start()
        self.remote = RemoteBackend(self.config, self.metadata, self.loop, self.cpu, "cpu", plugin_name="kvpool")
        self.held = []  # LMCache buffers this test holds a reference to: released at the end

    def hold(self, objs: list) -> list:
        self.held.extend(obj for obj in objs if obj is not None)
        return objs

    @property
    def connector(self):
        return None if self.remote.connection is None else self.remote.connection.getWrappedConnector()

    def chunk(self, seed: int, tokens: int = CHUNK):
        """A KV chunk in LMCache's buffer, filled with values that depend on seed."""
        obj = self.cpu.allocate(self.metadata.get_shapes(tokens), self.metadata.get_dtypes(), busy_loop=False)
        assert obj is not None
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed)))
        return self.hold([obj])[0]

    def get(self, k):
        return self.hold([self.remote.get_blocking(k)])[0]

    def batched_get(self, keys) -> list:
        return self.hold(self.remote.batched_get_blocking(keys))

    def get_prefix(self, lookup_id: str, keys) -> list:
        return self.hold(self.on_loop(self.remote.batched_get_non_blocking(lookup_id, keys)))

    def put(self, k, obj) -> None:
        self.remote.submit_put_task(k, obj).result(WAIT)

    def batched_put(self, keys, objs) -> None:
        done = set()
        all_done = threading.Event()

        def completed(k):
            done.add(k)
            if len(done) == len(keys):
                all_done.set()

        self.remote.batched_submit_put_task(keys, objs, on_complete_callback=completed)
        assert all_done.wait(WAIT)

    def on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT)

    def close(self) -> int:
        """Stop; returns how many LMCache buffers were still in use after the test's own were released."""
        if self.remote.connection is not None:
            self.remote.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)
        self.loop.close()
        for obj in self.held:
            obj.ref_count_down()
        leaked = self.cpu.memory_allocator.pin_allocator.num_active_allocations
        self.cpu.memory_allocator.close()
        return leaked


@pytest.fixture
def engines(cluster, request, caplog):
    """Engine(**extra) factory; every engine of a test shares the test's key prefix, as engines of one model do."""
    prefix = f"lmcache-test/{request.node.name}/"
    started = []

    def start(**extra):
        started.append(Engine(cluster.master_address, prefix, **extra))
        return started[-1]

    yield start
    leaked = [engine.close() for engine in started]
    with Client(cluster.master_address) as client:
        client.remove_prefix(prefix)
    # A buffer dropped without ref_count_down is only given back by the garbage collector, which LMCache reports.
    records = caplog.get_records("call") + caplog.get_records("teardown")
    dropped = [r.getMessage() for r in records if "garbage collected with ref_count" in r.getMessage()]
    assert leaked == [0] * len(started) and not dropped, "buffers were neither handed to LMCache nor released"


def same_chunk(got, want) -> bool:
    return (got is not None and got.get_shapes() == want.get_shapes() and got.get_dtypes() == want.get_dtypes()
            and got.get_memory_format() == want.get_memory_format() and bytes(got.byte_array) == bytes(want.byte_array))


def test_a_chunk_of_another_layout_comes_back_in_that_layout(engines, cluster):
    engine = engines()
    shape = torch.Size([2, LAYERS, CHUNK // 2, 2 * KV_HEADS * HEAD_DIM])  # as many bytes as this engine's chunk
    data = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    header = RemoteMetadata(CHUNK_BYTES, [shape], [torch.bfloat16], MemoryFormat.KV_2LTD).serialize()
    with Client(cluster.master_address) as client:
        client.put(engine.connector.name(key(5)), header + data.view(torch.uint8).numpy().tobytes())
    got = engine.get(key(5))
    assert got.get_shapes() == [shape] and torch.equal(got.tensor, data)
    assert torch.equal(engine.batched_get([key(5)])[0].tensor, data)


def test_chunks_put_by_one_engine_are_read_byte_exact_by_another(engines, cluster):
    writer = engines()
    assert isinstance(writer.connector, KvpoolConnector)  # built by LMCache from the example's plug-in entry
    chunks = {key(h): writer.chunk(seed=h) for h in (11, 12, 13)}
    assert not writer.remote.contains(key(11))
    for k, obj in chunks.items():
        writer.put(k, obj)
    assert all(writer.remote.contains(k) for k in chunks)
    assert same_chunk(writer.get(key(12)), chunks[key(12)])

    # One object per chunk, named by LMCache's key, holding LMCache's chunk header and the bytes.
    with Client(cluster.master_address) as client:
        stored = client.get(writer.connector.name(key(13)))
    header = writer.connector.remote_metadata_bytes
    assert len(stored) == header + CHUNK_BYTES
    meta = RemoteMetadata.deserialize(stored[:header])
    assert (meta.length, meta.fmt, meta.dtypes) == (CHUNK_BYTES, MemoryFormat.KV_2LTD, [torch.bfloat16])
    assert stored[header:] == bytes(chunks[key(13)].byte_array)

    reader = engines()  # another worker: its own buffer, loop, client and placement cache
    assert reader.remote.contains(key(11)) and not reader.remote.contains(key(99))
    for k, obj in chunks.items():
        assert same_chunk(reader.get(k), obj)
    assert reader.get(key(99)) is None
    assert reader.get(key(11, model="another-model")) is None
    # The same chunk stored again (another engine computed it too) is not an error.
    reader.put(key(11), reader.chunk(seed=11))
    assert writer.remote.put_failed_count == reader.remote.put_failed_count == 0


def test_batched_forms(engines):
    writer = engines()
    keys = [key(h) for h in range(20, 26)]
    chunks = [writer.chunk(seed=h) for h in range(20, 26)]
    writer.batched_put(keys[:3] + keys[4:], chunks[:3] + chunks[4:])  # chunk 23 missing
    reader = engines()
    assert reader.remote.batched_contains(keys) == 3
    assert reader.on_loop(reader.remote.batched_async_contains("lookup-1", keys, pin=True)) == 3
    assert reader.on_loop(reader.remote.batched_async_contains("lookup-2", keys[4:])) == 2
    assert reader.connector.batched_contains(keys[4:] + keys[:1]) == 3
    got = reader.batched_get(keys)
    assert got[3] is None
    assert all(same_chunk(g, c) for i, (g, c) in enumerate(zip(got, chunks)) if i != 3)
    prefix = reader.get_prefix("lookup-1", keys)
    assert len(prefix) == 3 and all(same_chunk(g, c) for g, c in zip(prefix, chunks))
    assert reader.batched_get([]) == []


def test_partial_chunk_comes_back_in_its_own_shape(engines):
    writer = engines()
    full, partial = writer.chunk(seed=30), writer.chunk(seed=31, tokens=5)  # a prompt's last, unfull chunk
    writer.batched_put([key(30), key(31)], [full, partial])
    reader = engines()
    got = reader.batched_get([key(30), key(31), key(32)])
    assert same_chunk(got[0], full) and same_chunk(got[1], partial) and got[2] is None
    assert got[1].get_shapes()[0][2] == 5
    assert same_chunk(reader.get(key(31)), partial)


def test_without_chunk_headers_bytes_alone_are_stored(engines, cluster):
    writer = engines(save_chunk_meta=False)
    assert not writer.connector.save_chunk_meta
    full, partial = writer.chunk(seed=40), writer.chunk(seed=41, tokens=7)
    writer.put(key(40), full)
    writer.put(key(41), partial)
    with Client(cluster.master_address) as client:
        assert client.get(writer.connector.name(key(40))) == bytes(full.byte_array)
    reader = engines(save_chunk_meta=False)
    got = reader.batched_get([key(40), key(41), key(42)])
    assert same_chunk(got[0], full) and same_chunk(got[1], partial) and got[2] is None
    assert same_chunk(reader.get(key(41)), partial)


def test_what_is_not_a_chunk_is_a_miss_never_garbage(engines, cluster):
    engine = engines()
    with Client(cluster.master_address) as client:
        client.put(engine.connector.name(key(50)), b"\x07" * (engine.connector.remote_metadata_bytes + CHUNK_BYTES))
        client.put(engine.connector.name(key(51)), b"short")
    assert engine.remote.contains(key(50))
    assert engine.get(key(50)) is None
    assert engine.batched_get([key(51), key(50)]) == [None, None]
    # A header that lies about the size of its layout: a miss.
    size = engine.connector.remote_metadata_bytes + CHUNK_BYTES
    fake = RemoteMetadata(CHUNK_BYTES, [torch.Size([2, LAYERS, CHUNK, KV_HEADS * HEAD_DIM])], [torch.float32],
                          MemoryFormat.KV_2LTD).serialize()
    with Client(cluster.master_address) as client:
        client.put(engine.connector.name(key(54)), fake + b"\x01" * (size - len(fake)))
    assert engine.get(key(54)) is None
    # A key kvpool cannot take (over 1024 bytes): a clean False / miss, the backend keeps working.
    too_long = key(52, model="m" * 1100)
    assert not engine.remote.contains(too_long)
    assert engine.get(too_long) is None
    engine.put(key(53), engine.chunk(seed=53))
    assert engine.remote.contains(key(53))


def test_bad_configuration_is_a_typed_error(engines, cluster):
    engine = engines(**{"remote_storage_plugin.kvpool.etcd": "127.0.0.1:2379"})  # both master and etcd
    assert engine.remote.connection is None  # RemoteBackend logged the failure and runs without remote storage
    assert not engine.remote.contains(key(60))
    with pytest.raises(InvalidArgumentError, match="one of them"):
        KvpoolConnector(engine.loop, engine.cpu, engine.config)
    engine.config.extra_config["remote_storage_plugin.kvpool.etcd"] = None
    engine.config.extra_config["remote_storage_plugin.kvpool.hold_seconds"] = "soon"
    with pytest.raises(InvalidArgumentError, match="hold_seconds"):
        KvpoolConnector(engine.loop, engine.cpu, engine.config)


def test_remove_ping_and_close(engines):
    engine = engines()
    engine.put(key(70), engine.chunk(seed=70))
    connector = engine.connector
    assert engine.on_loop(connector.ping()) == 0
    assert connector.remove_sync(key(70)) and not connector.remove_sync(key(70))
    assert not engine.remote.contains(key(70))
    with pytest.raises(RuntimeError, match="deadlock"):
        engine.on_loop(_sync_call_on_loop(connector))
    engine.put(key(71), engine.chunk(seed=71))
    engine.remote.close()
    assert connector.closed
    assert not engine.remote.contains(key(71))
    assert engine.get(key(71)) is None
    assert engine.on_loop(connector.ping()) != 0
    with pytest.raises(Exception, match="closed"):
        engine.remote.submit_put_task(key(72), engine.chunk(seed=72)).result(WAIT)
    engine.remote.close()  # a second close is harmless


def test_list_names_the_chunks_under_its_prefix_as_lmcache_does(engines, cluster):
    engine = engines()
    keys = [key(80 + i) for i in range(3)]
    for i, k in enumerate(keys):
        engine.put(k, engine.chunk(seed=80 + i))
    with Client(cluster.master_address) as client:
        client.put("lmcache-test/elsewhere", b"not under this engine's prefix")
        try:
            listed = engine.on_loop(engine.connector.list())
        finally:
            client.remove("lmcache-test/elsewhere")
    assert sorted(listed) == sorted(k.to_string() for k in keys)
    assert [CacheEngineKey.from_string(name) for name in sorted(listed)] == sorted(keys, key=lambda k: k.to_string())


async def _sync_call_on_loop(connector):
    return connector.exists_sync(key(71))
