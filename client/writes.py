"""Storing values: PutStart -> write every replica -> PutEnd (PutRevoke if anything fails).

A value is checksummed (and lz4-compressed first when asked or large enough:
it is then stored, checksummed and moved as its compressed bytes). The master
places it; every copy is written straight from the caller's buffer; the end is
posted or awaited (commits.py); the placement is cached, so a get right after
needs no lookup. A batch shares one BatchPutStart, one pipelined WRITE stream
per node and one BatchPutEnd (batch_put.py).
"""

import asyncio

from kvpool.errors import InvalidArgumentError
from kvpool.protocol.keys import validate_key

from . import batch_put as batch_puts
from . import compression, convert, put_options
from .core import Core
from .convert import check
from .replica_order import drop_replicas
from .transport import WriteItem
from .values import checksum_of, readable_view


async def put(core: Core, key: str, value, overwrite: bool, tier, pin, pin_ttl, ttl, compress, replicas,
              min_replicas) -> None:
    """AsyncClient.put."""
    raw = validate_key(key)
    choices = put_options.resolve(tier, pin, pin_ttl, ttl)
    count, needed = put_options.replica_counts(replicas, min_replicas, core.replicas)
    data = readable_view(value)
    raw_size = len(data)
    packed = compression.encode(data, compress, core.compress_above)
    if packed is not None:
        data = packed
    digest = checksum_of(data)
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
            await core.revoke([(key, info.generation)])
            raise
    await core.commits.end(key, convert.put_end_request(key, info.generation, failed), overwrite)
    drop_replicas(info, failed)
    core.remember(key, info, len(data), digest, packed is not None, raw_size)


async def batch_put(core: Core, keys, values, overwrite: bool, tier, pin, pin_ttl, ttl, compress, replicas,
                    min_replicas) -> None:
    """AsyncClient.batch_put."""
    count, needed = put_options.replica_counts(replicas, min_replicas, core.replicas)
    keys = list(keys)
    values = list(values)
    if len(keys) != len(values):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
    raws = [validate_key(key) for key in keys]
    choices = put_options.resolve(tier, pin, pin_ttl, ttl)
    views = [readable_view(value) for value in values]
    raw_sizes = [len(view) for view in views]
    packed = [compression.encode(view, compress, core.compress_above) for view in views]
    views = [view if p is None else p for view, p in zip(views, packed)]
    digests = [checksum_of(view) for view in views]
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
    await batch_puts.batch_put(core, request, keys, raws, views, digests, packed, raw_sizes, options, needed,
                               overwrite)


async def _write_replicas(core: Core, raw: bytes, info, data: memoryview, digest: int, options) -> dict:
    """Write every replica; node id -> error of each that failed."""
    transport = core.transport
    replicas = info.replicas
    if len(replicas) == 1:
        # The placing leader's term goes with the WRITEs: nodes refuse it once a newer leader spoke.
        await transport.write(replicas[0].address, raw, info.generation, data, digest, options, term=info.term)
        return {}
    # Every write must be over before a revoke frees the copies, so no early exit. The copies travel at
    # once: as tasks on the loop, even a blocking client's (io.py waits on a socket only outside tasks).
    item = WriteItem(raw, info.generation, data, digest, options, info.term)
    outcomes = await asyncio.gather(*(transport.write_many(r.address, (item,)) for r in replicas),
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


def _check_enough_written(info, failed: dict, needed: int) -> None:
    """Raise the first write error when fewer copies than `needed` (0 = all) were written."""
    if failed and len(info.replicas) - len(failed) < (needed or len(info.replicas)):
        raise next(iter(failed.values()))
