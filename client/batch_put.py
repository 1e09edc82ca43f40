"""AsyncClient.batch_put: many puts in one BatchPutStart, one pipelined WRITE stream per node,
one BatchPutEnd.

The master answers the keys column in columns (a generation per key and an index into the few
distinct placements, see BatchPutStartResponse in kvpool.proto), so no message is made per key on
either side: the WRITEs are grouped by placement, and the placement cache keeps each key as its
placement's serialized replicas plus the key's own fields.
"""

import asyncio

from kvpool.errors import BatchError, InternalError, error_for
from kvpool.proto import kvpool_pb2 as pb

from .replica_order import drop_replicas, nearest_first
from .transport import WriteItem


class Started:
    """The puts of one batch the master opened: index -> generation, and where each was placed."""

    def __init__(self, response: pb.BatchPutStartResponse, count: int):
        generations, placement = response.generations, response.placement
        if len(generations) != count or len(placement) != count or len(response.refused) != len(response.errors):
            raise InternalError(f"BatchPutStart answered {len(generations)} generations and {len(placement)} "
                                f"placements for {count} puts")
        self.generation = list(generations)
        self.placement = list(placement)
        self.placements = list(response.placements)
        self.refused = dict(zip(response.refused, response.errors))
        self.indices = [i for i, generation in enumerate(self.generation) if generation]
        if any(self.placement[i] >= len(self.placements) for i in self.indices):
            raise InternalError("BatchPutStart answered a placement it did not send")

    def info(self, i: int) -> pb.ObjectInfo:
        """An ObjectInfo of put i (replicas, generation, term)."""
        info = pb.ObjectInfo()
        info.CopyFrom(self.placements[self.placement[i]])
        info.generation = self.generation[i]
        return info


async def write_started(client, started: Started, raws, views, digests, options, needed: int) -> tuple[dict, dict]:
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
    transport = client._transport
    addresses = list(groups)
    if len(addresses) == 1:  # one node: no task for a gather to wait on
        outcomes = [await transport.write_many(addresses[0], groups[addresses[0]][1])]
    else:
        outcomes = await asyncio.gather(*(transport.write_many(address, groups[address][1]) for address in addresses))
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


async def batch_put(client, keys: list, raws: list, views: list, digests: list, packed: list, raw_sizes: list,
                    common: pb.PutStartRequest, options: list, needed: int, overwrite: bool) -> None:
    """The puts of AsyncClient.batch_put once its values are checksummed (and compressed: `packed`
    holds each compressed value or None); raises BatchError naming the keys that failed."""
    request = pb.BatchPutStartRequest(common=common, keys=keys, sizes=[len(view) for view in views],
                                      checksums=digests)
    compressed = any(p is not None for p in packed)
    if compressed:
        request.compressed.extend([p is not None for p in packed])
        request.raw_sizes.extend(raw_sizes)
    started = Started(await client._master.call("BatchPutStart", request), len(keys))
    errors = {keys[i]: error_for(e.status, e.message) for i, e in started.refused.items()}
    generation = started.generation
    try:
        failed, partial = await write_started(client, started, raws, views, digests, options, needed)
    except BaseException:
        await client._revoke([(keys[i], generation[i]) for i in started.indices])
        raise
    if failed:
        await client._revoke([(keys[i], generation[i]) for i in started.indices if i in failed])
        for i, exc in failed.items():
            errors[keys[i]] = exc
    # Puts with a copy missing go as items (they name the nodes), the rest as two lists.
    partly = [i for i in started.indices if i in partial]
    whole = [i for i in started.indices if i not in failed and i not in partial] if failed or partial \
        else started.indices
    written = partly + whole
    if written:
        end = pb.BatchPutEndRequest(
            items=[pb.PutEndRequest(key=keys[i], generation=generation[i], failed_nodes=list(partial[i]))
                   for i in partly],
            keys=[keys[i] for i in whole], generations=[generation[i] for i in whole])
        ended = await client._commits.end_batch([keys[i] for i in written], end, overwrite) or {}
        remember(client, started, keys, written, ended, partial, views, digests, packed, raw_sizes)
        for n, i in enumerate(written):
            if n in ended:
                errors[keys[i]] = ended[n]
    if errors:
        first_key, first = next(iter(errors.items()))
        raise BatchError(f"{len(errors)} of {len(keys)} puts failed (first: {first_key!r}: {first})", errors)


def remember(client, started: Started, keys, written, ended, partial, views, digests, packed, raw_sizes) -> None:
    """Cache where each put that ended lives (nearest replicas first, as reads want them)."""
    blobs = {}
    for where, placement in enumerate(started.placements):
        nearest_first(placement)
        blobs[where] = placement.SerializeToString()
    cache = client._cache
    for n, i in enumerate(written):
        if n in ended:
            continue
        compressed = packed[i] is not None
        if i in partial:
            info = started.info(i)
            drop_replicas(info, partial[i])
            client._remember(keys[i], info, len(views[i]), digests[i], compressed, raw_sizes[i])
        else:
            cache.put_placed(keys[i], blobs[started.placement[i]], started.generation[i], len(views[i]),
                             digests[i], compressed, raw_sizes[i])
