"""SGLang HiCache storage in kvpool: a HiCacheStorage backend (SGLang 0.5.23) loaded through SGLang's dynamic
storage-backend option, so HiCache's third tier (below GPU memory and the host memory pool) is a kvpool cluster.

Enable it on the server (examples/sglang/README.md has the whole recipe):

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvpool", "module_path": "kvpool.connectors.sglang",
            "class_name": "KvpoolHiCacheStorage", "master": "HOST:PORT", "interface_v1": 1}'

Options in that JSON: "master": "HOST:PORT" or "etcd": "HOST:PORT" (+ "cluster"), and "transports", "token" as
kvpool.Client takes them; "hold_seconds" (default 30): how long the pages a prefix lookup found are kept from
eviction, so that the load which follows it finds them. "interface_v1": 1 (read by SGLang itself) moves pages with
batch_get_v1 / batch_set_v1 straight between SGLang's host memory pool and the storage nodes, no copy on either
side; without it SGLang copies each page through a flat staging tensor and calls get / set / batch_get / batch_set.

What a page becomes (SGLang names a page by the hash of its token prefix): with MHA, this tensor-parallel rank's
K of every layer is one object and its V another, "<hash>/k" and "<hash>/v" under the BlockNamespace of model,
dtype, "sglang-mha-<host layout>" (plus -ppRofN / -cpRofN under pipeline / context parallelism), page size and
"rank R of TP size"; with heterogeneous tensor parallelism (extra config "tp_lcm_size", page_head layout) each
head group of the finer split is its own K and V under its rank of tp_lcm_size, so engines of different TP sizes
share pages. With MLA the latent cache of every layer, the same on every rank, is one object "<hash>/kv" under
rank 0 of 1, shared by all ranks. Both interfaces store the same objects, so either reads what the other wrote.
Hybrid models (SGLang's v2 interface): the host pool group's KV anchor is stored as above, and each side pool
registered by name (Mamba / linear-attention state, SWA KV) page by page as one object "<hash>/<pool>" beside
it (sglang_pools.py); batch_exists_v2 answers the longest prefix every pool can serve by its hit policy
(every page, or the trailing pages a state or window needs), in one lookup.

kvpool checksums every value end to end; a kvpool error on a read is a miss to SGLang (logged once at warning),
never a page of wrong bytes. Bad arguments (a key that is not a string, buffers of the wrong size, host indices
off the pool) raise kvpool's typed errors.
"""

import logging

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, PoolName, PoolTransferResult
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvpool.client import Client
from kvpool.client.put_options import hold_seconds
from kvpool.errors import BatchError, InvalidArgumentError, InvalidKeyError, KeyExistsError, KvpoolError
from kvpool.protocol.keys import validate_key

from .block_keys import BlockNamespace
from .client_settings import client_settings
from .sglang_pools import SidePool, check_host_indices, restorable_ends, side_pool

logger = logging.getLogger(__name__)

DEFAULT_HOLD_SECONDS = 30.0
# Host pool layouts whose pages SGLang's own page-buffer metadata describes as views of one kv_buffer.
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def namespaces_for(config: HiCacheStorageConfig, host_pool, split_factor: int) -> list[BlockNamespace]:
    """The namespaces this rank's pages are stored in: one, or one per head group when heads are split."""
    model = "-".join((config.model_name or "unnamed").split("/"))
    dtype = str(host_pool.dtype).removeprefix("torch.")
    layout = f"sglang-{'mla' if config.is_mla_model else 'mha'}-{host_pool.layout}"
    if config.pp_size > 1:  # each stage holds its own layers
        layout += f"-pp{config.pp_rank}of{config.pp_size}"
    if config.attn_cp_size > 1:  # each context-parallel rank holds its own slice of every page
        layout += f"-cp{config.attn_cp_rank}of{config.attn_cp_size}"
    page_size = host_pool.page_size
    if config.is_mla_model:  # the latent cache is replicated, not sharded, across TP ranks
        return [BlockNamespace(model, dtype, layout, page_size)]
    if split_factor > 1:
        world = config.tp_lcm_size
        return [BlockNamespace(model, dtype, layout, page_size, rank=config.tp_rank * split_factor + group,
                               world=world) for group in range(split_factor)]
    return [BlockNamespace(model, dtype, layout, page_size, rank=config.tp_rank, world=config.tp_size)]


class KvpoolHiCacheStorage(HiCacheStorage):
    """HiCache pages in kvpool. Built by SGLang's StorageBackendFactory as cls(storage_config, kwargs); the host
    memory pool comes after, through register_mem_pool_host, and fixes the page format and key namespaces."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        extra = storage_config.extra_config
        if not isinstance(extra, dict):
            raise InvalidArgumentError("the kvpool HiCache backend is configured by "
                                       "--hicache-storage-backend-extra-config (a JSON object)")
        if storage_config.dcp_size > 1:
            raise InvalidArgumentError("the kvpool HiCache backend does not support decode context parallelism")
        self.hold_seconds = hold_seconds(extra.get("hold_seconds", DEFAULT_HOLD_SECONDS))
        self.storage_config = storage_config
        self.split_factor = (storage_config.tp_lcm_size // storage_config.tp_size
                             if storage_config.should_split_heads else 1)
        self.mem_pool_host = None
        self.namespaces: list[BlockNamespace] = []
        self._objects: list[tuple[int, str]] = []  # per page: (namespace index, object name), in flat page order
        self._object_sizes: list[int] = []
        self._page_bytes = 0
        self._logged: set = set()
        self.side_pools: dict[str, SidePool] = {}  # hybrid models' pools beside the KV one, by name
        self.client = Client(**client_settings(extra, "in --hicache-storage-backend-extra-config"))

    # -- the host memory pool

    def register_mem_pool_host(self, mem_pool_host) -> None:
        config = self.storage_config
        anchor = getattr(mem_pool_host, "anchor_entry", None)  # a hybrid model's HostPoolGroup: its KV pool
        if anchor is not None:
            mem_pool_host = anchor.host_pool
        pool_class, layouts = ((MLATokenToKVPoolHost, MLA_LAYOUTS) if config.is_mla_model
                               else (MHATokenToKVPoolHost, MHA_LAYOUTS))
        kv_buffer = getattr(mem_pool_host, "kv_buffer", None)
        if not isinstance(mem_pool_host, pool_class) or kv_buffer is None or mem_pool_host.layout not in layouts:
            raise InvalidArgumentError(
                f"the kvpool HiCache backend stores a {pool_class.__name__} with a kv_buffer in layout "
                f"{', '.join(layouts)}; got {type(mem_pool_host).__name__} in layout "
                f"{getattr(mem_pool_host, 'layout', None)!r}")
        if kv_buffer.device.type != "cpu" or not kv_buffer.is_contiguous():
            raise InvalidArgumentError("the host pool's kv_buffer must be one contiguous CPU tensor")
        if self.split_factor > 1 and mem_pool_host.layout != "page_head":
            raise InvalidArgumentError("splitting heads across TP sizes (tp_lcm_size) needs the page_head layout")
        super().register_mem_pool_host(mem_pool_host)
        flat = kv_buffer.view(-1).view(torch.uint8)
        self._pool_bytes = memoryview(flat.numpy())
        self._pool_base = kv_buffer.data_ptr()
        self.client.register_buffer(flat)  # one registration for every transfer (UCX), a no-op otherwise
        self.namespaces = namespaces_for(config, mem_pool_host, self.split_factor)
        if config.is_mla_model:
            self._objects = [(0, "kv")]
        else:
            groups = range(self.split_factor)
            self._objects = [(group, "k") for group in groups] + [(group, "v") for group in groups]
        # One page's objects, measured where SGLang says page 0 lies; a flat page is them end to end.
        first_page = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        self._object_sizes = [sum(len(part) for part in parts) for parts in self._pool_parts(first_page, 1)[0]]
        self._page_bytes = sum(self._object_sizes)

    def _pool_parts(self, host_indices, pages: int) -> list[list[list[memoryview]]]:
        """For each page at host_indices: each object's parts, as views of the host pool's buffer."""
        host = self.mem_pool_host
        page_size = host.page_size
        check_host_indices(host_indices, pages, page_size)
        starts = host_indices[::page_size].tolist()
        if any(start % page_size or not 0 <= start <= host.size - page_size for start in starts):
            raise InvalidArgumentError(f"host indices must start whole pages of the {host.size}-token host pool")
        if self.split_factor > 1:
            pointers, sizes = host.get_split_heads_page_buffer_meta(host_indices, self.split_factor)
        else:
            pointers, sizes = host.get_page_buffer_meta(host_indices)
        per_page = len(pointers) // pages
        end = len(self._pool_bytes)
        result = []
        for page in range(pages):
            views = []
            for pointer, size in zip(pointers[page * per_page:(page + 1) * per_page],
                                     sizes[page * per_page:(page + 1) * per_page]):
                offset = pointer - self._pool_base
                if offset < 0 or offset + size > end:
                    raise InvalidArgumentError(f"page at host index {starts[page]} lies outside the host pool")
                views.append(self._pool_bytes[offset:offset + size])
            result.append(self._group(views))
        return result

    def _group(self, views: list) -> list[list[memoryview]]:
        """One page's views, in SGLang's order ([K, V] per layer or per page, per head group), as the parts of
        each object in self._objects order."""
        if self.storage_config.is_mla_model:
            return [views]
        per_group = len(views) // self.split_factor
        groups = [views[g * per_group:(g + 1) * per_group] for g in range(self.split_factor)]
        return [group[0::2] for group in groups] + [group[1::2] for group in groups]

    # -- keys and flat pages

    def _require_pool(self) -> None:
        if self.mem_pool_host is None:
            raise InvalidArgumentError("no host memory pool: SGLang calls register_mem_pool_host first")

    def _page_keys(self, page_hash) -> list[str]:
        if not isinstance(page_hash, str) or not page_hash:
            raise InvalidKeyError(f"a page key must be a non-empty str, got {page_hash!r}")
        keys = [self.namespaces[space].key(f"{page_hash}/{name}") for space, name in self._objects]
        for key in keys:
            validate_key(key)
        return keys

    def _flat_page(self, page, writable: bool) -> memoryview:
        """A flat page's bytes (a tensor, or any buffer), checked to be exactly one page."""
        if isinstance(page, torch.Tensor):
            if writable and (page.device.type != "cpu" or not page.is_contiguous()):
                raise InvalidArgumentError("a page to read into must be a contiguous CPU tensor")
            page = page.detach().cpu().contiguous()
            view = memoryview(page.reshape(-1).view(torch.uint8).numpy())
        else:
            try:
                view = memoryview(page).cast("B")
            except TypeError:
                raise InvalidArgumentError(f"a page must be a tensor or a buffer, not {type(page).__name__}") from None
            if writable and view.readonly:
                raise InvalidArgumentError("a page to read into must be writable")
        if len(view) != self._page_bytes:
            raise InvalidArgumentError(f"a page is {self._page_bytes} bytes here, got {len(view)}")
        return view

    def _split(self, view: memoryview) -> list[list[memoryview]]:
        """A flat page cut into its objects (one part each)."""
        pieces, offset = [], 0
        for size in self._object_sizes:
            pieces.append([view[offset:offset + size]])
            offset += size
        return pieces

    def _failed(self, what: str, exc: Exception) -> None:
        kind = (what, type(exc).__name__)
        if kind in self._logged:
            logger.debug("kvpool %s failed: %s", what, exc)
        else:
            self._logged.add(kind)
            logger.warning("kvpool %s failed, treated as a miss (logged once per kind): %s", what, exc)

    # -- moving pages

    def _put(self, keys: list, parts: list, pages: int, per: int | None = None) -> list[bool]:
        """Store every object (`per` of them a page: default, a KV page's); per page, whether all of its
        objects are stored (by this call or before)."""
        if not keys:
            return []
        failed: set = set()
        try:
            self.client.batch_put_parts(keys, parts)
        except BatchError as exc:
            # The same hash names the same bytes: an object stored (or being stored) by another writer is fine.
            failed = {key for key, error in exc.errors.items() if not isinstance(error, KeyExistsError)}
            if failed:
                self._failed("put", exc)
        except KvpoolError as exc:
            self._failed("put", exc)
            return [False] * pages
        per = per or len(self._objects)
        return [not failed.intersection(keys[page * per:(page + 1) * per]) for page in range(pages)]

    def _get(self, keys: list, parts: list, pages: int, per: int | None = None) -> list[bool]:
        """Read every object into its parts; per page, whether all of its objects were read."""
        try:
            sizes = self.client.batch_get_into_parts(keys, parts)
        except BatchError as exc:
            self._failed("get", exc)
            sizes = [None if isinstance(size, BaseException) else size for size in exc.results]
        except KvpoolError as exc:
            self._failed("get", exc)
            return [False] * pages
        per = per or len(self._objects)
        return [all(size is not None for size in sizes[page * per:(page + 1) * per]) for page in range(pages)]

    def _stored_prefix(self, keys, hold: float) -> int:
        self._require_pool()
        keys = list(keys)
        names = [name for key in keys for name in self._page_keys(key)]
        if not names:
            return 0
        try:
            found = self.client.batch_exists(names, hold=hold)
        except KvpoolError as exc:
            self._failed("exists", exc)
            return 0
        per = len(self._objects)
        return next((page for page in range(len(keys)) if not all(found[page * per:(page + 1) * per])), len(keys))

    # -- HiCacheStorage: zero-copy interface (extra config "interface_v1": 1)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._pages_in_pool(self._get, keys, host_indices)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._pages_in_pool(self._put, keys, host_indices)

    def _pages_in_pool(self, move, keys, host_indices) -> list[bool]:
        """Move pages between kvpool and the host pool's slots at host_indices, one flag per page."""
        self._require_pool()
        keys = list(keys)
        if not keys:
            return []
        names = [name for key in keys for name in self._page_keys(key)]
        parts = [p for page in self._pool_parts(host_indices, len(keys)) for p in page]
        return move(names, parts, len(keys))

    # -- HiCacheStorage: hybrid models' pools (v2)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool_name != PoolName.KV:  # the KV pool is the anchor, stored as v1 stores it
            self._require_pool()
            self.side_pools[str(host_pool_name)] = side_pool(host_pool_name, host_pool, self.namespaces[0])

    def _side(self, name) -> SidePool:
        pool = self.side_pools.get(str(name))
        if pool is None:
            raise InvalidArgumentError(f"pool {name} was never registered (register_mem_host_pool_v2)")
        return pool

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        """The longest prefix of `keys` the KV pool and every pool transfer's pool can serve, each by its hit
        policy, from one lookup (holding what it found for hold_seconds)."""
        self._require_pool()
        keys, transfers = list(keys), list(pool_transfers or [])
        kv_names = [name for key in keys for name in self._page_keys(key)]
        side_names = [self._side(t.name).key(key) for t in transfers for key in keys]
        try:
            found = self.client.batch_exists(kv_names + side_names, hold=self.hold_seconds) if keys else []
        except KvpoolError as exc:
            self._failed("exists", exc)
            return PoolTransferResult(0, {}, [])
        per = len(self._objects)
        kv_present = [all(found[page * per:(page + 1) * per]) for page in range(len(keys))]
        restorable = set(restorable_ends("all_pages", kv_present, 0))
        hits = {PoolName.KV: max(restorable, default=0)}
        at = len(kv_names)
        for transfer in transfers:
            present, at = found[at:at + len(keys)], at + len(keys)
            ends = restorable_ends(str(transfer.hit_policy.value), present, len(transfer.keys or ()))
            hits[transfer.name] = max(ends, default=0)
            restorable &= set(ends)
        ends = sorted(restorable)
        return PoolTransferResult(ends[-1] if ends else 0, {k: v for k, v in hits.items() if v}, ends)

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        return self._pools_moved(transfers, self._get, self.batch_get_v1)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return self._pools_moved(transfers, self._put, self.batch_set_v1)

    def _pools_moved(self, transfers, move, kv_move) -> dict:
        """Each transfer's pages moved between kvpool and its pool's slots: pool name -> a flag per page."""
        results = {}
        for transfer in transfers:
            keys = list(transfer.keys or ())
            if transfer.name == PoolName.KV:
                results[transfer.name] = kv_move(keys, transfer.host_indices)
                continue
            pool = self._side(transfer.name)
            parts = pool.page_parts(transfer.host_indices, len(keys)) if keys else []
            results[transfer.name] = move([pool.key(key) for key in keys], parts, len(keys), per=1)
        return results

    # -- HiCacheStorage: flat pages

    def get(self, key, target_location=None, target_sizes=None):
        """The page read into target_location (a flat page tensor; a new one when None), or None if missing."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None) -> list:
        self._require_pool()
        keys = list(keys)
        if target_locations is None:
            targets = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        else:
            targets = list(target_locations)
        if len(targets) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(targets)} target pages")
        names = [name for key in keys for name in self._page_keys(key)]
        parts = [p for target in targets for p in self._split(self._flat_page(target, writable=True))]
        done = self._get(names, parts, len(keys))
        return [target if ok else None for target, ok in zip(targets, done)]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Store flat pages (as the host pool's get_data_page gives them); True if every page is stored."""
        self._require_pool()
        keys = list(keys)
        values = [] if values is None else list(values)
        if len(values) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(values)} pages")
        names = [name for key in keys for name in self._page_keys(key)]
        parts = [p for value in values for p in self._split(self._flat_page(value, writable=False))]
        return all(self._put(names, parts, len(keys)))

    # -- HiCacheStorage: lookups and housekeeping

    def exists(self, key) -> bool:
        return self._stored_prefix([key], hold=0) == 1

    def batch_exists(self, keys, extra_info=None) -> int:
        """How many leading pages of `keys` are stored; those are kept from eviction for hold_seconds, since
        SGLang asks this right before loading them."""
        return self._stored_prefix(keys, hold=self.hold_seconds)

    def clear(self) -> bool:
        """Remove every page of this rank's namespaces (with MLA: the pages all ranks share)."""
        try:
            for namespace in self.namespaces:
                self.client.remove_prefix(namespace.prefix())
        except KvpoolError as exc:
            logger.warning("kvpool: clearing HiCache pages failed: %s", exc)
            return False
        return True

    def close(self) -> None:
        self.client.close()
