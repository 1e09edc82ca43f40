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
"async" (default) or "sync".

Scheduler side: get_num_new_matched_tokens asks kvpool, in one call, how many leading full blocks of the prompt
are stored; update_state_after_alloc notes where they go; build_connector_meta tells the worker which blocks to
load and which blocks this step completes and should be saved. A block of every layer is one kvpool object, sent
from the cache tensors and scattered back into them without a gather copy.

transfer "async": a request with blocks to load waits (vLLM's WAITING_FOR_REMOTE_KVS) while a worker thread loads
them, and the engine goes on stepping every other request meanwhile; get_finished tells the scheduler when it
may run. Saves are handed to the same thread when the step that filled the blocks ends, so no step waits for
kvpool; a finished request keeps its blocks (request_finished returns True) until they are saved.
transfer "sync": blocks load in start_load_kv before the forward pass that needs them, and wait_for_save stores
the completed blocks before the step returns. Either way, blocks that could not be loaded are reported through
get_block_ids_with_load_errors, and vLLM recomputes them.

Not layer by layer: a block of every layer is one object with one checksum, so no layer of it is handed to
attention before all of it is verified (and per-layer objects would multiply kvpool's operations by the number
of layers).
"""

import hashlib
import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
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

IDLE_WAIT = 0.05  # seconds an engine with nothing else to run waits for a load before its next (empty) step


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
    idle: bool = False  # the step runs no request: only transfers can make progress
    preempted: bool = False  # the step preempted requests: their blocks may be written from this step on


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
    load: BlockTransfer | None = None   # a synchronous load, sent with the step that schedules the request
    saving: bool = False                # a save was planned (async: vLLM must keep its blocks until it is done)
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
        self._async = transfer_mode(extra) == "async"
        self._client = Client(**client_settings(extra, "in kv_connector_extra_config"))
        parallel = vllm_config.parallel_config
        self._world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self._mover: ThreadPoolExecutor | None = None  # the worker's transfer thread (async mode)
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler looks up every rank's blocks: a prefix counts only when all ranks can load it.
            self._stores = [KVBlockStore(self._client, namespace_for(vllm_config, kv_cache_config, rank))
                            for rank in range(self._world)]
            self._requests: dict[str, _PromptState] = {}
            self._async_loads: list[BlockTransfer] = []  # for the next step's metadata
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
            rank = get_pp_group().rank_in_group * parallel.tensor_parallel_size + get_tensor_model_parallel_rank()
            self._namespace = namespace_for(vllm_config, kv_cache_config, rank)
            self._caches: list = []
            self._store: KVBlockStore | None = None
            self._load_errors: set[int] = set()
            self._moved = KVPoolWorkerMetadata()  # this step's, for the scheduler side
            # async: one thread moves blocks (and alone uses the client), in the order the steps asked.
            self._mover = ThreadPoolExecutor(1, thread_name_prefix="kvpool-blocks") if self._async else None
            self._loading: dict[str, list[tuple[Future, BlockTransfer]]] = {}
            self._saving: dict[str, list[Future]] = {}
            self._finished: set[str] = set()  # finished requests whose saves vLLM waits for
        log.info("kvpool connector: role %s, saves %s, loads %s, transfer %s", role.name, self._saves,
                 self._loads, "async" if self._async else "sync")

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        if not self._loads or state is None or state.moved.moved.get(request.request_id, {}).get("blocks_failed"):
            return 0, False  # after a failed load the request computes what it lacks (else: look up, fail again)
        # At least the last prompt token is always computed (its logits give the first output token).
        loadable = min((len(request.prompt_token_ids) - 1) // self._block_size, state.prompt_blocks)
        try:
            found = min(store.lookup(state.hashes[:loadable], hold=self._hold) for store in self._stores)
        except KvpoolError as exc:
            log.warning("kvpool lookup failed, computing the prompt: %s", exc)
            return 0, False
        state.found = found
        state.stored = max(state.stored, found)
        tokens = max(0, found * self._block_size - num_computed_tokens)
        return tokens, self._async and tokens > 0

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
            load = BlockTransfer(request.request_id, state.hashes[start:end], state.block_ids[start:end])
            if self._async:
                self._async_loads.append(load)  # the request waits, unscheduled, until it is loaded
            else:
                state.load = load

    def build_connector_meta(self, scheduler_output) -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata(loads=self._async_loads,
                                       idle=scheduler_output.total_num_scheduled_tokens == 0,
                                       preempted=bool(scheduler_output.preempted_req_ids))
        self._async_loads = []
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
        """sync: saves are done by now, so vLLM may free the blocks. async: a request with saves planned keeps
        its blocks until the worker reports them saved (get_finished). What kvpool moved for the request comes
        back in the output's kv_transfer_params["kvpool"] (async saves still under way are not counted)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        moved = state.moved.moved.get(request.request_id, {})
        return self._async and state.saving, {"kvpool": {"namespace": self._stores[0].namespace.prefix(), **moved}}

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
            state.saving = True

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
        if not isinstance(meta, KVPoolConnectorMetadata):
            return
        for load in meta.loads:
            if self._mover is not None:
                self._loading.setdefault(load.request_id, []).append((self._mover.submit(self._load, load), load))
            else:
                self._account(load, self._load(load))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # blocks are whole objects: loaded before the forward pass (sync) or before scheduling (async)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved once the step is done (wait_for_save)

    def wait_for_save(self):
        meta = self._connector_metadata
        if not isinstance(meta, KVPoolConnectorMetadata):
            return
        for save in meta.saves:
            if self._mover is not None:
                self._saving.setdefault(save.request_id, []).append(self._mover.submit(self._save, save))
            else:
                self._moved.add(save.request_id, self._save(save))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """async: the requests whose loads are done (they may run now; blocks that failed are reported with
        them), and the finished requests whose saves are done (vLLM may free their blocks)."""
        if self._mover is None:
            return None, None
        meta = self._connector_metadata
        if self._loading and isinstance(meta, KVPoolConnectorMetadata) and meta.idle:
            # Nothing else to run: wait here, briefly, rather than spin through empty steps that would keep the
            # loading thread from the interpreter.
            wait([f for loads in self._loading.values() for f, _ in loads], IDLE_WAIT, FIRST_COMPLETED)
        loaded = {request for request, loads in self._loading.items() if all(f.done() for f, _ in loads)}
        for request in loaded:
            for future, load in self._loading.pop(request):
                self._account(load, future.result())
        self._finished.update(request for request in finished_req_ids if request in self._saving)
        saved = {request for request in self._finished if all(f.done() for f in self._saving[request])}
        for request in saved:
            for future in self._saving.pop(request):
                self._moved.add(request, future.result())
        self._finished -= saved
        return saved or None, loaded or None

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """A preempted request's blocks are reused from this step on: finish the saves under way (they may read
        them) before the forward pass writes there. Steps without preemptions do not wait."""
        preempted = isinstance(kv_connector_metadata, KVPoolConnectorMetadata) and kv_connector_metadata.preempted
        if preempted and self._mover is not None and self._saving:
            for futures in self._saving.values():
                for future in futures:
                    future.result()

    def _load(self, load: BlockTransfer) -> int:
        """Scatter the blocks into the caches; how many leading ones were loaded (never raises)."""
        try:
            return self._store.load(load.hashes, load.block_ids, self._caches)
        except KvpoolError as exc:
            log.warning("kvpool: loading %d blocks of request %s failed: %s", len(load.hashes), load.request_id,
                        exc)
            return 0

    def _account(self, load: BlockTransfer, loaded: int) -> None:
        """Blocks past the loaded prefix are reported as load errors, so vLLM computes them."""
        self._load_errors.update(load.block_ids[loaded:])
        self._moved.add(load.request_id, {"blocks_loaded": loaded, "bytes_loaded": loaded * self._block_bytes,
                                          "blocks_failed": len(load.hashes) - loaded})
        log.info("kvpool: loaded %d of %d blocks (%d tokens) for request %s", loaded, len(load.hashes),
                 loaded * self._block_size, load.request_id)

    def _save(self, save: BlockTransfer) -> dict[str, int]:
        """Store the blocks kvpool does not hold yet; what was written (never raises: a block not saved is a
        later cache miss, not a failed request)."""
        try:
            written = self._store.save(save.hashes, save.block_ids, self._caches)
        except KvpoolError as exc:
            log.warning("kvpool: saving %d blocks of request %s failed: %s", len(save.hashes), save.request_id,
                        exc)
            return {}
        return {"blocks_saved": written, "bytes_saved": written * self._block_bytes}

    def build_connector_worker_meta(self) -> KVPoolWorkerMetadata | None:
        if not self._moved.moved:
            return None
        moved, self._moved = self._moved, KVPoolWorkerMetadata()
        return moved

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self):
        if self._mover is not None:
            self._mover.shutdown(wait=True)  # saves under way finish first
        self._client.close()


def transfer_mode(extra: dict) -> str:
    mode = str(extra.get("transfer", "async")).lower()
    if mode not in ("async", "sync"):
        raise ValueError(f'kv_connector_extra_config "transfer" must be "async" or "sync", not {mode!r}')
    return mode
