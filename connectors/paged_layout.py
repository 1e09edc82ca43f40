"""One KV block's bytes in paged KV caches: the K and V of every layer, as views into the caches.

vLLM's GPU backends keep one tensor per layer shaped (2, num_blocks, ...): index 0 holds K, 1 holds V, and all
after the block index (block_size x heads x head_dim in NHD, heads x block_size x head_dim in HND) is contiguous,
so a block of one layer is two contiguous views. Block-first layouts, such as the CPU backend's
(num_blocks, heads, block_size, 2 x head_dim), keep all of a block together: one view per layer. kvpool stores
a block of every layer as one object (put_parts) and scatters it back (get_into_parts) without gathering it
into one buffer first.
"""

from typing import Sequence

from kvpool.errors import InvalidArgumentError


def block_parts(layer_caches: Sequence, block_id: int, kv_first: bool = True) -> list:
    """Views of block `block_id` in every layer, in layer order: [K0, V0, K1, V1, ...] for caches shaped
    (2, num_blocks, ...) (kv_first), or [block of layer 0, block of layer 1, ...] for block-first caches."""
    parts = []
    for layer, cache in enumerate(layer_caches):
        blocks = cache.shape[1] if kv_first else cache.shape[0]
        if not 0 <= block_id < blocks:
            raise InvalidArgumentError(f"block {block_id} is outside layer {layer}'s {blocks} blocks")
        views = (cache[0, block_id], cache[1, block_id]) if kv_first else (cache[block_id],)
        for view in views:
            if not view.is_contiguous():
                raise InvalidArgumentError(f"layer {layer}: block {block_id} is not contiguous in this layout")
            parts.append(view)
    return parts
