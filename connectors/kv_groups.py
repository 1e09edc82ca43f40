"""The KV cache groups of a hybrid model, and which of each group's blocks a prefix hit needs.

A model's layers fall into groups by what their cache holds (vLLM's kv_cache_config.kv_cache_groups). Every
group has a block per `block_size` tokens of a request, named by the same chained prefix hash, and is stored in
its own namespace; what a group needs for a hit of n blocks (the next token's attention, or its recurrence)
differs by kind:
- "full" (full attention, MLA): every block of the prefix;
- "window" (sliding window): the blocks holding the last `window - 1` tokens before the hit's end;
- "chunk" (chunked local attention): the blocks from the start of the chunk the next token is in;
- "state" (Mamba, gated delta-net and other linear attention): the state after the hit's last token, which
  vLLM keeps per block at block boundaries (its mamba_cache_mode "align").
A hit of n blocks is one for which every group has what it needs (`longest_hit`): a full-attention prefix can
only count as far as the last block boundary a state group has a state for.

No engine imports here: `from_vllm` reads vLLM's specs by their class names.
"""

from dataclasses import dataclass
from typing import Sequence

from kvpool.errors import InvalidArgumentError

KINDS = ("full", "window", "chunk", "state")


@dataclass(frozen=True)
class KVGroup:
    index: int
    kind: str                 # one of KINDS
    layers: tuple[str, ...]   # the engine's layer names, in the order their blocks are stored
    block_size: int           # tokens per block
    span: int = 0             # window: tokens attended before the next (sliding_window); chunk: chunk size

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"unknown KV cache group kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind in ("window", "chunk") and self.span < 1:
            raise InvalidArgumentError(f"a {self.kind} group needs its span in tokens, got {self.span}")

    def tag(self) -> str:
        """What the group adds to its namespace's layout, e.g. "g0-window128" (nothing for a lone full group)."""
        return f"g{self.index}-{self.kind}{self.span or ''}"

    def needed(self, start: int, end: int) -> range:
        """Block positions in [start, end) a hit of `end` blocks needs from this group."""
        if self.kind == "full":
            first = start
        elif self.kind == "window":
            first = end - -(-(self.span - 1) // self.block_size)
        elif self.kind == "chunk":
            first = end * self.block_size // self.span * self.span // self.block_size
        else:  # state
            first = end - 1
        return range(max(start, first, 0), end)


def longest_hit(groups: Sequence[KVGroup], present: Sequence[Sequence[bool]], limit: int) -> int:
    """The most leading blocks (at most `limit`) for which every group holds what it needs; present[g][i]:
    group g's block i is stored."""
    full = limit
    for group, there in zip(groups, present):
        if group.kind == "full":
            full = min(full, next((i for i in range(limit) if not there[i]), limit))
    for end in range(full, 0, -1):
        if all(all(there[i] for i in group.needed(0, end)) for group, there in zip(groups, present)):
            return end
    return 0


def saved_positions(group: KVGroup, stored: int, computed: int) -> range:
    """Block positions a step that ends with `computed` tokens of KV completes for this group, past the first
    `stored`: every completed block, except for a state group, whose block holds the state at a block boundary
    only when the step ends exactly there."""
    done = computed // group.block_size
    if group.kind == "state":
        exact = computed == done * group.block_size
        return range(done - 1, done) if exact and done > stored else range(0)
    return range(stored, done)


def from_vllm(kv_cache_config, block_size: int) -> list[KVGroup]:
    """The groups of vLLM's kv_cache_config, or a refusal naming what kvpool cannot store yet."""
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kinds = {cls.__name__ for cls in type(spec).__mro__}
        if "MambaSpec" in kinds:
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode not in ("align", "all"):
                raise InvalidArgumentError(
                    f"KVPoolConnector: group {index} keeps recurrent state with mamba_cache_mode {mode!r}, which "
                    f"has no state per block to store; start vLLM with --mamba-cache-mode align")
            kind, span = "state", 0
        elif "SlidingWindowSpec" in kinds:
            kind, span = "window", int(spec.sliding_window)
        elif "ChunkedLocalAttentionSpec" in kinds:
            kind, span = "chunk", int(spec.attention_chunk_size)
        elif "FullAttentionSpec" in kinds or "MLAAttentionSpec" in kinds:
            kind, span = "full", 0
        else:
            raise InvalidArgumentError(f"KVPoolConnector cannot store KV cache group {index} "
                                       f"({type(spec).__name__}) yet: only full attention, MLA, sliding window, "
                                       f"chunked local attention and Mamba / linear-attention state")
        if spec.block_size != block_size:
            raise InvalidArgumentError(
                f"KVPoolConnector: group {index} has blocks of {spec.block_size} tokens and the engine's block "
                f"size is {block_size}; groups of different block sizes are not supported yet")
        groups.append(KVGroup(index, kind, tuple(group.layer_names), block_size, span))
    if not groups:
        raise InvalidArgumentError("KVPoolConnector: the model has no KV cache groups to store")
    return groups
