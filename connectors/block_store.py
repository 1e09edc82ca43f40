"""KV blocks of paged caches in kvpool: save, look up the stored prefix, load."""

import logging
import threading
from typing import Sequence

from kvpool.errors import BatchError, KeyExistsError

from .block_keys import BlockNamespace
from .paged_layout import block_bytes, gather_blocks, scatter_blocks

log = logging.getLogger(__name__)


class KVBlockStore:
    """Blocks named by their chained prefix hashes (block_keys) in one namespace, on a kvpool Client."""

    def __init__(self, client, namespace: BlockNamespace, kv_first: bool = True):
        self.client = client
        self.namespace = namespace
        self.kv_first = kv_first
        # CPU caches: the gathered blocks' buffer, kept per thread (fresh pages cost more than the copy itself).
        self._scratch = threading.local()

    def keys(self, hashes: Sequence[str]) -> list[str]:
        return [self.namespace.key(h) for h in hashes]

    def lookup(self, hashes: Sequence[str], hold: float = 0) -> int:
        """How many leading blocks of `hashes` are stored, in one round trip. hold > 0 keeps them
        from eviction that many seconds, e.g. until the engine has loaded them."""
        if not hashes:
            return 0
        found = self.client.batch_exists(self.keys(hashes), hold=hold)
        return next((i for i, there in enumerate(found) if not there), len(found))

    def save(self, hashes: Sequence[str], block_ids: Sequence[int], layer_caches: Sequence) -> int:
        """Store the blocks not stored yet (block i of the prefix lives in block_ids[i] of the caches);
        returns how many were written. Another writer storing the same block meanwhile is fine."""
        keys = self.keys(hashes)
        todo = [i for i, there in enumerate(self.client.batch_exists(keys)) if not there]
        written = 0
        size = block_bytes(layer_caches, self.kv_first)
        for group in _groups(todo, size):
            # Gathered on the caches' device (GPU or CPU), then one batch from that buffer.
            blocks = gather_blocks(layer_caches, [block_ids[i] for i in group], self.kv_first,
                                   out=self._buffer(layer_caches, len(group), size))
            try:
                self.client.batch_put_from([keys[i] for i in group], blocks, offsets=_offsets(group, size),
                                           sizes=[size] * len(group))
            except BatchError as exc:
                # Same hash, same bytes: a block someone else stored first is not a failure.
                if not all(isinstance(error, KeyExistsError) for error in exc.errors.values()):
                    raise
                written -= len(exc.errors)
            written += len(group)
        return written

    def load(self, hashes: Sequence[str], block_ids: Sequence[int], layer_caches: Sequence) -> int:
        """Scatter the stored blocks into block_ids of the caches; returns how many leading blocks were loaded.
        A block that is missing, or could not be read (logged), ends the prefix: the engine computes it."""
        if len(block_ids) < len(hashes):
            raise ValueError(f"{len(hashes)} blocks but {len(block_ids)} block ids")
        keys = self.keys(hashes)
        size = block_bytes(layer_caches, self.kv_first)
        loaded = 0
        for group in _groups(range(len(hashes)), size):
            blocks = self._buffer(layer_caches, len(group), size)
            try:
                sizes = self.client.batch_get_into([keys[i] for i in group], blocks, offsets=_offsets(group, size),
                                                   sizes=[size] * len(group))
            except BatchError as exc:
                log.warning("kvpool: %s", exc)
                sizes = [None if isinstance(got, BaseException) else got for got in exc.results]
            whole = next((n for n, got in enumerate(sizes) if got != size), len(sizes))
            scatter_blocks(layer_caches, [block_ids[i] for i in group[:whole]], blocks[:whole], self.kv_first)
            loaded += whole
            if whole < len(group):
                break
        return loaded

    def _buffer(self, layer_caches: Sequence, count: int, size: int):
        """Room for `count` blocks on the caches' device: new on a GPU (its allocator keeps freed memory for
        reuse, and the engine's own memory is tight), the kept one on the CPU."""
        import torch
        device = layer_caches[0].device
        if device.type != "cpu":
            return torch.empty((count, size), dtype=torch.uint8, device=device)
        kept = getattr(self._scratch, "buffer", None)
        if kept is None or kept.numel() < count * size:
            kept = self._scratch.buffer = torch.empty(count * size, dtype=torch.uint8)
        return kept[:count * size].view(count, size)


# Blocks moved per batch: the gathered buffer is this large at most (on a GPU, beside the engine's own memory).
GROUP_BYTES = 64 * 1024 * 1024


def _groups(indices, size: int) -> list[list[int]]:
    indices = list(indices)
    per = max(1, GROUP_BYTES // max(size, 1))
    return [indices[at:at + per] for at in range(0, len(indices), per)]


def _offsets(group: list, size: int) -> list[int]:
    return [n * size for n in range(len(group))]


