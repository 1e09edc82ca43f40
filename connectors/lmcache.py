"""LMCache remote storage in kvpool: a RemoteConnector that LMCache 0.5.6 loads as a remote-storage plug-in.

Enable it in LMCache's configuration (see examples/lmcache/):

    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.connectors.lmcache
      remote_storage_plugin.kvpool.class_name: KvpoolConnector
      remote_storage_plugin.kvpool.master: "HOST:PORT"    # or .etcd: "HOST:PORT" (+ .cluster)

Optional, under the same prefix: transports ("shm,tcp"), token (as kvpool.Client takes them), key_prefix (what
every object name starts with, default "lmcache/"), hold_seconds (how long a lookup with pin=True keeps the chunks
it found from eviction, default 30). One kvpool plug-in per LMCache configuration: LMCache builds a plug-in's class
with (loop, local_cpu_backend, config) only, so the connector finds its options by its module path.

LMCache's RemoteBackend runs every coroutine of a connector on the backend's event loop, so the connector keeps an
AsyncClient on that loop. A KV chunk is one kvpool object named key_prefix + CacheEngineKey.to_string() (model,
world size, worker, chunk hash, dtype). By default (LMCache's save_chunk_meta) the object is LMCache's RemoteMetadata
header (length, memory format, shapes, dtypes) followed by the chunk's bytes, so any reader rebuilds the MemoryObj
with the stored layout; with extra_config save_chunk_meta: false it is the bytes alone, read back in this engine's
own chunk layout. Bytes go from LMCache's CPU buffers to the storage nodes and back with no copy, except for a chunk
of another size than this engine's full chunk, which is read whole and copied once. A failed read is a miss.
"""

import asyncio

from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvpool.client import AsyncClient
from kvpool.errors import (
    BatchError, InvalidArgumentError, KeyExistsError, KeyNotFoundError, KvpoolError, UnavailableError,
)

from .client_settings import client_settings

logger = init_logger(__name__)

DEFAULT_KEY_PREFIX = "lmcache/"
DEFAULT_HOLD_SECONDS = 30.0


def plugin_options(config) -> dict:
    """The options under remote_storage_plugin.<name>. of the one plug-in whose module_path is this module."""
    extra = config.extra_config or {}
    names = [name for name in (config.remote_storage_plugins or [])
             if extra.get(f"remote_storage_plugin.{name}.module_path") == __name__]
    if len(names) != 1:
        raise InvalidArgumentError(f"expected one entry of remote_storage_plugins with module_path {__name__}, "
                                   f"found {len(names)}: {names}")
    prefix = f"remote_storage_plugin.{names[0]}."
    return {key[len(prefix):]: value for key, value in extra.items() if key.startswith(prefix)}


def chunk_bytes(memory_obj: MemoryObj) -> memoryview:
    """The chunk's bytes as a flat uint8 view into LMCache's buffer (its byte_array is of format '<B')."""
    view = memoryview(memory_obj.byte_array)
    return view if view.format == "B" else view.cast("B")


class KvpoolConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config=None):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        options = plugin_options(config if config is not None else local_cpu_backend.config)
        self.key_prefix = str(options.get("key_prefix", DEFAULT_KEY_PREFIX))
        try:
            self.hold_seconds = float(options.get("hold_seconds", DEFAULT_HOLD_SECONDS))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"hold_seconds must be a number, got {options['hold_seconds']!r}") from None
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.client = AsyncClient(**client_settings(options, "under remote_storage_plugin.<name>."))
        self.closed = False
        self._warned: set[str] = set()

    def name(self, key: CacheEngineKey) -> str:
        return self.key_prefix + key.to_string()

    def _check_open(self) -> None:
        if self.closed:
            raise UnavailableError("the kvpool connector is closed")

    def _run(self, coro):
        """A coroutine of this connector run on its loop, for the synchronous forms (called from other threads)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("a synchronous kvpool connector call on the connector's own event loop would deadlock")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _miss(self, what: str, exc: BaseException) -> None:
        """A read that failed is a miss to LMCache: said at warning level once per kind of failure."""
        kind = type(exc).__name__
        log = logger.debug if kind in self._warned else logger.warning
        self._warned.add(kind)
        log("kvpool: %s is a miss: %s: %s", what, kind, exc)

    # -- lookups

    async def exists(self, key: CacheEngineKey) -> bool:
        self._check_open()
        return await self.client.exists(self.name(key))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._run(self.exists(key))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many leading keys are stored, in one round trip; pin keeps those from eviction for hold_seconds."""
        self._check_open()
        found = await self.client.batch_exists([self.name(key) for key in keys],
                                               hold=self.hold_seconds if pin else 0)
        return next((i for i, there in enumerate(found) if not there), len(found))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._run(self.batched_async_contains("", keys))

    # -- puts

    def _value(self, memory_obj: MemoryObj) -> list:
        data = chunk_bytes(memory_obj)
        if not self.save_chunk_meta:
            return [data]
        header = RemoteMetadata(len(data), memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                memory_obj.get_memory_format()).serialize()
        return [header, data]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Store the chunk; the caller (LMCache) drops its reference afterwards."""
        self._check_open()
        try:
            await self.client.put_parts(self.name(key), self._value(memory_obj))
        except KeyExistsError:
            pass  # a chunk hash names its KV: whoever stored it first stored these bytes

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        self._check_open()
        try:
            await self.client.batch_put_parts([self.name(key) for key in keys],
                                              [self._value(memory_obj) for memory_obj in memory_objs])
        except BatchError as exc:
            if not all(isinstance(error, KeyExistsError) for error in exc.errors.values()):
                raise

    # -- gets

    def _allocate(self, shapes, dtypes, fmt) -> MemoryObj | None:
        # No busy loop: it would wait on this event loop, where the puts that release buffers run.
        return self.local_cpu_backend.allocate(shapes, dtypes, fmt, busy_loop=False)

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Each chunk in a MemoryObj from LMCache's allocator (None: missing or unreadable)."""
        names = [self.name(key) for key in keys]
        if self.closed:
            self._miss(f"reading {len(keys)} chunks", UnavailableError("the kvpool connector is closed"))
            return [None] * len(keys)
        results: list[MemoryObj | None] = [None] * len(keys)
        # Full chunks in this engine's layout are the rule: read each straight into a buffer of that size.
        objs = {}
        for i, name in enumerate(names):
            obj = self._allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None:
                self._miss(name, MemoryError("no free LMCache CPU buffer"))
            else:
                objs[i] = obj
        todo = list(objs)
        headers = [bytearray(self.remote_metadata_bytes) for _ in todo] if self.save_chunk_meta else None
        whole = set()  # chunks of another size than a full one here (a partial chunk, another layout)
        try:
            if self.save_chunk_meta:
                sizes = await self.client.batch_get_into_parts(
                    [names[i] for i in todo], [[header, chunk_bytes(objs[i])] for header, i in zip(headers, todo)])
            else:
                sizes = await self.client.batch_get_into([names[i] for i in todo], [chunk_bytes(objs[i]) for i in todo])
        except BatchError as exc:
            # The chunks that arrived are kept; one that did not fit is read whole below; others are misses.
            sizes = []
            for i, outcome in zip(todo, exc.results):
                if isinstance(outcome, InvalidArgumentError):
                    whole.add(i)
                elif isinstance(outcome, BaseException):
                    self._miss(names[i], outcome)
                sizes.append(None if isinstance(outcome, BaseException) else outcome)
        except KvpoolError as exc:
            for obj in objs.values():
                obj.ref_count_down()
            self._miss(f"reading {len(todo)} chunks", exc)
            return results
        except BaseException:  # cancelled (LMCache stopped waiting): a cancelled kvpool read no longer writes
            for obj in objs.values():
                obj.ref_count_down()
            raise
        for k, (i, size) in enumerate(zip(todo, sizes)):
            obj = objs[i]
            if size is None:
                obj.ref_count_down()
                if i in whole:
                    results[i] = await self._get_whole(names[i])
            elif self.save_chunk_meta:
                results[i] = self._checked(obj, headers[k])
                if results[i] is None:
                    results[i] = await self._get_whole(names[i])
            else:
                results[i] = self._shortened(names[i], obj, size)
        return results

    def _checked(self, obj: MemoryObj, header: bytearray) -> MemoryObj | None:
        """obj if the stored header describes exactly its layout, else None (obj released)."""
        try:
            meta = RemoteMetadata.deserialize(header)
        except Exception:  # unparsable: _get_whole says why
            obj.ref_count_down()
            return None
        if (meta.length == obj.get_size() and meta.shapes == obj.get_shapes() and meta.dtypes == obj.get_dtypes()
                and meta.fmt == obj.get_memory_format()):
            return obj
        obj.ref_count_down()
        return None

    def _shortened(self, name: str, obj: MemoryObj, size: int) -> MemoryObj | None:
        """obj cut to the `size` bytes read (fewer tokens than a full chunk), or None if no whole token count."""
        try:
            obj = self.reshape_partial_chunk(obj, size)
        except ValueError as exc:
            obj.ref_count_down()
            self._miss(name, exc)
            return None
        if obj.meta.shapes is not None and len(obj.meta.shapes) == 1:
            obj.meta.shapes = [obj.meta.shape]  # reshape_partial_chunk updates only the legacy single shape
        return obj

    async def _get_whole(self, name: str) -> MemoryObj | None:
        """Read the object whole, then copy it into a MemoryObj of the layout it describes."""
        try:
            value = memoryview(await self.client.get(name))
        except KeyNotFoundError:
            return None
        except KvpoolError as exc:
            self._miss(name, exc)
            return None
        if not self.save_chunk_meta:
            obj = self._allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None or len(value) > obj.get_size():
                if obj is not None:
                    obj.ref_count_down()
                self._miss(name, ValueError(f"{len(value)} bytes do not fit a chunk of this engine"))
                return None
            chunk_bytes(obj)[:len(value)] = value
            return self._shortened(name, obj, len(value))
        size = self.remote_metadata_bytes
        try:
            meta = RemoteMetadata.deserialize(value[:size])
            if len(value) != size + meta.length:
                raise ValueError(f"header says {meta.length} bytes of KV, the object holds {len(value) - size}")
            obj = self._allocate(meta.shapes, meta.dtypes, meta.fmt)
        except Exception as exc:  # not a chunk LMCache can lay out
            self._miss(name, exc)
            return None
        if obj is None or obj.get_size() != meta.length:
            if obj is not None:
                obj.ref_count_down()
            self._miss(name, MemoryError(f"no LMCache CPU buffer of {meta.length} bytes for {meta.shapes}"))
            return None
        chunk_bytes(obj)[:] = value[size:]
        return obj

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading chunks that could be read, up to the first that could not (the rest released)."""
        objs = await self.batched_get(keys)
        first_miss = next((i for i, obj in enumerate(objs) if obj is None), len(objs))
        for obj in objs[first_miss:]:
            if obj is not None:
                obj.ref_count_down()
        return objs[:first_miss]

    # -- the rest

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self._run(self._remove(key))

    async def _remove(self, key: CacheEngineKey) -> bool:
        self._check_open()
        return await self.client.remove(self.name(key))

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the master answers, else the kvpool error code."""
        try:
            self._check_open()
            await self.client.stats()
        except KvpoolError as exc:
            return int(exc.code)
        return 0

    async def list(self) -> list[str]:
        """Every chunk stored under this plug-in's key_prefix, as LMCache names it (CacheEngineKey.to_string()),
        in byte order; read a page of keys at a time (AsyncClient.iter_keys)."""
        self._check_open()
        start = len(self.key_prefix)
        return [name[start:] async for name in self.client.iter_keys(self.key_prefix)]

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.client.close()
