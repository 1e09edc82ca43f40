"""AsyncClient: the kvpool API on asyncio.

Control goes to the master over its binary control port, or gRPC (MasterLink); value bytes go straight
between the caller's buffers and the storage nodes (Transport). A put is
PutStart -> write every replica -> PutEnd (PutRevoke if anything fails); a get
is a placement lookup (cached, else one GetReplicaList) -> read one replica ->
verify the checksum. Batches use one RPC per phase for all keys and pipeline
the transfers per node, all nodes at once.

A compressed object is stored, checksummed and moved as its lz4 bytes; the
client compresses before PutStart and decompresses after the checksum matched,
so callers only ever see raw values.
"""

import asyncio
import os

from kvpool.security import auth
from kvpool.protocol import transports as transport_names
from kvpool.protocol.cluster_layout import DEFAULT_CLUSTER
from kvpool.errors import (
    BatchError, ChecksumMismatchError, Code, InternalError, InvalidArgumentError, InvalidKeyError,
    KeyNotFoundError, KvpoolError, StaleReplicaError, UnavailableError, error_for,
)
from kvpool.protocol.keys import validate_key
from kvpool.protocol.parts import Parts
from kvpool.proto import kvpool_pb2 as pb
from kvpool.net.tcp_link import DEFAULT_CONNECT_TIMEOUT
from kvpool.security.tls import client_files

from . import batch_put as batch_puts
from . import compression, put_options
from .commits import Commits
from .master_link import DEFAULT_RPC_TIMEOUT, MasterLink, check
from .replica_order import drop_replicas, nearest_first
from .placement_cache import DEFAULT_CAPACITY, PlacementCache
from .selector import TransportSelector
from .transport import ReadItem, Transport, WriteItem
from .values import bytes_of, checksum_of, fresh_bytes_view, readable_view, value_parts, writable_view

DEFAULT_READ_TIMEOUT = 5.0
CLOSE_FLUSH_TIMEOUT = 2.0  # how long close() waits for the master's answers to posted put ends

# A replica read that fails like this may mean the placement moved on: ask the master again.
_REFETCH = (StaleReplicaError, KeyNotFoundError, UnavailableError)
# What a node says when it no longer has the version the master placed there (evicted, expired).
_GONE = (StaleReplicaError, KeyNotFoundError)


class AsyncClient:
    """AsyncClient("HOST:PORT") or AsyncClient(etcd="HOST:PORT", cluster="default").

    replicas: copies written per put. cache_size: placements remembered (0 = always ask the master).
    compress_above: values larger than this many bytes are lz4-compressed when that makes them
    smaller, unless a put says compress=False (None: only puts with compress=True are compressed).
    read_timeout: seconds a replica may take to answer a read (plus one second per 100 MB read)
    before the read moves on to the next replica: a hung node must not hang its readers.
    transports: which data transports value bytes may take, e.g. "shm,tcp" (default
    $KVPOOL_TRANSPORTS, else all: shared memory with nodes on this host, UCX, TCP).
    token: the client token (`kvpool token --client`) or the cluster secret, proved to the master and
    every node at connect time (default: the file $KVPOOL_TOKEN_FILE names, else $KVPOOL_TOKEN;
    "" for none, with a cluster that runs without a secret).
    tls_ca: the cluster's CA certificate (`ca.pem`) when it runs TLS: every connection is then TLS and
    checked against it (default $KVPOOL_TLS_CA; none: plain TCP).
    confirm_puts: a put of a new key returns once its copies are written and the frame that ends it
    has left for the master, which every later call of this client reaches after it; True waits for
    the master's answer too, as overwrites always do (client/commits.py). flush() waits for and
    reports those answers.
    """

    def __init__(self, address: str | None = None, *, etcd: str | None = None,
                 cluster: str = DEFAULT_CLUSTER, replicas: int = 1, cache_size: int = DEFAULT_CAPACITY,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 transport: Transport | None = None, compress_above: int | None = None,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, transports: str | None = None,
                 token: str | None = None, confirm_puts: bool = False, tls_ca: str | None = None,
                 _blocking: bool = False):
        if not isinstance(replicas, int) or replicas < 1:
            raise InvalidArgumentError(f"replicas must be a positive integer, got {replicas!r}")
        self._compress_above = compression.check_threshold(compress_above)
        try:
            credential = auth.client_credential(token)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        tls = client_files(tls_ca)
        # _blocking: set by the blocking Client, whose loop runs only inside one caller's call.
        self._master = MasterLink(address, etcd, cluster, rpc_timeout, blocking=_blocking, credential=credential,
                                  tls=tls)
        if transport is None:
            try:
                allowed = transport_names.parse(transports if transports is not None
                                                else os.environ.get(transport_names.ENV))
            except ValueError as exc:
                raise InvalidArgumentError(str(exc)) from None
            transport = TransportSelector(connect_timeout, allowed, credential, inline=_blocking, tls=tls)
        self._transport = transport
        self._cache = PlacementCache(cache_size)
        self._commits = Commits(self._master, self._cache.invalidate, confirm_puts)
        self._replicas = replicas
        if not read_timeout > 0:
            raise InvalidArgumentError(f"read_timeout must be positive, got {read_timeout!r}")
        self._read_timeout = read_timeout

    def bytes_by_transport(self) -> dict:
        """Value bytes moved so far per data transport ("shm", "ucx", "tcp")."""
        return dict(getattr(self._transport, "moved", {}))

    def transport_for(self, address: str) -> str | None:
        """The transport value bytes to the node at `address` take now (None before first contact)."""
        choose = getattr(self._transport, "transport_for", None)
        return choose(address) if choose else None

    def _deadline_for(self, nbytes: int) -> float:
        return self._read_timeout + nbytes / 100e6

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def flush(self) -> None:
        """Wait until the master answered the end of every put; raises BatchError naming the puts
        that did not end since the last flush (they are not stored)."""
        await self._commits.flush()

    async def close(self) -> None:
        try:
            await self._commits.flush(CLOSE_FLUSH_TIMEOUT)
        except KvpoolError:
            pass  # logged as each answer came
        await self._transport.close()
        await self._master.close()

    # -- put

    async def put(self, key: str, value, overwrite: bool = False, *, tier: str | None = None,
                  pin: str | None = None, pin_ttl: float | None = None, ttl: float | None = None,
                  compress: bool | None = None, replicas: int | None = None,
                  min_replicas: int | None = None) -> None:
        """Store `value` under `key`.

        tier: "dram" (default) or "ssd", where the node places it first. pin: "soft" (evicted only when
        nothing unpinned is left, for pin_ttl seconds, default 600) or "hard" (never evicted). ttl:
        seconds until it expires. compress: True/False, or None to follow compress_above.
        replicas: copies on distinct nodes (default: the client's). min_replicas: the put succeeds once
        this many are written (the master copies the rest later); default all of them.
        """
        raw = validate_key(key)
        choices = put_options.resolve(tier, pin, pin_ttl, ttl)
        count, needed = put_options.replica_counts(replicas, min_replicas, self._replicas)
        data = readable_view(value)
        raw_size = len(data)
        packed = compression.encode(data, compress, self._compress_above)
        if packed is not None:
            data = packed
        digest = checksum_of(data)
        request = pb.PutStartRequest(key=key, size=len(data), checksum=digest, overwrite=overwrite,
                                     replicas=count, min_replicas=needed, options=choices.request,
                                     compressed=packed is not None, raw_size=raw_size)
        info = check(await self._master.call("PutStart", request)).object
        failed: dict = {}
        if info.replicas:
            options = choices.write_options(packed is not None, raw_size)
            try:
                failed = await self._write_replicas(raw, info, data, digest, options)
                _check_enough_written(info, failed, needed)
            except BaseException:
                await self._revoke([(key, info.generation)])
                raise
        await self._commits.end(key, pb.PutEndRequest(key=key, generation=info.generation, failed_nodes=list(failed)),
                                overwrite)
        drop_replicas(info, failed)
        self._remember(key, info, len(data), digest, packed is not None, raw_size)

    async def batch_put(self, keys, values, overwrite: bool = False, *, tier: str | None = None,
                        pin: str | None = None, pin_ttl: float | None = None, ttl: float | None = None,
                        compress: bool | None = None, replicas: int | None = None,
                        min_replicas: int | None = None) -> None:
        """Put every pair (options as put, for every key); raises BatchError naming the keys
        that failed after finishing the rest."""
        count, needed = put_options.replica_counts(replicas, min_replicas, self._replicas)
        keys = list(keys)
        values = list(values)
        if len(keys) != len(values):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
        raws = [validate_key(key) for key in keys]
        choices = put_options.resolve(tier, pin, pin_ttl, ttl)
        views = [readable_view(value) for value in values]
        raw_sizes = [len(view) for view in views]
        packed = [compression.encode(view, compress, self._compress_above) for view in views]
        views = [view if p is None else p for view, p in zip(views, packed)]
        digests = [checksum_of(view) for view in views]
        if not keys:
            return
        if any(p is not None for p in packed):
            options = [choices.write_options(p is not None, raw_size) for p, raw_size in zip(packed, raw_sizes)]
        else:
            options = [choices.write_options(False, 0)] * len(keys)  # one immutable WriteOptions for all
        # What every put shares goes once, the rest as packed lists (client/batch_put.py).
        common = pb.PutStartRequest(overwrite=overwrite, replicas=count, min_replicas=needed, options=choices.request)
        await batch_puts.batch_put(self, keys, raws, views, digests, packed, raw_sizes, common, options, needed,
                                   overwrite)

    async def _write_replicas(self, raw: bytes, info, data: memoryview, digest: int, options) -> dict:
        """Write every replica; node id -> error of each that failed."""
        write = self._transport.write
        replicas = info.replicas
        if len(replicas) == 1:
            # The placing leader's term goes with the WRITEs: nodes refuse it once a newer leader spoke.
            await write(replicas[0].address, raw, info.generation, data, digest, options, term=info.term)
            return {}
        # Every write must be over before a revoke frees the copies, so no early exit. write_many,
        # unlike write, never goes inline (TcpTransport.inline): the copies travel at once.
        item = WriteItem(raw, info.generation, data, digest, options, info.term)
        outcomes = await asyncio.gather(*(self._transport.write_many(r.address, (item,)) for r in replicas),
                                        return_exceptions=True)
        failed = {}
        for replica, outcome in zip(replicas, outcomes):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome  # cancelled: not a node failure
                failed[replica.node_id] = outcome
            elif outcome[0] is not None:
                failed[replica.node_id] = outcome[0]
        return failed

    async def _revoke(self, puts: list) -> None:
        """Best effort: a put the master never hears about again is reclaimed after --put-timeout."""
        if not puts:
            return
        try:
            if len(puts) == 1:
                key, generation = puts[0]
                await self._master.call("PutRevoke", pb.PutRevokeRequest(key=key, generation=generation))
            else:
                await self._master.call("BatchPutRevoke", pb.BatchPutRevokeRequest(items=[
                    pb.PutRevokeRequest(key=key, generation=generation) for key, generation in puts]))
        except KvpoolError:
            pass

    def _remember(self, key: str, info, size: int, digest: int, compressed: bool, raw_size: int) -> None:
        # The client knows what it committed first-hand; don't depend on the echo.
        info.key, info.size, info.checksum = key, size, digest
        info.compressed, info.raw_size = compressed, raw_size
        nearest_first(info)
        self._cache.put(key, info)

    # -- get

    async def get(self, key: str) -> bytes:
        """The value as a new bytes object, received in place."""
        return bytes_of(await self._read_object(key, None))

    async def get_into(self, key: str, buffer) -> int:
        """Read the value into the front of `buffer`; returns its size."""
        return len(await self._read_object(key, writable_view(buffer)))

    async def batch_get(self, keys) -> list:
        """Values in key order; None for a key that does not exist. Any other failure raises
        BatchError (after every key was tried) mapping each failed key to its error."""
        keys = list(keys)
        return _batch_results(keys, await self._read_batch(keys, None), bytes_of)

    # -- zero-copy forms: caller buffers, one buffer with offsets, and values made of parts

    async def put_from(self, key: str, buffer, overwrite: bool = False, **options) -> None:
        """put() of any buffer (bytearray, numpy array, torch CPU tensor, ...): sent from it, never copied."""
        await self.put(key, buffer, overwrite, **options)

    async def batch_put_from(self, keys, buffers, overwrite: bool = False, *, offsets=None, sizes=None,
                             **options) -> None:
        """batch_put() from one buffer per key, or from one buffer and each key's (offset, size)."""
        keys = list(keys)
        if offsets is not None:
            buffers = _slices(readable_view(buffers), keys, offsets, sizes)
        await self.batch_put(keys, buffers, overwrite, **options)

    async def batch_get_into(self, keys, buffers, *, offsets=None, sizes=None) -> list:
        """Read each key into its buffer, in key order; None for a key that does not exist.

        buffers: one per key; or, with offsets, ONE buffer that key i lands in at offsets[i] (how KV
        caches are laid out), with room for sizes[i] bytes (default: up to the next offset, or the end).
        Returns the sizes read."""
        keys = list(keys)
        if offsets is not None:
            dests = _slices(writable_view(buffers), keys, offsets, sizes)
        else:
            dests = [writable_view(buffer) for buffer in buffers]
        if len(dests) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(dests)} buffers")
        return _batch_results(keys, await self._read_batch(keys, dests), len)

    async def put_parts(self, key: str, parts, overwrite: bool = False, **options) -> None:
        """Store the buffers in `parts` (e.g. one block's K and V of every layer) as one value,
        in order, sent straight from each."""
        await self.put(key, value_parts(parts, "parts", writable=False), overwrite, **options)

    async def get_into_parts(self, key: str, parts) -> int:
        """Scatter the value back into `parts`, whose sizes must add up to its size; returns it."""
        return len(await self._read_object(key, value_parts(parts, "parts", writable=True)))

    async def batch_put_parts(self, keys, parts_per_key, overwrite: bool = False, **options) -> None:
        await self.batch_put(keys, [value_parts(p, "parts", writable=False) for p in parts_per_key],
                             overwrite, **options)

    async def batch_get_into_parts(self, keys, parts_per_key) -> list:
        """get_into_parts for every key: sizes in key order, None for a key that does not exist."""
        return await self.batch_get_into(keys, [value_parts(p, "parts", writable=True) for p in parts_per_key])

    def register_buffer(self, buffer) -> None:
        """Tell the transports a buffer will be used for many transfers (UCX registers its memory
        once instead of per transfer); a no-op for the others."""
        register = getattr(self._transport, "register_buffer", None)
        if register is not None:
            register(writable_view(buffer))

    async def _read_object(self, key: str, dest: memoryview | None) -> memoryview:
        """The value read, verified (and decompressed) into dest, or a new buffer when dest is None."""
        raw = validate_key(key)
        info = self._cache.get(key)
        cached = info is not None
        if not cached:
            info = await self._lookup(key)
        for attempt in (0, 1):
            view = _landing(info, dest)
            if view is None:
                if not cached or attempt:
                    raise _does_not_fit(dest, key, info)
                # else the cached size may be out of date: ask the master below
            else:
                if not info.size:
                    return view
                try:
                    await self._read_replicas(raw, info, view)
                    return _decoded(info, view, dest, key)
                except _REFETCH as exc:
                    self._cache.invalidate(key)
                    # A cached placement may be outdated; a fresh one is retried only if it went stale.
                    if attempt or not (cached or isinstance(exc, StaleReplicaError)):
                        raise _gone(key, exc) from None
            self._cache.invalidate(key)
            info = await self._lookup(key)
        raise AssertionError("unreachable")

    async def _lookup(self, key: str):
        answer = await self._master.call("GetReplicaList", pb.GetReplicaListRequest(key=key))
        if answer.status == Code.NOT_FOUND:
            raise KeyNotFoundError(f"key {key!r} not found")
        info = check(answer).object
        nearest_first(info)
        self._cache.put(key, info)
        return info

    async def _read_replicas(self, raw: bytes, info, view: memoryview) -> None:
        """Fill view from the first replica that delivers bytes matching the object's checksum."""
        want = info.checksum
        error = None
        for replica in info.replicas:
            try:
                # asyncio.timeout, unlike wait_for, runs the read in this task: no extra task per get.
                async with asyncio.timeout(self._deadline_for(len(view))):
                    digest = await self._transport.read_into(replica.address, raw, info.generation, view)
            except TimeoutError:
                error = error or UnavailableError(f"node {replica.address} did not answer a read in time")
                continue
            except KvpoolError as exc:
                # What a replica said about the data beats "node unreachable".
                if error is None or isinstance(error, UnavailableError):
                    error = exc
                continue
            if digest == want:
                return
            error = ChecksumMismatchError(
                f"replica of {raw.decode()!r} on node {replica.node_id} does not match checksum {want:#x}")
        raise error or UnavailableError(f"{raw.decode()!r} has no replica")

    async def _read_many_in_time(self, address: str, items: list) -> list:
        """read_many, but a node that does not answer in time fails every item (they try their next replica)."""
        try:
            async with asyncio.timeout(self._deadline_for(sum(len(item.buf) for item in items))):
                return await self._transport.read_many(address, items)
        except TimeoutError:
            return [UnavailableError(f"node {address} did not answer a read in time") for _ in items]

    async def _read_batch(self, keys: list, dests: list | None) -> list:
        """Per key: the filled view, None if the master does not know it, or its error.

        Rounds: every key still to read is tried on one replica, grouped per node and pipelined;
        a failed key moves to its next replica, or (once) back to the master for a new placement.
        """
        raws = [validate_key(key) for key in keys]
        count = len(keys)
        cache = self._cache
        infos = [cache.get(key) for key in keys]
        cached = [info is not None for info in infos]
        refetched = [False] * count
        results: list = [None] * count
        await self._lookup_many(keys, [i for i in range(count) if infos[i] is None], infos, results)
        todo = [(i, 0) for i in range(count) if infos[i] is not None]  # (key index, replica index)
        while todo:
            refetch = []
            groups: dict[str, tuple[list, list]] = {}
            for i, r in todo:
                info = infos[i]
                dest = None if dests is None else dests[i]
                view = _landing(info, dest)
                if view is None:
                    if cached[i] and not refetched[i]:
                        refetch.append(i)  # the cached size may be out of date
                    else:
                        results[i] = _does_not_fit(dest, keys[i], info)
                    continue
                if not info.size:
                    results[i] = view
                    continue
                replica = info.replicas[r]
                group = groups.get(replica.address)
                if group is None:
                    group = groups[replica.address] = ([], [])
                group[0].append((i, r, view))
                group[1].append(ReadItem(raws[i], info.generation, view))
            addresses = list(groups)
            outcomes = await asyncio.gather(*(self._read_many_in_time(address, groups[address][1])
                                              for address in addresses))
            todo = []
            for address, digests in zip(addresses, outcomes):
                for (i, r, view), outcome in zip(groups[address][0], digests):
                    info = infos[i]
                    if outcome == info.checksum:
                        try:
                            results[i] = _decoded(info, view, None if dests is None else dests[i], keys[i])
                        except KvpoolError as exc:
                            results[i] = exc
                        continue
                    error = outcome if isinstance(outcome, KvpoolError) else ChecksumMismatchError(
                        f"replica of {keys[i]!r} on {address} does not match checksum {info.checksum:#x}")
                    # What a replica said about the data beats "node unreachable" from another.
                    earlier = results[i] if r else None
                    if isinstance(error, UnavailableError) and isinstance(earlier, KvpoolError):
                        error = earlier
                    if r + 1 < len(info.replicas):
                        todo.append((i, r + 1))
                    elif (isinstance(error, _REFETCH) and not refetched[i]
                          and (cached[i] or isinstance(error, StaleReplicaError))):
                        refetch.append(i)
                    results[i] = error
            if refetch:
                for i in refetch:
                    cache.invalidate(keys[i])
                    refetched[i] = True
                    cached[i] = False
                await self._lookup_many(keys, refetch, infos, results)
                todo.extend((i, 0) for i in refetch if infos[i] is not None)
        # A fresh placement whose nodes no longer hold the object: it was evicted, so it is missing.
        for i, result in enumerate(results):
            if isinstance(result, _GONE):
                cache.invalidate(keys[i])
                results[i] = None
        return results

    async def _lookup_many(self, keys: list, indices: list, infos: list, results: list) -> None:
        """One BatchGetReplicaList for keys[indices]: fills infos, or results with None / the error."""
        if not indices:
            return
        request = pb.BatchGetReplicaListRequest(keys=[keys[i] for i in indices])
        answers = _items(await self._master.call("BatchGetReplicaList", request), len(indices),
                         "BatchGetReplicaList")
        for i, answer in zip(indices, answers):
            if answer.status:
                infos[i] = None
                results[i] = None if answer.status == Code.NOT_FOUND else error_for(answer.status, answer.message)
            else:
                infos[i] = answer.object
                nearest_first(answer.object)
                self._cache.put(keys[i], answer.object)

    # -- metadata

    async def exists(self, key: str, hold: float = 0) -> bool:
        """Whether key is stored. hold > 0: also keep it from eviction for that many seconds
        (bounded by the master's --max-hold); the only way a hold is made or renewed."""
        validate_key(key)
        request = pb.ExistsRequest(key=key, hold_seconds=put_options.hold_seconds(hold))
        return check(await self._master.call("Exists", request)).exists

    async def batch_exists(self, keys, hold: float = 0) -> list:
        """exists() for every key, in one round trip."""
        keys = list(keys)
        for key in keys:
            validate_key(key)
        seconds = put_options.hold_seconds(hold)
        if not keys:
            return []
        request = pb.BatchExistsRequest(keys=keys, hold_seconds=seconds)
        answer = check(await self._master.call("BatchExists", request))
        if len(answer.exists) != len(keys):
            raise InternalError(f"BatchExists answered {len(answer.exists)} of {len(keys)} keys")
        return list(answer.exists)

    async def remove(self, key: str) -> bool:
        """True if the key existed."""
        validate_key(key)
        try:
            answer = await self._master.call("Remove", pb.RemoveRequest(key=key))
        finally:
            self._cache.invalidate(key)
        if answer.status == Code.NOT_FOUND:
            return False
        return check(answer).removed > 0

    async def remove_prefix(self, prefix: str) -> int:
        """Remove every key starting with `prefix`; returns how many were removed."""
        if not isinstance(prefix, str):
            raise InvalidKeyError(f"prefix must be str, not {type(prefix).__name__}")
        try:
            answer = await self._master.call("RemoveByPrefix", pb.RemoveByPrefixRequest(prefix=prefix))
        finally:
            self._cache.invalidate_prefix(prefix)
        return check(answer).removed

    async def stats(self) -> pb.StatsResponse:
        return await self._master.call("Stats", pb.StatsRequest())

    async def drain(self, node_id: str) -> int:
        """Have the master move every object off a storage node (no new placement there, copies
        made elsewhere, then its own freed); returns how many objects had a copy there."""
        return check(await self._master.call("Drain", pb.DrainRequest(node_id=node_id))).objects


def _check_enough_written(info, failed: dict, needed: int) -> None:
    """Raise the first write error when fewer copies than `needed` (0 = all) were written."""
    if failed and len(info.replicas) - len(failed) < (needed or len(info.replicas)):
        raise next(iter(failed.values()))


def _items(response, expected: int, method: str):
    if len(response.items) != expected:
        raise InternalError(f"{method} answered {len(response.items)} items for {expected} requests")
    return response.items


def _batch_results(keys: list, results: list, convert) -> list:
    outcomes = [r if r is None or isinstance(r, BaseException) else convert(r) for r in results]
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
    if sizes is None:
        ends = sorted(set(offsets)) + [len(whole)]
        sizes = [ends[ends.index(offset) + 1] - offset for offset in offsets]
    views = []
    for offset, size in zip(offsets, sizes):
        if offset < 0 or size < 0 or offset + size > len(whole):
            raise InvalidArgumentError(f"slice [{offset}, {offset + size}) is outside the {len(whole)}-byte buffer")
        views.append(whole[offset:offset + size])
    return views


def _does_not_fit(dest, key: str, info) -> InvalidArgumentError:
    if isinstance(dest, Parts):
        return InvalidArgumentError(f"parts of {len(dest)} bytes in all do not match {key!r} "
                                    f"({_raw_size(info)} bytes)")
    return InvalidArgumentError(f"buffer of {len(dest)} bytes is too small for {key!r} ({_raw_size(info)} bytes)")


def _raw_size(info) -> int:
    """The size callers see: before compression."""
    return info.raw_size if info.compressed else info.size


def _landing(info, dest: memoryview | Parts | None) -> memoryview | Parts | None:
    """Where the stored bytes are received: dest itself when they fit (a compressed value is
    decompressed out of it afterwards), else a new buffer; None when dest cannot take the value."""
    size = info.size
    if dest is None:
        return fresh_bytes_view(size)
    if isinstance(dest, Parts):  # parts are a layout: they must add up to the value exactly
        if len(dest) != _raw_size(info):
            return None
        return fresh_bytes_view(size) if info.compressed else dest
    if len(dest) < _raw_size(info):
        return None
    if len(dest) >= size:
        return dest if len(dest) == size else dest[:size]
    return fresh_bytes_view(size)  # compressed bytes larger than the value (it did not compress)


def _decoded(info, view: memoryview, dest: memoryview | None, key: str) -> memoryview:
    """The value from verified stored bytes: `view` itself, or decompressed into dest (or new bytes)."""
    if not info.compressed:
        return view
    value = compression.decode(view, info.raw_size, f"{key!r}")
    if dest is None:
        return memoryview(value)
    if isinstance(dest, Parts):
        dest.copy_from(memoryview(value))
        return dest
    dest[:len(value)] = value
    return dest[:len(value)]


def _gone(key: str, exc: KvpoolError) -> KvpoolError:
    """A node's NOT_FOUND or STALE for the placement the master just gave: the object was evicted."""
    if isinstance(exc, _GONE):
        return KeyNotFoundError(f"key {key!r} not found: no longer held by its node ({exc})")
    return exc
