"""What both sides of the vLLM connector share: its settings, the block namespace, and the metadata the scheduler
sends the workers each step and the workers send back."""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .block_keys import BlockNamespace
from .kv_groups import KVGroup, from_vllm
from .kv_shards import KVShard
from .transfer_stats import add_counts


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's options, read once from vLLM's config (the module docstring of `vllm.py` lists them)."""
    saves: bool             # kv_producer or kv_both
    loads: bool             # kv_consumer or kv_both
    hold: float             # seconds a lookup keeps the found blocks from eviction
    save_decode: bool       # save blocks filled with generated tokens too
    transfer_async: bool    # "transfer": "async" (default) or "sync"
    block_size: int         # tokens per block
    save_buffer: int        # bytes of blocks staged for saving at most ("save_buffer_mb"); more are shed
    extra: dict             # kv_connector_extra_config, for the client's settings

    @classmethod
    def from_vllm(cls, vllm_config) -> "ConnectorSettings":
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config or {}
        return cls(saves=transfer.is_kv_producer, loads=transfer.is_kv_consumer,
                   hold=float(extra.get("hold_seconds", 30)),
                   save_decode=str(extra.get("save_decode_blocks", True)).lower() not in ("false", "0", "no"),
                   transfer_async=transfer_mode(extra) == "async",
                   block_size=vllm_config.cache_config.block_size,
                   save_buffer=save_buffer_bytes(extra), extra=extra)


SAVE_BUFFER_MB = 256  # default: a few steps' worth of completed blocks of a large model


def save_buffer_bytes(extra: dict) -> int:
    try:
        megabytes = float(extra.get("save_buffer_mb", SAVE_BUFFER_MB))
    except (TypeError, ValueError):
        megabytes = -1
    if not megabytes > 0:
        raise ValueError(f'kv_connector_extra_config "save_buffer_mb" must be a positive number of MiB, not '
                         f'{extra.get("save_buffer_mb")!r}')
    return int(megabytes * (1 << 20))


def transfer_mode(extra: dict) -> str:
    mode = str(extra.get("transfer", "async")).lower()
    if mode not in ("async", "sync"):
        raise ValueError(f'kv_connector_extra_config "transfer" must be "async" or "sync", not {mode!r}')
    return mode


def shard_of(vllm_config, tp_rank: int, pp_rank: int) -> KVShard:
    """The KV shard a rank holds (kv_shards.py), from the model's heads and the engine's parallelism."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    replicated = bool(getattr(model, "use_mla", False))
    return KVShard.of(tp_rank, parallel.tensor_parallel_size, pp_rank, parallel.pipeline_parallel_size,
                      model.get_num_kv_heads(parallel), model.get_total_num_kv_heads(), replicated)


def hybrid_groups(settings: ConnectorSettings, vllm_config, kv_cache_config) -> list[KVGroup]:
    """The model's KV cache groups, or a refusal naming what the connector cannot do with them."""
    groups = from_vllm(kv_cache_config, vllm_config.cache_config.block_size)
    if len(groups) > 1 and settings.loads and not settings.transfer_async:
        # vLLM takes failed loads of a model with several groups per request, and only for asynchronous loads.
        raise ValueError(f'KVPoolConnector: "transfer": "sync" cannot load a model with {len(groups)} KV cache '
                         f'groups (vLLM recomputes a failed load of a hybrid model only when it was asynchronous); '
                         f'use "transfer": "async" (the default)')
    return groups


def namespace_for(vllm_config, kv_cache_config, shard: KVShard, group: KVGroup) -> BlockNamespace:
    """Everything that shapes a block's bytes, so that only an engine with the same model, dtype, cache layout,
    block size and sharding ever loads a block another one saved: one namespace per KV cache group (a model
    with one group keeps the plain layout name) and per distinct KV shard (rank R of W counts shards, not
    processes: every rank holding the same KV names the same namespace)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    name = extra.get("model_id") or model.served_model_name or model.model
    if isinstance(name, (list, tuple)):
        name = name[0]
    spec = kv_cache_config.kv_cache_groups[group.index].kv_cache_spec
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = str(model.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    layout = f"vllm-{kv_cache_config.kv_cache_layout or 'default'}-page{spec.page_size_bytes}"
    if len(kv_cache_config.kv_cache_groups) > 1:
        layout += f"-{group.tag()}"
    heads = f"{model.get_num_kv_heads(parallel)}of{model.get_total_num_kv_heads()}"
    return BlockNamespace(str(name).strip("/").replace("/", "_"), dtype, layout, group.block_size, heads,
                          shard.index, shard.count)


@dataclass
class BlockTransfer:
    """Blocks of one request and KV cache group to move: their prefix hashes and where they sit in the paged
    caches."""
    request_id: str
    hashes: list[str]
    block_ids: list[int]
    group: int = 0


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    """The scheduler's orders for one step."""
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
        add_counts(self.moved.setdefault(request_id, {}), counts)

    def aggregate(self, other: "KVPoolWorkerMetadata") -> "KVPoolWorkerMetadata":
        for request_id, counts in other.moved.items():
            self.add(request_id, counts)
        return self
