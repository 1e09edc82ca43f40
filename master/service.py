"""The Master gRPC service: validates requests and answers them from the object table.

Every answer carries a typed Status; batch RPCs answer each item on its own, so
one bad key never fails its neighbours. Handlers never await: the table is
consistent between any two lines of the event loop.
"""

import functools
import logging
import time

from kvpool.errors import Code, InvalidArgumentError, KvpoolError
from kvpool.keys import validate_key
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc

from .metrics import MasterMetrics
from .node_free import NodeFreer
from .objects import ObjectTable, ObjectVersion

log = logging.getLogger(__name__)

TIERS = {"dram": pb.DRAM, "ssd": pb.SSD}


def _answer(response_cls, fn, *args):
    """fn(*args), or a response_cls carrying the status of the error it raised."""
    try:
        return fn(*args)
    except KvpoolError as exc:
        return response_cls(status=int(exc.code), message=str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug must answer INTERNAL, not kill the RPC
        log.exception("internal error in %s", getattr(fn, "__name__", fn))
        return response_cls(status=pb.INTERNAL, message=f"internal error: {type(exc).__name__}: {exc}")


def _error_statuses(response) -> list[str]:
    if "items" in response.DESCRIPTOR.fields_by_name:
        statuses = [item.status for item in response.items]
    else:
        statuses = [getattr(response, "status", pb.OK)]
    return [Code(s).name if s in Code._value2member_map_ else str(s) for s in statuses if s != pb.OK]


def _rpc(handler):
    """Adapt a synchronous handler(self, request) to grpc.aio, with metrics and FREE dispatch."""

    @functools.wraps(handler)
    async def method(self, request, context):
        started = time.perf_counter()
        response = handler(self, request)
        self._freer.submit(self._table.take_frees())
        self._metrics.observe(handler.__name__, time.perf_counter() - started, _error_statuses(response))
        return response

    return method


def object_info(version: ObjectVersion) -> pb.ObjectInfo:
    return pb.ObjectInfo(
        key=version.key, size=version.size, checksum=version.checksum, generation=version.generation,
        replicas=[pb.Replica(node_id=r.node_id, address=r.address, tier=TIERS.get(r.tier, pb.TIER_UNSPECIFIED),
                             offset=r.offset, length=r.length) for r in version.replicas],
    )


def _validate_prefix(prefix: str) -> None:
    # An empty prefix would wipe the whole cluster; that deserves more than a default argument.
    if prefix == "":
        raise InvalidArgumentError("prefix must not be empty")
    validate_key(prefix)


class MasterService(kvpool_pb2_grpc.MasterServicer):
    def __init__(self, table: ObjectTable, freer: NodeFreer, metrics: MasterMetrics, master_id: str,
                 address: str):
        self._table = table
        self._freer = freer
        self._metrics = metrics
        self.master_id = master_id
        self.address = address

    # ----- one item each -----

    def _put_start(self, req: pb.PutStartRequest) -> pb.PutStartResponse:
        validate_key(req.key)
        version = self._table.put_start(req.key, req.size, req.checksum, req.overwrite, req.replicas or 1)
        return pb.PutStartResponse(status=pb.OK, object=object_info(version))

    def _put_end(self, req: pb.PutEndRequest) -> pb.StatusResponse:
        validate_key(req.key)
        self._table.put_end(req.key, req.generation)
        return pb.StatusResponse(status=pb.OK)

    def _put_revoke(self, req: pb.PutRevokeRequest) -> pb.StatusResponse:
        validate_key(req.key)
        self._table.put_revoke(req.key, req.generation)
        return pb.StatusResponse(status=pb.OK)

    def _replica_list(self, key: str) -> pb.GetReplicaListResponse:
        validate_key(key)
        return pb.GetReplicaListResponse(status=pb.OK, object=object_info(self._table.get(key)))

    def _exists(self, key: str) -> pb.ExistsResponse:
        validate_key(key)
        return pb.ExistsResponse(status=pb.OK, exists=self._table.exists(key))

    def _batch_exists(self, keys) -> pb.BatchExistsResponse:
        # One status for the whole answer (the proto has no per-item status): any bad key fails it.
        for i, key in enumerate(keys):
            try:
                validate_key(key)
            except KvpoolError as exc:
                raise type(exc)(f"keys[{i}]: {exc}") from None
        return pb.BatchExistsResponse(status=pb.OK, exists=[self._table.exists(k) for k in keys])

    def _remove(self, key: str) -> pb.RemoveResponse:
        validate_key(key)
        self._table.remove(key)
        return pb.RemoveResponse(status=pb.OK, removed=1)

    def _remove_by_prefix(self, prefix: str) -> pb.RemoveResponse:
        _validate_prefix(prefix)
        return pb.RemoveResponse(status=pb.OK, removed=self._table.remove_by_prefix(prefix))

    # ----- the RPCs -----

    @_rpc
    def PutStart(self, request):
        return _answer(pb.PutStartResponse, self._put_start, request)

    @_rpc
    def PutEnd(self, request):
        return _answer(pb.StatusResponse, self._put_end, request)

    @_rpc
    def PutRevoke(self, request):
        return _answer(pb.StatusResponse, self._put_revoke, request)

    @_rpc
    def BatchPutStart(self, request):
        return pb.BatchPutStartResponse(items=[_answer(pb.PutStartResponse, self._put_start, item)
                                               for item in request.items])

    @_rpc
    def BatchPutEnd(self, request):
        return pb.BatchStatusResponse(items=[_answer(pb.StatusResponse, self._put_end, item)
                                             for item in request.items])

    @_rpc
    def BatchPutRevoke(self, request):
        return pb.BatchStatusResponse(items=[_answer(pb.StatusResponse, self._put_revoke, item)
                                             for item in request.items])

    @_rpc
    def GetReplicaList(self, request):
        return _answer(pb.GetReplicaListResponse, self._replica_list, request.key)

    @_rpc
    def BatchGetReplicaList(self, request):
        return pb.BatchGetReplicaListResponse(items=[_answer(pb.GetReplicaListResponse, self._replica_list, key)
                                                     for key in request.keys])

    @_rpc
    def Exists(self, request):
        return _answer(pb.ExistsResponse, self._exists, request.key)

    @_rpc
    def BatchExists(self, request):
        return _answer(pb.BatchExistsResponse, self._batch_exists, list(request.keys))

    @_rpc
    def Remove(self, request):
        return _answer(pb.RemoveResponse, self._remove, request.key)

    @_rpc
    def RemoveByPrefix(self, request):
        return _answer(pb.RemoveResponse, self._remove_by_prefix, request.prefix)

    @_rpc
    def Stats(self, request):
        t = self._table
        nodes = []
        for node in sorted(t.nodes.values(), key=lambda n: n.node_id):
            objects = t.objects_on(node.node_id)
            tiers = [pb.TierStats(tier=TIERS.get(name, pb.TIER_UNSPECIFIED), capacity=alloc.capacity,
                                  used=alloc.used, objects=objects.get(name, 0))
                     for name, alloc in sorted(node.tiers.items())]
            nodes.append(pb.NodeStats(node_id=node.node_id, address=node.address, tiers=tiers,
                                      objects=sum(objects.values()), transports=node.transports))
        c = t.counters
        return pb.StatsResponse(
            master_id=self.master_id, address=self.address, nodes=nodes, objects=t.object_count,
            bytes=t.total_bytes, pending_puts=t.pending_count, hits=c.hits, misses=c.misses, puts=c.puts,
            removes=c.removes, reclaimed_puts=c.reclaimed_puts,
        )
