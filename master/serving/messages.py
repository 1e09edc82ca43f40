"""Between the Master protocol's messages (proto/kvpool.proto) and the object table's records.

Every protobuf the master builds from a table record, and every table record it
reads out of a request, is converted here; the service (service.py) only routes
requests to the table. Answers are written into the response in place where a
batch carries many (no message built per item and copied in).
"""

from kvpool.errors import Code, InvalidArgumentError, KvpoolError
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol.write_options import WriteOptions, lifetime_problem, placed_options

from kvpool.master.table.ledger import Counters
from kvpool.master.table.node_state import NodeState
from kvpool.master.table.shared_tier import SharedTier
from kvpool.master.table.versions import NO_OPTIONS, SHARED, ObjectVersion, PutOptions

TIERS = {"dram": pb.DRAM, "ssd": pb.SSD, "shared": pb.SHARED}
TIER_NAMES = {value: name for name, value in TIERS.items()}
PINS = {"none": pb.PIN_NONE, "soft": pb.PIN_SOFT, "hard": pb.PIN_HARD}
PIN_NAMES = {value: name for name, value in PINS.items()}


# ----- requests -----

def put_options(message: pb.PutOptions) -> PutOptions:
    if message.tier not in TIER_NAMES and message.tier != pb.TIER_UNSPECIFIED:
        raise InvalidArgumentError(f"unknown tier {message.tier}")
    if message.pin not in PIN_NAMES:
        raise InvalidArgumentError(f"unknown pin {message.pin}")
    for name, seconds in (("ttl_seconds", message.ttl_seconds), ("pin_ttl_seconds", message.pin_ttl_seconds)):
        problem = lifetime_problem(name, seconds)
        if problem:
            raise InvalidArgumentError(problem)
    return PutOptions(tier=TIER_NAMES.get(message.tier), pin=PIN_NAMES[message.pin],
                      pin_ttl_seconds=message.pin_ttl_seconds, ttl_seconds=message.ttl_seconds)


def options_of(request) -> PutOptions:
    """The PutOptions of a request whose `options` field may be unset (then the defaults)."""
    return put_options(request.options) if request.HasField("options") else NO_OPTIONS


# ----- objects -----

def fill_object_info(info: pb.ObjectInfo, version: ObjectVersion, term: int) -> None:
    """Write `version` into an empty ObjectInfo in place (e.g. inside a batch's answer: no copies).
    `term`: the placement's authority, the leader answering (WRITEs carry it, so nodes refuse a
    deposed leader's placements)."""
    info.key, info.size, info.checksum, info.generation = version.key, version.size, version.checksum, \
        version.generation
    add = info.replicas.add
    for r in version.replicas:
        add(node_id=r.node_id, address=r.address, tier=TIERS.get(r.tier, pb.TIER_UNSPECIFIED), length=version.size)
    info.compressed, info.raw_size = version.compressed, version.raw_size
    o = version.options
    if o != NO_OPTIONS:
        info.options.tier, info.options.pin = TIERS.get(o.tier, pb.TIER_UNSPECIFIED), PINS[o.pin]
        info.options.pin_ttl_seconds, info.options.ttl_seconds = o.pin_ttl_seconds, o.ttl_seconds
    info.target_replicas = version.target_replicas
    info.term = term


def write_options(version: ObjectVersion) -> WriteOptions:
    """What the WRITEs of `version` carry, as its client builds them (write_options.placed_options)."""
    o = version.options
    return placed_options(o.tier == "ssd", o.pin == "hard", o.pin_ttl_seconds if o.pin == "soft" else 0.0,
                          o.ttl_seconds, version.compressed, version.raw_size, o.tier == SHARED)


def seal_of(sealer, version: ObjectVersion, node_id: str, term: int, options: WriteOptions) -> bytes:
    """The leader's seal over the copy of `version` it placed on `node_id` (kvpool/security/placement_seal.py)."""
    return sealer.seal(node_id.encode(), version.key.encode(), version.generation, version.size, version.checksum,
                       term, options.flags, options.ttl_ms, options.soft_pin_ms, options.raw_size or version.size)


def seal_placement(info: pb.ObjectInfo, version: ObjectVersion, sealer, term: int) -> None:
    """Each copy of a PutStart's answer sealed (nothing when the cluster has no secret)."""
    if sealer is not None:
        options = write_options(version)
        for replica in info.replicas:
            replica.seal = seal_of(sealer, version, replica.node_id, term, options)


# ----- batch answers -----

def refuse_put_starts(response: pb.BatchPutStartResponse, count: int, exc: KvpoolError) -> None:
    """Every one of a BatchPutStart's `count` columnar puts refused with `exc`."""
    response.generations.extend([0] * count)
    response.placement.extend([0] * count)
    response.refused.extend(range(count))
    response.errors.extend([pb.StatusResponse(status=int(exc.code), message=str(exc))] * count)


def fill_put_starts(response: pb.BatchPutStartResponse, started: list, term: int, sealer=None) -> None:
    """The columnar answers of a BatchPutStart (see kvpool.proto), one per result: a pending
    ObjectVersion, or the KvpoolError that refused it. Each distinct placement is written once; each copy
    placed is sealed when the cluster has a secret."""
    refused = [i for i, result in enumerate(started) if isinstance(result, KvpoolError)]
    if refused:  # a refused put answers generation 0 at placement 0
        for i in refused:
            response.errors.add(status=int(started[i].code), message=str(started[i]))
        started = [None if isinstance(result, KvpoolError) else result for result in started]
    # Column by column: the table shares one replica tuple per placement, so they are told apart by id.
    replica_sets = {id(v.replicas): v.replicas for v in started if v is not None}
    index_of = {}
    for where, (shared, replicas) in enumerate(replica_sets.items()):
        index_of[shared] = where
        placed = response.placements.add(term=term)
        for r in replicas:
            placed.replicas.add(node_id=r.node_id, address=r.address, tier=TIERS.get(r.tier, pb.TIER_UNSPECIFIED))
    response.generations.extend([0 if v is None else v.generation for v in started])
    response.placement.extend([0 if v is None else index_of[id(v.replicas)] for v in started])
    response.refused.extend(refused)
    if sealer is not None:
        seals, plain, last = [], None, None
        for version in started:
            if version is None:
                continue
            if version.compressed:  # its raw size is in its options
                options = write_options(version)
            else:  # a batch shares one PutOptions value: its WriteOptions are made once
                if version.options is not last:
                    plain, last = write_options(version), version.options
                options = plain
            for replica in version.replicas:
                seals.append(seal_of(sealer, version, replica.node_id, term, options))
        response.seals = b"".join(seals)


def fill_statuses(response: pb.BatchStatusResponse, errors: list) -> None:
    """One item per result: None for OK, else the KvpoolError."""
    if not any(errors):  # the usual batch: as many empty (OK) items, parsed in one call, not added one by one
        response.MergeFromString(_EMPTY_ITEM * len(errors))
        return
    add = response.items.add
    for error in errors:
        item = add()  # an empty item is OK: cheaper than building one per put
        if error is not None:
            item.status, item.message = int(error.code), str(error)


_EMPTY_ITEM = b"\x0a\x00"  # BatchStatusResponse.items (field 1) holding an empty StatusResponse: OK


# response class -> which of items / errors / status it has (read once per class); a LOOKUP's answer is bytes
# with no status of its own (a refused one raised instead)
_STATUS_FIELDS: dict = {bytes: (False, False, False)}


def error_statuses(response) -> list[str]:
    """The names of the non-OK statuses in an answer (each item's, for a batch), for metrics."""
    shape = _STATUS_FIELDS.get(type(response))
    if shape is None:
        fields = response.DESCRIPTOR.fields_by_name
        shape = _STATUS_FIELDS[type(response)] = ("items" in fields, "errors" in fields, "status" in fields)
    items, errors, status = shape
    if type(response) is pb.BatchStatusResponse and response.ByteSize() == len(_EMPTY_ITEM) * len(response.items):
        return []  # every item is empty, so OK: seen in one C call instead of item by item
    if items:
        statuses = [item.status for item in response.items]
    elif errors:  # a BatchPutStart's columnar answers
        statuses = [error.status for error in response.errors]
    elif status:
        if response.status == pb.OK:  # the common case, answered without building a list
            return []
        statuses = [response.status]
    else:
        statuses = []
    return [Code(s).name if s in Code._value2member_map_ else str(s) for s in statuses if s != pb.OK]


# ----- stats -----

def tier_stats(node: NodeState, name: str) -> pb.TierStats:
    """One tier of a node: capacity as registered; usage estimated (NodeState.estimated_use);
    the node's counters as reported."""
    reported = node.reported.get(name, {})

    def number(field: str) -> int:
        try:
            return max(0, int(reported.get(field) or 0))
        except (TypeError, ValueError):
            return 0

    objects, used = node.estimated_use(name)
    return pb.TierStats(
        tier=TIERS.get(name, pb.TIER_UNSPECIFIED), capacity=node.capacity.get(name, 0),
        used=used, objects=objects, hits=number("hits"),
        misses=number("misses"), demotions=number("demotions"), promotions=number("promotions"),
        evictions=number("evictions"), evicted_bytes=number("evicted_bytes"),
        watermark=str(reported.get("watermark") or ""), pinned_bytes=number("pinned_bytes"),
        fault=str(reported.get("fault") or "")[:200])


def node_stats(node: NodeState, objects: int) -> pb.NodeStats:
    tiers = [tier_stats(node, name) for name in sorted(set(node.capacity) | set(node.reported))]
    return pb.NodeStats(node_id=node.node_id, address=node.address, tiers=tiers, objects=objects,
                        transports=node.transports, zone=node.zone, draining=node.draining,
                        reports=node.reports, version=node.version, shared_fault=node.shared_fault)


def shared_stats(shared: SharedTier) -> dict:
    """The StatsResponse field of the shared tier, while a node mounting it is registered."""
    node = shared.node
    if node is None:
        return {}
    return {"shared": pb.SharedTierStats(capacity=shared.capacity, used=node.keys.bytes, objects=len(node.keys),
                                         servers=len(shared.servers))}


def counter_stats(c: Counters) -> dict:
    """The StatsResponse fields the table's counters fill."""
    return {"hits": c.hits, "misses": c.misses, "puts": c.puts, "removes": c.removes,
            "reclaimed_puts": c.reclaimed_puts, "repairs_done": c.repairs_done, "repair_bytes": c.repair_bytes}
