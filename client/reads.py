"""Reading values: one path for a get and a batch get (a get is a batch of one), with one retry policy.

Per key: its placement from the cache, else from the master (one lookup for
every key missing). Then rounds: every key still to read is tried on one
replica, grouped per node and pipelined, all nodes at once; the bytes must match
the object's checksum (a mismatch is a failed replica). A key whose replica
failed moves to its next replica; when none is left, and the failure may mean
the placement moved on (STALE, NOT_FOUND, an unreachable node) and it came from
the cache or its nodes no longer hold it, the master is asked once more: an
overwrite that ended between the lookup and the read frees the version looked
up, so a key overwritten again and again is asked about while each answer names a
newer version (up to MAX_LOOKUPS). A placement asked afresh that names the
version its nodes no longer hold means it was evicted: it is missing. A
transport that fails a transfer is set aside and the transfer retried on TCP by
the transport itself (selector.py).

A compressed object is read as its stored bytes and decompressed once verified.
"""


from kvpool.errors import (
    ChecksumMismatchError, InvalidArgumentError, KeyNotFoundError, KvpoolError, StaleReplicaError,
    UnavailableError,
)
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol.keys import validate_key
from kvpool.protocol.parts import Parts

from kvpool.client import compression, convert
from kvpool.client.deadlines import node_in_time
from kvpool.client.assembly import Core
from kvpool.client.transport import ReadItem
from kvpool.client.values import fresh_bytes_view

# A replica read that fails like this may mean the placement moved on: ask the master again.
_REFETCH = (StaleReplicaError, KeyNotFoundError, UnavailableError)
# What a node says when it no longer has the version the master placed there (evicted, expired).
_GONE = (StaleReplicaError, KeyNotFoundError)
MAX_LOOKUPS = 4  # of one key in one read, while each names a newer version than the one that failed
DIRECT = object()  # the group of reads this client makes from the shared tier's files itself


async def read(core: Core, keys: list, dests: list | None) -> list:
    """Per key: the value read and verified (in its dest, or a new buffer when dests is None), or the
    error it failed with: KeyNotFoundError when it does not exist (now)."""
    keys = core.stored_keys(keys)
    count = len(keys)
    cache = core.cache
    raws, infos, cached, missing, todo = [], [], [], [], []  # todo: (key index, replica index) to read
    for i, key in enumerate(keys):  # one pass: a get of one key is the common case, keep it short
        raws.append(validate_key(key))
        info = cache.get(key)
        infos.append(info)
        cached.append(info is not None)
        if info is None:
            missing.append(i)
        else:
            todo.append((i, 0))
    shared = core.shared  # the shared tier's directory, when this client mounts it: read directly
    direct_failed: set[int] = set()  # keys whose direct read failed: through the replica's node instead
    refetched = [False] * count
    failed_generation: list = [None] * count  # the version whose read sent a key back to the master
    lookups = [0] * count
    results: list = [None] * count
    if missing:
        await _lookup(core, keys, missing, infos, results)
        todo.extend((i, 0) for i in missing if infos[i] is not None)
    failed = False  # whether any replica failed: only then is there anything to tidy at the end
    while todo:
        refetch = []
        groups: dict[str, tuple[list, list]] = {}  # node address -> ([(i, r, view)], [ReadItem])
        for i, r in todo:
            info = infos[i]
            dest = None if dests is None else dests[i]
            view = landing(info, dest)
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
            address = DIRECT if (shared is not None and replica.tier == pb.SHARED
                                 and i not in direct_failed) else replica.address
            group = groups.get(address)
            if group is None:
                group = groups[address] = ([], [])
            group[0].append((i, r, view))
            group[1].append(ReadItem(raws[i], info.generation, view))
        if len(groups) == 1:  # one node: no task for a gather to wait on
            [(address, (reading, items))] = groups.items()
            outcomes = [await (_read_directly(core, items, reading, infos) if address is DIRECT
                               else _read_in_time(core, address, items))]
        else:
            outcomes = await core.io.gather(*(_read_directly(core, items, reading, infos) if address is DIRECT
                                              else _read_in_time(core, address, items)
                                              for address, (reading, items) in groups.items()))
        todo = []
        for (address, (reading, _)), digests in zip(groups.items(), outcomes):
            for (i, r, view), outcome in zip(reading, digests):
                info = infos[i]
                if outcome == info.checksum:
                    try:
                        results[i] = decoded(info, view, None if dests is None else dests[i], keys[i])
                    except KvpoolError as exc:
                        results[i] = exc
                    continue
                failed = True
                if address is DIRECT:  # the same copy through the node that serves it next
                    direct_failed.add(i)
                    todo.append((i, r))
                    results[i] = outcome
                    continue
                error = outcome if isinstance(outcome, KvpoolError) else ChecksumMismatchError(
                    f"replica of {keys[i]!r} on {address} does not match checksum {info.checksum:#x}")
                # What a replica said about the data beats "node unreachable" from another.
                earlier = results[i] if r else None
                if isinstance(error, UnavailableError) and isinstance(earlier, KvpoolError):
                    error = earlier
                results[i] = error
                if r + 1 < len(info.replicas):
                    todo.append((i, r + 1))
                elif (isinstance(error, _REFETCH) and lookups[i] < MAX_LOOKUPS
                      and info.generation != failed_generation[i]
                      and (cached[i] or isinstance(error, _GONE))):
                    refetch.append(i)
        if refetch:
            for i in refetch:
                cache.invalidate(keys[i])
                refetched[i] = True
                failed_generation[i] = infos[i].generation
                lookups[i] += 1
                cached[i] = False
            await _lookup(core, keys, refetch, infos, results)
            todo.extend((i, 0) for i in refetch if infos[i] is not None)
    if failed:
        for i, result in enumerate(results):
            if isinstance(result, _REFETCH) and infos[i] is not None:  # the placement is no use: forget it
                cache.invalidate(keys[i])
                if isinstance(result, _GONE):  # a fresh one whose nodes no longer hold it: evicted, so missing
                    results[i] = KeyNotFoundError(f"key {keys[i]!r} not found: no longer held by its node "
                                                  f"({result})")
    return results


async def size(core: Core, key: str) -> int:
    """The size callers see of `key`'s current version: asked of the master, never of the cache (a cached
    placement may name a version since removed)."""
    [stored] = core.stored_keys([key])
    validate_key(stored)
    [info] = convert.placements(await core.master.call(*convert.lookup_call([stored])), [stored])
    if isinstance(info, BaseException):
        raise info
    return _raw_size(info)


async def _lookup(core: Core, keys: list, indices: list, infos: list, results: list) -> None:
    """Ask the master where keys[indices] live: fills infos (and the cache), or results with the error."""
    if not indices:
        return
    asked = [keys[i] for i in indices]
    found = convert.placements(await core.master.call(*convert.lookup_call(asked)), asked)
    for i, info in zip(indices, found):
        if isinstance(info, BaseException):
            infos[i] = None
            results[i] = info
        else:
            infos[i] = info
            if all(replica.tier != pb.SHARED for replica in info.replicas):
                # A shared copy's placement is asked afresh on every read: no node's read grant covers the
                # file, so the master's answer is what keeps a replaced version from being read.
                core.cache.put(keys[i], info)


async def _read_directly(core: Core, items: list, reading: list, infos: list) -> list:
    """Per item, read from the shared tier's file by this client (kvpool/sharedfs), checked against its
    placement: the checksum on success, else the error (the caller then reads through the node)."""
    outcomes = []
    for item, (i, _r, _view) in zip(items, reading):
        buf = item.buf.flat_or_new() if isinstance(item.buf, Parts) else item.buf
        try:
            # (the blocking Client's caller waits in its own thread; an AsyncClient's in one beside the loop)
            await core.io.blocking(core.shared_gate.run_blocking, core.shared.read_into, item.key, item.generation,
                                   len(item.buf), infos[i].checksum, buf)
            if buf is not item.buf:
                item.buf.fill_from(buf)
            outcomes.append(infos[i].checksum)
            core.shared_bytes += len(item.buf)
        except KvpoolError as exc:
            outcomes.append(exc)
    return outcomes


async def _read_in_time(core: Core, address: str, items: list) -> list:
    """Per item the checksum of what arrived, or its error; a node that does not answer in time fails
    every item (they try their next replica)."""
    transport = core.transport
    nbytes = len(items[0].buf) if len(items) == 1 else sum(len(item.buf) for item in items)
    return await node_in_time(
        core.io, core.read_deadline(nbytes), items,
        lambda one: transport.read_into(address, one.key, one.generation, one.buf),
        lambda many: transport.read_many(address, many),
        lambda: UnavailableError(f"node {address} did not answer a read in time"))


def _raw_size(info) -> int:
    """The size callers see: before compression."""
    return info.raw_size if info.compressed else info.size


def _does_not_fit(dest, key: str, info) -> InvalidArgumentError:
    if isinstance(dest, Parts) and not dest.flexible:
        return InvalidArgumentError(f"parts of {len(dest)} bytes in all do not match {key!r} "
                                    f"({_raw_size(info)} bytes)")
    return InvalidArgumentError(f"buffer of {len(dest)} bytes is too small for {key!r} ({_raw_size(info)} bytes)")


def landing(info, dest: memoryview | Parts | None) -> memoryview | Parts | None:
    """Where the stored bytes are received: dest itself when they fit (a compressed value is
    decompressed out of it afterwards), else a new buffer; None when dest cannot take the value."""
    size = info.size
    if dest is None:
        return fresh_bytes_view(size)
    if isinstance(dest, Parts):
        dest.undeliver()  # a new fill begins (what went straight to device memory before no longer counts)
        if not dest.flexible:  # parts are a layout: they must add up to the value exactly
            if len(dest) != _raw_size(info):
                return None
            return fresh_bytes_view(size) if info.compressed else dest
        if info.compressed:  # decompressed from flat bytes, into the front of dest (staging for the device)
            return fresh_bytes_view(size) if len(dest) >= _raw_size(info) else None
    if len(dest) < _raw_size(info):
        return None
    if len(dest) >= size:
        return dest if len(dest) == size else dest[:size]
    return fresh_bytes_view(size)  # compressed bytes larger than the value (it did not compress)


def decoded(info, view: memoryview, dest: memoryview | None, key: str) -> memoryview:
    """The value from verified stored bytes: `view` itself, or decompressed into dest (or new bytes)."""
    if not info.compressed:
        return view
    value = compression.decode(view, info.raw_size, f"{key!r}")
    if dest is None:
        return memoryview(value)
    if isinstance(dest, Parts) and not dest.flexible:
        dest.copy_from(memoryview(value))
        return dest
    dest[:len(value)] = value
    return dest[:len(value)]
