"""The block store's gather and scatter: the GPU's way (an indexing kernel per layer) and the CPU's (a copy per
range) give the same bytes, in block_parts' order, for every layout the store takes. Run on CPU tensors, so the
GPU's code path is checked where no GPU is."""

import pytest

from kvpool.connectors.paged_layout import block_bytes, block_parts, gather_blocks, scatter_blocks
from kvpool.errors import InvalidArgumentError

torch = pytest.importorskip("torch")

LAYERS, BLOCKS = 3, 12
IDS = [7, 2, 11, 0, 5]


def layouts():
    generator = torch.Generator().manual_seed(5)

    def random(shape):
        return torch.randint(-2**15, 2**15, shape, generator=generator, dtype=torch.int16).view(torch.bfloat16)

    kv_first = [random((2, BLOCKS, 16, 2, 8)) for _ in range(LAYERS)]
    block_first = [random((BLOCKS, 2, 16, 16)) for _ in range(LAYERS)]
    # Heads before tokens in memory, shown as (2, num_blocks, tokens, heads, dim): each block still one range.
    permuted = [random((2, BLOCKS, 2, 16, 8)).permute(0, 1, 3, 2, 4) for _ in range(LAYERS)]
    return {"kv-first": (kv_first, True), "block-first": (block_first, False), "permuted": (permuted, True)}


@pytest.mark.parametrize("layout", ["kv-first", "block-first", "permuted"])
@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "copied"])
def test_gathered_rows_are_the_blocks_in_block_parts_order_and_scatter_back(layout, indexed):
    caches, kv_first = layouts()[layout]
    rows = gather_blocks(caches, IDS, kv_first, indexed=indexed)
    assert rows.shape == (len(IDS), block_bytes(caches, kv_first)) and rows.dtype == torch.uint8
    for row, block in zip(rows, IDS):
        if layout == "permuted":  # as the bytes lie in memory: heads before tokens
            expected = b"".join(bytes(cache.permute(0, 1, 3, 2, 4)[kv, block].contiguous().view(torch.uint8).numpy())
                                for cache in caches for kv in (0, 1))
        else:
            expected = b"".join(bytes(part.contiguous().view(torch.uint8).numpy())
                                for part in block_parts(caches, block, kv_first))
        assert bytes(row.numpy()) == expected
    targets = [torch.zeros_like(cache) for cache in caches] if layout != "permuted" else \
        [torch.zeros_like(cache.permute(0, 1, 3, 2, 4)).permute(0, 1, 3, 2, 4) for cache in caches]
    slots = [1, 3, 4, 8, 10]
    scatter_blocks(targets, slots, rows, kv_first, indexed=indexed)
    for target, cache in zip(targets, caches):
        target, cache = target.view(torch.int16), cache.view(torch.int16)  # bit patterns: some are NaNs
        for slot, block in zip(slots, IDS):
            assert torch.equal(target[:, slot] if kv_first else target[slot], cache[:, block] if kv_first
                               else cache[block])
        untouched = [b for b in range(BLOCKS) if b not in slots]
        assert not torch.count_nonzero(target[:, untouched] if kv_first else target[untouched])


def test_both_ways_give_the_same_bytes():
    for caches, kv_first in layouts().values():
        assert torch.equal(gather_blocks(caches, IDS, kv_first, indexed=True),
                           gather_blocks(caches, IDS, kv_first, indexed=False))


def test_a_block_outside_the_caches_or_a_layout_without_contiguous_blocks_is_refused():
    caches, kv_first = layouts()["kv-first"]
    with pytest.raises(InvalidArgumentError, match="outside"):
        gather_blocks(caches, [BLOCKS], kv_first)
    tokens_split = [cache.transpose(1, 2) for cache in caches]  # block index no longer leads in memory
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        gather_blocks(tokens_split, [0], kv_first)


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "copied"])
def test_gathered_into_a_given_tensor_fills_it_and_a_wrong_one_is_refused(indexed):
    caches, kv_first = layouts()["kv-first"]
    out = torch.full((len(IDS), block_bytes(caches, kv_first)), 0xA5, dtype=torch.uint8)
    assert gather_blocks(caches, IDS, kv_first, indexed=indexed, out=out) is out
    assert torch.equal(out, gather_blocks(caches, IDS, kv_first, indexed=indexed))
    with pytest.raises(InvalidArgumentError, match="shape"):
        gather_blocks(caches, IDS, kv_first, indexed=indexed, out=out[1:])
