"""One KV block's bytes in paged KV caches: the K and V of every layer, as views into the caches.

vLLM keeps one tensor per layer shaped (2, num_blocks, ...): index 0 holds K, 1 holds V, and everything after the
block index (block_size x heads x head_dim in NHD, heads x block_size x head_dim in HND) is contiguous. So a
block of every layer is 2 x layers contiguous views, which kvpool stores as one object (put_parts) and scatters
back (get_into_parts) without copying them together first.
"""

from typing import Sequence

from kvpool.errors import InvalidArgumentError


def block_parts(layer_caches: Sequence, block_id: int, kv_first: bool = True) -> list:
    """[K of layer 0, V of layer 0, K of layer 1, ...] of block `block_id`, as views into the caches.

    kv_first: caches shaped (2, num_blocks, ...) as vLLM's; False for (num_blocks, 2, ...)."""
    parts = []
    for layer, cache in enumerate(layer_caches):
        blocks = cache.shape[1] if kv_first else cache.shape[0]
        if not 0 <= block_id < blocks:
            raise InvalidArgumentError(f"block {block_id} is outside layer {layer}'s {blocks} blocks")
        for kv in (0, 1):
            view = cache[kv, block_id] if kv_first else cache[block_id, kv]
            if not view.is_contiguous():
                raise InvalidArgumentError(f"layer {layer}: a block's {'KV'[kv]} is not contiguous in this layout")
            parts.append(view)
    return parts
