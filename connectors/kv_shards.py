"""Which ranks of a parallel engine hold the same KV, so that it is stored once.

Tensor parallelism splits KV heads across ranks, except where it cannot: MLA's latent KV is the same on every
rank, and with more ranks than KV heads each head is replicated on tp / heads ranks (rank r holds head
r * heads // tp). Pipeline stages hold different layers. A shard is one distinct KV: the block namespace names
shards (rank R of W counts them, not processes), the first rank holding a shard writes it, and every rank
holding it reads it. No engine imports here.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class KVShard:
    """Which KV a rank holds, among the distinct ones of the engine: ranks that hold the same KV (MLA's latent
    on every tensor-parallel rank, KV heads replicated when there are more ranks than heads) share one shard,
    stored once, written by the first rank holding it and read by all."""
    index: int      # this rank's shard (pipeline stage x distinct tensor-parallel KV)
    count: int      # distinct shards in the engine
    writer: bool    # this rank writes its shard

    @classmethod
    def of(cls, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, heads_per_rank: int, total_heads: int,
           replicated: bool) -> "KVShard":
        distinct = 1 if replicated else max(1, min(tp_size, total_heads // max(heads_per_rank, 1)))
        tp_shard = tp_rank * distinct // tp_size
        return cls(pp_rank * distinct + tp_shard, pp_size * distinct, tp_rank == -(-tp_shard * tp_size // distinct))
