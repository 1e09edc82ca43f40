"""What the object tier writes to a bucket, encrypted and authenticated (AES-256-GCM), when its URL asks for it
(`s3://BUCKET/PREFIX?encryption=aes-gcm`): a bucket is often shared with other systems and their operators.

The key comes from the cluster's client key (`kvpool token --client`, itself derived from the cluster secret), so
the storage nodes (holding the secret) and clients reading the tier directly (holding the client token) derive the
same key, and none is ever stored in the bucket. A sealed object is

    MAGIC (8) | key id (8) | nonce (12) | AES-256-GCM ciphertext of the object's plain bytes | tag (16)

with the object's name in the bucket as associated data, so an object copied under another name, one written
with another key and a damaged one all fail alike (ChecksumMismatchError, never served). The key id names which
key sealed it, so a reader holding another one says so instead of only "damaged". Names and sizes stay visible.
"""

import hashlib
import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import ChecksumMismatchError

MAGIC = b"KVPAEAD1"
_KEY_ID, _NONCE, _TAG = 8, 12, 16
OVERHEAD = len(MAGIC) + _KEY_ID + _NONCE + _TAG  # bytes a sealed object has beyond its plain bytes


class ObjectCipher:
    """Seals and opens the tier's objects with one 256-bit key (`key`: kvpool.security.auth.object_tier_key)."""

    def __init__(self, key: bytes):
        if len(key) != 32:
            raise ValueError(f"the object tier's key is {len(key)} bytes, not 32")
        self._aead = AESGCM(key)
        self.key_id = hmac.new(key, b"kvpool object tier key id", hashlib.sha256).digest()[:_KEY_ID]

    def seal(self, name: str, plain) -> bytes:
        """`plain` (bytes, or a list of buffers joined in order) as stored under `name`."""
        body = b"".join(memoryview(part).cast("B") for part in plain) if isinstance(plain, list) else plain
        nonce = os.urandom(_NONCE)  # random 96-bit nonces: safe for far more objects than a tier holds per key
        prefix = MAGIC + self.key_id
        return prefix + nonce + self._aead.encrypt(nonce, bytes(body), prefix + name.encode())

    def open(self, name: str, data) -> bytes:
        """The plain bytes of the object stored under `name`, or ChecksumMismatchError saying why there are
        none: not sealed (written without encryption: refused, an unauthenticated object could be anyone's),
        sealed with another key, or damaged."""
        view = memoryview(data).cast("B")
        head = len(MAGIC) + _KEY_ID
        if len(view) < OVERHEAD or view[:len(MAGIC)] != MAGIC:
            raise ChecksumMismatchError(f"{name} is not encrypted, and the object tier is (?encryption=aes-gcm): "
                                        "refused")
        prefix = bytes(view[:head])
        if prefix[len(MAGIC):] != self.key_id:
            raise ChecksumMismatchError(f"{name} was encrypted with another key (key id {prefix[len(MAGIC):].hex()}"
                                        f", this one's is {self.key_id.hex()}): another cluster secret")
        try:
            return self._aead.decrypt(bytes(view[head:head + _NONCE]), bytes(view[head + _NONCE:]),
                                      prefix + name.encode())
        except InvalidTag:
            raise ChecksumMismatchError(f"{name} fails its authentication (damaged or altered)") from None


def is_sealed(data) -> bool:
    return bytes(memoryview(data).cast("B")[:len(MAGIC)]) == MAGIC

