"""The vLLM connector's scheduler side: looks up how many leading blocks of a prompt kvpool holds, notes where
vLLM puts them, and tells the workers, each step, which blocks to load and which completed blocks to save, per
KV cache group (kv_groups: what each group needs for a hit, and which of its blocks a step completes)."""

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from kvpool.client import Client
from kvpool.errors import KvpoolError

from .block_keys import block_hashes
from .client_settings import client_settings
from .kv_groups import longest_hit, saved_positions
from .vllm_common import (BlockTransfer, ConnectorSettings, KVPoolConnectorMetadata, KVPoolWorkerMetadata, KVShard,
                          hybrid_groups, namespace_for, shard_of)

log = logging.getLogger(__name__)


@dataclass
class _PromptState:
    """What the scheduler side tracks for a request until it finishes."""
    hashes: list[str]               # every full block of the prompt, then of the tokens generated after it
    groups: int                     # KV cache groups
    prompt_blocks: int = 0          # how many of `hashes` are the prompt's
    request: Any = None             # the scheduler's request (its all_token_ids grows as tokens are generated)
    salt: str = ""
    found: int = 0                  # leading blocks the last lookup found in kvpool (a hit in every group)
    lookups: int = 0                # lookups made for the request (one round trip each, all ranks and groups)
    stored: list[int] = field(default_factory=list)      # per group: leading blocks in kvpool, or passed by
    block_ids: list[list[int]] = field(default_factory=list)  # per group: the request's blocks in the caches
    load: list[BlockTransfer] = field(default_factory=list)   # a synchronous load, sent with the next step
    moved: KVPoolWorkerMetadata = field(default_factory=KVPoolWorkerMetadata)  # reported back by the workers

    def __post_init__(self):
        self.stored = [0] * self.groups
        self.block_ids = [[] for _ in range(self.groups)]


NULL_BLOCK = 0  # vLLM's placeholder in a group's block table for a block it does not keep (out of a window)


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
        self._groups = hybrid_groups(settings, vllm_config, kv_cache_config)
        # Every distinct KV shard's blocks of every group, looked up in one round trip: a prefix counts only
        # when every rank can load it.
        shards = shard_of(vllm_config, 0, 0).count
        self._namespaces = [[namespace_for(vllm_config, kv_cache_config, KVShard(index, shards, False), group)
                             for group in self._groups] for index in range(shards)]
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
            found = self._lookup(state.hashes[:loadable], settings.hold) if loadable else 0
        except KvpoolError as exc:
            log.warning("kvpool lookup failed, computing the prompt: %s", exc)
            return 0, False
        state.lookups += 1
        state.found = found
        state.stored = [max(stored, found) for stored in state.stored]
        tokens = max(0, found * settings.block_size - num_computed_tokens)
        return tokens, settings.transfer_async and tokens > 0

    def _lookup(self, hashes: list[str], hold: float) -> int:
        """The longest hit every shard has for every group, from one batch_exists of all their keys."""
        keys = [namespace.key(h) for shard in self._namespaces for namespace in shard for h in hashes]
        there = self._client.batch_exists(keys, hold=hold)
        count, at, hits = len(hashes), 0, []
        for shard in self._namespaces:
            present = []
            for _ in shard:
                present.append(there[at:at + count])
                at += count
            hits.append(longest_hit(self._groups, present, count))
        return min(hits)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        state = self._state(request)
        if state is None:
            return
        state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if num_external_tokens > 0:
            # The engine loads the found blocks beyond its own prefix cache hit (the hit and the load are whole
            # blocks: the lookup answered whole blocks past a block-aligned hit), of each group what it needs.
            end = state.found
            start = end - num_external_tokens // self._settings.block_size
            loads = []
            for group, ids in zip(self._groups, state.block_ids):
                wanted = [at for at in group.needed(start, end) if at < len(ids) and ids[at] != NULL_BLOCK]
                if wanted:
                    loads.append(BlockTransfer(request.request_id, [state.hashes[at] for at in wanted],
                                               [ids[at] for at in wanted], group.index))
            if self._settings.transfer_async:
                self._async_loads.extend(loads)  # the request waits, unscheduled, until it is loaded
            else:
                state.load = loads

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
            state.block_ids = [list(ids) for ids in new.block_ids]
            meta.loads.extend(state.load)
            state.load = []
            self._plan_save(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = [list(ids) for ids in new_ids]
                else:
                    for ids, more in zip(state.block_ids, new_ids):
                        ids.extend(more)
            meta.loads.extend(state.load)  # resumed after preemption with blocks to load again
            state.load = []
            self._plan_save(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def update_connector_output(self, connector_output):
        moved = connector_output.kv_connector_worker_meta
        if isinstance(moved, KVPoolWorkerMetadata):
            for request_id, counts in moved.moved.items():
                if request_id in self._requests:
                    self._requests[request_id].moved.add(request_id, counts)

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        """vLLM may free the request's blocks at once: the saves it planned copied them out in their step. What
        kvpool moved for the request comes back in the output's kv_transfer_params["kvpool"] (saves still being
        written are not counted)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        moved = state.moved.moved.get(request.request_id, {})
        return False, {"kvpool": {"namespace": self._namespaces[0][0].prefix(), "lookups": state.lookups,
                                  "namespaces": [namespace.prefix() for namespace in self._namespaces[0]], **moved}}

    def shutdown(self):
        self._client.close()

    def _state(self, request) -> _PromptState | None:
        """The request's tracked state, made on first sight; None for requests whose tokens do not name their
        KV (multimodal inputs)."""
        state = self._requests.get(request.request_id)
        if state is None and not request.mm_features and request.prompt_token_ids:
            salt = _salt(request)
            hashes = block_hashes(request.prompt_token_ids, self._settings.block_size, parent=salt)
            state = self._requests[request.request_id] = _PromptState(hashes, len(self._groups), len(hashes),
                                                                      request, salt)
        return state

    def _plan_save(self, meta: KVPoolConnectorMetadata, req_id: str, state: _PromptState, computed: int):
        """Save the blocks this step completes that kvpool does not hold yet, in every group: the prompt's, and
        (with save_decode_blocks) those filled with generated tokens, named by the same chained hash."""
        if self._settings.save_decode and state.request is not None:
            self._extend_hashes(state, computed)
        named = len(state.hashes)  # blocks past the hashed ones (generated, save_decode_blocks off) are not saved
        for group, ids in zip(self._groups, state.block_ids):
            stored = state.stored[group.index]
            at = [p for p in saved_positions(group, stored, computed)
                  if p < min(named, len(ids)) and ids[p] != NULL_BLOCK]
            state.stored[group.index] = max(stored, computed // group.block_size)
            if self._settings.saves and at:
                meta.saves.append(BlockTransfer(req_id, [state.hashes[p] for p in at], [ids[p] for p in at],
                                                group.index))

    def _extend_hashes(self, state: _PromptState, computed: int) -> None:
        """Hash the full blocks of generated tokens whose KV is computed by the end of this step."""
        size = self._settings.block_size
        tokens = state.request.all_token_ids
        full = min(computed, len(tokens)) // size
        have = len(state.hashes)
        if full > have:
            parent = state.hashes[-1] if state.hashes else state.salt
            state.hashes.extend(block_hashes(list(tokens[have * size:full * size]), size, parent=parent))
