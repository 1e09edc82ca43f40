"""The KV-aware router's logic (connectors/router.py): engine views built from KV events, scores, choice."""

import pytest
from block_hash_golden import RANGE_32_BS4_SHA256, range_blocks

from kvpool.connectors.router import EngineView, RoundRobin, Router

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def store_prompt(view: EngineView, prompt: list[int], engine_salt: int = 7, per_event: int = 2) -> list:
    """Emit BlockStored events as an engine does: runs of blocks, each run naming its parent by the
    engine's own hash (which differs from kvpool's)."""
    full = len(prompt) // BS
    engine_hashes = [hash((engine_salt, tuple(prompt[:(i + 1) * BS]))) for i in range(full)]
    for start in range(0, full, per_event):
        run = engine_hashes[start:start + per_event]
        parent = engine_hashes[start - 1] if start else None
        view.stored(run, parent, prompt[start * BS:(start + len(run)) * BS], BS)
    return engine_hashes


def test_engine_blocks_are_named_as_kvpool_names_them():
    view = EngineView("a")
    prompt = tokens(4 * BS + 2)
    store_prompt(view, prompt)
    assert view.blocks == range_blocks(4 * BS)


def test_removed_cleared_and_unmappable_blocks():
    view = EngineView("a")
    prompt = tokens(6 * BS)
    engine_hashes = store_prompt(view, prompt)
    view.removed(engine_hashes[4:])
    assert view.blocks == range_blocks(4 * BS)
    assert view.stored([123], 999_999, tokens(BS, 50), BS) == 0  # its parent never seen: not counted
    assert view.stored([124], None, tokens(BS, 60), BS, extra_keys=[("lora", "x")]) == 0  # KV not its tokens'
    assert view.unmapped == 2
    view.cleared()
    assert not view.blocks


def test_the_engine_holding_more_of_the_prefix_wins_and_load_breaks_ties():
    router = Router(["a", "b"], BS, pool_weight=0.5)
    system = tokens(3 * BS)  # a shared system prompt
    store_prompt(router.view("b"), system + tokens(2 * BS, 100))
    store_prompt(router.view("a"), system)
    prompt = system + tokens(2 * BS, 100) + [5]
    engine, scores = router.choose(prompt)
    assert engine == "b"
    assert {s.engine: s.local_blocks for s in scores} == {"a": 3, "b": 5}
    # Equal prefixes: the one with fewer requests in flight ("b" has one now).
    engine, _ = router.choose(system + tokens(BS, 500) + [1])
    assert engine == "a"
    router.finished("b")
    assert router.view("b").in_flight == 0


def test_pool_blocks_count_but_less_than_local_ones():
    router = Router(["a", "b"], BS, pool_weight=0.5)
    prompt = tokens(6 * BS) + [9]
    for block in RANGE_32_BS4_SHA256[:6]:  # prompt[:6 * BS] as kvpool names it
        router.pool_changed("stored", block)
    store_prompt(router.view("a"), prompt[:2 * BS])
    store_prompt(router.view("b"), prompt[:3 * BS])
    engine, scores = router.choose(prompt)
    by = {s.engine: s for s in scores}
    assert by["a"].pool_blocks == by["b"].pool_blocks == 6
    assert by["a"].reusable == 2 + 0.5 * 4 and by["b"].reusable == 3 + 0.5 * 3 and engine == "b"
    router.pool_changed("removed", RANGE_32_BS4_SHA256[0])  # the pool lost the first block
    assert all(s.pool_blocks == 0 for s in router.scores(prompt))


def test_the_last_prompt_token_is_never_counted_reusable():
    router = Router(["a"], BS)
    prompt = tokens(2 * BS)  # exactly two blocks: the second holds the last token
    store_prompt(router.view("a"), prompt)
    assert router.scores(prompt)[0].local_blocks == 1


def test_round_robin_and_bad_settings():
    rr = RoundRobin(["a", "b", "c"])
    assert [rr.choose([])[0] for _ in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(ValueError):
        Router([], BS)
    with pytest.raises(ValueError):
        Router(["a"], BS, pool_weight=2)


def test_a_busy_engine_loses_to_an_idle_one_that_can_load_the_prefix():
    router = Router(["a", "b"], BS, pool_weight=0.8)
    prompt = tokens(8 * BS) + [3]
    store_prompt(router.view("a"), prompt[:8 * BS])
    for block in RANGE_32_BS4_SHA256[:8]:
        router.pool_changed("stored", block)
    assert router.choose(prompt)[0] == "a"  # idle, and holds it all
    other = tokens(8 * BS, 900) + [4]  # a long prompt nobody holds: "a" now has it queued
    assert router.choose(other)[0] == "b"
    assert router.choose(tokens(8 * BS, 1800) + [5])[0] == "a"  # b's queue is now the longer one
    engine, scores = router.choose(prompt)
    by = {s.engine: s for s in scores}
    assert by["a"].cost == pytest.approx(8 + 1 / BS - 8 + (1 / BS + 1) + (8 + 1 / BS + 1))
    assert engine == "a"
    # With load_weight 0 the queue never matters: the most reusable prefix wins.
    greedy = Router(["a", "b"], BS, load_weight=0)
    store_prompt(greedy.view("a"), prompt[:8 * BS])
    assert [greedy.choose(prompt)[0] for _ in range(3)] == ["a", "a", "a"]
    router.finished("a")
    assert router.view("a").in_flight == 2
