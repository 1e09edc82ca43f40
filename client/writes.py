"""Storing values: PutStart -> write every replica -> PutEnd (PutRevoke if anything fails); one path for a
put and a batch put (a put is a batch of one), with one rule for enough copies.

A value is checksummed (and lz4-compressed first when asked or large enough:
it is then stored, checksummed and moved as its compressed bytes). The master
places it; every copy is written straight from the caller's buffer; the end is
posted or awaited (commits.py); the placement is cached, so a get right
after needs no lookup.

The puts of a call share one start (PutStart for one, BatchPutStart for more),
one pipelined WRITE stream per node and one end (PutEnd, BatchPutEnd). The
master answers a batch's keys column in columns (a generation per key and an
index into the few distinct placements, see BatchPutStartResponse in
kvpool.proto), so no message is made per key on either side: the WRITEs are
grouped by placement, and the placement cache keeps each key as its placement's
serialized replicas plus the key's own fields.

A put counts as stored once `min_replicas` of its copies (default all) are
written: the master is then told which nodes failed; with fewer it fails with
the first write error, and is revoked. Ending a put: its end is posted or
awaited (commits.py). A put past its deadline (deadlines.py) is revoked, unless
its end had left: then its outcome is unknown (PutOutcomeUnknownError).
"""

from __future__ import annotations  # Core is named for the reader only: assembly.py imports this module

from typing import TYPE_CHECKING

from kvpool.errors import BatchError, InvalidArgumentError, KvpoolError, UnavailableError
from kvpool.protocol.keys import validate_key

from kvpool.client import compression, convert, put_options
from kvpool.client.deadlines import node_in_time
from kvpool.client.convert import Started
from kvpool.client.replica_order import drop_replicas, nearest_first
from kvpool.client.transport import WriteItem
from kvpool.client.device.staged import is_device
from kvpool.client.values import checksum_of

if TYPE_CHECKING:
    from kvpool.client.assembly import Core

_NONE: dict = {}  # no errors (only read)


async def put(core: Core, key: str, value, overwrite: bool = False, *, tier: str | None = None,
              pin: str | None = None, pin_ttl: float | None = None, ttl: float | None = None,
              compress: bool | None = None, replicas: int | None = None, min_replicas: int | None = None,
              timeout: float | None = None) -> None:
    """AsyncClient.put: a batch of one, whose error is raised as it is."""
    data = core.devices.readable(value)
    options = (overwrite, tier, pin, pin_ttl, ttl, compress, replicas, min_replicas)
    async with core.bounded(timeout, f"put of {key!r}", len(data)) as call:
        keys = [core.stored(key)]
        if is_device(data):  # sent from staging, its checksum taken as it was staged (client/device)
            async with core.devices.staged(data) as staged:
                errors = await _put_all(core, call, keys, [staged], [staged.digest], *options)
        else:
            errors = await _put_all(core, call, keys, [data], None, *options)
        if errors:
            raise errors[0]


async def batch_put(core: Core, keys, values, overwrite: bool = False, *, tier: str | None = None,
                    pin: str | None = None, pin_ttl: float | None = None, ttl: float | None = None,
                    compress: bool | None = None, replicas: int | None = None,
                    min_replicas: int | None = None, timeout: float | None = None) -> None:
    """AsyncClient.batch_put."""
    keys = core.stored_keys(list(keys))
    devices = core.devices
    views = [devices.readable(value) for value in values]
    options = (overwrite, tier, pin, pin_ttl, ttl, compress, replicas, min_replicas)
    async with core.bounded(timeout, f"batch_put of {len(keys)} keys", sum(map(len, views))) as call:
        if len(keys) != len(views):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(views)} values")
        if any(is_device(view) for view in views):  # one start per wave of staged values (client/device)
            async def send(indices: list, values: list, digests: list) -> None:
                wave = [keys[i] for i in indices]
                failed = await _put_all(core, call, wave, values, digests, *options)
                if failed:  # put_waves gathers each wave's errors by key
                    raise BatchError(f"{len(failed)} puts of a wave failed", {wave[i]: e for i, e in failed.items()})

            errors = await devices.put_waves(keys, views, send)
        else:
            errors = await _put_all(core, call, keys, views, None, *options)
            errors = {keys[i]: error for i, error in errors.items()}
        if errors:
            first_key, first = next(iter(errors.items()))
            raise core.named_errors(BatchError(f"{len(errors)} of {len(keys)} puts failed (first: {first_key!r}: "
                                               f"{first})", errors))


async def _put_all(core: Core, call, keys: list, views: list, known_digests: list | None, overwrite: bool, tier,
                   pin, pin_ttl, ttl, compress, replicas, min_replicas) -> dict:
    """The puts of `keys` (stored keys) of `views` (their checksums already known where `known_digests`
    has one); index -> error of each that failed, those the master refused first."""
    raws = list(map(validate_key, keys))
    choices = put_options.resolve(tier, pin, pin_ttl, ttl)
    count, needed = put_options.replica_counts(replicas, min_replicas, core.replicas)
    if not keys:
        return {}
    views, digests, raw_sizes, compressed = _encoded(views, known_digests, compress, core.compress_above)
    if compressed is None:
        options = [choices.write_options(False, 0)] * len(keys)  # one immutable WriteOptions for all
    else:
        options = [choices.write_options(c, raw_size) for c, raw_size in zip(compressed, raw_sizes)]
    method, request = convert.put_start_call(keys, list(map(len, views)), digests, overwrite, count, needed,
                                             choices, compressed, raw_sizes)
    started = convert.started(method, await core.master.call(method, request), len(keys))
    errors = started.refused
    indices, generation = started.indices, started.generation
    try:
        failed, partial = await _write_started(core, started, raws, views, digests, options, needed)
    except BaseException:
        await _revoke(core, [(keys[i], generation[i]) for i in indices])
        raise
    if failed:
        await _revoke(core, [(keys[i], generation[i]) for i in indices if i in failed])
        errors.update(failed)
    # Puts with a copy missing end as items (they name the nodes), the others as two columns.
    if failed or partial:
        partly = [i for i in indices if i in partial]
        whole = [i for i in indices if i not in failed and i not in partial]
    else:
        partly, whole = (), indices
    written = partly + whole if partly else whole
    if written:
        whole_keys, whole_generations = _at(keys, whole), _at(generation, whole)
        if partly:  # the request names them first
            items = [(keys[i], generation[i], partial[i]) for i in partly]
            ended_keys, ended_generations = [keys[i] for i in written], [generation[i] for i in written]
        else:
            items, ended_keys, ended_generations = (), whole_keys, whole_generations
        method, request = convert.put_end_call(items, whole_keys, whole_generations)
        call.ending = True  # from here on, puts past the deadline may have been stored
        ended = await core.commits.end(method, request, ended_keys, ended_generations, overwrite)
        _remember(core, started, keys, written, ended or _NONE, partial, views, digests, compressed, raw_sizes)
        if ended:
            for n, i in enumerate(written):
                if n in ended:
                    errors[i] = ended[n]
    return errors


def _at(column: list, indices: list) -> list:
    """The entries of `column` at `indices` (ascending): the column itself when they are all of it (the usual case)."""
    return column if len(indices) == len(column) else [column[i] for i in indices]


def _encoded(views: list, known_digests: list | None, compress, compress_above) -> tuple:
    """(the bytes to store per value, their checksums, the values' sizes, per value whether it was compressed or
    None when none was), in one pass: a put of one value is the common case."""
    stored, digests, raw_sizes, compressed = views, [], [], None
    for i, view in enumerate(views):
        raw_sizes.append(len(view))
        packed = compression.encode(view, compress, compress_above)
        if packed is not None:  # stored, checksummed and moved as its compressed bytes
            if compressed is None:
                stored, compressed = list(views), [False] * len(views)
            stored[i] = packed
            compressed[i] = True
            digests.append(checksum_of(packed))
        elif known_digests is None or known_digests[i] is None:
            digests.append(checksum_of(view))
        else:
            digests.append(known_digests[i])
    return stored, digests, raw_sizes, compressed


def _enough_written(copies: int, missing: int, needed: int) -> bool:
    """Whether a put of `copies` with `missing` of them unwritten is stored: `needed` (0 = all) were written."""
    return copies - missing >= (needed or copies)


async def _write_started(core: Core, started: Started, raws, views, digests, options,
                         needed: int) -> tuple[dict, dict]:
    """Write every replica of the started puts, one pipelined stream per node, every node at once.

    Returns (index -> first error of puts with too few copies written, index -> {node id: error}
    of puts that succeeded with some copies missing)."""
    placements, generation = started.placements, started.generation
    groups: dict[str, tuple] = {}  # node address -> (its node id, [index of each put], [its WriteItem])
    seal = started.seal if started.seals else None  # else every WriteItem shares its put's options as they are
    for where, indices in _by_placement(started).items():
        # The placing leader's term goes with the WRITEs: nodes refuse it once a newer leader spoke.
        term, replicas = placements[where].term, placements[where].replicas
        for copy in range(len(replicas)):  # (indexing a repeated field is cheaper than iterating it)
            replica = replicas[copy]
            group = groups.get(replica.address)
            if group is None:
                group = groups[replica.address] = (replica.node_id, [], [])
            group[1].extend(indices)
            items = group[2]
            for i in indices:
                items.append(WriteItem(raws[i], generation[i], views[i], digests[i], options[i] if seal is None
                                       else options[i]._replace(seal=seal(i, copy)), term))
    if not groups:  # nothing to write (empty values)
        return {}, {}
    if len(groups) == 1:  # one node: no task for a gather to wait on
        [(address, (node_id, writing, items))] = groups.items()
        missing = _missing(node_id, writing, await _write_in_time(core, address, items), {})
    else:
        # Every write must be over (done, failed or out of time) before a revoke frees the copies, so no
        # early exit: a node whose writes raised fails each of them.
        outcomes = await core.io.gather(*[_write_in_time(core, address, group[2])
                                          for address, group in groups.items()], return_exceptions=True)
        missing = {}
        for (node_id, writing, _), results in zip(groups.values(), outcomes):
            if isinstance(results, BaseException):
                if not isinstance(results, Exception):
                    raise results  # cancelled: not a node failure
                results = [results] * len(writing)
            _missing(node_id, writing, results, missing)
    failed, partial = {}, {}
    for i, errors in missing.items():
        if _enough_written(len(placements[started.placement[i]].replicas), len(errors), needed):
            partial[i] = errors
        else:
            failed[i] = next(iter(errors.values()))
    return failed, partial


def _by_placement(started: Started) -> dict:
    """Placement index -> the indices of the started puts placed there."""
    if len(started.placements) == 1:
        return {0: started.indices}
    by_placement: dict[int, list[int]] = {}
    placement = started.placement
    for i in started.indices:
        by_placement.setdefault(placement[i], []).append(i)
    return by_placement


def _missing(node_id: str, writing: list, results: list, missing: dict) -> dict:
    """`missing` (index -> {node id: error}) with the writes of the puts `writing` to node `node_id` that failed."""
    for i, result in zip(writing, results):
        if result is not None:
            missing.setdefault(i, {})[node_id] = result
    return missing


async def _write_in_time(core: Core, address: str, items) -> list:
    """Per item None, or the error its write to one node failed with; a node that does not answer within
    the client's write deadline fails every item (a silent node must not hold a put for longer)."""
    transport = core.transport
    nbytes = len(items[0].data) if len(items) == 1 else sum(len(item.data) for item in items)
    return await node_in_time(
        core.io, core.write_deadline(nbytes), items,
        lambda one: transport.write(address, one.key, one.generation, one.data, one.checksum, one.options,
                                    term=one.term),
        lambda many: transport.write_many(address, many),
        lambda: _no_answer(core, address))


def _no_answer(core: Core, address: str) -> UnavailableError:
    return UnavailableError(f"node {address} did not answer a write within {core.write_timeout:g}s")


def _remember(core: Core, started: Started, keys, written, ended, partial, views, digests, compressed,
              raw_sizes) -> None:
    """Cache where each put that ended lives (nearest replicas first, as reads want them)."""
    blobs = started.serialized_placements()
    cache = core.cache
    for n, i in enumerate(written):
        if n in ended:
            continue
        is_compressed = compressed is not None and compressed[i]
        if i in partial:
            info = started.info(i)
            drop_replicas(info, partial[i])
            _remember_info(core, keys[i], info, len(views[i]), digests[i], is_compressed, raw_sizes[i])
        else:
            cache.put_placed(keys[i], blobs[started.placement[i]], started.generation[i], len(views[i]),
                             digests[i], is_compressed, raw_sizes[i])


def _remember_info(core: Core, key: str, info, size: int, digest: int, compressed: bool, raw_size: int) -> None:
    """Cache where a put this client ended lives; it knows what it committed first-hand
    (don't depend on the master's echo)."""
    info.key, info.size, info.checksum = key, size, digest
    info.compressed, info.raw_size = compressed, raw_size
    nearest_first(info)
    core.cache.put(key, info)


async def _revoke(core: Core, puts: list) -> None:
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
