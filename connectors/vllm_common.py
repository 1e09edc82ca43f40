"""What both sides of the vLLM connector share: its settings, the block namespace, and the metadata the scheduler
sends the workers each step and the workers send back."""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .block_keys import BlockNamespace
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
    world: int              # ranks that each hold a shard of every block (tensor x pipeline parallel)
    extra: dict             # kv_connector_extra_config, for the client's settings

    @classmethod
    def from_vllm(cls, vllm_config) -> "ConnectorSettings":
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config or {}
        parallel = vllm_config.parallel_config
        return cls(saves=transfer.is_kv_producer, loads=transfer.is_kv_consumer,
                   hold=float(extra.get("hold_seconds", 30)),
                   save_decode=str(extra.get("save_decode_blocks", True)).lower() not in ("false", "0", "no"),
                   transfer_async=transfer_mode(extra) == "async",
                   block_size=vllm_config.cache_config.block_size,
                   world=parallel.tensor_parallel_size * parallel.pipeline_parallel_size, extra=extra)


def transfer_mode(extra: dict) -> str:
    mode = str(extra.get("transfer", "async")).lower()
    if mode not in ("async", "sync"):
        raise ValueError(f'kv_connector_extra_config "transfer" must be "async" or "sync", not {mode!r}')
    return mode


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


@dataclass
class BlockTransfer:
    """Blocks of one request to move: their prefix hashes and where they sit in the paged caches."""
    request_id: str
    hashes: list[str]
    block_ids: list[int]


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
