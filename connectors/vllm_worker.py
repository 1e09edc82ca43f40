"""The vLLM connector's worker side: moves the blocks the scheduler names between the paged KV caches and
kvpool (in a thread with transfer "async", in the step with "sync"), reports blocks it could not load so vLLM
computes them, and counts what it moved: per request for the scheduler, per step for vLLM's stats."""

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from kvpool.client import Client
from kvpool.errors import KvpoolError

from .block_store import KVBlockStore
from .client_settings import client_settings
from . import stream_order
from .paged_layout import block_bytes
from .transfer_stats import add_counts, is_empty
from .vllm_common import (BlockTransfer, ConnectorSettings, KVPoolConnectorMetadata, KVPoolWorkerMetadata,
                          namespace_for)
from .vllm_stats import KVPoolConnectorStats

log = logging.getLogger(__name__)

IDLE_WAIT = 0.05  # seconds an engine with nothing else to run waits for a load before its next (empty) step


class KVPoolWorker:
    def __init__(self, settings: ConnectorSettings, vllm_config, kv_cache_config):
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        self._settings = settings
        self._kv_cache_config = kv_cache_config
        self._client = Client(**client_settings(settings.extra, "in kv_connector_extra_config"))
        tensor_parallel = vllm_config.parallel_config.tensor_parallel_size
        rank = get_pp_group().rank_in_group * tensor_parallel + get_tensor_model_parallel_rank()
        self._namespace = namespace_for(vllm_config, kv_cache_config, rank)
        self._caches: list = []
        self._store: KVBlockStore | None = None
        self._block_bytes = 0
        self._load_errors: set[int] = set()
        self._moved = KVPoolWorkerMetadata()  # this step's, per request, for the scheduler side
        self._stats: dict = {}  # what moved since vLLM last asked (get_kv_connector_stats)
        # async: one thread moves blocks (and alone uses the client), in the order the steps asked.
        self._mover = ThreadPoolExecutor(1, thread_name_prefix="kvpool-blocks") if settings.transfer_async else None
        self._loading: dict[str, list[tuple[Future, BlockTransfer]]] = {}
        self._saving: dict[str, list[tuple[Future, BlockTransfer]]] = {}
        self._finished: set[str] = set()  # finished requests whose saves vLLM waits for

    def register_kv_caches(self, kv_caches: dict):
        self._caches = list(kv_caches.values())
        num_blocks = self._kv_cache_config.num_blocks
        first = self._caches[0]
        # (2, num_blocks, ...) keeps K and V apart; anything with the block index first is one slab per block.
        kv_first = first.shape[0] == 2 and first.shape[1] == num_blocks and num_blocks != 2
        self._store = KVBlockStore(self._client, self._namespace, kv_first=kv_first)
        self._block_bytes = block_bytes(self._caches, kv_first)
        log.info("kvpool connector: %d layers, cache shape %s, blocks stored under %s", len(self._caches),
                 tuple(first.shape), self._namespace.prefix())

    def start_load_kv(self, meta: KVPoolConnectorMetadata) -> None:
        self._move(meta.loads, self._timed_load, self._loading, self._account_load)

    def wait_for_save(self, meta: KVPoolConnectorMetadata) -> None:
        self._move(meta.saves, self._timed_save, self._saving, self._account_save)

    def _move(self, transfers: list[BlockTransfer], timed, under_way: dict, account) -> None:
        """async: hand each transfer to the mover thread (accounted once done, in get_finished); sync: run it and
        account for it now."""
        for transfer in transfers:
            if self._mover is not None:
                # What the engine's stream holds now (the kernels that wrote blocks to save, or last read blocks
                # a load overwrites) comes first on the mover's stream.
                ready = stream_order.mark(self._caches)
                under_way.setdefault(transfer.request_id, []).append(
                    (self._mover.submit(self._ordered, ready, timed, transfer), transfer))
            else:
                account(transfer, *timed(transfer))

    def _ordered(self, ready, timed, transfer) -> tuple:
        """timed(transfer) on the mover's thread after `ready`; its outcome and an event after its copies."""
        stream_order.follow(ready)
        outcome = timed(transfer)
        return outcome, stream_order.mark(self._caches)

    @staticmethod
    def _outcome(future: Future) -> tuple:
        """A transfer's outcome on the mover's thread, once the engine's stream waits for its copies."""
        outcome, moved = future.result()
        stream_order.follow(moved)
        return outcome

    def get_finished(self, finished_req_ids: set[str], meta) -> tuple[set[str] | None, set[str] | None]:
        """async: the requests whose loads are done (they may run now; blocks that failed are reported with
        them), and the finished requests whose saves are done (vLLM may free their blocks)."""
        if self._mover is None:
            return None, None
        if self._loading and isinstance(meta, KVPoolConnectorMetadata) and meta.idle:
            # Nothing else to run: wait here, briefly, rather than spin through empty steps that would keep the
            # loading thread from the interpreter.
            wait([f for loads in self._loading.values() for f, _ in loads], IDLE_WAIT, FIRST_COMPLETED)
        loaded = {request for request, loads in self._loading.items() if all(f.done() for f, _ in loads)}
        for request in loaded:
            for future, load in self._loading.pop(request):
                self._account_load(load, *self._outcome(future))
        self._finished.update(request for request in finished_req_ids if request in self._saving)
        saved = {request for request in self._finished if all(f.done() for f, _ in self._saving[request])}
        for request in saved:
            for future, save in self._saving.pop(request):
                self._account_save(save, *self._outcome(future))
        self._finished -= saved
        return saved or None, loaded or None

    def handle_preemptions(self, meta) -> None:
        """A preempted request's blocks are reused from this step on: finish the saves under way (they may read
        them) before the forward pass writes there. Steps without preemptions do not wait."""
        preempted = isinstance(meta, KVPoolConnectorMetadata) and meta.preempted
        if preempted and self._mover is not None and self._saving:
            for saves in self._saving.values():
                for future, _ in saves:
                    future.result()

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
        if self._mover is not None:
            self._mover.shutdown(wait=True)  # saves under way finish first
        self._client.close()

    def _timed_load(self, load: BlockTransfer) -> tuple[int, float]:
        began = time.perf_counter()
        loaded = self._load(load)
        return loaded, time.perf_counter() - began

    def _load(self, load: BlockTransfer) -> int:
        """Scatter the blocks into the caches; how many leading ones were loaded (never raises)."""
        try:
            return self._store.load(load.hashes, load.block_ids, self._caches)
        except KvpoolError as exc:
            log.warning("kvpool: loading %d blocks of request %s failed: %s", len(load.hashes), load.request_id,
                        exc)
            return 0

    def _account_load(self, load: BlockTransfer, loaded: int, seconds: float) -> None:
        """Blocks past the loaded prefix are reported as load errors, so vLLM computes them."""
        self._load_errors.update(load.block_ids[loaded:])
        counts = {"blocks_loaded": loaded, "bytes_loaded": loaded * self._block_bytes,
                  "blocks_failed": len(load.hashes) - loaded}
        self._moved.add(load.request_id, counts)
        add_counts(self._stats, {**counts, "loads": 1, "load_seconds": seconds})
        log.info("kvpool: loaded %d of %d blocks (%d tokens) for request %s", loaded, len(load.hashes),
                 loaded * self._settings.block_size, load.request_id)

    def _timed_save(self, save: BlockTransfer) -> tuple[int | None, float]:
        began = time.perf_counter()
        written = self._save(save)
        return written, time.perf_counter() - began

    def _save(self, save: BlockTransfer) -> int | None:
        """Store the blocks kvpool does not hold yet; how many were written, None if the save failed (never
        raises: a block not saved is a later cache miss, not a failed request)."""
        try:
            return self._store.save(save.hashes, save.block_ids, self._caches)
        except KvpoolError as exc:
            log.warning("kvpool: saving %d blocks of request %s failed: %s", len(save.hashes), save.request_id,
                        exc)
            return None

    def _account_save(self, save: BlockTransfer, written: int | None, seconds: float) -> None:
        counts = {} if written is None else {"blocks_saved": written, "bytes_saved": written * self._block_bytes}
        self._moved.add(save.request_id, counts)
        failed = len(save.hashes) if written is None else 0
        add_counts(self._stats, {**counts, "saves": 1, "save_seconds": seconds, "blocks_save_failed": failed})
