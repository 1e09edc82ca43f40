"""LMCache's own `mooncakestore` backend, unchanged, on kvpool: LMCache builds its MooncakestoreConnector from a
mooncakestore:// URL, and that connector's `from mooncake.store import ...` finds kvpool's package
(compat/mooncake_store, installed in the LMCache venv). Chunks go through LMCache's code paths (with chunk headers:
put_parts and batch_get_buffer; without: zero-copy put_from / batch_put_from / batch_get_into on LMCache's
registered buffer) to a real kvpool cluster and come back byte-exact in another worker.

Run from the repository root: .venv-lmcache/bin/python -m pytest -q -p no:cacheprovider tests/engines/in_lmcache_mooncake.py
"""

import asyncio
import threading

import mooncake.store
import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.mooncakestore_connector import MooncakestoreConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from in_lmcache import CHUNK, CHUNK_BYTES, HEAD_DIM, KV_HEADS, LAYERS, Engine

from kvpool import Client

MODEL = "tiny-llama-mc"


def key(chunk_hash: int) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, 0, chunk_hash, torch.bfloat16)


class Worker(Engine):
    """One LMCache worker whose remote storage is mooncakestore://, as a Mooncake user configures it (the rest is
    in_lmcache.py's Engine: its chunks, batches and close)."""

    def __init__(self, master: str, save_chunk_meta: bool):
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.01, remote_serde="naive",
            remote_url="mooncakestore://127.0.0.1:50051/",
            extra_config={"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                          "master_server_address": master, "global_segment_size": 0,
                          "save_chunk_meta": save_chunk_meta, "transfer_timeout": 10})
        self.metadata = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                                        local_worker_id=0, kv_dtype=torch.bfloat16,
                                        kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM), chunk_size=CHUNK)
        self.cpu = LocalCPUBackend(self.config, self.metadata)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.remote = RemoteBackend(self.config, self.metadata, self.loop, self.cpu, "cpu")
        self.held = []


@pytest.fixture
def workers(cluster):
    started = []

    def start(save_chunk_meta: bool = True):
        started.append(Worker(cluster.master_address, save_chunk_meta))
        return started[-1]

    yield start
    for worker in started:
        worker.close()
    with Client(cluster.master_address) as client:
        client.remove_prefix(MODEL)


def same_chunk(got, want) -> bool:
    return got is not None and got.get_shapes() == want.get_shapes() and bytes(got.byte_array) == bytes(
        want.byte_array)


def test_mooncake_store_here_is_kvpools():
    assert mooncake.store.BACKEND == "kvpool"


@pytest.mark.parametrize("save_chunk_meta", [True, False], ids=["with-chunk-headers", "zero-copy"])
def test_lmcache_mooncakestore_backend_stores_and_loads_through_kvpool(workers, cluster, save_chunk_meta):
    writer = workers(save_chunk_meta)
    assert isinstance(writer.connector, MooncakestoreConnector)  # LMCache's own connector, from the URL
    # Zero-copy calls name addresses in LMCache's buffer, which it registered with the store.
    assert writer.connector.registered_buffer_ptr is not None
    keys = [key(h) for h in (1, 2, 3, 4)]
    chunks = [writer.chunk(seed=h) for h in (1, 2, 3)] + [writer.chunk(seed=4, tokens=5)]  # the last one partial
    writer.batched_put(keys[:2] + keys[3:], chunks[:2] + chunks[3:])  # chunk 3 never stored
    assert writer.remote.put_failed_count == 0

    reader = workers(save_chunk_meta)  # another worker: its own buffer and store
    assert reader.remote.contains(keys[0]) and not reader.remote.contains(keys[2])
    assert reader.remote.batched_contains(keys) == 2
    got = reader.batched_get(keys)
    assert same_chunk(got[0], chunks[0]) and same_chunk(got[1], chunks[1]) and got[2] is None
    if save_chunk_meta:  # the header carries the partial chunk's shape
        assert same_chunk(got[3], chunks[3])
    else:  # bytes only: LMCache reshapes by the size read
        assert got[3] is not None and bytes(got[3].byte_array)[:len(bytes(chunks[3].byte_array))] == bytes(
            chunks[3].byte_array)

    # What LMCache stored is one kvpool object per chunk under LMCache's key: its header (or not) and the bytes.
    with Client(cluster.master_address) as client:
        stored = client.get(keys[0].to_string())
    header = writer.connector.remote_metadata_bytes if save_chunk_meta else 0
    assert len(stored) == header + CHUNK_BYTES and stored[header:] == bytes(chunks[0].byte_array)
