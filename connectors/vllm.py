"""vLLM v1 KV connector: prompt blocks go to kvpool after prefill, and any later engine loads them instead of
computing them (prefill/decode disaggregation, prefix reuse across engines).

Enable it with
    --kv-transfer-config '{"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"master": "HOST:PORT"}}'
kv_role: kv_producer saves, kv_consumer loads, kv_both does both. Extra config: "master" or "etcd" (+ "cluster"),
"transports", "token_file", "tls_ca" as kvpool.Client takes them; "model_id" (the name blocks are stored under;
default the served model name); "hold_seconds" (how long a lookup keeps the found blocks from eviction until they are
loaded, default 30); "save_decode_blocks" (default true: blocks filled with generated tokens are saved too, so
the next turn of a conversation, whose prompt holds this answer, loads it instead of computing it); "transfer":
"async" (default) or "sync"; "save_buffer_mb" (how much memory completed blocks waiting to be written may take,
default 256: past it, saves are shed).

Every KV cache group of the model is stored (full attention, MLA, sliding window, chunked local attention, and
Mamba / linear-attention state with vLLM's --mamba-cache-mode align), each in its own namespace, with vLLM's
hybrid KV cache manager kept on (the connector declares SupportsHMA): a hit counts only as far as every group
has what the next token needs (all blocks; the window's; the state at the hit's end: kv_groups.py).

Scheduler side: get_num_new_matched_tokens asks kvpool, in one call for every rank and group, how many leading
full blocks of the prompt are stored; update_state_after_alloc notes where they go; build_connector_meta tells
the worker which blocks to load and which blocks this step completes and should be saved. A block of every
layer of a group is one kvpool object, sent from the cache tensors and scattered back into them without a
gather copy. Ranks holding the same KV (MLA, replicated KV heads) share one copy: the first writes it.

transfer "async": a request with blocks to load waits (vLLM's WAITING_FOR_REMOTE_KVS) while a loading thread
loads them, and the engine goes on stepping every other request meanwhile; get_transfer_results tells the
scheduler when it may run. Saves never hold a load up: the blocks a step completes are copied out of the caches
in that step, into a bounded buffer, and written by another thread on another client, coalesced across
requests and steps; when the pool refuses puts for space or they run past their deadline, saves are shed for
a while (blocks_save_shed) instead of queueing (save_queue.py). vLLM may free a request's blocks as soon as it
finishes. transfer "sync" (models with one KV cache group): blocks load in start_load_kv before the forward pass
that needs them, and wait_for_save stores the completed blocks before the step returns. Blocks that could not
be loaded are reported through get_block_ids_with_load_errors (one group) or the request's whole load as
failed (several groups: vLLM takes no block errors for them), and vLLM recomputes them.

Built as vLLM's own OffloadingConnector is: this class is the facade vLLM loads (keep its name and module path,
users' configs name them); the scheduler side is `vllm_scheduler.py`, the worker side `vllm_worker.py`, what they
share `vllm_common.py`. What moved (loads, blocks and bytes loaded, blocks failed, load time, the same for saves,
saves shed) reaches vLLM as KVConnectorStats (`vllm_stats.py`): summed across workers, logged as "KV Transfer
metrics", and counted in Prometheus as vllm:kvpool_<count> (with log stats on).

Not layer by layer: a block of every layer is one object with one checksum, so no layer of it is handed to
attention before all of it is verified (and per-layer objects would multiply kvpool's operations by the number
of layers).
"""

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                              KVConnectorTransferResults, SupportsHMA)

from .vllm_common import ConnectorSettings, KVPoolConnectorMetadata, KVPoolWorkerMetadata
from .vllm_scheduler import KVPoolScheduler
from .vllm_stats import KVPoolConnectorStats, KVPoolPromMetrics
from .vllm_worker import KVPoolWorker

log = logging.getLogger(__name__)

__all__ = ["KVPoolConnector", "KVPoolConnectorMetadata", "KVPoolWorkerMetadata"]


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """Hands each hook to the side of the connector that vLLM built this instance for."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_vllm(vllm_config)
        self.connector_scheduler: KVPoolScheduler | None = None
        self.connector_worker: KVPoolWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVPoolScheduler(settings, vllm_config, kv_cache_config)
        else:
            self.connector_worker = KVPoolWorker(settings, vllm_config, kv_cache_config)
        log.info("kvpool connector: role %s, saves %s, loads %s, transfer %s", role.name, settings.saves,
                 settings.loads, "async" if settings.transfer_async else "sync")

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVPoolConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict):
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if isinstance(self._connector_metadata, KVPoolConnectorMetadata):
            self.connector_worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # blocks are whole objects: loaded before the forward pass (sync) or before scheduling (async)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved once the step is done (wait_for_save)

    def wait_for_save(self):
        if isinstance(self._connector_metadata, KVPoolConnectorMetadata):
            self.connector_worker.wait_for_save(self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        loaded, failed = self.connector_worker.transfer_results(self._connector_metadata)
        return KVConnectorTransferResults(finished_recving=loaded, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    def build_connector_worker_meta(self) -> KVPoolWorkerMetadata | None:
        return self.connector_worker.build_connector_worker_meta() if self.connector_worker else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.get_block_ids_with_load_errors()

    # ---------------------------------------------------------------- both sides

    def get_kv_connector_stats(self) -> KVPoolConnectorStats | None:
        """The workers' transfer counts since the last step (the scheduler side moves nothing)."""
        return self.connector_worker.get_kv_connector_stats() if self.connector_worker else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPoolConnectorStats:
        return KVPoolConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVPoolPromMetrics:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        for side in (self.connector_worker, self.connector_scheduler):
            if side is not None:
                side.shutdown()
