"""Every protobuf message the client builds or reads (proto/kvpool.proto), and nowhere else.

Requests are made from the caller's arguments (checked: keys, hold), answers
read back into what the API returns or the typed error they stand for.
"""

from kvpool.errors import Code, InternalError, InvalidArgumentError, InvalidKeyError, KeyNotFoundError, error_for
from kvpool.protocol.keys import validate_key, validate_keys, validate_listing
from kvpool.protocol.wire import SEAL
from kvpool.proto import kvpool_pb2 as pb

from kvpool.client.put_options import hold_seconds
from kvpool.client.replica_order import nearest_first

_NOT_FOUND = Code.NOT_FOUND


def check(response):
    """`response` if its status is OK, else raise the typed error it carries."""
    if response.status:
        raise error_for(response.status, response.message)
    return response


def items(response, expected: int, method: str):
    """The per-request items of a batch answer, which must be one per request."""
    if len(response.items) != expected:
        raise InternalError(f"{method} answered {len(response.items)} items for {expected} requests")
    return response.items


# -- lookups

def exists_request(key: str, hold: float) -> pb.ExistsRequest:
    validate_key(key)
    return pb.ExistsRequest(key=key, hold_seconds=hold_seconds(hold))


def exists_answer(response: pb.ExistsResponse) -> bool:
    return check(response).exists


def batch_exists_request(keys: list, hold: float) -> pb.BatchExistsRequest | None:
    """None for no keys (nothing to ask)."""
    validate_keys(keys)
    seconds = hold_seconds(hold)
    return pb.BatchExistsRequest(keys=keys, hold_seconds=seconds) if keys else None


def batch_exists_answer(response, count: int) -> list:
    """A bool per key from a BatchExistsResponse, or from a LOOKUP's answer (already a list)."""
    found = response if type(response) is list else check(response).exists
    if len(found) != count:
        raise InternalError(f"BatchExists answered {len(found)} of {count} keys")
    return found[:]  # a list


# -- placements

def lookup_call(keys: list) -> tuple[str, object]:
    """(method, request) asking where `keys` live: GetReplicaList for one, BatchGetReplicaList for more."""
    if len(keys) == 1:
        return "GetReplicaList", pb.GetReplicaListRequest(key=keys[0])
    return "BatchGetReplicaList", pb.BatchGetReplicaListRequest(keys=keys)


def placements(response, keys: list) -> list:
    """Per key of a lookup_call: its ObjectInfo (nearest replicas first), or the KeyNotFoundError or
    other error the master answered for it."""
    if len(keys) == 1:
        answers = [response]
    else:
        answers = items(response, len(keys), "BatchGetReplicaList")
    found = []
    for key, answer in zip(keys, answers):
        if answer.status == _NOT_FOUND:
            found.append(KeyNotFoundError(f"key {key!r} not found"))
        elif answer.status:
            found.append(error_for(answer.status, answer.message))
        else:
            nearest_first(answer.object)
            found.append(answer.object)
    return found


# -- puts

def put_start_call(keys: list, sizes: list, digests: list, overwrite: bool, count: int, needed: int, choices,
                   compressed: list | None, raw_sizes: list) -> tuple[str, object]:
    """(method, request) opening the puts of `keys`: PutStart for one, BatchPutStart for more (what every
    put shares goes once, `common`, the rest as packed lists); compressed: per key, or None when none is."""
    if len(keys) == 1:
        return "PutStart", pb.PutStartRequest(key=keys[0], size=sizes[0], checksum=digests[0], overwrite=overwrite,
                                              replicas=count, min_replicas=needed, options=choices.request,
                                              compressed=compressed is not None and compressed[0],
                                              raw_size=raw_sizes[0])
    common = pb.PutStartRequest(overwrite=overwrite, replicas=count, min_replicas=needed, options=choices.request)
    request = pb.BatchPutStartRequest(common=common, keys=keys, sizes=sizes, checksums=digests)
    if compressed is not None:
        request.compressed.extend(compressed)
        request.raw_sizes.extend(raw_sizes)
    return "BatchPutStart", request


def _put_end_request(key: str, generation: int, failed_nodes) -> pb.PutEndRequest:
    return pb.PutEndRequest(key=key, generation=generation, failed_nodes=list(failed_nodes))


def put_end_call(partly: list, keys: list, generations: list) -> tuple[str, object]:
    """(method, request) ending puts whose copies are written: PutEnd for one, BatchPutEnd for more.
    partly: (key, generation, failed node ids) of puts with a copy missing; keys, generations: the others."""
    if len(partly) + len(keys) == 1:
        return "PutEnd", _put_end_request(*partly[0]) if partly else _put_end_request(keys[0], generations[0], ())
    return "BatchPutEnd", pb.BatchPutEndRequest(
        items=[_put_end_request(key, generation, failed) for key, generation, failed in partly],
        keys=keys, generations=generations)


def revoke_call(puts: list) -> tuple[str, object]:
    """(method, request) revoking (key, generation) puts: PutRevoke for one, BatchPutRevoke for more."""
    if len(puts) == 1:
        key, generation = puts[0]
        return "PutRevoke", pb.PutRevokeRequest(key=key, generation=generation)
    return "BatchPutRevoke", pb.BatchPutRevokeRequest(items=[
        pb.PutRevokeRequest(key=key, generation=generation) for key, generation in puts])


def batch_end_errors(response, expected: int) -> dict:
    """index -> error of the puts a BatchPutEnd answer says did not end."""
    if len(response.items) != expected:
        error = InternalError(f"BatchPutEnd answered {len(response.items)} items for {expected} requests")
        return dict.fromkeys(range(expected), error)
    return {i: error_for(item.status, item.message) for i, item in enumerate(response.items) if item.status}


def started(method: str, response, count: int) -> "Started":
    """The answer to a put_start_call of `count` puts as Started; a PutStart's refusal is its one put's."""
    if method == "PutStart":
        if response.status:
            return Started([0], [0], [], {0: error_for(response.status, response.message)}, [], b"")
        info = response.object  # its copies' seals come each in its replica: as a batch's, in a row
        replicas = info.replicas
        seals = b"".join([r.seal for r in replicas]) if replicas and replicas[0].seal else b""
        return Started([info.generation], [0], [info], {}, [0] if info.generation else [], seals)
    generations, placement = list(response.generations), list(response.placement)
    placements = list(response.placements)
    if len(generations) != count or len(placement) != count or len(response.refused) != len(response.errors):
        raise InternalError(f"BatchPutStart answered {len(generations)} generations and {len(placement)} "
                            f"placements for {count} puts")
    indices = [i for i, generation in enumerate(generations) if generation]
    if any(placement[i] >= len(placements) for i in indices):
        raise InternalError("BatchPutStart answered a placement it did not send")
    return Started(generations, placement, placements,
                   {i: error_for(e.status, e.message) for i, e in zip(response.refused, response.errors)},
                   indices, response.seals)


class Started:
    """The puts of one call the master opened (its answer, `started`): index -> generation (0: refused, the
    error in `refused`), and where each was placed (a few distinct placements, each put an index into them)."""

    def __init__(self, generation: list, placement: list, placements: list, refused: dict, indices: list,
                 seals: bytes):
        self.generation = generation
        self.placement = placement
        self.placements = placements
        self.refused = refused
        self.indices = indices  # of the puts started
        self.seals = seals  # each copy's, in order of puts then replicas (empty: nothing sealed)
        self.seal_at: dict[int, int] = {}  # put index -> where its first copy's seal starts
        if seals:
            at, copies = 0, [len(p.replicas) * SEAL for p in placements]
            for i in indices:
                self.seal_at[i] = at
                at += copies[placement[i]]
            if at != len(seals):
                raise InternalError(f"the master answered {len(seals)} bytes of seals for {at}")

    def seal(self, i: int, copy: int) -> bytes:
        """The leader's seal over copy `copy` (in the placement's order as answered) of put i; only when the
        answer carried seals."""
        at = self.seal_at[i] + copy * SEAL
        return self.seals[at:at + SEAL]

    def info(self, i: int) -> pb.ObjectInfo:
        """An ObjectInfo of put i (replicas, generation, term)."""
        info = pb.ObjectInfo()
        info.CopyFrom(self.placements[self.placement[i]])
        info.generation = self.generation[i]
        return info

    def serialized_placements(self) -> list[bytes]:
        """Each placement, nearest replicas first, as the placement cache keeps it."""
        blobs = []
        for placement in self.placements:
            nearest_first(placement)
            blobs.append(placement.SerializeToString())
        return blobs


def stats_request() -> pb.StatsRequest:
    return pb.StatsRequest()


def remove_request(key: str) -> pb.RemoveRequest:
    validate_key(key)
    return pb.RemoveRequest(key=key)


def removed(response) -> bool:
    """A Remove answer: whether the key existed."""
    if response.status == _NOT_FOUND:
        return False
    return check(response).removed > 0


def remove_prefix_request(prefix: str) -> pb.RemoveByPrefixRequest:
    return pb.RemoveByPrefixRequest(prefix=prefix)


def list_keys_request(prefix: str, limit: int, cursor: str | None, stored) -> pb.ListKeysRequest:
    """A ListKeys of the keys this client names beginning with `prefix`, after `cursor` (None or "": from the
    first); stored(key): the key stored for a key it names (its tenant's scope before it)."""
    if not isinstance(prefix, str) or not (cursor is None or isinstance(cursor, str)):
        raise InvalidKeyError(f"prefix and cursor must be str, not {type(prefix).__name__}, {type(cursor).__name__}")
    prefix, cursor = stored(prefix), stored(cursor) if cursor else ""
    validate_listing(prefix, limit, cursor)
    return pb.ListKeysRequest(prefix=prefix, limit=limit, cursor=cursor)


def listed_keys(response: pb.ListKeysResponse, named) -> tuple[list[str], str | None]:
    """A ListKeys answer: (the page's keys, the cursor of the next page or None at the end), as this client
    names them; named(stored): the key it names for a stored key (its tenant's scope taken off)."""
    check(response)
    return [named(key) for key in response.keys], named(response.next_cursor) if response.next_cursor else None


def drain_request(node_id: str) -> pb.DrainRequest:
    return pb.DrainRequest(node_id=node_id)


def tenants_request(action: str, name: str, limits: dict) -> pb.TenantsRequest:
    """An operator's Tenants call; `limits` (bytes, or objects for quota_objects) as TenantLimits names them."""
    try:
        given = pb.TenantLimits(**limits)
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"tenant limits {limits}: {exc}") from None
    return pb.TenantsRequest(action=action, name=name, limits=given, given=sorted(limits))
