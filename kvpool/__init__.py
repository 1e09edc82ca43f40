"""kvpool: a distributed object store for LLM KV-cache blocks.

    from kvpool import Client
    with Client("127.0.0.1:50051") as c:
        c.put("block-1", b"...")
        value = c.get("block-1")
"""

from .errors import (
    BatchError, ChecksumMismatchError, ClusterUnavailableError, DeadlineExceededError, InvalidArgumentError,
    InvalidKeyError, KeyExistsError, KeyNotFoundError, KvpoolError, NoSpaceError, PutExpiredError,
    PutOutcomeUnknownError, StaleReplicaError, UnavailableError, ValueTooLargeError,
)

from .protocol.release import VERSION as __version__  # the release, written in that one place

__all__ = [
    "Client", "AsyncClient", "KvpoolError", "KeyNotFoundError", "KeyExistsError", "NoSpaceError",
    "ValueTooLargeError", "InvalidKeyError", "InvalidArgumentError", "UnavailableError",
    "StaleReplicaError", "ChecksumMismatchError", "PutExpiredError", "BatchError",
    "DeadlineExceededError", "PutOutcomeUnknownError", "ClusterUnavailableError",
]


def __getattr__(name):
    # The clients pull in grpc; load them only when asked so `kvpool.protocol.units` etc. stay light.
    if name in ("Client", "AsyncClient"):
        from . import client
        return getattr(client, name)
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
