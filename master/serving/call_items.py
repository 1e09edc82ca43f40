"""What a master call names, and how each item of it is answered: the helpers every handler of
service.py shares (an item's error becomes its status, a batch's invalid keys are answered in place),
and per RPC the keys it names (the scope check, kvpool/security/roles.py) and how many (--max-batch)."""

import logging

from kvpool.errors import KvpoolError
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol import control
from kvpool.protocol.keys import validate_key, validate_keys

log = logging.getLogger("kvpool.master.serving.service")


def answer(response_cls, fn, *args):
    """fn(*args), or a response_cls carrying the status of the error it raised."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a bug must answer INTERNAL, not kill the RPC
        return error_answer(response_cls, fn, exc)


async def answer_async(response_cls, fn, *args):
    """await fn(*args), or a response_cls carrying the status of the error it raised."""
    try:
        return await fn(*args)
    except Exception as exc:  # noqa: BLE001 - a bug must answer INTERNAL, not kill the RPC
        return error_answer(response_cls, fn, exc)


def error_answer(response_cls, fn, exc: Exception):
    """The answer to a call of `fn` that raised `exc` (called while it is handled): its status, or INTERNAL."""
    if isinstance(exc, KvpoolError):
        return response_cls(status=int(exc.code), message=str(exc))
    log.exception("internal error in %s", fn.__name__)
    return response_cls(status=pb.INTERNAL, message=f"internal error: {type(exc).__name__}: {exc}")


def valid_keys(keys) -> list[str]:
    """A batch's keys, all valid, or the typed error of the first that is not, naming its index."""
    keys = list(keys)
    validate_keys(keys)
    return keys


def invalid_keys(keys) -> dict:
    """index -> the error of each of a batch's keys that is not a valid key."""
    try:
        validate_keys(keys)  # one pass over the whole batch when every key is valid (the usual case)
        return {}
    except KvpoolError:
        pass
    bad = {}
    for i, key in enumerate(keys):
        try:
            validate_key(key)
        except KvpoolError as exc:
            bad[i] = exc
    return bad


def valid_only(column, bad: dict) -> list:
    """A batch's column without the entries of its invalid keys."""
    return [value for i, value in enumerate(column) if i not in bad] if bad else list(column)


def in_request_order(count: int, bad: dict, results: list) -> list:
    """The results of the valid keys, in order, with the invalid keys' errors put back in their places."""
    if not bad:
        return results
    valid = iter(results)
    return [bad[i] if i in bad else next(valid) for i in range(count)]


# How many keys each batch request names (its repeated fields of one key each).
BATCH_SIZE = {"BatchPutStart": lambda r: len(r.keys),
              "BatchPutEnd": lambda r: len(r.items) + len(r.keys), "BatchPutRevoke": lambda r: len(r.items),
              "BatchGetReplicaList": lambda r: len(r.keys), "BatchExists": lambda r: len(r.keys),
              control.LOOKUP: len}

# The keys each call names, for the scope check (roles.check_scope): every RPC that names a key is here.
def _item_keys(request) -> list:
    return [item.key for item in request.items]


KEYS = {"PutStart": lambda r: (r.key,), "PutEnd": lambda r: (r.key,), "PutRevoke": lambda r: (r.key,),
        "BatchPutStart": lambda r: r.keys,
        "BatchPutEnd": lambda r: _item_keys(r) + list(r.keys) if r.items else r.keys,
        "BatchPutRevoke": _item_keys, "GetReplicaList": lambda r: (r.key,),
        "BatchGetReplicaList": lambda r: r.keys, "Exists": lambda r: (r.key,), "BatchExists": lambda r: r.keys,
        "Remove": lambda r: (r.key,), "RemoveByPrefix": lambda r: (r.prefix,),
        "ListKeys": lambda r: (r.prefix, r.cursor) if r.cursor else (r.prefix,), control.LOOKUP: lambda keys: keys}
