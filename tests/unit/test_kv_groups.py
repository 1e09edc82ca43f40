"""Hybrid models' KV cache groups: what a hit needs from each, which blocks a step saves, which ranks share KV,
and the staging ring saves are copied into."""

import pytest

from kvpool.connectors.kv_groups import KVGroup, from_vllm, longest_hit, saved_positions
from kvpool.connectors.kv_shards import KVShard
from kvpool.connectors.save_queue import StagingRing
from kvpool.errors import InvalidArgumentError

FULL = KVGroup(0, "full", ("full",), 16)
WINDOW = KVGroup(1, "window", ("window",), 16, span=40)   # the next token attends 39 tokens back: 3 blocks
STATE = KVGroup(2, "state", ("state",), 16)
CHUNK = KVGroup(3, "chunk", ("chunk",), 16, span=64)      # chunks of 4 blocks


def test_what_each_kind_needs_for_a_hit():
    assert list(FULL.needed(2, 6)) == [2, 3, 4, 5]
    assert list(WINDOW.needed(0, 6)) == [3, 4, 5] and list(WINDOW.needed(4, 6)) == [4, 5]
    assert list(WINDOW.needed(0, 2)) == [0, 1]
    assert list(STATE.needed(0, 6)) == [5] and list(STATE.needed(5, 6)) == [5]
    assert list(CHUNK.needed(0, 6)) == [4, 5] and list(CHUNK.needed(0, 8)) == []  # the next token starts a chunk


def test_a_hit_is_as_long_as_every_group_allows():
    blocks = 8
    everything = [True] * blocks
    assert longest_hit([FULL, WINDOW, STATE], [everything] * 3, blocks) == 8
    # A state kept only at some boundaries: the hit ends at the last one the full prefix reaches.
    states = [False, False, True, False, False, True, False, False]
    assert longest_hit([FULL, STATE], [everything, states], blocks) == 6
    assert longest_hit([FULL, STATE], [[True] * 5 + [False] * 3, states], blocks) == 3
    # A window needs only its last blocks: the early ones may be gone.
    window = [False] * 5 + [True] * 3
    assert longest_hit([FULL, WINDOW], [everything, window], blocks) == 8
    assert longest_hit([FULL, WINDOW], [everything, [True] * 6 + [False, True]], blocks) == 6
    # A missing full block ends the prefix whatever the others hold.
    assert longest_hit([FULL, WINDOW], [[True, True, False] + [True] * 5, everything], blocks) == 2
    assert longest_hit([FULL, STATE], [everything, [False] * blocks], blocks) == 0
    # No full group (a pure state model): the state alone decides.
    assert longest_hit([STATE], [states], blocks) == 6


def test_a_step_saves_every_completed_block_but_a_state_only_at_an_exact_boundary():
    assert list(saved_positions(FULL, 2, 80)) == [2, 3, 4]
    assert list(saved_positions(WINDOW, 0, 50)) == [0, 1, 2]
    assert list(saved_positions(STATE, 0, 64)) == [3]
    assert list(saved_positions(STATE, 0, 70)) == []  # the block holds the state after token 70, not 64
    assert list(saved_positions(STATE, 4, 64)) == []  # already passed


class MambaSpec:  # vLLM's spec classes are read by name
    def __init__(self, mode):
        self.block_size, self.mamba_cache_mode = 16, mode


class SlidingWindowSpec:
    block_size, sliding_window = 16, 40


class FullAttentionSpec:
    def __init__(self, block_size=16):
        self.block_size = block_size


class MLAAttentionSpec(FullAttentionSpec):
    pass


class CrossAttentionSpec:
    block_size = 16


class Group:
    def __init__(self, spec, *layers):
        self.kv_cache_spec, self.layer_names = spec, list(layers)


class Config:
    def __init__(self, *groups):
        self.kv_cache_groups = list(groups)


def test_groups_read_from_vllm_and_refusals_name_what_is_missing():
    groups = from_vllm(Config(Group(SlidingWindowSpec(), "a"), Group(MambaSpec("align"), "b"),
                              Group(MLAAttentionSpec(), "c", "d")), 16)
    assert [(g.kind, g.span, g.layers) for g in groups] == [("window", 40, ("a",)), ("state", 0, ("b",)),
                                                          ("full", 0, ("c", "d"))]
    assert [g.tag() for g in groups] == ["g0-window40", "g1-state", "g2-full"]
    with pytest.raises(InvalidArgumentError, match="--mamba-cache-mode align"):
        from_vllm(Config(Group(MambaSpec("none"), "b")), 16)
    with pytest.raises(InvalidArgumentError, match="CrossAttentionSpec"):
        from_vllm(Config(Group(CrossAttentionSpec(), "x")), 16)
    with pytest.raises(InvalidArgumentError, match="different block sizes"):
        from_vllm(Config(Group(FullAttentionSpec(32), "x")), 16)


@pytest.mark.parametrize("tp, heads_per_rank, total, replicated, shards, writers", [
    (1, 8, 8, False, [0], [0]),
    (8, 1, 8, False, list(range(8)), list(range(8))),       # one head per rank: every rank its own
    (8, 1, 2, False, [0] * 4 + [1] * 4, [0, 4]),             # 2 heads on 8 ranks: each replicated 4 times
    (2, 4, 8, False, [0, 1], [0, 1]),
    (8, 1, 1, True, [0] * 8, [0]),                           # MLA: one copy whatever the degree
])
def test_ranks_holding_the_same_kv_share_one_shard_written_once(tp, heads_per_rank, total, replicated, shards,
                                                                  writers):
    of = [KVShard.of(rank, tp, 0, 1, heads_per_rank, total, replicated) for rank in range(tp)]
    assert [shard.index for shard in of] == shards
    assert [rank for rank, shard in enumerate(of) if shard.writer] == writers
    assert {shard.count for shard in of} == {len(set(shards))}
    # Pipeline stages hold other layers: never shared.
    stage = KVShard.of(0, tp, 1, 2, heads_per_rank, total, replicated)
    assert stage.index == len(set(shards)) and stage.count == 2 * len(set(shards))


def test_the_staging_ring_takes_in_order_and_refuses_what_does_not_fit():
    torch = pytest.importorskip("torch")
    ring = StagingRing(100)
    like = torch.empty(1)
    assert ring.take(40, like) == 0 and ring.take(40, like) == 40
    assert ring.take(30, like) is None          # 20 left at the end, nothing free at the start
    ring.give_back(1)                           # the oldest is written: [0, 40) is free again
    assert ring.take(30, like) == 0             # wraps
    assert ring.take(15, like) is None          # between 30 and 40 only 10 are free
    assert ring.pending() == 70 and ring.take(10, like) == 30  # exactly up to the oldest
    assert ring.take(1, like) is None           # full, though [80, 100) lies past the wrap
    ring.give_back(3)
    assert ring.pending() == 0 and ring.take(100, like) == 0 and ring.take(101, like) is None
