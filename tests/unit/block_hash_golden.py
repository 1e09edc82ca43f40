"""Fixed expected block names: what `block_hashes` must give for fixed tokens, written down as literals.

Every stored KV block is found again only under the name it was saved with, so a change of encoding (token
width or byte order, the hash, how a parent is chained in, the namespace's layout) would orphan every block a
pool holds while each property test still passed. Tests compare with these, never with the function itself.
"""

BS = 4

# block_hashes(list(range(32)), 4): sha256(parent digest + the block's tokens as little-endian int64), chained.
RANGE_32_BS4_SHA256 = [
    "a1e03200f1f82ad2c1cec8795c271aaecf98f5aa2d151d2229ec5fa0c177cf77",
    "2516f6eea4abc53615737cbf4de98f921d434c2015fce74da094f421e1b0fad2",
    "f01ef82cd062004e667c7efa94532c6ebb487f38662215bde9f4abfb6a798614",
    "315a68badc7ddc7184e6636ea0ad5c3040eb8eb1d726e040f4620cca0f832daa",
    "bcd25e0d6580de19561eb2838a44eaefc9f4953c2bee7c378b5d7eb7dc0c8a79",
    "a58cb40e011c0be586e89bad1af133cbe896e31b9bac9096eed24dd9a230d570",
    "90aa5d200a332a749d2b1451e20be7f4d3a69a391de283131e81987f977c5c7a",
    "1bf35a9bdb8a9af75e22ec3e2f0ead20cabae69b5b3267d6b8c57d73f772817b",
]

# block_hashes(list(range(12)), 4, algorithm="xxh3"): xxh3-128 the same way.
RANGE_12_BS4_XXH3 = [
    "e9bf57da474242be3e1520d65af7f34a",
    "ba3d7c2477894f752c60165545e3ca67",
    "b31e3d0688698204a4e702434221851e",
]

# block_hashes([1, 2, 3, 4, 5], 2, parent="00" * 32): a parent's digest goes in first; the odd token is left out.
ONES_TO_FIVE_BS2_PARENT_ZERO = [
    "bc46af79e96bc03a3b5a1a88aeab5079b0dd4c6dfc5f9c14e318fec7de310f6b",
    "456085d4fd464c1c3933d729ca9c0ca386011432460b3a08c6ccf903fbed4d9c",
]

# block_hashes([2**40, -1, 0, 7], 4): tokens are 64-bit signed, not truncated to 32.
WIDE_TOKENS_BS4 = ["cba0413de02b55a5e29355ea1a83f2950efb5939cb73b69c242ab996821560dd"]

# BlockNamespace("tiny-llama", "bfloat16", "vllm-nhd", 4, kv_heads="0-3", rank=1, world=2).key(first block above)
SHARDED_KEY = ("kv/tiny-llama/bfloat16/vllm-nhd/bs4/heads-0-3/rank1of2/"
               "a1e03200f1f82ad2c1cec8795c271aaecf98f5aa2d151d2229ec5fa0c177cf77")
DEFAULT_PREFIX = "kv/llama-8b/bfloat16/vllm-nhd/bs16/heads-all/rank0of1/"  # BlockNamespace("llama-8b", ..., 16)


def range_blocks(tokens: int) -> set[str]:
    """The golden names of the full blocks of list(range(tokens)) at block size 4."""
    assert tokens <= 32
    return set(RANGE_32_BS4_SHA256[:tokens // BS])
