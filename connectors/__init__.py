"""What inference engines plug into: KV blocks named by their token prefix, moved between paged KV
caches and kvpool (block_keys, paged_layout, block_store)."""

from .block_keys import BlockNamespace, block_hashes
from .block_store import KVBlockStore
from .paged_layout import block_parts

__all__ = ["BlockNamespace", "KVBlockStore", "block_hashes", "block_parts"]
