"""Typed errors shared by every component.

Code values equal proto Status values and the status byte of the data
protocol, so an error keeps its type from whichever side raised it.
"""

from enum import IntEnum


class Code(IntEnum):
    OK = 0
    NOT_FOUND = 1
    EXISTS = 2
    NO_SPACE = 3
    TOO_LARGE = 4
    INVALID_KEY = 5
    INVALID_ARGUMENT = 6
    UNAVAILABLE = 7
    STALE = 8
    CHECKSUM_MISMATCH = 9
    PUT_EXPIRED = 10
    INTERNAL = 11
    NOT_LEADER = 12
    PROTOCOL = 13  # data protocol only: a malformed frame
    FORBIDDEN = 14  # data protocol only: a transport this client may not use (e.g. a wrong cluster token)
    QUOTA_EXCEEDED = 15  # a tenant's put past its quota with nothing of its own left to evict


class KvpoolError(Exception):
    """Base of every error kvpool raises on purpose."""

    code = Code.INTERNAL


class KeyNotFoundError(KvpoolError, KeyError):
    """No committed version of the key (never put, removed, expired or evicted everywhere)."""

    code = Code.NOT_FOUND

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return Exception.__str__(self)


class KeyExistsError(KvpoolError):
    """A put without `overwrite` of a key already committed or being put; or a node asked to store a version
    it holds with other bytes."""

    code = Code.EXISTS


class NoSpaceError(KvpoolError):
    """No node has room for the value, even after evicting what may be evicted."""

    code = Code.NO_SPACE


class ValueTooLargeError(KvpoolError, ValueError):
    """The value is larger than the cluster accepts (`--max-object-size` or its largest tier)."""

    code = Code.TOO_LARGE


class InvalidKeyError(KvpoolError, ValueError):
    """The key breaks the key rules (kvpool/protocol/keys.py): not a str, empty, not UTF-8, too long, or a NUL."""

    code = Code.INVALID_KEY


class InvalidArgumentError(KvpoolError, ValueError):
    """An argument out of its range or of the wrong kind; the message names it."""

    code = Code.INVALID_ARGUMENT


class UnavailableError(KvpoolError, ConnectionError):
    """A master or storage node could not be reached or failed mid-transfer."""

    code = Code.UNAVAILABLE


class DeadlineExceededError(UnavailableError, TimeoutError):
    """A client call ran past its deadline (`Client(..., timeout=)` or the call's own `timeout=`): it was
    given up on, and whatever it had under way at a node or the master was abandoned."""


class PutOutcomeUnknownError(UnavailableError):
    """A put whose end reached, or may have reached, the master, with no answer to tell whether it
    took (the answer was lost, or its deadline came first) and no master to ask where the key is:
    the value may or may not be stored. Only such a put can end this way; every other put error
    means the value is not stored."""


class ClusterUnavailableError(UnavailableError):
    """The master cannot serve: etcd is silent to it beyond what its lease allows, so no leader can be
    confirmed (puts, removes and lookups fail at once until etcd answers again)."""


class StaleReplicaError(KvpoolError):
    """The extent no longer holds the (key, generation) asked for."""

    code = Code.STALE


class ChecksumMismatchError(KvpoolError):
    """Bytes that do not match their checksum: never returned to the caller."""

    code = Code.CHECKSUM_MISMATCH


class PutExpiredError(KvpoolError):
    """PutEnd/PutRevoke for a put the master no longer knows (reclaimed or never started)."""

    code = Code.PUT_EXPIRED


class InternalError(KvpoolError):
    """A failure inside a component that no other code describes; its log has the cause."""

    code = Code.INTERNAL


class NotLeaderError(KvpoolError):
    """The master asked is a standby; the client follows the leader it names."""

    code = Code.NOT_LEADER


class ProtocolError(KvpoolError):
    """A frame or message that breaks the protocol (malformed, out of bounds, unknown op)."""

    code = Code.PROTOCOL


class VersionMismatchError(ProtocolError):
    """The peer speaks another version of the wire protocol: nothing it sends is read as this version's. The
    message names both (`ours`, `theirs`) and the way across (docs/upgrades.md)."""

    def __init__(self, message: str, ours: int = 0, theirs: int = 0):
        super().__init__(message)
        self.ours, self.theirs = ours, theirs


class ForbiddenError(KvpoolError, PermissionError):
    """The caller's role or tenant scope does not allow the call or the key."""

    code = Code.FORBIDDEN


class QuotaExceededError(NoSpaceError):
    """A tenant's put would take it past its quota, and none of its own objects may be evicted to make
    room (all pinned, held or being read)."""
    code = Code.QUOTA_EXCEEDED


class DeviceCopyError(KvpoolError):
    """A copy between device memory and host memory failed (the device's own error, e.g. CUDA's): nothing
    was stored or filled by the call that hit it."""
    code = Code.INTERNAL


class BatchError(KvpoolError):
    """Some items of a batch failed; `errors` maps each failed key to its error. For reads, `results` holds
    every item's outcome in order (what the call would have returned for it, or its error), so what did arrive
    need not be read again."""

    def __init__(self, message: str, errors: dict, results: list | None = None):
        super().__init__(message)
        self.errors = errors
        self.results = results
        codes = {e.code for e in errors.values()}
        self.code = codes.pop() if len(codes) == 1 else Code.INTERNAL


_BY_CODE = {cls.code: cls for cls in (
    KeyNotFoundError, KeyExistsError, NoSpaceError, ValueTooLargeError, InvalidKeyError,
    InvalidArgumentError, UnavailableError, StaleReplicaError, ChecksumMismatchError,
    PutExpiredError, InternalError, NotLeaderError, ProtocolError, ForbiddenError, QuotaExceededError,
)}


def error_for(code: int, message: str) -> KvpoolError:
    """The typed exception for a status code received from another component."""
    cls = _BY_CODE.get(code, InternalError)
    if not message:
        message = Code(code).name if code in Code._value2member_map_ else f"status {code}"
    return cls(message)
