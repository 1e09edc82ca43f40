"""What inference engines plug into: KV blocks named by their token prefix, moved between paged KV
caches and kvpool (block_keys, paged_layout, block_store), and a stream of which blocks exist (block_events)."""

from .block_events import REMOVED, STORED, block_events
from .block_keys import BlockNamespace, block_hashes
from .block_store import KVBlockStore
from .paged_layout import block_parts

__all__ = ["REMOVED", "STORED", "BlockNamespace", "KVBlockStore", "block_events", "block_hashes", "block_parts"]
