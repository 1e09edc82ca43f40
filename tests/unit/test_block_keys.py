"""Chained block hashes and namespaces of KV blocks."""

import numpy
import pytest

from kvpool.connectors import BlockNamespace, block_hashes
from kvpool.errors import InvalidArgumentError

NS = BlockNamespace(model="tiny-llama", dtype="bfloat16", layout="vllm-nhd", block_size=4)


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3"])
def test_a_block_hash_covers_its_whole_prefix(algorithm):
    tokens = list(range(100, 118))  # four full blocks of 4, and 2 tokens left over
    hashes = block_hashes(tokens, 4, algorithm=algorithm)
    assert len(hashes) == 4 and len(set(hashes)) == 4
    changed = tokens[:9] + [7] + tokens[10:]  # a token of the third block
    other = block_hashes(changed, 4, algorithm=algorithm)
    assert other[:2] == hashes[:2] and all(a != b for a, b in zip(other[2:], hashes[2:]))
    # Hashing the rest later, chained to the last hash so far, gives the same names.
    assert block_hashes(tokens[8:], 4, parent=hashes[1], algorithm=algorithm) == hashes[2:]
    assert block_hashes(tokens[:3], 4, algorithm=algorithm) == []


def test_same_tokens_in_another_order_or_block_size_are_other_blocks():
    assert block_hashes([1, 2, 3, 4], 4) != block_hashes([2, 1, 3, 4], 4)
    assert block_hashes([1, 2, 3, 4], 2)[1] != block_hashes([1, 2, 3, 4], 4)[0]


def test_namespaces_keep_models_and_shards_apart():
    h = block_hashes([1, 2, 3, 4], 4)[0]
    keys = {NS.key(h), BlockNamespace("tiny-llama", "float16", "vllm-nhd", 4).key(h),
            BlockNamespace("other", "bfloat16", "vllm-nhd", 4).key(h),
            BlockNamespace("tiny-llama", "bfloat16", "vllm-nhd", 4, kv_heads="0-3", rank=0, world=2).key(h),
            BlockNamespace("tiny-llama", "bfloat16", "vllm-nhd", 4, kv_heads="4-7", rank=1, world=2).key(h)}
    assert len(keys) == 5 and all(key.endswith(h) for key in keys)


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgumentError):
        block_hashes([1, 2], 0)
    with pytest.raises(InvalidArgumentError):
        block_hashes([1, 2], 2, algorithm="md5")
    with pytest.raises(InvalidArgumentError):
        BlockNamespace("m", "bf16", "nhd", 4, rank=2, world=2)


def test_block_names_are_the_fixed_golden_values():
    """A change of encoding would orphan every stored block: the names must stay exactly these."""
    import block_hash_golden as golden

    assert block_hashes(list(range(32)), 4) == golden.RANGE_32_BS4_SHA256
    assert block_hashes(numpy.arange(32, dtype="int32"), 4) == golden.RANGE_32_BS4_SHA256  # any int array
    assert block_hashes(list(range(12)), 4, algorithm="xxh3") == golden.RANGE_12_BS4_XXH3
    assert block_hashes([1, 2, 3, 4, 5], 2, parent="00" * 32) == golden.ONES_TO_FIVE_BS2_PARENT_ZERO
    assert block_hashes([2**40, -1, 0, 7], 4) == golden.WIDE_TOKENS_BS4
    assert block_hashes(list(range(16, 32)), 4, parent=golden.RANGE_32_BS4_SHA256[3]) == \
        golden.RANGE_32_BS4_SHA256[4:]
    sharded = BlockNamespace("tiny-llama", "bfloat16", "vllm-nhd", 4, kv_heads="0-3", rank=1, world=2)
    assert sharded.key(golden.RANGE_32_BS4_SHA256[0]) == golden.SHARDED_KEY
    assert BlockNamespace("llama-8b", "bfloat16", "vllm-nhd", 16).prefix() == golden.DEFAULT_PREFIX
    assert BlockNamespace.from_prefix(golden.SHARDED_KEY.rsplit("/", 1)[0] + "/") == sharded


def test_the_golden_values_follow_the_documented_encoding():
    """The literals are not arbitrary: sha256 over the parent's digest and the tokens as little-endian int64."""
    import hashlib
    import struct

    import block_hash_golden as golden

    parent = b""
    for i, expected in enumerate(golden.RANGE_32_BS4_SHA256):
        parent = hashlib.sha256(parent + struct.pack("<4q", *range(4 * i, 4 * i + 4))).digest()
        assert parent.hex() == expected
