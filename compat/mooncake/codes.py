"""Mooncake Store's return codes (mooncake-store/include/types.h, ErrorCode) and the one mapping of kvpool's
typed errors onto them. Mooncake's Python client returns these as ints: 0 or a size on success, negative on
error."""

import logging

from kvpool import errors

log = logging.getLogger("kvpool.compat.mooncake")

OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200  # no segment has room
INVALID_KEY = -400
INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601
INVALID_WRITE = -700
INVALID_READ = -701
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FAIL = -900

# Most specific first: QuotaExceededError is a NoSpaceError, DeadlineExceededError an UnavailableError.
_BY_ERROR = (
    (errors.KeyNotFoundError, OBJECT_NOT_FOUND),
    (errors.KeyExistsError, OBJECT_ALREADY_EXISTS),
    (errors.NoSpaceError, NO_AVAILABLE_HANDLE),
    (errors.ValueTooLargeError, NO_AVAILABLE_HANDLE),
    (errors.InvalidKeyError, INVALID_KEY),
    (errors.InvalidArgumentError, INVALID_PARAMS),
    (errors.ForbiddenError, ILLEGAL_CLIENT),
    (errors.UnavailableError, RPC_FAIL),
    (errors.NotLeaderError, RPC_FAIL),
    (errors.StaleReplicaError, INVALID_READ),
    (errors.ChecksumMismatchError, TRANSFER_FAIL),
    (errors.ProtocolError, TRANSFER_FAIL),
    (errors.PutExpiredError, INVALID_WRITE),
)


def code_of(exc: BaseException) -> int:
    """Mooncake's code for a failure of kvpool's Client (logged unless it is a plain miss)."""
    for error_type, code in _BY_ERROR:
        if isinstance(exc, error_type):
            break
    else:
        code = INVALID_PARAMS if isinstance(exc, (ValueError, TypeError)) else INTERNAL_ERROR
    if code != OBJECT_NOT_FOUND:
        log.warning("kvpool: %s (Mooncake code %d)", exc, code)
    return code

