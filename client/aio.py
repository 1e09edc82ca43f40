"""AsyncClient: the kvpool API on asyncio.

Control goes to the master over gRPC (MasterLink); value bytes go straight
between the caller's buffers and the storage nodes (Transport). A put is
PutStart -> write every replica -> PutEnd (PutRevoke if anything fails); a get
is a placement lookup (cached, else one GetReplicaList) -> read one replica ->
verify the checksum. Batches use one RPC per phase for all keys and pipeline
the transfers per node, all nodes at once.
"""

import asyncio

from kvpool.checksum import checksum
from kvpool.cluster_layout import DEFAULT_CLUSTER
from kvpool.errors import (
    BatchError, ChecksumMismatchError, Code, InternalError, InvalidArgumentError, InvalidKeyError,
    KeyNotFoundError, KvpoolError, StaleReplicaError, UnavailableError, error_for,
)
from kvpool.keys import validate_key
from kvpool.proto import kvpool_pb2 as pb

from .master_link import DEFAULT_RPC_TIMEOUT, MasterLink, check
from .placement_cache import DEFAULT_CAPACITY, PlacementCache
from .tcp import DEFAULT_CONNECT_TIMEOUT, TcpTransport
from .transport import ReadItem, Transport, WriteItem
from .values import bytes_of, fresh_bytes_view, readable_view, writable_view

# A replica read that fails like this may mean the placement moved on: ask the master again.
_REFETCH = (StaleReplicaError, KeyNotFoundError, UnavailableError)


class AsyncClient:
    """AsyncClient("HOST:PORT") or AsyncClient(etcd="HOST:PORT", cluster="default").

    replicas: copies written per put. cache_size: placements remembered (0 = always ask the master).
    """

    def __init__(self, address: str | None = None, *, etcd: str | None = None,
                 cluster: str = DEFAULT_CLUSTER, replicas: int = 1, cache_size: int = DEFAULT_CAPACITY,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 transport: Transport | None = None):
        if not isinstance(replicas, int) or replicas < 1:
            raise InvalidArgumentError(f"replicas must be a positive integer, got {replicas!r}")
        self._master = MasterLink(address, etcd, cluster, rpc_timeout)
        self._transport = transport or TcpTransport(connect_timeout)
        self._cache = PlacementCache(cache_size)
        self._replicas = replicas

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._transport.close()
        await self._master.close()

    # -- put

    async def put(self, key: str, value, overwrite: bool = False) -> None:
        raw = validate_key(key)
        data = readable_view(value)
        digest = checksum(data)
        request = pb.PutStartRequest(key=key, size=len(data), checksum=digest, overwrite=overwrite,
                                     replicas=self._replicas)
        info = check(await self._master.call("PutStart", request)).object
        if info.replicas:
            try:
                await self._write_replicas(raw, info, data, digest)
            except BaseException:
                await self._revoke([(key, info.generation)])
                raise
        check(await self._master.call("PutEnd", pb.PutEndRequest(key=key, generation=info.generation)))
        self._remember(key, info, len(data), digest)

    async def batch_put(self, keys, values, overwrite: bool = False) -> None:
        """Put every pair; raises BatchError naming the keys that failed after finishing the rest."""
        keys = list(keys)
        values = list(values)
        if len(keys) != len(values):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
        raws = [validate_key(key) for key in keys]
        views = [readable_view(value) for value in values]
        digests = [checksum(view) for view in views]
        if not keys:
            return
        request = pb.BatchPutStartRequest(items=[
            pb.PutStartRequest(key=key, size=len(view), checksum=digest, overwrite=overwrite,
                               replicas=self._replicas)
            for key, view, digest in zip(keys, views, digests)])
        answers = _items(await self._master.call("BatchPutStart", request), len(keys), "BatchPutStart")
        errors = {}
        started = []  # (index, ObjectInfo) of puts the master opened
        for i, answer in enumerate(answers):
            if answer.status:
                errors[keys[i]] = error_for(answer.status, answer.message)
            else:
                started.append((i, answer.object))
        try:
            failed = await self._write_batch(raws, views, digests, started)
        except BaseException:
            await self._revoke([(keys[i], info.generation) for i, info in started])
            raise
        if failed:
            await self._revoke([(keys[i], info.generation) for i, info in started if i in failed])
            for i, exc in failed.items():
                errors[keys[i]] = exc
        written = [(i, info) for i, info in started if i not in failed]
        if written:
            request = pb.BatchPutEndRequest(items=[
                pb.PutEndRequest(key=keys[i], generation=info.generation) for i, info in written])
            ends = _items(await self._master.call("BatchPutEnd", request), len(written), "BatchPutEnd")
            for (i, info), end in zip(written, ends):
                if end.status:
                    errors[keys[i]] = error_for(end.status, end.message)
                else:
                    self._remember(keys[i], info, len(views[i]), digests[i])
        if errors:
            first_key, first = next(iter(errors.items()))
            raise BatchError(f"{len(errors)} of {len(keys)} puts failed (first: {first_key!r}: {first})", errors)

    async def _write_replicas(self, raw: bytes, info, data: memoryview, digest: int) -> None:
        write = self._transport.write
        replicas = info.replicas
        if len(replicas) == 1:
            replica = replicas[0]
            await write(replica.address, raw, info.generation, replica.offset, data, digest)
            return
        # Every write must be over before a revoke frees the extents, so no early exit.
        outcomes = await asyncio.gather(
            *(write(r.address, raw, info.generation, r.offset, data, digest) for r in replicas),
            return_exceptions=True)
        for outcome in outcomes:
            if outcome is not None:
                raise outcome

    async def _write_batch(self, raws, views, digests, started) -> dict:
        """Write every replica of the started puts, one pipelined stream per node; index -> first error."""
        groups: dict[str, tuple[list, list]] = {}
        for i, info in started:
            for replica in info.replicas:
                group = groups.get(replica.address)
                if group is None:
                    group = groups[replica.address] = ([], [])
                group[0].append(i)
                group[1].append(WriteItem(raws[i], info.generation, replica.offset, views[i], digests[i]))
        if not groups:
            return {}
        addresses = list(groups)
        outcomes = await asyncio.gather(
            *(self._transport.write_many(address, groups[address][1]) for address in addresses))
        failed = {}
        for address, results in zip(addresses, outcomes):
            for i, result in zip(groups[address][0], results):
                if result is not None and i not in failed:
                    failed[i] = result
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

    def _remember(self, key: str, info, size: int, digest: int) -> None:
        # The client knows the committed size and checksum first-hand; don't depend on the echo.
        info.key, info.size, info.checksum = key, size, digest
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

    async def batch_get_into(self, keys, buffers) -> list:
        """Sizes read into each buffer, in key order; None for a key that does not exist."""
        keys = list(keys)
        dests = [writable_view(buffer) for buffer in buffers]
        if len(dests) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(dests)} buffers")
        return _batch_results(keys, await self._read_batch(keys, dests), len)

    async def _read_object(self, key: str, dest: memoryview | None) -> memoryview:
        """The value read and verified into dest (or a new buffer when dest is None)."""
        raw = validate_key(key)
        info = self._cache.get(key)
        cached = info is not None
        if not cached:
            info = await self._lookup(key)
        for attempt in (0, 1):
            size = info.size
            if dest is None:
                view = fresh_bytes_view(size)
            elif len(dest) >= size:
                view = dest if len(dest) == size else dest[:size]
            elif cached and not attempt:
                view = None  # the cached size may be out of date: ask the master below
            else:
                raise InvalidArgumentError(f"buffer of {len(dest)} bytes is too small for {key!r} ({size} bytes)")
            if view is not None:
                if not size:
                    return view
                try:
                    await self._read_replicas(raw, info, view)
                    return view
                except _REFETCH as exc:
                    self._cache.invalidate(key)
                    # A cached placement may be outdated; a fresh one is retried only if it went stale.
                    if attempt or not (cached or isinstance(exc, StaleReplicaError)):
                        raise
            self._cache.invalidate(key)
            info = await self._lookup(key)
        raise AssertionError("unreachable")

    async def _lookup(self, key: str):
        answer = await self._master.call("GetReplicaList", pb.GetReplicaListRequest(key=key))
        if answer.status == Code.NOT_FOUND:
            raise KeyNotFoundError(f"key {key!r} not found")
        info = check(answer).object
        self._cache.put(key, info)
        return info

    async def _read_replicas(self, raw: bytes, info, view: memoryview) -> None:
        """Fill view from the first replica that delivers bytes matching the object's checksum."""
        want = info.checksum
        error = None
        for replica in info.replicas:
            try:
                digest = await self._transport.read_into(replica.address, raw, info.generation, replica.offset, view)
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
                size = info.size
                dest = None if dests is None else dests[i]
                if dest is None:
                    view = fresh_bytes_view(size)
                elif len(dest) >= size:
                    view = dest if len(dest) == size else dest[:size]
                elif cached[i] and not refetched[i]:
                    refetch.append(i)  # the cached size may be out of date
                    continue
                else:
                    results[i] = InvalidArgumentError(
                        f"buffer of {len(dest)} bytes is too small for {keys[i]!r} ({size} bytes)")
                    continue
                if not size:
                    results[i] = view
                    continue
                replica = info.replicas[r]
                group = groups.get(replica.address)
                if group is None:
                    group = groups[replica.address] = ([], [])
                group[0].append((i, r, view))
                group[1].append(ReadItem(raws[i], info.generation, replica.offset, view))
            addresses = list(groups)
            outcomes = await asyncio.gather(
                *(self._transport.read_many(address, groups[address][1]) for address in addresses))
            todo = []
            for address, digests in zip(addresses, outcomes):
                for (i, r, view), outcome in zip(groups[address][0], digests):
                    want = infos[i].checksum
                    if outcome == want:
                        results[i] = view
                        continue
                    error = outcome if isinstance(outcome, KvpoolError) else ChecksumMismatchError(
                        f"replica of {keys[i]!r} on {address} does not match checksum {want:#x}")
                    if r + 1 < len(infos[i].replicas):
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
                self._cache.put(keys[i], answer.object)

    # -- metadata

    async def exists(self, key: str) -> bool:
        validate_key(key)
        return check(await self._master.call("Exists", pb.ExistsRequest(key=key))).exists

    async def batch_exists(self, keys) -> list:
        keys = list(keys)
        for key in keys:
            validate_key(key)
        if not keys:
            return []
        answer = check(await self._master.call("BatchExists", pb.BatchExistsRequest(keys=keys)))
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


def _items(response, expected: int, method: str):
    if len(response.items) != expected:
        raise InternalError(f"{method} answered {len(response.items)} items for {expected} requests")
    return response.items


def _batch_results(keys: list, results: list, convert) -> list:
    errors = {keys[i]: r for i, r in enumerate(results) if isinstance(r, BaseException)}
    if errors:
        first_key, first = next(iter(errors.items()))
        raise BatchError(f"{len(errors)} of {len(keys)} reads failed (first: {first_key!r}: {first})", errors)
    return [None if r is None else convert(r) for r in results]
