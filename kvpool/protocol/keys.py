"""What a valid object key is, checked alike by client and master."""

from ..errors import InvalidKeyError

MAX_KEY_BYTES = 1024


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
