"""Mooncake Store's Python client on kvpool: `from kvpool.compat.mooncake import MooncakeDistributedStore` where
code says `from mooncake.store import MooncakeDistributedStore`, or install compat/mooncake_store to give such
code the module `mooncake.store` itself. docs/mooncake.md lists every method and what differs."""

from .codes import OBJECT_NOT_FOUND, OK
from .config import ReplicateConfig, SoftPinAction
from .memory import MooncakeHostMemAllocator
from .store import BufferHandle, MooncakeDistributedStore


def bind_to_numa_node(node: int) -> None:
    """Accepted and ignored: kvpool's client pins no threads (its nodes place their memory themselves)."""


__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "BufferHandle",
           "MooncakeHostMemAllocator", "bind_to_numa_node", "OK", "OBJECT_NOT_FOUND"]
