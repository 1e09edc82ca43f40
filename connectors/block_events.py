"""Which KV blocks of a namespace exist, as a stream of changes: for a KV-aware router's own index.

Served by the leading master (WatchKeys, see proto/kvpool.proto): first every
block stored now, then changes as they commit. The stream follows the leader
across a failover and resumes after a broken connection with the position it
reached; when the master cannot continue from there (a new leader, or this
subscriber fell too far behind) it sends a fresh snapshot, and only the
difference to what was already reported is yielded, so a subscriber's index
never drifts. A block whose object is overwritten or gets a new copy is not
reported again.
"""

import asyncio
import logging
from collections.abc import AsyncIterator

from kvpool.client.master_link import MasterLink
from kvpool.protocol.cluster_layout import DEFAULT_CLUSTER
from kvpool.security import auth
from kvpool.errors import ForbiddenError, InvalidArgumentError, KvpoolError
from kvpool.proto import kvpool_pb2 as pb

from .block_keys import BlockNamespace

log = logging.getLogger(__name__)

STORED, REMOVED = "stored", "removed"
IDLE_TIMEOUT = 10.0  # the master sends at least every 2 s; silence this long means it is gone


async def block_events(namespace: BlockNamespace, master: str | None = None, *, etcd: str | None = None,
                       cluster: str = DEFAULT_CLUSTER, retry_delay: float = 0.5,
                       rpc_timeout: float = 10.0, token: str | None = None) -> AsyncIterator[tuple[str, str]]:
    """Yields (STORED | REMOVED, block hash) for the blocks of `namespace`, forever.

    `master`: HOST:PORT of the master(s), comma-separated (the leader is followed), or `etcd`:
    HOST:PORT of the cluster's etcd, where the leader is looked up. `token`: as for the Client
    (default: the environment's). A refused credential is raised, not retried."""
    if not isinstance(namespace, BlockNamespace):
        raise InvalidArgumentError(f"namespace must be a BlockNamespace, got {type(namespace).__name__}")
    try:
        credential = auth.client_credential(token)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    link = MasterLink(master, etcd, cluster, rpc_timeout, credential=credential)
    prefix = namespace.prefix()
    known: set[str] = set()  # what the subscriber has been told is stored
    feed_id, sequence = "", 0  # where to resume
    try:
        while True:
            request = pb.WatchKeysRequest(prefix=prefix, feed_id=feed_id, after_sequence=sequence)
            snapshot: set[str] | None = None  # pages of a snapshot being received
            try:
                async for message in link.stream("WatchKeys", request, IDLE_TIMEOUT):
                    if message.snapshot:
                        snapshot = snapshot or set()
                        snapshot.update(key[len(prefix):] for key in message.present)
                        if not message.snapshot_done:
                            continue
                        stored, removed = sorted(snapshot - known), sorted(known - snapshot)
                        known, snapshot = snapshot, None
                        feed_id, sequence = message.feed_id, message.sequence
                        for block in stored:
                            yield STORED, block
                        for block in removed:
                            yield REMOVED, block
                        continue
                    feed_id, sequence = message.feed_id, message.sequence
                    for change in message.changes:
                        block = change.key[len(prefix):]
                        if change.kind == pb.KEY_STORED and block not in known:
                            known.add(block)
                            yield STORED, block
                        elif change.kind == pb.KEY_REMOVED and block in known:
                            known.discard(block)
                            yield REMOVED, block
                log.warning("the master ended the block event stream; resuming")
            except (InvalidArgumentError, ForbiddenError):
                raise
            except KvpoolError as exc:  # leader gone or changed, connection broken: resume where it was
                log.warning("block event stream broke (%s: %s); resuming", type(exc).__name__, exc)
            await asyncio.sleep(retry_delay)
    finally:
        await link.close()
