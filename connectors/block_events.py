"""Which KV blocks of a namespace exist, as a stream of changes: for a KV-aware router's own index.

Read from the placement record the leading master keeps in etcd (a key per committed object), so a
router needs etcd's address only and puts no load on the master. The stream starts with every block
stored now, then follows changes; after a broken watch (etcd away, history compacted) it reads the
record again and reports only the difference, so a subscriber's index never drifts.
"""

import asyncio
import contextlib
import logging
from typing import AsyncIterator

import aetcd
from aetcd.rtypes import EventKind

from kvpool.cluster_layout import DEFAULT_CLUSTER, objects_prefix, parse_hostport

from .block_keys import BlockNamespace

log = logging.getLogger(__name__)

STORED, REMOVED = "stored", "removed"


async def block_events(etcd: str, namespace: BlockNamespace, cluster: str = DEFAULT_CLUSTER,
                       retry_delay: float = 0.5) -> AsyncIterator[tuple[str, str]]:
    """Yields (STORED | REMOVED, block hash) for the blocks of `namespace`, forever."""
    host, port = parse_hostport(etcd)
    prefix = objects_prefix(cluster) + namespace.prefix().encode()
    known: set[str] = set()
    async with aetcd.Client(host=host, port=port) as client:
        while True:
            try:
                snapshot = await client.get_prefix(prefix)
                present = {kv.key[len(prefix):].decode() for kv in snapshot}
                for block in sorted(present - known):
                    yield STORED, block
                for block in sorted(known - present):
                    yield REMOVED, block
                known = present
                watch = await client.watch_prefix(prefix, start_revision=snapshot.header.revision + 1)
                try:
                    async for event in watch:
                        block = event.kv.key[len(prefix):].decode()
                        # A stored object's record is rewritten when its copies change: report it once.
                        if event.kind == EventKind.PUT and block not in known:
                            known.add(block)
                            yield STORED, block
                        elif event.kind == EventKind.DELETE and block in known:
                            known.discard(block)
                            yield REMOVED, block
                finally:
                    with contextlib.suppress(Exception):
                        await watch.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd away or history compacted: read it all again
                log.warning("block event watch failed (%s: %s); reading the record again", type(exc).__name__, exc)
                await asyncio.sleep(retry_delay)
