"""One KV block's bytes in paged KV caches: the K and V of every layer, as views into the caches.

vLLM's GPU backends keep one tensor per layer shaped (2, num_blocks, ...): index 0 holds K, 1 holds V, and all
after the block index (block_size x heads x head_dim in NHD, heads x block_size x head_dim in HND) is contiguous,
so a block of one layer is two contiguous views. Block-first layouts, such as the CPU backend's
(num_blocks, heads, block_size, 2 x head_dim), keep all of a block together: one view per layer. kvpool stores
a block of every layer as one object: block_parts names its views; gather_blocks copies many blocks of every
layer into one buffer with one indexing kernel per layer, and scatter_blocks writes them back the same way.
That is how blocks move, on a GPU (where a transfer per view would cost a copy each) and on the CPU alike.
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


def block_bytes(layer_caches: Sequence, kv_first: bool = True) -> int:
    """Bytes of one block of every layer: the size of one stored block."""
    per_block = (lambda cache: 2 * cache[0, 0].nelement()) if kv_first else (lambda cache: cache[0].nelement())
    return sum(per_block(cache) * cache.element_size() for cache in layer_caches)


def _as_bytes(cache, kv_first: bool, layer: int):
    """The cache as uint8, shaped (2, num_blocks, block bytes) (kv_first) or (num_blocks, block bytes), in the
    order its bytes lie in memory: an engine may allocate heads before tokens and show them permuted (vLLM's
    HND stride order), and may space blocks wider than their content (a hybrid model's state pages share
    memory with attention pages of another size); what must hold is that each block (of K, of V) is one
    contiguous range."""
    torch = _torch()
    leading = 2 if kv_first else 1
    if cache.dim() > leading and not cache.is_contiguous():
        inner = sorted(range(leading, cache.dim()), key=lambda dim: -cache.stride(dim))
        outer = sorted(range(leading), key=lambda dim: -cache.stride(dim))
        if outer != list(range(leading)):
            raise InvalidArgumentError(f"layer {layer}: a block is not one contiguous range in this layout")
        cache = cache.permute(outer + inner)
    block = cache[(0,) * leading] if cache.dim() > leading else None
    if block is not None and not block.is_contiguous():
        raise InvalidArgumentError(f"layer {layer}: a block is not one contiguous range in this layout")
    size = cache.element_size()
    width = (block.nelement() if block is not None else 1) * size
    flat = cache.view(cache.shape[:leading] + (-1,)) if cache.dim() > leading else cache.unsqueeze(-1)
    raw = flat.view(torch.uint8)  # the last dimension is contiguous: a dtype view of it is exact
    strides = tuple(raw.stride(dim) for dim in range(leading))
    if any(stride < width for stride in strides[leading - 1:]) or (kv_first and strides[0] < cache.shape[1] * width):
        raise InvalidArgumentError(f"layer {layer}: blocks overlap in this layout")
    return raw.as_strided(tuple(cache.shape[:leading]) + (width,), strides + (1,))


def gather_blocks(layer_caches: Sequence, block_ids: Sequence[int], kv_first: bool = True,
                  indexed: bool | None = None, out=None):
    """Blocks `block_ids` of every layer copied into one new uint8 tensor on the caches' device, shaped
    (len(block_ids), block bytes): each row one stored block in block_parts' order. On a GPU one indexing
    kernel per layer (K and V together), whatever the number of blocks, enqueued on the current stream; on the
    CPU, where indexing kernels run several times slower than copying each block's ranges, a copy per range
    (`indexed` chooses either way: both give the same bytes). out: the tensor to fill instead of a new one."""
    torch = _torch()
    views = [_as_bytes(cache, kv_first, layer) for layer, cache in enumerate(layer_caches)]
    ids = _checked_ids(layer_caches, block_ids, kv_first)
    shape = (len(ids), block_bytes(layer_caches, kv_first))
    if out is not None and (tuple(out.shape) != shape or out.dtype != torch.uint8):
        raise InvalidArgumentError(f"out must be uint8 of shape {shape}, not {out.dtype} {tuple(out.shape)}")
    if not _indexed(layer_caches, indexed):
        gathered = torch.empty(shape, dtype=torch.uint8) if out is None else out
        for row, block in zip(gathered, ids):
            for piece, view in zip(_row_pieces(row, views, kv_first), views):
                piece.copy_(view[:, block] if kv_first else view[block])
        return gathered
    index = torch.tensor(ids, dtype=torch.long).to(layer_caches[0].device, non_blocking=True)
    rows = []
    for view in views:
        taken = view.index_select(1 if kv_first else 0, index)
        rows.append(taken.transpose(0, 1) if kv_first else taken)  # (n, 2, bytes) / (n, bytes)
    return torch.cat([row.reshape(len(ids), -1) for row in rows], dim=1, out=out)


def scatter_blocks(layer_caches: Sequence, block_ids: Sequence[int], blocks, kv_first: bool = True,
                   indexed: bool | None = None) -> None:
    """Write rows of `blocks` (as gather_blocks makes them) into `block_ids` of every layer: one indexing
    kernel per layer on a GPU, enqueued on the current stream; a copy per range on the CPU."""
    if not len(block_ids):
        return
    torch = _torch()
    views = [_as_bytes(cache, kv_first, layer) for layer, cache in enumerate(layer_caches)]
    ids = _checked_ids(layer_caches, block_ids, kv_first)
    if not _indexed(layer_caches, indexed):
        for row, block in zip(blocks, ids):
            for piece, view in zip(_row_pieces(row, views, kv_first), views):
                (view[:, block] if kv_first else view[block]).copy_(piece)
        return
    index = torch.tensor(ids, dtype=torch.long).to(layer_caches[0].device, non_blocking=True)
    for piece, view in zip(_row_pieces(blocks, views, kv_first), views):
        if kv_first:
            view.index_copy_(1, index, piece.transpose(0, 1))
        else:
            view.index_copy_(0, index, piece)


def _row_pieces(rows, views: list, kv_first: bool) -> list:
    """Each layer's part of a gathered row (or of every row, for a 2-D `rows`): (2, bytes) kv_first, else
    (bytes,), with the rows' leading dimension kept."""
    pieces, at = [], 0
    for view in views:
        width = 2 * view.shape[2] if kv_first else view.shape[1]
        piece = rows[..., at:at + width]
        pieces.append(piece.unflatten(-1, (2, view.shape[2])) if kv_first else piece)
        at += width
    return pieces


def _indexed(layer_caches: Sequence, indexed: bool | None) -> bool:
    return layer_caches[0].device.type != "cpu" if indexed is None else indexed


def _checked_ids(layer_caches: Sequence, block_ids: Sequence[int], kv_first: bool) -> list[int]:
    first = layer_caches[0]
    blocks = first.shape[1] if kv_first else first.shape[0]
    ids = [int(block) for block in block_ids]
    bad = [block for block in ids if not 0 <= block < blocks]
    if bad:
        raise InvalidArgumentError(f"block {bad[0]} is outside the caches' {blocks} blocks")
    return ids


def _torch():
    import torch
    return torch
