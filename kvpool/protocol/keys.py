"""What a valid object key is, and a valid key listing, checked alike by client and master."""

from ..errors import InvalidArgumentError, InvalidKeyError

MAX_KEY_BYTES = 1024
DEFAULT_LIST_LIMIT = 1000  # keys a ListKeys page holds unless asked otherwise
MAX_LIST_LIMIT = 10_000  # at most: a page is read and answered on the leader's event loop


def validate_key(key: str) -> bytes:
    """The key's UTF-8 bytes, or InvalidKeyError saying what is wrong with it."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"key must be str, not {type(key).__name__}")
    if not key:
        raise InvalidKeyError("key must not be empty")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(f"key is not valid UTF-8: {exc}") from None
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"key is {len(raw)} bytes; at most {MAX_KEY_BYTES} allowed")
    if "\x00" in key:
        raise InvalidKeyError("key must not contain NUL")
    return raw


def validate_keys(keys) -> None:
    """validate_key for every key of a batch, or InvalidKeyError naming the first bad one's index. Plain
    ASCII keys are checked in one pass over them all: lookups are on the hot path of every request an
    engine makes, and a per-key check costs more than the protobuf around them."""
    try:
        joined = "".join(keys)
    except TypeError:
        joined = None
    if (joined is not None and joined.isascii() and "\x00" not in joined and all(keys)
            and max(map(len, keys), default=0) <= MAX_KEY_BYTES):
        return
    for i, key in enumerate(keys):  # says which key is wrong and how (or accepts the non-ASCII ones)
        try:
            validate_key(key)
        except InvalidKeyError as exc:
            raise InvalidKeyError(f"keys[{i}]: {exc}") from None


def validate_listing(prefix: str, limit: int, cursor: str) -> None:
    """InvalidArgumentError (InvalidKeyError for a bad prefix or cursor) unless this names a page of keys:
    a prefix ("" = every key) and cursor ("" = from the first) that could begin or be keys, a limit in
    1..MAX_LIST_LIMIT."""
    if type(limit) is not int or not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidArgumentError(f"limit must be a whole number from 1 to {MAX_LIST_LIMIT}, not {limit!r}")
    for name, value in (("prefix", prefix), ("cursor", cursor)):
        if not isinstance(value, str):
            raise InvalidKeyError(f"{name} must be str, not {type(value).__name__}")
        if value:
            try:
                validate_key(value)
            except InvalidKeyError as exc:
                raise InvalidKeyError(f"{name}: {exc}") from None
