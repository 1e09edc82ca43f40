"""vLLM v1 KV connector: prompt blocks go to kvpool after prefill, and any later engine loads them instead of
computing them (prefill/decode disaggregation, prefix reuse across engines).

Enable it with
    --kv-transfer-config '{"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"master": "HOST:PORT"}}'
kv_role: kv_producer saves, kv_consumer loads, kv_both does both. Extra config: "master" or "etcd" (+ "cluster"),
"transports", "token_file", "tls_ca" as kvpool.Client takes them; "model_id" (the name blocks are stored under; default the
served model name); "hold_seconds" (how long a lookup keeps the found blocks from eviction until they are
loaded, default 30); "save_decode_blocks" (default true: blocks filled with generated tokens are saved too, so
the next turn of a conversation, whose prompt holds this answer, loads it instead of computing it).

Scheduler side: get_num_new_matched_tokens asks kvpool, in one call, how many leading full blocks of the prompt
are stored; update_state_after_alloc notes where they go; build_connector_meta tells the worker which blocks to
load this step and which prompt blocks this step completes and should be saved. Worker side: start_load_kv
scatters the blocks into the paged caches before the forward pass; wait_for_save stores the completed blocks
after it (a block of every layer is one kvpool object, sent from the cache tensors without a gather copy).
Blocks that could not be loaded are reported through get_block_ids_with_load_errors, so vLLM recomputes them.
"""

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvpool.client import Client
from kvpool.errors import KvpoolError

from .block_keys import BlockNamespace, block_hashes
from .block_store import KVBlockStore
from .client_settings import client_settings
from .paged_layout import block_parts

log = logging.getLogger(__name__)


@dataclass
class BlockTransfer:
    """Blocks of one request to move: their prefix hashes and where they sit in the paged caches."""
    request_id: str
    hashes: list[str]
    block_ids: list[int]


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers moved this step, per request: blocks_loaded, bytes_loaded, blocks_failed (found but not
    loadable: recomputed), blocks_saved, bytes_saved."""
    moved: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, request_id: str, counts: dict[str, int]):
        mine = self.moved.setdefault(request_id, {})
        for name, value in counts.items():
            mine[name] = mine.get(name, 0) + value

    def aggregate(self, other: "KVPoolWorkerMetadata") -> "KVPoolWorkerMetadata":
        for request_id, counts in other.moved.items():
            self.add(request_id, counts)
        return self


@dataclass
class _PromptState:
    """What the scheduler side tracks for a request until it finishes."""
    hashes: list[str]               # every full block of the prompt, then of the tokens generated after it
    prompt_blocks: int = 0          # how many of `hashes` are the prompt's
    request: Any = None             # the scheduler's request (its all_token_ids grows as tokens are generated)
    salt: str = ""
    found: int = 0                  # leading blocks the last lookup found in kvpool
    stored: int = 0                 # leading blocks known to be in kvpool (found, or planned to be saved)
    block_ids: list[int] = field(default_factory=list)
    load: BlockTransfer | None = None
    moved: KVPoolWorkerMetadata = field(default_factory=KVPoolWorkerMetadata)  # reported back by the workers


def namespace_for(vllm_config, kv_cache_config, rank: int) -> BlockNamespace:
    """Everything that shapes a block's bytes, so that only an engine with the same model, dtype, cache layout,
    block size and sharding ever loads a block another one saved."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"KVPoolConnector supports models with one KV cache group, this one has {len(groups)}")
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    name = extra.get("model_id") or model.served_model_name or model.model
    if isinstance(name, (list, tuple)):
        name = name[0]
    spec = groups[0].kv_cache_spec
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = str(model.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    layout = f"vllm-{kv_cache_config.kv_cache_layout or 'default'}-page{spec.page_size_bytes}"
    world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    heads = f"{model.get_num_kv_heads(parallel)}of{model.get_total_num_kv_heads()}"
    return BlockNamespace(str(name).strip("/").replace("/", "_"), dtype, layout, spec.block_size, heads, rank,
                          world)


def _salt(request) -> str:
    """A parent hash for what changes a prompt's KV besides its tokens (cache salt, LoRA adapter)."""
    lora = getattr(request, "lora_request", None)
    parts = [getattr(request, "cache_salt", None) or "", lora.lora_name if lora else ""]
    if not any(parts):
        return ""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


class KVPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        extra = transfer.kv_connector_extra_config or {}
        self._saves = transfer.is_kv_producer
        self._loads = transfer.is_kv_consumer
        self._hold = float(extra.get("hold_seconds", 30))
        self._save_decode = str(extra.get("save_decode_blocks", True)).lower() not in ("false", "0", "no")
        self._block_size = vllm_config.cache_config.block_size
        self._client = Client(**client_settings(extra, "in kv_connector_extra_config"))
        parallel = vllm_config.parallel_config
        self._world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler looks up every rank's blocks: a prefix counts only when all ranks can load it.
            self._stores = [KVBlockStore(self._client, namespace_for(vllm_config, kv_cache_config, rank))
                            for rank in range(self._world)]
            self._requests: dict[str, _PromptState] = {}
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
            rank = get_pp_group().rank_in_group * parallel.tensor_parallel_size + get_tensor_model_parallel_rank()
            self._namespace = namespace_for(vllm_config, kv_cache_config, rank)
            self._caches: list = []
            self._store: KVBlockStore | None = None
            self._load_errors: set[int] = set()
            self._moved = KVPoolWorkerMetadata()  # this step's, for the scheduler side
        log.info("kvpool connector: role %s, saves %s, loads %s", role.name, self._saves, self._loads)

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        if not self._loads or state is None:
            return 0, False
        # At least the last prompt token is always computed (its logits give the first output token).
        loadable = min((len(request.prompt_token_ids) - 1) // self._block_size, state.prompt_blocks)
        try:
            found = min(store.lookup(state.hashes[:loadable], hold=self._hold) for store in self._stores)
        except KvpoolError as exc:
            log.warning("kvpool lookup failed, computing the prompt: %s", exc)
            return 0, False
        state.found = found
        state.stored = max(state.stored, found)
        return max(0, found * self._block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        state = self._state(request)
        if state is None:
            return
        state.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens > 0:
            # The engine loads the found blocks beyond its own prefix cache hit (the hit and the load are whole
            # blocks: the lookup answered whole blocks past a block-aligned hit).
            end = state.found
            start = end - num_external_tokens // self._block_size
            state.load = BlockTransfer(request.request_id, state.hashes[start:end], state.block_ids[start:end])

    def build_connector_meta(self, scheduler_output) -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if state.load is not None:
                meta.loads.append(state.load)
                state.load = None
            self._plan_save(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = list(new_ids[0])
                else:
                    state.block_ids.extend(new_ids[0])
            if state.load is not None:  # resumed after preemption with blocks to load again
                meta.loads.append(state.load)
                state.load = None
            self._plan_save(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def update_connector_output(self, connector_output):
        moved = connector_output.kv_connector_worker_meta
        if isinstance(moved, KVPoolWorkerMetadata):
            for request_id, counts in moved.moved.items():
                if request_id in self._requests:
                    self._requests[request_id].moved.add(request_id, counts)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are done by now (wait_for_save is synchronous), so vLLM may free the blocks. What kvpool moved
        for the request comes back in the output's kv_transfer_params["kvpool"]."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        moved = state.moved.moved.get(request.request_id, {})
        return False, {"kvpool": {"namespace": self._stores[0].namespace.prefix(), **moved}}

    def _state(self, request) -> _PromptState | None:
        """The request's tracked state, made on first sight; None for requests whose tokens do not name their
        KV (multimodal inputs)."""
        state = self._requests.get(request.request_id)
        if state is None and not request.mm_features and request.prompt_token_ids:
            salt = _salt(request)
            hashes = block_hashes(request.prompt_token_ids, self._block_size, parent=salt)
            state = self._requests[request.request_id] = _PromptState(hashes, len(hashes), request, salt)
        return state

    def _plan_save(self, meta: KVPoolConnectorMetadata, req_id: str, state: _PromptState, computed: int):
        """Save the blocks this step completes that kvpool does not hold yet: the prompt's, and (with
        save_decode_blocks) those filled with generated tokens, named by the same chained hash."""
        if self._save_decode and state.request is not None:
            self._extend_hashes(state, computed)
        done = min(computed // self._block_size, len(state.hashes), len(state.block_ids))
        if self._saves and done > state.stored:
            meta.saves.append(BlockTransfer(req_id, state.hashes[state.stored:done],
                                            state.block_ids[state.stored:done]))
            state.stored = done

    def _extend_hashes(self, state: _PromptState, computed: int) -> None:
        """Hash the full blocks of generated tokens whose KV is computed by the end of this step."""
        tokens = state.request.all_token_ids
        full = min(computed, len(tokens)) // self._block_size
        have = len(state.hashes)
        if full > have:
            parent = state.hashes[-1] if state.hashes else state.salt
            state.hashes.extend(block_hashes(list(tokens[have * self._block_size:full * self._block_size]),
                                             self._block_size, parent=parent))

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict):
        self._caches = list(kv_caches.values())
        num_blocks = self._kv_cache_config.num_blocks
        first = self._caches[0]
        # (2, num_blocks, ...) keeps K and V apart; anything with the block index first is one slab per block.
        kv_first = first.shape[0] == 2 and first.shape[1] == num_blocks and num_blocks != 2
        self._store = KVBlockStore(self._client, self._namespace, kv_first=kv_first)
        self._block_bytes = sum(part.nbytes for part in block_parts(self._caches, 0, kv_first))
        log.info("kvpool connector: %d layers, cache shape %s, blocks stored under %s", len(self._caches),
                 tuple(first.shape), self._namespace.prefix())

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVPoolConnectorMetadata) or not meta.loads:
            return
        for load in meta.loads:
            try:
                loaded = self._store.load(load.hashes, load.block_ids, self._caches)
            except KvpoolError as exc:
                log.warning("kvpool: loading %d blocks of request %s failed: %s", len(load.hashes),
                            load.request_id, exc)
                loaded = 0
            self._load_errors.update(load.block_ids[loaded:])
            self._moved.add(load.request_id, {"blocks_loaded": loaded, "bytes_loaded": loaded * self._block_bytes,
                                              "blocks_failed": len(load.hashes) - loaded})
            log.info("kvpool: loaded %d of %d blocks (%d tokens) for request %s", loaded, len(load.hashes),
                     loaded * self._block_size, load.request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved once the forward pass is done (wait_for_save)

    def wait_for_save(self):
        meta = self._connector_metadata
        if not isinstance(meta, KVPoolConnectorMetadata):
            return
        for save in meta.saves:
            try:
                written = self._store.save(save.hashes, save.block_ids, self._caches)
            except KvpoolError as exc:  # a block not saved is a later cache miss, not a failed request
                log.warning("kvpool: saving %d blocks of request %s failed: %s", len(save.hashes),
                            save.request_id, exc)
                continue
            self._moved.add(save.request_id, {"blocks_saved": written, "bytes_saved": written * self._block_bytes})

    def build_connector_worker_meta(self) -> KVPoolWorkerMetadata | None:
        if not self._moved.moved:
            return None
        moved, self._moved = self._moved, KVPoolWorkerMetadata()
        return moved

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self):
        self._client.close()
