"""The Master service (over gRPC and the control port): validates requests and answers them from the object table.

A thin adapter: each handler validates its request, calls the object table and
writes the answer (conversions in messages.py). Every answer carries a typed
Status; batch RPCs answer each item on its own, so one bad key never fails its
neighbours. Handlers change the table without awaiting, so it is consistent
between any two lines of the event loop; the waiting comes after (FREEs of
released replicas), or, for an Exists asking for a hold, before a fresh read of
the table.
"""

import asyncio
import functools
import logging
import time
import types

import grpc

from kvpool.errors import ForbiddenError, InvalidArgumentError, KeyNotFoundError, KvpoolError
from kvpool.protocol import control, release, wire
from kvpool.protocol.keys import DEFAULT_LIST_LIMIT, validate_key, validate_keys, validate_listing
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc
from kvpool.security.grpc_auth import CALLER
from kvpool.security.placement_seal import PlacementSeal
from kvpool.security.roles import MEMBER, Caller, check_rpc, check_scope

from kvpool.master.serving import messages
from kvpool.master.serving.call_items import (BATCH_SIZE, KEYS, answer, answer_async, in_request_order, invalid_keys, valid_keys,
                            valid_only)
from kvpool.master.leadership.election import LeadershipState
from kvpool.master.serving.key_feed import FeedClosed
from kvpool.master.serving.key_watch import KeyWatch
from kvpool.master.serving.metrics import MasterMetrics
from kvpool.master.nodes.node_io import HoldOrder, NodeIO
from kvpool.master.table.objects import ObjectTable
from kvpool.master.serving.tenants import TenantAdmin
from kvpool.master.table.versions import SHARED

log = logging.getLogger(__name__)

HOLD_TIMEOUT = 2.0  # an Exists with a hold answers from the table if a node is slower than this
FREE_WAIT = 1.0     # longest a request waits for nodes to confirm the FREEs it caused


MAX_BATCH = 65536  # default --max-batch: keys one batch call may name
# Seconds a BatchPutEnd's plain ends may wait to be folded into the table: long enough for the lookup its
# client sends next to be answered first, short next to the reads that follow (which fold them anyway).
FOLD_AFTER = 0.001
FOLLOWER_RPCS = ("Stats",)  # what a master that does not lead still answers itself


async def _not_leader(context, leader: str) -> None:
    """Abort the call with the NOT_LEADER convention (see the end of kvpool.proto)."""
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not leader",
                        trailing_metadata=(("kvpool-leader", leader),))


class NotLeading(Exception):
    """This master may not answer; the leader it knows of is `leader` (gRPC) with its
    `control_address` ("" for what it does not know)."""

    def __init__(self, leader: str, control_address: str):
        super().__init__("not leader")
        self.leader = leader
        self.control_address = control_address


class EtcdSilent(NotLeading):
    """This master cannot tell who leads: etcd, asked (a lease refresh), has not answered it since
    (answered on the control port as UNAVAILABLE, which clients raise at once as
    ClusterUnavailableError instead of waiting for a leader; over gRPC, as NOT_LEADER naming nobody)."""

    def __init__(self, master: str):
        NotLeading.__init__(self, "", "")
        self.args = (f"master {master} cannot serve: etcd, asked, has not answered it, so no "
                     f"leader can be confirmed; retry once etcd is reachable",)


_HANDLERS = {}  # RPC name (or control.LOOKUP) -> handler(self, request), for dispatch
_COROUTINE = types.CoroutineType


def _rpc(handler):
    """Register a handler(self, request) for MasterService.dispatch, and adapt it to grpc.aio:
    gRPC and the control port serve every RPC the same way. A handler returns its response, or,
    when it must wait (a hold to ask nodes for), a coroutine returning it."""
    name = handler.__name__
    _HANDLERS[name] = handler

    @functools.wraps(handler)
    async def method(self, request, context):
        try:
            return await self.dispatch(name, request, CALLER.get())
        except ForbiddenError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except NotLeading as exc:
            await _not_leader(context, exc.leader)
        except InvalidArgumentError as exc:  # a request refused whole (e.g. past --max-batch)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    return method


def _validate_prefix(prefix: str) -> None:
    # An empty prefix would wipe the whole cluster; that deserves more than a default argument.
    if prefix == "":
        raise InvalidArgumentError("prefix must not be empty")
    validate_key(prefix)


class MasterService(kvpool_pb2_grpc.MasterServicer):
    # Set by start-up (main.py) once they exist:
    leadership: LeadershipState | None = None  # None: serve unconditionally (a lone master without etcd)
    control_address = ""  # HOST:PORT of this master's control port (master/serving/control_port.py)
    key_watch: KeyWatch | None = None  # serves WatchKeys from the leader's key feed
    sealer: PlacementSeal | None = None  # seals the copies it places (None: a cluster without a secret)
    caller: Caller = MEMBER  # who the call being served proved (set by serve_now; read by handlers that scope)
    current = staticmethod(lambda caller: True)  # whether a caller's credential still holds (Verifier.current)
    tenants: TenantAdmin | None = None  # an operator's tenants (None: a master that keeps none)
    _fold_timer: asyncio.TimerHandle | None = None  # folds the ends a BatchPutEnd let wait

    @property
    def term(self) -> int:
        return self.leadership.term if self.leadership is not None and self.leadership.serving else 0

    def __init__(self, table: ObjectTable, node_io: NodeIO, metrics: MasterMetrics, master_id: str,
                 address: str, max_hold: float = 300.0, max_batch: int = MAX_BATCH):
        self._table = table
        self.max_batch = max_batch
        self._node_io = node_io
        self.max_hold = max_hold
        self._metrics = metrics
        self.master_id = master_id
        self.address = address

    async def dispatch(self, name: str, request, caller: Caller):
        """Serve the RPC `name`, whichever port it came in by: the leadership gate (NotLeading),
        the handler, FREEs, metrics. The replicas a request released (an overwritten or removed
        version) are freed on their nodes before it is answered, so the caller's next read
        cannot get them."""
        response = self.serve_now(name, request, caller)
        if type(response) is _COROUTINE:
            response = await response
        return response

    def serve_now(self, name: str, request, caller: Caller):
        """dispatch without a coroutine when nothing needs waiting for (most calls): the response;
        else a coroutine finishing the call (its hold, the FREEs it caused) and returning it.
        caller: what it proved; what it may call and which keys it may name are kvpool/security/roles.py's,
        checked here only."""
        started = time.perf_counter()
        check_rpc(caller.role, name)
        if caller.scope is not None:
            keys_of = KEYS.get(name)
            if keys_of is not None:
                check_scope(caller, keys_of(request), name)
        self.caller = caller  # read by the handlers that scope their answer, before their first await
        gate = self.leadership
        if gate is not None and name not in FOLLOWER_RPCS and not gate.answering():
            leader = gate.leader_address if gate.leader_address != self.address else ""
            if not leader and gate.etcd_silent():  # asked and silent: no leader can be confirmed
                raise EtcdSilent(self.address)
            raise NotLeading(leader, gate.leader_control_address if leader else "")
        batch_size = BATCH_SIZE.get(name)
        if batch_size is not None:
            size = batch_size(request)
            if size > self.max_batch:  # placed and answered on the leader's loop: bounded, or it stalls
                raise InvalidArgumentError(f"{name} of {size} keys exceeds --max-batch {self.max_batch}")
        response = _HANDLERS[name](self, request)
        if type(response) is _COROUTINE:
            return self._finish(name, response, started)
        frees = self._table.take_frees()
        if frees:
            return self._finish(name, response, started, frees)
        self._metrics.observe(name, time.perf_counter() - started, messages.error_statuses(response))
        return response

    async def _finish(self, name: str, response, started: float, frees=None):
        if type(response) is _COROUTINE:
            response = await response
            frees = self._table.take_frees()
        await self._node_io.free_now(frees, FREE_WAIT)
        self._metrics.observe(name, time.perf_counter() - started, messages.error_statuses(response))
        return response

    # ----- one item each -----

    def _put_start(self, req: pb.PutStartRequest) -> pb.PutStartResponse:
        options = messages.options_of(req)
        validate_key(req.key)
        version = self._table.put_start(req.key, req.size, req.checksum, req.overwrite, req.replicas or 1,
                                        options=options, compressed=req.compressed, raw_size=req.raw_size,
                                        min_replicas=req.min_replicas)
        response = pb.PutStartResponse(status=pb.OK)
        term = self.term
        messages.fill_object_info(response.object, version, term)
        messages.seal_placement(response.object, version, self.sealer, term)
        return response

    def _put_starts(self, request: pb.BatchPutStartRequest, response: pb.BatchPutStartResponse) -> None:
        """The columnar puts of a BatchPutStart, answered in the response's columns (see kvpool.proto)."""
        keys, sizes, checksums = request.keys, request.sizes, request.checksums
        count = len(keys)
        common = request.common
        try:
            if not len(sizes) == len(checksums) == count or \
                    (request.compressed or request.raw_sizes) and not len(request.compressed) == len(request.raw_sizes) == count:
                raise InvalidArgumentError(f"{count} keys but {len(sizes)} sizes, {len(checksums)} checksums, "
                                           f"{len(request.compressed)} compressed, {len(request.raw_sizes)} raw sizes")
            options = messages.options_of(common)
            bad = invalid_keys(keys)
            started = self._table.put_start_many(
                valid_only(keys, bad), valid_only(sizes, bad), valid_only(checksums, bad), common.overwrite,
                common.replicas or 1, options,
                valid_only(request.compressed, bad) if request.compressed else None,
                valid_only(request.raw_sizes, bad) if request.raw_sizes else None, common.min_replicas)
        except KvpoolError as exc:
            messages.refuse_put_starts(response, count, exc)
            return
        messages.fill_put_starts(response, in_request_order(count, bad, started), self.term, self.sealer)

    def _put_end(self, req: pb.PutEndRequest) -> pb.StatusResponse:
        validate_key(req.key)
        self._table.put_end(req.key, req.generation, req.failed_nodes)
        return pb.StatusResponse(status=pb.OK)

    def _put_revoke(self, req: pb.PutRevokeRequest) -> pb.StatusResponse:
        validate_key(req.key)
        self._table.put_revoke(req.key, req.generation)
        return pb.StatusResponse(status=pb.OK)

    def _replica_list(self, key: str) -> pb.GetReplicaListResponse:
        validate_key(key)
        response = pb.GetReplicaListResponse(status=pb.OK)
        messages.fill_object_info(response.object, self._table.get(key), self.term)
        return response

    def _hold_ms(self, seconds: float) -> int:
        """Milliseconds to hold for, capped at --max-hold; 0 = no hold asked for."""
        if not (seconds >= 0):  # also NaN
            raise InvalidArgumentError(f"hold_seconds must be >= 0, got {seconds}")
        if seconds == 0:
            return 0
        return max(1, round(min(seconds, self.max_hold) * 1000))

    async def _exists_holding(self, keys: list[str], hold_seconds: float) -> list[bool]:
        """Whether each key exists; with a hold, each replica's node is asked to keep it first,
        and a node that answers it does not hold it loses that replica here too."""
        ms = self._hold_ms(hold_seconds)
        if not ms:
            return [self._table.exists(k) for k in keys]
        targets = []
        for key in keys:
            version = self._table.lookup(key)
            if version is not None:
                raw = key.encode()
                targets.extend((version, r, HoldOrder(r.address, raw, version.generation, ms))
                               for r in version.replicas if r.tier != SHARED)  # the leader evicts those
        results = await self._node_io.hold([order for _, _, order in targets], HOLD_TIMEOUT)
        for (version, replica, _), result in zip(targets, results, strict=True):
            if result is False or isinstance(result, KeyNotFoundError):
                self._table.drop_replica(version.key, version.generation, replica.node_id)
        return [self._table.exists(k) for k in keys]

    async def _exists(self, req: pb.ExistsRequest) -> pb.ExistsResponse:
        validate_key(req.key)
        (exists,) = await self._exists_holding([req.key], req.hold_seconds)
        return pb.ExistsResponse(status=pb.OK, exists=exists)

    async def _batch_exists(self, req: pb.BatchExistsRequest) -> pb.BatchExistsResponse:
        # One status for the whole answer (the proto has no per-item status): any bad key fails it.
        keys = valid_keys(req.keys)
        return pb.BatchExistsResponse(status=pb.OK, exists=await self._exists_holding(keys, req.hold_seconds))

    def _batch_exists_now(self, req: pb.BatchExistsRequest) -> pb.BatchExistsResponse | None:
        """The answer of a BatchExists that asks for no hold (read from the table at once), else None."""
        keys = valid_keys(req.keys)
        if self._hold_ms(req.hold_seconds):
            return None
        return pb.BatchExistsResponse(status=pb.OK, exists=self._table.exists_many(keys))

    def _lookup(self, keys: list[str]) -> bytes:
        """A LOOKUP (control.LOOKUP: a BatchExists without a hold, in the lean frame) of `keys`: one byte
        per key; a bad key refuses the whole call (InvalidKeyError, answered as its error status)."""
        validate_keys(keys)
        return control.found_body(self._table.exists_many(keys))

    def _remove(self, key: str) -> pb.RemoveResponse:
        validate_key(key)
        self._table.remove(key)
        return pb.RemoveResponse(status=pb.OK, removed=1)

    def _list_keys(self, req: pb.ListKeysRequest) -> pb.ListKeysResponse:
        limit = req.limit or DEFAULT_LIST_LIMIT
        validate_listing(req.prefix, limit, req.cursor)
        keys, next_cursor = self._table.list_keys(req.prefix, limit, req.cursor, self.caller.scope)  # its keys only
        return pb.ListKeysResponse(status=pb.OK, keys=keys, next_cursor=next_cursor)

    def _drain(self, node_id: str) -> pb.DrainResponse:
        if not node_id:
            raise InvalidArgumentError("node_id must not be empty")
        objects = self._table.start_drain(node_id)
        log.info("draining node %s: %d objects to copy elsewhere", node_id, objects)
        return pb.DrainResponse(status=pb.OK, objects=objects)

    def _remove_by_prefix(self, prefix: str) -> pb.RemoveResponse:
        _validate_prefix(prefix)
        return pb.RemoveResponse(status=pb.OK, removed=self._table.remove_by_prefix(prefix))

    # ----- the RPCs -----

    @_rpc
    def PutStart(self, request):
        return answer(pb.PutStartResponse, self._put_start, request)

    @_rpc
    def PutEnd(self, request):
        return answer(pb.StatusResponse, self._put_end, request)

    @_rpc
    def PutRevoke(self, request):
        return answer(pb.StatusResponse, self._put_revoke, request)

    @_rpc
    def BatchPutStart(self, request):
        response = pb.BatchPutStartResponse()
        if request.keys:
            self._put_starts(request, response)
        return response

    @_rpc
    def BatchPutEnd(self, request):
        response = pb.BatchStatusResponse(items=[answer(pb.StatusResponse, self._put_end, item)
                                                 for item in request.items] if request.items else None)
        keys, generations = request.keys, request.generations
        if len(keys) != len(generations):
            message = f"{len(keys)} keys but {len(generations)} generations"
            response.items.extend([pb.StatusResponse(status=pb.INVALID_ARGUMENT, message=message)] * len(keys))
            return response
        if not request.items and self._table.end_later(keys, generations):
            # Every end plain (its keys valid: they were placed): OK each, folded in a moment.
            if self._fold_timer is None:
                self._fold_timer = asyncio.get_running_loop().call_later(FOLD_AFTER, self._fold_ends)
            messages.fill_statuses(response, [None] * len(keys))
            return response
        bad = invalid_keys(keys)
        ended = in_request_order(len(keys), bad, self._table.put_end_many(valid_only(keys, bad),
                                                                           valid_only(generations, bad)))
        messages.fill_statuses(response, ended)
        return response

    def _fold_ends(self) -> None:
        """Fold the ends a BatchPutEnd let wait (ObjectTable.end_later), once the lookups sent right
        after them had their turn; anything else that reads the table folds them sooner."""
        self._fold_timer = None
        self._table.fold_ends()

    @_rpc
    def BatchPutRevoke(self, request):
        return pb.BatchStatusResponse(items=[answer(pb.StatusResponse, self._put_revoke, item)
                                             for item in request.items])

    @_rpc
    def GetReplicaList(self, request):
        return answer(pb.GetReplicaListResponse, self._replica_list, request.key)

    @_rpc
    def BatchGetReplicaList(self, request):
        return pb.BatchGetReplicaListResponse(items=[answer(pb.GetReplicaListResponse, self._replica_list, key)
                                                     for key in request.keys])

    @_rpc
    def Exists(self, request):
        return answer_async(pb.ExistsResponse, self._exists, request)

    @_rpc
    def BatchExists(self, request):
        # Without a hold nothing is waited for: answered here, with no coroutine (lookups are most calls).
        answered = answer(pb.BatchExistsResponse, self._batch_exists_now, request)
        if answered is not None:
            return answered
        return answer_async(pb.BatchExistsResponse, self._batch_exists, request)

    @_rpc
    def Remove(self, request):
        return answer(pb.RemoveResponse, self._remove, request.key)

    @_rpc
    def RemoveByPrefix(self, request):
        return answer(pb.RemoveResponse, self._remove_by_prefix, request.prefix)

    @_rpc
    def ListKeys(self, request):
        return answer(pb.ListKeysResponse, self._list_keys, request)

    @_rpc
    def Drain(self, request):
        return answer(pb.DrainResponse, self._drain, request.node_id)

    async def WatchKeys(self, request, context):
        """A server stream (key_watch.py), so not an _rpc; it ends with NOT_LEADER when the term does."""
        gate = self.leadership
        if self.key_watch is None or (gate is not None and not gate.answering()):
            leader = gate.leader_address if gate is not None and gate.leader_address != self.address else ""
            await _not_leader(context, leader)
        caller = CALLER.get()
        try:
            check_scope(caller, (request.prefix,), "WatchKeys")
        except ForbiddenError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        try:
            await self.key_watch.serve(request, context, caller.scope, lambda: self.current(caller))
        except FeedClosed:
            await _not_leader(context, "")

    @_rpc
    def Tenants(self, request):
        if self.tenants is None:
            return pb.TenantsResponse(status=pb.INVALID_ARGUMENT, message="this master keeps no tenants")
        return answer_async(pb.TenantsResponse, self.tenants.serve, request)

    @_rpc
    def Stats(self, request):
        caller = self.caller
        if caller.tenant:  # a tenant sees the masters (to find and follow the leader) and its own figures only
            return pb.StatsResponse(master_id=self.master_id, address=self.address, version=release.VERSION,
                                    wire_protocol=wire.VERSION,
                                    control_address=self.control_address,
                                    tenants=self.tenants.figures([caller.tenant]) if self.tenants else (),
                                    **self._leadership_stats())
        t = self._table
        nodes = [messages.node_stats(node, t.objects_on(node.node_id))
                 for node in sorted(t.nodes.values(), key=lambda n: n.node_id) if not node.shared]
        return pb.StatsResponse(
            master_id=self.master_id, address=self.address, control_address=self.control_address,
            version=release.VERSION, wire_protocol=wire.VERSION,
            nodes=nodes, objects=t.object_count, bytes=t.total_bytes, pending_puts=t.pending_count,
            under_replicated=t.under_replicated(), **messages.counter_stats(t.counters), **self._leadership_stats(),
            tenants=self.tenants.figures() if self.tenants is not None and caller.scope is None else (),
            **messages.shared_stats(t.shared),
        )

    def _leadership_stats(self) -> dict:
        gate = self.leadership
        if gate is None:
            return {"leader": self.address, "term": 0}
        leader = self.address if gate.serving else gate.leader_address
        return {"leader": leader, "followers": [a for a in gate.members if a != leader],
                "term": gate.term if gate.serving else gate.leader_term}


# A LOOKUP is served by dispatch only (the control port's lean frame; gRPC callers ask BatchExists).
_HANDLERS[control.LOOKUP] = MasterService._lookup
