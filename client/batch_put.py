"""A batch put (writes.batch_put): many puts in one BatchPutStart, one pipelined WRITE stream per node,
one BatchPutEnd.

The master answers the keys column in columns (a generation per key and an index into the few
distinct placements, see BatchPutStartResponse in kvpool.proto), so no message is made per key on
either side: the WRITEs are grouped by placement, and the placement cache keeps each key as its
placement's serialized replicas plus the key's own fields.
"""


from kvpool.errors import BatchError

from . import convert
from .convert import Started
from .core import Core
from .replica_order import drop_replicas
from .transport import WriteItem


async def write_started(core: Core, started: Started, raws, views, digests, options, needed: int) -> tuple[dict, dict]:
    """Write every replica of the started puts, one pipelined stream per node.

    Returns (index -> first error of puts with too few copies written, index -> {node id: error}
    of puts that succeeded with some copies missing)."""
    by_placement: dict[int, list[int]] = {}
    for i in started.indices:
        by_placement.setdefault(started.placement[i], []).append(i)
    groups: dict[str, tuple[list, list]] = {}  # node address -> ([(index, node id)], [WriteItem])
    for where, indices in by_placement.items():
        placement = started.placements[where]
        term, generation = placement.term, started.generation
        for replica in placement.replicas:
            group = groups.get(replica.address)
            if group is None:
                group = groups[replica.address] = ([], [])
            node_id = replica.node_id
            group[0].extend((i, node_id) for i in indices)
            group[1].extend(WriteItem(raws[i], generation[i], views[i], digests[i], options[i], term) for i in indices)
    if not groups:
        return {}, {}
    transport = core.transport
    addresses = list(groups)
    if len(addresses) == 1:  # one node: no task for a gather to wait on
        outcomes = [await transport.write_many(addresses[0], groups[addresses[0]][1])]
    else:
        outcomes = await core.io.gather(*(transport.write_many(address, groups[address][1])
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


async def batch_put(core: Core, request, keys: list, raws: list, views: list, digests: list, packed: list,
                    raw_sizes: list, options: list, needed: int, overwrite: bool) -> None:
    """The puts of AsyncClient.batch_put once its values are checksummed (and compressed: `packed`
    holds each compressed value or None) and its BatchPutStart `request` made; raises BatchError
    naming the keys that failed."""
    started = Started(await core.master.call("BatchPutStart", request), len(keys))
    errors = {keys[i]: error for i, error in started.refused.items()}
    generation = started.generation
    try:
        failed, partial = await write_started(core, started, raws, views, digests, options, needed)
    except BaseException:
        await core.revoke([(keys[i], generation[i]) for i in started.indices])
        raise
    if failed:
        await core.revoke([(keys[i], generation[i]) for i in started.indices if i in failed])
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
        ended = await core.commits.end_batch([keys[i] for i in written], end, overwrite) or {}
        remember(core, started, keys, written, ended, partial, views, digests, packed, raw_sizes)
        for n, i in enumerate(written):
            if n in ended:
                errors[keys[i]] = ended[n]
    if errors:
        first_key, first = next(iter(errors.items()))
        raise BatchError(f"{len(errors)} of {len(keys)} puts failed (first: {first_key!r}: {first})", errors)


def remember(core: Core, started: Started, keys, written, ended, partial, views, digests, packed,
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
            core.remember(keys[i], info, len(views[i]), digests[i], compressed, raw_sizes[i])
        else:
            cache.put_placed(keys[i], blobs[started.placement[i]], started.generation[i], len(views[i]),
                             digests[i], compressed, raw_sizes[i])
