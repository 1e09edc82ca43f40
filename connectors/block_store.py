"""KV blocks of paged caches in kvpool: save, look up the stored prefix, load."""

import logging
from typing import Sequence

from kvpool.errors import BatchError, KeyExistsError

from .block_keys import BlockNamespace
from .paged_layout import block_parts

log = logging.getLogger(__name__)


class KVBlockStore:
    """Blocks named by their chained prefix hashes (block_keys) in one namespace, on a kvpool Client."""

    def __init__(self, client, namespace: BlockNamespace, kv_first: bool = True):
        self.client = client
        self.namespace = namespace
        self.kv_first = kv_first

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
        if not todo:
            return 0
        parts = [block_parts(layer_caches, block_ids[i], self.kv_first) for i in todo]
        try:
            self.client.batch_put_parts([keys[i] for i in todo], parts)
        except BatchError as exc:
            # Same hash, same bytes: a block someone else stored first is not a failure.
            if not all(isinstance(error, KeyExistsError) for error in exc.errors.values()):
                raise
            return len(todo) - len(exc.errors)
        return len(todo)

    def load(self, hashes: Sequence[str], block_ids: Sequence[int], layer_caches: Sequence) -> int:
        """Scatter the stored blocks into block_ids of the caches; returns how many leading blocks were loaded.
        A block that is missing, or could not be read (logged), ends the prefix: the engine computes it."""
        if len(block_ids) < len(hashes):
            raise ValueError(f"{len(hashes)} blocks but {len(block_ids)} block ids")
        parts = [block_parts(layer_caches, block_ids[i], self.kv_first) for i in range(len(hashes))]
        try:
            sizes = self.client.batch_get_into_parts(self.keys(hashes), parts)
        except BatchError as exc:
            log.warning("kvpool: %s", exc)
            sizes = [None if isinstance(size, BaseException) else size for size in exc.results]
        return next((i for i, size in enumerate(sizes) if size is None), len(sizes))
