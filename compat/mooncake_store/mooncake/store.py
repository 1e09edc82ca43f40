"""mooncake.store as code written for Mooncake Store imports it, answered by a kvpool cluster: setup()'s
master_server_addr names a kvpool master (HOST:PORT) or etcd://HOST:PORT. docs/mooncake.md lists the methods.

This package ships mooncake/store.py alone (mooncake/ is a namespace package here), so it never replaces a file
of a real Mooncake's: where one is installed, its compiled store.so is what `import mooncake.store` finds."""

BACKEND = "kvpool"  # what answers: a real Mooncake's module has no such name

try:
    from kvpool.compat.mooncake import (  # noqa: F401
        BufferHandle, MooncakeDistributedStore, MooncakeHostMemAllocator, ReplicateConfig, SoftPinAction,
        bind_to_numa_node,
    )
except ImportError as exc:  # this package without kvpool beside it
    raise ImportError(f"mooncake.store here is kvpool's and needs kvpool installed beside it "
                      f"(pip install <kvpool checkout>): {exc}") from exc

__all__ = ["BufferHandle", "MooncakeDistributedStore", "MooncakeHostMemAllocator", "ReplicateConfig", "SoftPinAction",
           "bind_to_numa_node"]
