"""Storing values: PutStart -> write every replica -> PutEnd (PutRevoke if anything fails).

A value is checksummed (and lz4-compressed first when asked or large enough:
it is then stored, checksummed and moved as its compressed bytes). The master
places it; every copy is written straight from the caller's buffer; the end is
posted or awaited (commits.py); the placement is cached, so a get right
after needs no lookup.

A batch shares one BatchPutStart, one pipelined WRITE stream per node and one
BatchPutEnd. The master answers the keys column in columns (a generation per key
and an index into the few distinct placements, see BatchPutStartResponse in
kvpool.proto), so no message is made per key on either side: the WRITEs are
grouped by placement, and the placement cache keeps each key as its placement's
serialized replicas plus the key's own fields.

Ending a put: its end is posted or awaited (commits.py). A put past its
deadline (deadlines.py) is revoked, unless its end had left: then its outcome
is unknown (PutOutcomeUnknownError).
"""

from __future__ import annotations  # Core is named for the reader only: assembly.py imports this module

import asyncio
from typing import TYPE_CHECKING

from kvpool.errors import BatchError, InvalidArgumentError, KvpoolError, UnavailableError
from kvpool.protocol.keys import validate_key

from kvpool.client import compression, convert, put_options
from kvpool.client.convert import Started, check
from kvpool.client.replica_order import drop_replicas, nearest_first
from kvpool.client.transport import WriteItem
from kvpool.client.device.staged import is_device
from kvpool.client.values import checksum_of

if TYPE_CHECKING:
    from kvpool.client.assembly import Core


async def put(core: Core, key: str, value, overwrite: bool = False, *, tier: str | None = None,
              pin: str | None = None, pin_ttl: float | None = None, ttl: float | None = None,
              compress: bool | None = None, replicas: int | None = None, min_replicas: int | None = None,
              timeout: float | None = None) -> None:
    """AsyncClient.put."""
    data = core.devices.readable(value)
    async with core.bounded(timeout, f"put of {key!r}", len(data)) as call:
        if is_device(data):  # sent from staging, its checksum taken as it was staged (client/device)
            async with core.devices.staged(data) as staged:
                await _put(core, call, core.stored(key), staged, overwrite, tier, pin, pin_ttl, ttl, compress,
                           replicas, min_replicas, staged.digest)
            return
        await _put(core, call, core.stored(key), data, overwrite, tier, pin, pin_ttl, ttl, compress, replicas,
                   min_replicas)


async def _put(core: Core, call, key: str, data, overwrite: bool, tier, pin, pin_ttl, ttl, compress, replicas,
               min_replicas, known_digest: int | None = None) -> None:
    raw = validate_key(key)
    choices = put_options.resolve(tier, pin, pin_ttl, ttl)
    count, needed = put_options.replica_counts(replicas, min_replicas, core.replicas)
    raw_size = len(data)
    packed = compression.encode(data, compress, core.compress_above)
    if packed is not None:
        data = packed
    digest = checksum_of(data) if packed is not None or known_digest is None else known_digest
    request = convert.put_start_request(key, len(data), digest, overwrite, count, needed, choices,
                                        packed is not None, raw_size)
    info = check(await core.master.call("PutStart", request)).object
    failed: dict = {}
    if info.replicas:
        options = choices.write_options(packed is not None, raw_size)
        try:
            failed = await _write_replicas(core, raw, info, data, digest, options)
            _check_enough_written(info, failed, needed)
        except BaseException:
            await revoke(core, [(key, info.generation)])
            raise
    call.ending = True  # from here on, a put past its deadline may have been stored
    await core.commits.end(key, info.generation, convert.put_end_request(key, info.generation, failed),
                           overwrite)
    drop_replicas(info, failed)
    remember(core, key, info, len(data), digest, packed is not None, raw_size)


async def batch_put(core: Core, keys, values, overwrite: bool = False, *, tier: str | None = None,
                    pin: str | None = None, pin_ttl: float | None = None, ttl: float | None = None,
                    compress: bool | None = None, replicas: int | None = None,
                    min_replicas: int | None = None, timeout: float | None = None) -> None:
    """AsyncClient.batch_put."""
    keys = core.stored_keys(list(keys))
    devices = core.devices
    views = [devices.readable(value) for value in values]
    async with core.bounded(timeout, f"batch_put of {len(keys)} keys", sum(map(len, views))) as call:
        try:
            if any(is_device(view) for view in views):
                await _device_batch(core, call, keys, views, overwrite, tier, pin, pin_ttl, ttl, compress,
                                    replicas, min_replicas)
            else:
                await _start_batch(core, call, keys, views, overwrite, tier, pin, pin_ttl, ttl, compress,
                                   replicas, min_replicas)
        except BatchError as exc:
            raise core.named_errors(exc) from None


async def _device_batch(core: Core, call, keys: list, views: list, *options) -> None:
    """A batch with device values: one BatchPutStart per wave of staged values (client/device)."""
    if len(keys) != len(views):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(views)} values")

    async def send(indices: list, values: list, digests: list) -> None:
        await _start_batch(core, call, [keys[i] for i in indices], values, *options, known_digests=digests)

    errors = await core.devices.put_waves(keys, views, send)
    if errors:
        first_key, first = next(iter(errors.items()))
        raise BatchError(f"{len(errors)} of {len(keys)} puts failed (first: {first_key!r}: {first})", errors)


async def _start_batch(core: Core, call, keys: list, views: list, overwrite: bool, tier, pin, pin_ttl, ttl,
                       compress, replicas, min_replicas, known_digests: list | None = None) -> None:
    count, needed = put_options.replica_counts(replicas, min_replicas, core.replicas)
    if len(keys) != len(views):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(views)} values")
    raws = [validate_key(key) for key in keys]
    choices = put_options.resolve(tier, pin, pin_ttl, ttl)
    raw_sizes = [len(view) for view in views]
    packed = [compression.encode(view, compress, core.compress_above) for view in views]
    views = [view if p is None else p for view, p in zip(views, packed)]
    known_digests = known_digests or [None] * len(views)
    digests = [checksum_of(view) if p is not None or known is None else known
               for view, p, known in zip(views, packed, known_digests)]
    if not keys:
        return
    compressed = [p is not None for p in packed]
    if any(compressed):
        options = [choices.write_options(c, raw_size) for c, raw_size in zip(compressed, raw_sizes)]
    else:
        compressed = None
        options = [choices.write_options(False, 0)] * len(keys)  # one immutable WriteOptions for all
    request = convert.batch_put_start_request(keys, [len(view) for view in views], digests, overwrite, count,
                                              needed, choices, compressed, raw_sizes)
    await _batch_put(core, call, request, keys, raws, views, digests, packed, raw_sizes, options, needed, overwrite)


async def _write_replicas(core: Core, raw: bytes, info, data: memoryview, digest: int, options) -> dict:
    """Write every replica; node id -> error of each that failed."""
    transport = core.transport
    replicas = info.replicas
    if len(replicas) == 1:
        # The placing leader's term goes with the WRITEs: nodes refuse it once a newer leader spoke.
        address = replicas[0].address
        try:
            async with core.io.timeout(core.write_deadline(len(data))):
                await transport.write(address, raw, info.generation, data, digest, _sealed(options, replicas[0].seal),
                                      term=info.term)
        except TimeoutError:
            raise _no_answer(core, address) from None
        return {}
    # Every write must be over (done, failed or out of time) before a revoke frees the copies, so no
    # early exit. The copies travel at once: as tasks on the loop, even a blocking client's (waiting.py waits
    # on a socket only outside tasks).
    outcomes = await asyncio.gather(*(_write_in_time(core, r.address, (WriteItem(
        raw, info.generation, data, digest, _sealed(options, r.seal), info.term),)) for r in replicas),
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


async def _write_in_time(core: Core, address: str, items) -> list:
    """write_many to one node; a node that does not answer within the client's write deadline fails
    every item (a silent node must not hold a put for longer)."""
    try:
        async with core.io.timeout(core.write_deadline(sum(len(item.data) for item in items))):
            return await core.transport.write_many(address, items)
    except TimeoutError:
        return [_no_answer(core, address)] * len(items)


def _sealed(options, seal: bytes):
    """The WriteOptions of one copy: the put's, with the leader's seal over that copy (none: unsealed)."""
    return options._replace(seal=seal) if seal else options


def _no_answer(core: Core, address: str) -> UnavailableError:
    return UnavailableError(f"node {address} did not answer a write within {core.write_timeout:g}s")


def _check_enough_written(info, failed: dict, needed: int) -> None:
    """Raise the first write error when fewer copies than `needed` (0 = all) were written."""
    if failed and len(info.replicas) - len(failed) < (needed or len(info.replicas)):
        raise next(iter(failed.values()))


async def _write_started(core: Core, started: Started, raws, views, digests, options,
                         needed: int) -> tuple[dict, dict]:
    """Write every replica of the started puts, one pipelined stream per node.

    Returns (index -> first error of puts with too few copies written, index -> {node id: error}
    of puts that succeeded with some copies missing)."""
    by_placement: dict[int, list[int]] = {}
    for i in started.indices:
        by_placement.setdefault(started.placement[i], []).append(i)
    groups: dict[str, tuple[list, list]] = {}  # node address -> ([(index, node id)], [WriteItem])
    sealed = bool(started.seals)  # else every WriteItem shares its put's options as they are
    for where, indices in by_placement.items():
        placement = started.placements[where]
        term, generation = placement.term, started.generation
        for copy, replica in enumerate(placement.replicas):
            group = groups.get(replica.address)
            if group is None:
                group = groups[replica.address] = ([], [])
            node_id = replica.node_id
            group[0].extend((i, node_id) for i in indices)
            if sealed:
                seal = started.seal
                group[1].extend(WriteItem(raws[i], generation[i], views[i], digests[i],
                                          options[i]._replace(seal=seal(i, copy)), term) for i in indices)
            else:
                group[1].extend(WriteItem(raws[i], generation[i], views[i], digests[i], options[i], term)
                                for i in indices)
    if not groups:
        return {}, {}
    addresses = list(groups)
    if len(addresses) == 1:  # one node: no task for a gather to wait on
        outcomes = [await _write_in_time(core, addresses[0], groups[addresses[0]][1])]
    else:
        outcomes = await core.io.gather(*(_write_in_time(core, address, groups[address][1])
                                          for address in addresses))
    missing: dict[int, dict] = {}
    for address, results in zip(addresses, outcomes):
        for (i, node_id), result in zip(groups[address][0], results):
            if result is not None:
                missing.setdefault(i, {})[node_id] = result
    failed, partial = {}, {}
    for i, errors in missing.items():
        copies = len(started.placements[started.placement[i]].replicas)
        if copies - len(errors) < (needed or copies):
            failed[i] = next(iter(errors.values()))
        else:
            partial[i] = errors
    return failed, partial


async def _batch_put(core: Core, call, request, keys: list, raws: list, views: list, digests: list, packed: list,
                     raw_sizes: list, options: list, needed: int, overwrite: bool) -> None:
    """The puts of AsyncClient.batch_put once its values are checksummed (and compressed: `packed`
    holds each compressed value or None) and its BatchPutStart `request` made; raises BatchError
    naming the keys that failed."""
    started = Started(await core.master.call("BatchPutStart", request), len(keys))
    errors = {keys[i]: error for i, error in started.refused.items()}
    generation = started.generation
    try:
        failed, partial = await _write_started(core, started, raws, views, digests, options, needed)
    except BaseException:
        await revoke(core, [(keys[i], generation[i]) for i in started.indices])
        raise
    if failed:
        await revoke(core, [(keys[i], generation[i]) for i in started.indices if i in failed])
        for i, exc in failed.items():
            errors[keys[i]] = exc
    # Puts with a copy missing go as items (they name the nodes), the rest as two lists.
    partly = [i for i in started.indices if i in partial]
    whole = [i for i in started.indices if i not in failed and i not in partial] if failed or partial \
        else started.indices
    written = partly + whole
    if written:
        end = convert.batch_put_end_request([(keys[i], generation[i], partial[i]) for i in partly],
                                            [(keys[i], generation[i]) for i in whole])
        call.ending = True  # from here on, puts past the deadline may have been stored
        ended = await core.commits.end_batch([keys[i] for i in written], [generation[i] for i in written], end,
                                             overwrite) or {}
        _remember_batch(core, started, keys, written, ended, partial, views, digests, packed, raw_sizes)
        for n, i in enumerate(written):
            if n in ended:
                errors[keys[i]] = ended[n]
    if errors:
        first_key, first = next(iter(errors.items()))
        raise BatchError(f"{len(errors)} of {len(keys)} puts failed (first: {first_key!r}: {first})", errors)


def _remember_batch(core: Core, started: Started, keys, written, ended, partial, views, digests, packed,
                    raw_sizes) -> None:
    """Cache where each put that ended lives (nearest replicas first, as reads want them)."""
    blobs = started.serialized_placements()
    cache = core.cache
    for n, i in enumerate(written):
        if n in ended:
            continue
        compressed = packed[i] is not None
        if i in partial:
            info = started.info(i)
            drop_replicas(info, partial[i])
            remember(core, keys[i], info, len(views[i]), digests[i], compressed, raw_sizes[i])
        else:
            cache.put_placed(keys[i], blobs[started.placement[i]], started.generation[i], len(views[i]),
                             digests[i], compressed, raw_sizes[i])


def remember(core: Core, key: str, info, size: int, digest: int, compressed: bool, raw_size: int) -> None:
    """Cache where a put this client ended lives; it knows what it committed first-hand
    (don't depend on the master's echo)."""
    info.key, info.size, info.checksum = key, size, digest
    info.compressed, info.raw_size = compressed, raw_size
    nearest_first(info)
    core.cache.put(key, info)


async def revoke(core: Core, puts: list) -> None:
    """Best effort: a put the master never hears about again is reclaimed after --put-timeout. Posted
    where it can be (the call it ends may be out of time), else asked."""
    if not puts:
        return
    method, request = convert.revoke_call(puts)
    if core.master.post(method, request, _ignored):
        return
    try:
        await core.master.call(method, request)
    except KvpoolError:
        pass


def _ignored(_answer) -> None:
    """The answer to a posted revoke: nothing waits for it."""
