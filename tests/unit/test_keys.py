"""A batch's keys are checked as each key alone is: the one-pass check of plain ASCII keys never accepts a
key validate_key refuses, and a refusal names the key's index."""

import pytest

from kvpool.errors import InvalidKeyError
from kvpool.protocol.keys import MAX_KEY_BYTES, validate_keys


def test_valid_batches_pass():
    validate_keys([])
    validate_keys(["a", "kv/model/0", "x" * MAX_KEY_BYTES])
    validate_keys(["é" * (MAX_KEY_BYTES // 2), "plain"])  # non-ASCII within the byte limit


@pytest.mark.parametrize("bad, why", [
    ("", "must not be empty"),
    ("x" * (MAX_KEY_BYTES + 1), "bytes"),
    ("é" * (MAX_KEY_BYTES // 2 + 1), "bytes"),  # fewer characters than the limit, more bytes
    ("a\x00b", "NUL"),
    (7, "must be str"),
])
def test_a_bad_key_is_named_by_its_index(bad, why):
    with pytest.raises(InvalidKeyError) as refused:
        validate_keys(["good", bad, "also-good"])
    assert str(refused.value).startswith("keys[1]: ") and why in str(refused.value)
