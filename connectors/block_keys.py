"""Keys of KV blocks: a chained hash of the token prefix, inside a namespace of everything that shapes the bytes.

Block i's hash covers its parent's hash and its own tokens, so equal hashes mean equal whole prefixes (as
vLLM's prefix caching names blocks). The namespace (model, dtype, layout, block size, KV-head shard, parallel
rank) goes into the key, so blocks of another model or sharding can never be mistaken for these.
"""

import hashlib
from dataclasses import dataclass

import numpy
import xxhash

from kvpool.errors import InvalidArgumentError

HASHES = ("sha256", "xxh3")


@dataclass(frozen=True)
class BlockNamespace:
    model: str
    dtype: str          # e.g. "bfloat16"
    layout: str         # how a block's bytes are laid out, e.g. "vllm-nhd"
    block_size: int     # tokens per block
    kv_heads: str = "all"  # which KV heads this shard holds, e.g. "0-7"
    rank: int = 0       # tensor/pipeline-parallel rank ...
    world: int = 1      # ... out of this many

    def __post_init__(self):
        if self.block_size < 1 or not 0 <= self.rank < self.world:
            raise InvalidArgumentError(f"bad namespace: block_size {self.block_size}, rank {self.rank}/{self.world}")

    def prefix(self) -> str:
        return (f"kv/{self.model}/{self.dtype}/{self.layout}/bs{self.block_size}/heads-{self.kv_heads}/"
                f"rank{self.rank}of{self.world}/")

    def key(self, block_hash: str) -> str:
        return self.prefix() + block_hash

    @classmethod
    def from_prefix(cls, prefix: str) -> "BlockNamespace":
        """The namespace whose prefix() is `prefix` (as a connector reports it)."""
        parts = prefix.strip("/").split("/")
        try:
            kv, model, dtype, layout, size, heads, rank = parts
            assert kv == "kv" and size.startswith("bs") and heads.startswith("heads-") and rank.startswith("rank")
            rank_of, world = rank.removeprefix("rank").split("of")
            return cls(model, dtype, layout, int(size[2:]), heads.removeprefix("heads-"), int(rank_of), int(world))
        except (ValueError, AssertionError):
            raise InvalidArgumentError(f"not a block namespace prefix: {prefix!r} "
                                       f"(expected kv/MODEL/DTYPE/LAYOUT/bsN/heads-H/rankRofW/)") from None


def block_hashes(tokens, block_size: int, parent: str = "", algorithm: str = "sha256") -> list[str]:
    """Hex hashes of every full block of `tokens` (a sequence or array of token ids), each chained to the
    one before (the first to `parent`, e.g. the last hash of an earlier part of the prompt)."""
    if algorithm not in HASHES:
        raise InvalidArgumentError(f"unknown hash {algorithm!r}; choose from {', '.join(HASHES)}")
    if block_size < 1:
        raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
    ids = numpy.ascontiguousarray(tokens, dtype="<i8")
    blocks = ids[:len(ids) // block_size * block_size].reshape(-1, block_size)
    hashes, previous = [], bytes.fromhex(parent)
    for block in blocks:  # one hash per block: the token bytes go in whole, not token by token
        if algorithm == "sha256":
            digest = hashlib.sha256(previous + block.tobytes()).digest()
        else:
            digest = xxhash.xxh3_128(previous + block.tobytes()).digest()
        hashes.append(digest.hex())
        previous = digest
    return hashes
