"""The vLLM connector's scheduler side: looks up how many leading blocks of a prompt kvpool holds, notes where
vLLM puts them, and tells the workers, each step, which blocks to load and which completed blocks to save."""

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from kvpool.client import Client
from kvpool.errors import KvpoolError

from .block_keys import block_hashes
from .block_store import KVBlockStore
from .client_settings import client_settings
from .vllm_common import (BlockTransfer, ConnectorSettings, KVPoolConnectorMetadata, KVPoolWorkerMetadata,
                          namespace_for)

log = logging.getLogger(__name__)


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


def _salt(request) -> str:
    """A parent hash for what changes a prompt's KV besides its tokens (cache salt, LoRA adapter)."""
    lora = getattr(request, "lora_request", None)
    parts = [getattr(request, "cache_salt", None) or "", lora.lora_name if lora else ""]
    if not any(parts):
        return ""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


class KVPoolScheduler:
    def __init__(self, settings: ConnectorSettings, vllm_config, kv_cache_config):
        self._settings = settings
        self._client = Client(**client_settings(settings.extra, "in kv_connector_extra_config"))
        # The scheduler looks up every rank's blocks: a prefix counts only when all ranks can load it.
        self._stores = [KVBlockStore(self._client, namespace_for(vllm_config, kv_cache_config, rank))
                        for rank in range(settings.world)]
        self._requests: dict[str, _PromptState] = {}
        self._async_loads: list[BlockTransfer] = []  # for the next step's metadata

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        settings = self._settings
        state = self._state(request)
        if not settings.loads or state is None or state.moved.moved.get(request.request_id, {}).get("blocks_failed"):
            return 0, False  # after a failed load the request computes what it lacks (else: look up, fail again)
        # At least the last prompt token is always computed (its logits give the first output token).
        loadable = min((len(request.prompt_token_ids) - 1) // settings.block_size, state.prompt_blocks)
        try:
            found = min(store.lookup(state.hashes[:loadable], hold=settings.hold) for store in self._stores)
        except KvpoolError as exc:
            log.warning("kvpool lookup failed, computing the prompt: %s", exc)
            return 0, False
        state.found = found
        state.stored = max(state.stored, found)
        tokens = max(0, found * settings.block_size - num_computed_tokens)
        return tokens, settings.transfer_async and tokens > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        state = self._state(request)
        if state is None:
            return
        state.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens > 0:
            # The engine loads the found blocks beyond its own prefix cache hit (the hit and the load are whole
            # blocks: the lookup answered whole blocks past a block-aligned hit).
            end = state.found
            start = end - num_external_tokens // self._settings.block_size
            load = BlockTransfer(request.request_id, state.hashes[start:end], state.block_ids[start:end])
            if self._settings.transfer_async:
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

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        """sync: saves are done by now, so vLLM may free the blocks. async: a request with saves planned keeps
        its blocks until the worker reports them saved (get_finished). What kvpool moved for the request comes
        back in the output's kv_transfer_params["kvpool"] (async saves still under way are not counted)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        moved = state.moved.moved.get(request.request_id, {})
        return (self._settings.transfer_async and state.saving,
                {"kvpool": {"namespace": self._stores[0].namespace.prefix(), **moved}})

    def shutdown(self):
        self._client.close()

    def _state(self, request) -> _PromptState | None:
        """The request's tracked state, made on first sight; None for requests whose tokens do not name their
        KV (multimodal inputs)."""
        state = self._requests.get(request.request_id)
        if state is None and not request.mm_features and request.prompt_token_ids:
            salt = _salt(request)
            hashes = block_hashes(request.prompt_token_ids, self._settings.block_size, parent=salt)
            state = self._requests[request.request_id] = _PromptState(hashes, len(hashes), request, salt)
        return state

    def _plan_save(self, meta: KVPoolConnectorMetadata, req_id: str, state: _PromptState, computed: int):
        """Save the blocks this step completes that kvpool does not hold yet: the prompt's, and (with
        save_decode_blocks) those filled with generated tokens, named by the same chained hash."""
        if self._settings.save_decode and state.request is not None:
            self._extend_hashes(state, computed)
        done = min(computed // self._settings.block_size, len(state.hashes), len(state.block_ids))
        if self._settings.saves and done > state.stored:
            meta.saves.append(BlockTransfer(req_id, state.hashes[state.stored:done],
                                            state.block_ids[state.stored:done]))
            state.stored = done
            state.saving = True

    def _extend_hashes(self, state: _PromptState, computed: int) -> None:
        """Hash the full blocks of generated tokens whose KV is computed by the end of this step."""
        size = self._settings.block_size
        tokens = state.request.all_token_ids
        full = min(computed, len(tokens)) // size
        have = len(state.hashes)
        if full > have:
            parent = state.hashes[-1] if state.hashes else state.salt
            state.hashes.extend(block_hashes(list(tokens[have * size:full * size]), size, parent=parent))
