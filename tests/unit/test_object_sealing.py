"""The object tier's encryption (kvpool/objectstore/sealing.py): what is sealed opens under its name and key only,
and the format and the key's derivation from the cluster secret and the client token are fixed (golden values:
a bucket written by one version is read by the next)."""

import pytest

from kvpool.errors import ChecksumMismatchError
from kvpool.objectstore.sealing import MAGIC, OVERHEAD, ObjectCipher, is_sealed
from kvpool.security import auth

SECRET = "5e" * 32


def test_the_key_comes_alike_from_the_secret_and_its_client_token_and_is_fixed():
    key = auth.object_tier_key(SECRET)
    assert auth.object_tier_key(auth.client_token(SECRET)) == key
    assert key.hex() == "ce59278e54880d4dd03e1dbe05b756e986b8561fa5efcf5df81ab9a14edc1007"
    assert ObjectCipher(key).key_id.hex() == "3ca76a61d984d24b"
    assert auth.object_tier_key("6f" * 32) != key
    with pytest.raises(ValueError, match="tenant"):
        auth.object_tier_key(auth.tenant_token(SECRET, "team-a", 1))


def test_sealed_objects_open_under_their_name_and_key_only():
    cipher = ObjectCipher(auth.object_tier_key(SECRET))
    sealed = cipher.seal("c/objects/ab/x-1", [b"header|", memoryview(b"payload")])
    assert is_sealed(sealed) and sealed.startswith(MAGIC + cipher.key_id)
    assert len(sealed) == len(b"header|payload") + OVERHEAD and b"payload" not in sealed
    assert cipher.open("c/objects/ab/x-1", sealed) == b"header|payload"
    assert cipher.seal("n", b"same") != cipher.seal("n", b"same")  # a fresh nonce each time
    with pytest.raises(ChecksumMismatchError, match="authentication"):  # copied under another name
        cipher.open("c/objects/ab/x-2", sealed)
    damaged = bytearray(sealed)
    damaged[-20] ^= 1
    with pytest.raises(ChecksumMismatchError, match="authentication"):
        cipher.open("c/objects/ab/x-1", bytes(damaged))
    with pytest.raises(ChecksumMismatchError, match="another key"):
        ObjectCipher(auth.object_tier_key("6f" * 32)).open("c/objects/ab/x-1", sealed)
    with pytest.raises(ChecksumMismatchError, match="not encrypted"):
        cipher.open("c/objects/ab/x-1", b"KVPSHR01" + bytes(100))
    with pytest.raises(ChecksumMismatchError, match="not encrypted"):
        cipher.open("c/objects/ab/x-1", sealed[:OVERHEAD - 1])
    assert not is_sealed(b"KVPSHR01")
