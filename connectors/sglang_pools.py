"""The side pools of a hybrid model in SGLang's HiCache (its v2 storage interface): Mamba / linear-attention
state, sliding-window KV and the like, each a host pool registered by name beside the KV pool.

A side pool's page (a Mamba state slot, an SWA page) is one kvpool object, "<hash>/<pool>", in the KV pool's
namespace with the pool's name added to the layout; its parts are the views SGLang's own get_page_buffer_meta
names (for Mamba: the temporal state, then each conv state, every layer), each checked to lie inside one of the
pool's own CPU buffers before it is read or written. Which pages a prefix hit needs from a pool is its hit policy:
ALL_PAGES, every page; TRAILING_PAGES, only the last pages before the hit's end (a state, a window).
"""

from dataclasses import dataclass

import torch

from kvpool.errors import InvalidArgumentError

from .block_keys import BlockNamespace

BUFFERS = ("kv_buffer", "k_buffer", "v_buffer", "temporal_buffer", "conv_buffer")  # where host pools keep bytes


@dataclass
class SidePool:
    name: str
    host: object
    namespace: BlockNamespace
    regions: list  # (start address, memoryview of the bytes) of each of the pool's buffers

    def key(self, page_hash: str) -> str:
        return self.namespace.key(f"{page_hash}/{self.name}")

    def page_parts(self, host_indices, pages: int) -> list[list[memoryview]]:
        """Each page's parts at host_indices, as views of the pool's own buffers."""
        check_host_indices(host_indices, pages, self.host.page_size or 1)
        pointers, sizes = self.host.get_page_buffer_meta(host_indices)
        if not pages or len(pointers) % pages:
            raise InvalidArgumentError(f"pool {self.name}: {len(pointers)} buffers for {pages} pages")
        per_page = len(pointers) // pages
        views = [self._view(int(pointer), int(size)) for pointer, size in zip(pointers, sizes)]
        return [views[page * per_page:(page + 1) * per_page] for page in range(pages)]

    def _view(self, address: int, size: int) -> memoryview:
        for start, view in self.regions:
            if start <= address and address + size <= start + len(view):
                return view[address - start:address - start + size]
        raise InvalidArgumentError(f"pool {self.name}: a page lies outside the pool's buffers")


def check_host_indices(host_indices, pages: int, page_size: int) -> None:
    """Host indices as SGLang passes them for `pages` pages: a 1-D integer tensor of pages x page_size."""
    if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1 \
            or host_indices.dtype.is_floating_point or host_indices.dtype == torch.bool:
        raise InvalidArgumentError("host_indices must be a 1-D integer tensor")
    if host_indices.numel() != pages * page_size:
        raise InvalidArgumentError(f"{pages} pages need {pages * page_size} host indices, got {host_indices.numel()}")


def side_pool(name, host_pool, kv_namespace: BlockNamespace) -> SidePool:
    """A registered host pool, its buffers found and checked (CPU, contiguous)."""
    if not hasattr(host_pool, "get_page_buffer_meta"):
        raise InvalidArgumentError(f"host pool {name} ({type(host_pool).__name__}) names no page buffers")
    regions = []
    for attribute in BUFFERS:
        value = getattr(host_pool, attribute, None)
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise InvalidArgumentError(f"host pool {name}: {attribute} must be contiguous CPU tensors")
            regions.append((tensor.data_ptr(), memoryview(tensor.reshape(-1).view(torch.uint8).numpy())))
    if not regions:
        raise InvalidArgumentError(f"host pool {name} ({type(host_pool).__name__}) has no CPU buffers")
    dtype = str(getattr(host_pool, "dtype", "bytes")).removeprefix("torch.")
    namespace = BlockNamespace(kv_namespace.model, dtype, f"{kv_namespace.layout}-{name}", kv_namespace.block_size,
                               kv_namespace.kv_heads, kv_namespace.rank, kv_namespace.world)
    return SidePool(str(name), host_pool, namespace, regions)


def restorable_ends(policy: str, present: list[bool], trailing: int) -> list[int]:
    """Prefix lengths (1..len(present)) a pool can serve: ALL_PAGES needs every page before the end,
    TRAILING_PAGES the last `trailing`."""
    if policy == "all_pages":
        first_missing = next((i for i, there in enumerate(present) if not there), len(present))
        return list(range(1, first_missing + 1))
    if policy == "trailing_pages":
        window = max(1, trailing)
        return [end for end in range(1, len(present) + 1) if all(present[max(0, end - window):end])]
    raise InvalidArgumentError(f"hit policy {policy!r} is not supported by the kvpool HiCache backend yet")
