"""AsyncClient: the kvpool API on asyncio.

Control goes to the master over its binary control port, or gRPC (master_link.py); value bytes go
straight between the caller's buffers and the storage nodes (the Transport). A put is
PutStart -> write every replica -> PutEnd (writes.py, batches too); a get is a placement lookup (cached, else
one GetReplicaList) -> read one replica -> verify the checksum (reads.py: a get is a batch of one).
Batches use one RPC per phase for all keys and pipeline the transfers per node, all nodes at once.
This module is the API only: each method checks its arguments and hands them to the machinery.

A compressed object is stored, checksummed and moved as its lz4 bytes; the
client compresses before PutStart and decompresses after the checksum matched,
so callers only ever see raw values.
"""

from kvpool.protocol.cluster_layout import DEFAULT_CLUSTER
from kvpool.protocol.keys import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, validate_keys
from kvpool.errors import BatchError, InvalidArgumentError, InvalidKeyError, KeyNotFoundError
from kvpool.proto import kvpool_pb2 as pb
from kvpool.net.node_connections import DEFAULT_CONNECT_TIMEOUT

from kvpool.client import convert, reads, writes
from kvpool.client.convert import check
from kvpool.client.assembly import Core
from kvpool.client.deadlines import DEFAULT_TIMEOUT, check_timeout
from kvpool.client.master_link import DEFAULT_RPC_TIMEOUT
from kvpool.client.placement_cache import DEFAULT_CAPACITY
from kvpool.client.transport import Transport
from kvpool.client.device.staged import is_device
from kvpool.client.values import bytes_of, writable_view


class AsyncClient:
    """AsyncClient("HOST:PORT") or AsyncClient(etcd="HOST:PORT", cluster="default").

    replicas: copies written per put. cache_size: placements remembered (0 = always ask the master).
    compress_above: values larger than this many bytes are lz4-compressed when that makes them
    smaller, unless a put says compress=False (None: only puts with compress=True are compressed).
    read_timeout: seconds a replica may take to answer a read (plus one second per 100 MB read)
    before the read moves on to the next replica: a hung node must not hang its readers (default 3 s, or
    0.6 of `timeout` when that is less, so a silent replica leaves the call time for another).
    write_timeout: seconds a node may take to store a put's copy (plus one second per 100 MB) before
    that copy counts as failed: the put then fails (and is revoked) unless min_replicas copies were
    written, in which case it returns and the master is told which nodes failed. A silent node
    (a partition) thus costs a put at most this long (default as read_timeout's).
    transports: which data transports value bytes may take, e.g. "shm,tcp" (default
    $KVPOOL_TRANSPORTS, else all: shared memory with nodes on this host, UCX, TCP).
    token: the client token (`kvpool token --client`) or the cluster secret, proved to the master and
    every node at connect time (default: the file $KVPOOL_TOKEN_FILE names, else $KVPOOL_TOKEN;
    "" for none, with a cluster that runs without a secret).
    tls_ca: the cluster's CA certificate (`ca.pem`) when it runs TLS: every connection is then TLS and
    checked against it (default $KVPOOL_TLS_CA; none: plain TCP).
    confirm_puts: a put of a new key returns once its copies are written and the frame that ends it
    has left for the master, which every later call of this client reaches after it; True waits for
    the master's answer too, as overwrites always do (client/writes.py). flush() waits for and
    reports those answers.
    timeout: seconds any call may take, end to end (master calls with their retries and failover,
    node reads and writes; default 5, plus a second per 100 MB a put or a get into buffers moves);
    every call also takes its own `timeout=`, which is exact. A call past it raises
    DeadlineExceededError, except a put whose end had left for the master: PutOutcomeUnknownError.
    device_pool_size, device_chunk_size: the staging pool device memory (CUDA tensors, CuPy arrays) moves
    through: page-locked host memory allocated once, at the first device transfer (default 256 MiB, in 4 MiB
    chunks). A transfer waits for room (within its deadline); a single value larger than the pool is refused.
    copy_engine: what copies device memory (default: the CUDA engine, made at the first CUDA buffer);
    client.device.cpu.CpuCopyEngine runs the same pipeline over host memory.
    shared_dir: the shared tier's directory (a storage node's --shared-dir), when this host mounts it too:
    objects there are read from their files by this client, each checked against its placement and
    checksum (a file that fails is read through a node instead). The file system's permissions decide who
    may read them (docs/tiers.md, "Shared tier"): give it only to clients trusted with every key of the pool.
    object_store: the shared tier's bucket (a storage node's --object-store, s3://BUCKET/PREFIX, credentials
    as the AWS tools read them), for the same direct reads; the bucket's policy decides who may read them.
    Both, where the nodes have the bucket beneath the directory: the directory is read first.
    """

    def __init__(self, address: str | None = None, *, etcd: str | None = None,
                 cluster: str = DEFAULT_CLUSTER, replicas: int = 1, cache_size: int = DEFAULT_CAPACITY,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 transport: Transport | None = None, compress_above: int | None = None,
                 read_timeout: float | None = None, transports: str | None = None,
                 token: str | None = None, confirm_puts: bool = False, tls_ca: str | None = None,
                 write_timeout: float | None = None, timeout: float = DEFAULT_TIMEOUT,
                 shared_dir: str | None = None, device_pool_size: int | None = None,
                 device_chunk_size: int | None = None, copy_engine=None, object_store: str | None = None,
                 _core: Core | None = None):
        # _core: the parts to run on, made by the blocking Client (with its blocking io).
        self._core = _core or Core(address, etcd=etcd, cluster=cluster, replicas=replicas, cache_size=cache_size,
                                   rpc_timeout=rpc_timeout, connect_timeout=connect_timeout, transport=transport,
                                   compress_above=compress_above, read_timeout=read_timeout,
                                   transports=transports, token=token, confirm_puts=confirm_puts, tls_ca=tls_ca,
                                   write_timeout=write_timeout, timeout=timeout, shared_dir=shared_dir,
                                   device_pool_size=device_pool_size, device_chunk_size=device_chunk_size,
                                   copy_engine=copy_engine, object_store=object_store)

    def bytes_by_transport(self) -> dict:
        """Value bytes moved so far per data transport ("shm", "ucx", "tcp"; "shared": read from the shared
        tier's files by this client). Device memory's bytes are counted twice: by the transport that carried
        them, and as "cuda:staged" (through the staging pool) or "cuda:direct" (one DMA between the GPU and a
        same-host node's mapping)."""
        moved = dict(self._core.transport.moved)
        if self._core.shared_bytes:
            moved["shared"] = self._core.shared_bytes
        moved.update((path, count) for path, count in self._core.devices.moved.items() if count > 0)
        return moved

    def device_memory(self) -> dict:
        """The device pipeline's staging pool (bytes: its size, chunk, allocated, in use, peak; waits for room)
        and its copy engine ("cuda"; None before the first device buffer)."""
        report = self._core.devices.report()
        report.pop("moved")
        return report

    def transport_for(self, address: str) -> str | None:
        """The transport value bytes to the node at `address` take now (None before first contact)."""
        return self._core.transport.transport_for(address)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the master answered the end of every put (for up to `timeout`, default the
        client's); raises BatchError naming the puts that did not end since the last flush: each
        error says the value is not stored, except PutOutcomeUnknownError (no answer could be had)."""
        core = self._core
        await core.commits.flush(core.timeout if timeout is None else check_timeout(timeout))

    async def close(self) -> None:
        await self._core.close()

    # -- put

    async def put(self, key: str, value, overwrite: bool = False, *, tier: str | None = None,
                  pin: str | None = None, pin_ttl: float | None = None, ttl: float | None = None,
                  compress: bool | None = None, replicas: int | None = None,
                  min_replicas: int | None = None, timeout: float | None = None) -> None:
        """Store `value` under `key`.

        tier: "dram" (default) or "ssd", where the node places it first; "shared" (or "object", its name when
        it is a bucket): on to the shared tier once stored. pin: "soft" (evicted only when
        nothing unpinned is left, for pin_ttl seconds, default 600) or "hard" (never evicted). ttl:
        seconds until it expires. compress: True/False, or None to follow compress_above.
        replicas: copies on distinct nodes (default: the client's). min_replicas: the put succeeds once
        this many are written (the master copies the rest later); default all of them.
        timeout: seconds this call may take (default: the client's).
        """
        await writes.put(self._core, key, value, overwrite, tier=tier, pin=pin, pin_ttl=pin_ttl, ttl=ttl,
                         compress=compress, replicas=replicas, min_replicas=min_replicas, timeout=timeout)

    async def batch_put(self, keys, values, overwrite: bool = False, *, tier: str | None = None,
                        pin: str | None = None, pin_ttl: float | None = None, ttl: float | None = None,
                        compress: bool | None = None, replicas: int | None = None,
                        min_replicas: int | None = None, timeout: float | None = None) -> None:
        """Put every pair (options as put, for every key); raises BatchError naming the keys
        that failed after finishing the rest."""
        await writes.batch_put(self._core, keys, values, overwrite, tier=tier, pin=pin, pin_ttl=pin_ttl, ttl=ttl,
                               compress=compress, replicas=replicas, min_replicas=min_replicas, timeout=timeout)

    # -- get

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """The value as a new bytes object, received in place."""
        return bytes_of(await self._read_one(key, None, timeout))

    async def get_into(self, key: str, buffer, *, timeout: float | None = None) -> int:
        """Read the value into the front of `buffer`; returns its size."""
        return len(await self._read_one(key, self._core.devices.writable(buffer), timeout))

    async def batch_get(self, keys, *, timeout: float | None = None) -> list:
        """Values in key order; None for a key that does not exist. Any other failure raises
        BatchError (after every key was tried) mapping each failed key to its error."""
        keys = list(keys)
        return _batch_results(keys, await self._read(keys, None, timeout), bytes_of)

    async def size(self, key: str, *, timeout: float | None = None) -> int:
        """The size get would return for `key`, from the master (nothing is read); KeyNotFoundError when
        it does not exist."""
        async with self._core.bounded(timeout, f"size of {key!r}"):
            return await reads.size(self._core, key)

    # -- zero-copy forms: caller buffers, one buffer with offsets, and values made of parts

    async def put_from(self, key: str, buffer, overwrite: bool = False, **options) -> None:
        """put() of any buffer (bytearray, numpy array, torch CPU tensor, ...): sent from it, never copied.
        Device memory (a CUDA tensor, ...) goes through the client's staging pool (client/device)."""
        await self.put(key, buffer, overwrite, **options)

    async def batch_put_from(self, keys, buffers, overwrite: bool = False, *, offsets=None, sizes=None,
                             **options) -> None:
        """batch_put() from one buffer per key, or from one buffer and each key's (offset, size)."""
        keys = list(keys)
        if offsets is not None:
            buffers = _slices(self._core.devices.readable(buffers), keys, offsets, sizes)
        await self.batch_put(keys, buffers, overwrite, **options)

    async def batch_get_into(self, keys, buffers, *, offsets=None, sizes=None, timeout: float | None = None) -> list:
        """Read each key into its buffer, in key order; None for a key that does not exist.

        buffers: one per key; or, with offsets, ONE buffer that key i lands in at offsets[i] (how KV
        caches are laid out), with room for sizes[i] bytes (default: up to the next offset, or the end).
        Returns the sizes read."""
        keys = list(keys)
        devices = self._core.devices
        if offsets is not None:
            dests = _slices(devices.writable(buffers), keys, offsets, sizes)
        else:
            dests = [devices.writable(buffer) for buffer in buffers]
        if len(dests) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(dests)} buffers")
        return _batch_results(keys, await self._read(keys, dests, timeout), len)

    async def put_parts(self, key: str, parts, overwrite: bool = False, **options) -> None:
        """Store the buffers in `parts` (e.g. one block's K and V of every layer) as one value,
        in order, sent straight from each."""
        await self.put(key, self._core.devices.parts(parts, writable=False), overwrite, **options)

    async def get_into_parts(self, key: str, parts, *, timeout: float | None = None) -> int:
        """Scatter the value back into `parts`, whose sizes must add up to its size; returns it."""
        return len(await self._read_one(key, self._core.devices.parts(parts, writable=True), timeout))

    async def batch_put_parts(self, keys, parts_per_key, overwrite: bool = False, **options) -> None:
        devices = self._core.devices
        await self.batch_put(keys, [devices.parts(p, writable=False) for p in parts_per_key], overwrite, **options)

    async def batch_get_into_parts(self, keys, parts_per_key, *, timeout: float | None = None) -> list:
        """get_into_parts for every key: sizes in key order, None for a key that does not exist."""
        devices = self._core.devices
        return await self.batch_get_into(keys, [devices.parts(p, writable=True) for p in parts_per_key],
                                         timeout=timeout)

    def register_buffer(self, buffer) -> None:
        """Tell the transports a buffer will be used for many transfers (UCX registers its memory
        once instead of per transfer); a no-op for the others."""
        self._core.transport.register_buffer(writable_view(buffer))

    async def _read_one(self, key: str, dest, timeout: float | None):
        """The value read, verified (and decompressed) into dest, or a new buffer when dest is None."""
        async with self._core.bounded(timeout, f"get of {key!r}", 0 if dest is None else len(dest)):
            [result] = await _read(self._core, [key], None if dest is None else [dest])
            if isinstance(result, BaseException):
                raise result
        return result

    async def _read(self, keys: list, dests: list | None, timeout: float | None) -> list:
        """reads.read within the call's deadline."""
        nbytes = 0 if dests is None else sum(map(len, dests))
        async with self._core.bounded(timeout, f"get of {len(keys)} keys", nbytes):
            return await _read(self._core, keys, dests)

    # -- metadata

    async def exists(self, key: str, hold: float = 0, *, timeout: float | None = None) -> bool:
        """Whether key is stored. hold > 0: also keep it from eviction for that many seconds
        (bounded by the master's --max-hold); the only way a hold is made or renewed."""
        return convert.exists_answer(await self._call("Exists", convert.exists_request(self._core.stored(key), hold),
                                                      timeout))

    async def batch_exists(self, keys, hold: float = 0, *, timeout: float | None = None) -> list:
        """exists() for every key, in one round trip."""
        keys = self._core.stored_keys(list(keys))
        if hold == 0 and type(hold) in (int, float):  # no hold: a LOOKUP (MasterLink.lookup)
            validate_keys(keys)
            if not keys:
                return []
            async with self._core.bounded(timeout, "BatchExists"):
                found = await self._core.master.lookup(keys, lambda: convert.batch_exists_request(keys, 0))
            return convert.batch_exists_answer(found, len(keys))
        request = convert.batch_exists_request(keys, hold)
        if request is None:
            return []
        return convert.batch_exists_answer(await self._call("BatchExists", request, timeout), len(keys))

    async def remove(self, key: str, *, timeout: float | None = None) -> bool:
        """True if the key existed."""
        key = self._core.stored(key)
        request = convert.remove_request(key)
        try:
            answer = await self._call("Remove", request, timeout)
        finally:
            self._core.cache.invalidate(key)
        return convert.removed(answer)

    async def remove_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        """Remove every key starting with `prefix`; returns how many were removed."""
        if not isinstance(prefix, str):
            raise InvalidKeyError(f"prefix must be str, not {type(prefix).__name__}")
        if not prefix:  # (a tenant's scope would make it non-empty: refused alike)
            raise InvalidArgumentError("prefix must not be empty")
        prefix = self._core.stored(prefix)
        try:
            answer = await self._call("RemoveByPrefix", convert.remove_prefix_request(prefix), timeout)
        finally:
            self._core.cache.invalidate_prefix(prefix)
        return check(answer).removed

    async def list_keys(self, prefix: str = "", limit: int = DEFAULT_LIST_LIMIT, cursor: str | None = None, *,
                        timeout: float | None = None) -> tuple[list[str], str | None]:
        """A page of the stored keys beginning with `prefix`, in byte order: (up to `limit` keys, 1 to
        10000, the cursor to pass for the next page, None after the last). Only committed objects are
        listed (not puts in progress), and only this client's: a tenant's own keys, the client token's
        those of no tenant. A key stored throughout a listing is listed exactly once, whatever else is
        put or removed meanwhile."""
        core = self._core
        request = convert.list_keys_request(prefix, limit, cursor, core.stored)
        return convert.listed_keys(await self._call("ListKeys", request, timeout), core.named)

    async def iter_keys(self, prefix: str = "", *, timeout: float | None = None):
        """Every stored key beginning with `prefix`, in byte order, a page (list_keys) at a time."""
        cursor = None
        while True:
            keys, cursor = await self.list_keys(prefix, MAX_LIST_LIMIT, cursor, timeout=timeout)
            for key in keys:
                yield key
            if cursor is None:
                return

    async def stats(self, *, timeout: float | None = None) -> pb.StatsResponse:
        return await self._call("Stats", convert.stats_request(), timeout)

    async def drain(self, node_id: str, *, timeout: float | None = None) -> int:
        """Have the master move every object off a storage node (no new placement there, copies
        made elsewhere, then its own freed); returns how many objects had a copy there."""
        return check(await self._call("Drain", convert.drain_request(node_id), timeout)).objects

    async def tenants(self, action: str = "list", name: str = "", *, timeout: float | None = None,
                      **limits) -> list:
        """An operator's tenants (needs the cluster secret): action list, usage, create, set, rotate or
        delete; create and set take limits in bytes (quota, quota_dram, quota_ssd, reserve) or objects
        (quota_objects). Returns the tenants' TenantUsage (for a change, the record as it now is)."""
        return list(check(await self._call("Tenants", convert.tenants_request(action, name, limits), timeout)).tenants)

    async def _call(self, method: str, request, timeout: float | None):
        """Master.<method> within the call's deadline."""
        async with self._core.bounded(timeout, method):
            return await self._core.master.call(method, request)


async def _read(core: Core, keys: list, dests: list | None) -> list:
    """reads.read, through the device pipeline when a destination is device memory (client/device)."""
    if dests is not None and any(is_device(dest) for dest in dests):
        return await core.devices.read_waves(core, keys, dests, reads.read)
    return await reads.read(core, keys, dests)


def _batch_results(keys: list, results: list, convert_value) -> list:
    """Values in key order, None for a key that does not exist; BatchError if any other failed."""
    outcomes = [None if r is None or isinstance(r, KeyNotFoundError) else r if isinstance(r, BaseException)
                else convert_value(r) for r in results]
    errors = {keys[i]: r for i, r in enumerate(outcomes) if isinstance(r, BaseException)}
    if errors:
        first_key, first = next(iter(errors.items()))
        raise BatchError(f"{len(errors)} of {len(keys)} reads failed (first: {first_key!r}: {first})", errors,
                         outcomes)
    return outcomes


def _slices(whole: memoryview, keys: list, offsets, sizes) -> list:
    """Views of `whole` at each key's offset: sizes[i] bytes, or (sizes None) up to the next offset."""
    offsets = list(offsets)
    sizes = None if sizes is None else list(sizes)
    if len(offsets) != len(keys) or (sizes is not None and len(sizes) != len(keys)):
        raise InvalidArgumentError(f"{len(keys)} keys need as many offsets (and sizes)")
    if sizes is None:  # one sort, then each offset's end looked up (not searched for: thousands of blocks)
        starts = sorted(set(offsets))
        end_of = dict(zip(starts, starts[1:] + [len(whole)]))
        sizes = [end_of[offset] - offset for offset in offsets]
    views = []
    for offset, size in zip(offsets, sizes):
        if offset < 0 or size < 0 or offset + size > len(whole):
            raise InvalidArgumentError(f"slice [{offset}, {offset + size}) is outside the {len(whole)}-byte buffer")
        views.append(whole[offset:offset + size])
    return views
