"""What a node without a shared tier does with its objects when told to stop (SIGTERM, SIGINT): it asks the leading
master to drain it, as `kvpool drain` does (nothing new is placed here; each object is copied to nodes with room,
then its copy here is freed), keeps serving while the copies are made, and leaves once it holds nothing, within
--stop-grace. It leaves sooner when the copies stop coming (no other node has room, or every node is stopping, as
in a whole cluster stopped at once) and says in one line how many objects it handed on and how many it could not.
"""

import asyncio
import json
import logging

import grpc

from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol.cluster_layout import master_key
from kvpool.security.grpc_auth import blocking_channel
from kvpool.storenode.storage.store import ObjectStore

log = logging.getLogger(__name__)

POLL = 0.05  # seconds between looks at what the node still holds
STALL = 1.0  # seconds without a copy leaving before the node stops waiting for more
ASK_TIMEOUT = 5.0  # the leader's address and its answer to Drain
# The leader starts a drain on its loop, key by key, and its repair plans over the whole set: at 2.85 million
# objects a node's Drain held the leader past its election lease. Above this a stopping node leaves its objects
# to their other copies until the drain is made incremental.
MOST = 100_000


def held(store: ObjectStore) -> int:
    return sum(1 for rec in store.index if rec.held)


async def hand_off_on_stop(store: ObjectStore, etcd, cluster: str, node_id: str, credential, tls,
                           grace: float) -> tuple[int, int]:
    """(objects handed on, objects left) after at most `grace` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    before = held(store)
    if not before:
        return 0, 0
    if before > MOST:
        log.warning("stopping: %d objects are more than a drain at stop may ask the leader to copy (%d); leaving "
                    "them to their other copies", before, MOST)
        return 0, before
    try:
        leader = await asyncio.wait_for(_leader(etcd, cluster), min(ASK_TIMEOUT, grace))
        await asyncio.to_thread(_drain, leader, node_id, credential, tls, max(0.1, min(ASK_TIMEOUT, grace)))
    except Exception as exc:  # noqa: BLE001 - no leader to ask: the node leaves with its objects, and says so
        log.warning("stopping: the leader could not be asked to take this node's %d objects (%s); leaving with "
                    "them", before, exc)
        return 0, before
    left, last_change = before, loop.time()
    while left and loop.time() < deadline and loop.time() - last_change < STALL:
        await asyncio.sleep(POLL)
        now = held(store)
        if now != left:
            left, last_change = now, loop.time()
    why = "" if not left else " (the grace ran out)" if loop.time() >= deadline else " (no other node took them)"
    log.log(logging.WARNING if left else logging.INFO, "stopping: %d objects handed to other nodes, %d not%s",
            before - left, left, why)
    return before - left, left


async def _leader(etcd, cluster: str) -> str:
    record = await etcd.get(master_key(cluster))
    if record is None or not record.value:
        raise LookupError("no leading master in etcd")
    return json.loads(record.value)["address"]


def _drain(address: str, node_id: str, credential, tls, timeout: float) -> None:
    channel = blocking_channel(address, credential, tls=tls)
    try:
        drain = channel.unary_unary("/kvpool.Master/Drain", request_serializer=pb.DrainRequest.SerializeToString,
                                    response_deserializer=pb.DrainResponse.FromString)
        reply = drain(pb.DrainRequest(node_id=node_id), timeout=timeout)
    except grpc.RpcError as exc:
        raise ConnectionError(f"Drain at {address}: {exc.code().name}") from None
    finally:
        channel.close()
    if reply.status != pb.OK:
        raise ConnectionError(f"Drain at {address}: {pb.Status.Name(reply.status)} {reply.message}")
