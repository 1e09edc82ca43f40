"""The vLLM connector's worker side: moves the blocks the scheduler names between the paged KV caches and
kvpool, per KV cache group, reports loads that failed so vLLM computes those blocks, and counts what it moved:
per request for the scheduler, per step for vLLM's stats.

Loads and saves never share a queue: loads run on their own thread and client (transfer "async"; in the step
with "sync"), and saves are copied out of the caches in the step that completed them and written by the save
queue's thread and client (save_queue.py), shed when the pool pushes back. A rank whose KV another rank also
holds (MLA, replicated KV heads: vllm_common.KVShard) reads its shard and leaves writing it to the first rank.
"""

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from kvpool.client import Client
from kvpool.errors import KvpoolError

from .block_store import KVBlockStore
from .client_settings import client_settings
from . import stream_order
from .paged_layout import block_bytes
from .save_queue import SaveQueue, Saved
from .transfer_stats import add_counts, is_empty
from .vllm_common import (BlockTransfer, ConnectorSettings, KVPoolConnectorMetadata, KVPoolWorkerMetadata,
                          hybrid_groups, namespace_for, shard_of)
from .vllm_stats import KVPoolConnectorStats

log = logging.getLogger(__name__)

IDLE_WAIT = 0.05  # seconds an engine with nothing else to run waits for a load before its next (empty) step
CLOSE_WAIT = 10.0  # seconds shutdown waits for staged saves to be written


class KVPoolWorker:
    def __init__(self, settings: ConnectorSettings, vllm_config, kv_cache_config):
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        self._settings = settings
        self._kv_cache_config = kv_cache_config
        self._groups = hybrid_groups(settings, vllm_config, kv_cache_config)
        self._shard = shard_of(vllm_config, get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)
        self._namespaces = [namespace_for(vllm_config, kv_cache_config, self._shard, group) for group in self._groups]
        options = client_settings(settings.extra, "in kv_connector_extra_config")
        self._client = Client(**options)  # loads
        self._saves = None
        if settings.saves and self._shard.writer:
            self._saves = SaveQueue(Client(**options), settings.save_buffer, background=settings.transfer_async)
        self._caches: list[list] = []       # per group: its layers' caches
        self._stores: list[KVBlockStore] = []
        self._block_bytes: list[int] = []   # per group: bytes of one stored block
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # requests whose load failed as a whole (hybrid models)
        self._moved = KVPoolWorkerMetadata()  # this step's, per request, for the scheduler side
        self._stats: dict = {}  # what moved since vLLM last asked (get_kv_connector_stats)
        # async: one thread loads blocks (and alone uses the loads' client), in the order the steps asked.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-loads") if settings.transfer_async else None
        self._loading: dict[str, list[tuple[Future, BlockTransfer]]] = {}

    def register_kv_caches(self, kv_caches: dict):
        num_blocks = self._kv_cache_config.num_blocks
        for group, namespace in zip(self._groups, self._namespaces):
            caches = []
            for name in group.layers:  # a state layer may hold several tensors (e.g. conv and SSM state)
                cache = kv_caches[name]
                caches.extend(cache if isinstance(cache, (list, tuple)) else [cache])
            first = caches[0]
            # (2, num_blocks, ...) keeps K and V apart; anything with the block index first is one slab per block.
            kv_first = group.kind != "state" and first.shape[0] == 2 and first.shape[1] == num_blocks != 2
            self._caches.append(caches)
            self._stores.append(KVBlockStore(self._client, namespace, kv_first=kv_first))
            self._block_bytes.append(block_bytes(caches, kv_first))
            log.info("kvpool connector: group %d (%s), %d layers, cache shape %s, blocks stored under %s%s",
                     group.index, group.kind, len(caches), tuple(first.shape), namespace.prefix(),
                     "" if self._shard.writer else " (read here, written by another rank)")

    def start_load_kv(self, meta: KVPoolConnectorMetadata) -> None:
        """async: hand each load to the loading thread (accounted once done, in transfer_results); sync: load
        now."""
        for load in meta.loads:
            if self._loader is None:
                self._account_load(load.request_id, [(load, *self._timed_load(load))])
                continue
            # What the engine's stream holds now (the kernels that last read blocks a load overwrites) comes
            # first on the loader's stream.
            ready = stream_order.mark(self._caches[load.group])
            self._loading.setdefault(load.request_id, []).append(
                (self._loader.submit(self._ordered, ready, load), load))

    def wait_for_save(self, meta: KVPoolConnectorMetadata) -> None:
        """Copy the blocks this step completed out of the caches, to be written in the background (sync: now)."""
        if self._saves is None:
            return
        for save in meta.saves:
            store = self._stores[save.group]
            self._saves.stage(save, store.keys(save.hashes), save.block_ids, self._caches[save.group],
                              store.kv_first, self._block_bytes[save.group])

    def _ordered(self, ready, load: BlockTransfer) -> tuple:
        """The load on the loader's thread after `ready`; its outcome and an event after its copies."""
        stream_order.follow(ready)
        outcome = self._timed_load(load)
        return outcome, stream_order.mark(self._caches[load.group])

    @staticmethod
    def _outcome(future: Future) -> tuple:
        """A load's outcome on the loader's thread, once the engine's stream waits for its copies."""
        outcome, moved = future.result()
        stream_order.follow(moved)
        return outcome

    def transfer_results(self, meta) -> tuple[set[str], set[str]]:
        """async: the requests whose loads are done (they may run now), and those of them whose load failed
        as a whole (a hybrid model's: vLLM computes all of it). Saves done are accounted for here too."""
        self._account_saves()
        if self._loader is None:
            return set(), set()
        if self._loading and isinstance(meta, KVPoolConnectorMetadata) and meta.idle:
            # Nothing else to run: wait here, briefly, rather than spin through empty steps that would keep the
            # loading thread from the interpreter.
            wait([f for loads in self._loading.values() for f, _ in loads], IDLE_WAIT, FIRST_COMPLETED)
        loaded = {request for request, loads in self._loading.items() if all(f.done() for f, _ in loads)}
        for request in loaded:
            self._account_load(request, [(load, *self._outcome(future)) for future, load in self._loading.pop(request)])
        failed, self._failed_loads = self._failed_loads, set()
        return loaded, failed

    def _timed_load(self, load: BlockTransfer) -> tuple[int, float]:
        began = time.perf_counter()
        try:
            loaded = self._stores[load.group].load(load.hashes, load.block_ids, self._caches[load.group])
        except KvpoolError as exc:
            log.warning("kvpool: loading %d blocks of request %s failed: %s", len(load.hashes), load.request_id,
                        exc)
            loaded = 0
        return loaded, time.perf_counter() - began

    def _account_load(self, request_id: str, outcomes: list[tuple[BlockTransfer, int, float]]) -> None:
        """One request's loads, all groups. One group: blocks past the loaded prefix are reported as load
        errors, so vLLM computes them. Several: a hit needs every group's part, so a load short in any group
        fails the request's load as a whole (vLLM cannot take block errors of several groups) and vLLM
        computes the prompt."""
        whole = all(loaded == len(load.hashes) for load, loaded, _ in outcomes)
        counts = {"loads": 1, "load_seconds": sum(seconds for _, _, seconds in outcomes)}
        for load, loaded, _ in outcomes:
            if len(self._groups) == 1:
                self._load_errors.update(load.block_ids[loaded:])
            elif not whole:
                loaded = 0
            add_counts(counts, {"blocks_loaded": loaded, "bytes_loaded": loaded * self._block_bytes[load.group],
                                "blocks_failed": len(load.hashes) - loaded})
            if len(self._groups) > 1:
                add_counts(counts, {f"blocks_loaded_g{load.group}": loaded})
        if not whole and len(self._groups) > 1:
            self._failed_loads.add(request_id)
        self._moved.add(request_id, {k: v for k, v in counts.items() if k not in ("loads", "load_seconds")})
        add_counts(self._stats, counts)
        log.info("kvpool: loaded %d of %d blocks for request %s", counts.get("blocks_loaded", 0),
                 counts.get("blocks_loaded", 0) + counts.get("blocks_failed", 0), request_id)

    def _account_saves(self) -> None:
        if self._saves is None:
            return
        for saved in self._saves.outcomes():
            self._account_save(saved)

    def _account_save(self, saved: Saved) -> None:
        save: BlockTransfer = saved.tag
        size = self._block_bytes[save.group]
        counts = {"blocks_saved": saved.written or 0, "bytes_saved": (saved.written or 0) * size}
        self._moved.add(save.request_id, counts)
        add_counts(self._stats, {**counts, "blocks_save_shed": saved.shed,
                                 **({"saves": 1, "save_seconds": saved.seconds,
                                     "blocks_save_failed": saved.blocks if saved.written is None else 0}
                                    if saved.blocks else {})})

    def build_connector_worker_meta(self) -> KVPoolWorkerMetadata | None:
        if not self._moved.moved:
            return None
        moved, self._moved = self._moved, KVPoolWorkerMetadata()
        return moved

    def get_kv_connector_stats(self) -> KVPoolConnectorStats | None:
        """What moved since the last call (vLLM asks after every step), or None when nothing did."""
        if is_empty(self._stats):
            return None
        stats, self._stats = KVPoolConnectorStats(data=self._stats), {}
        return stats

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self):
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._saves is not None:
            self._saves.close(CLOSE_WAIT)  # staged saves are written first
        self._client.close()
