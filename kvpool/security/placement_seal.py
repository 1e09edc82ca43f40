"""The leader's seal over each copy it places, so a node stores only what the leader placed.

A client holds the client key, which lets it talk to nodes, but what it may store there is the
leader's decision: the leader seals every copy of a PutStart's answer with a key made from the
cluster secret that only members hold, over everything the node acts on (the copy's node, key,
generation, size, checksum, the placing term and the WRITE's options), and the WRITE or ALLOCATE
carries the seal (kvpool/protocol/wire.py WRITE_OPTIONS). A node stores a client's write only under a
seal it can recompute: a client cannot choose a generation, replace a version with other bytes, make
room for a size nobody placed, or keep an object longer or pinned harder than it was placed.

Members (a node copying to another) hold the key themselves and send no seal; one they do send is
checked. A cluster without a secret has no key: nothing is sealed or checked.
"""

import hashlib
import hmac
import struct

from ..protocol.wire import NO_SEAL, SEAL
from .auth import placement_key

# generation, size, checksum, term, ttl_ms, soft_pin_ms, raw_size (as packed: the stored size when not
# compressed), flags, then the node id's length; the node id and the key follow.
_FIELDS = struct.Struct("<QQQQQQQHH")


class PlacementSeal:
    """Seals placements (the leader) and checks them (a node): keyed BLAKE2b, 128 bits."""

    def __init__(self, key: bytes):
        self._keyed = hashlib.blake2b(key=key, digest_size=SEAL)

    def seal(self, node_id: bytes, key: bytes, generation: int, size: int, checksum: int, term: int, flags: int,
             ttl_ms: int, soft_pin_ms: int, raw_size: int) -> bytes:
        mac = self._keyed.copy()
        mac.update(_FIELDS.pack(generation, size, checksum, term, ttl_ms, soft_pin_ms, raw_size, flags,
                                len(node_id)))
        mac.update(node_id)
        mac.update(key)
        return mac.digest()

    def valid(self, seal: bytes, node_id: bytes, key: bytes, generation: int, size: int, checksum: int, term: int,
              flags: int, ttl_ms: int, soft_pin_ms: int, raw_size: int) -> bool:
        return seal != NO_SEAL and hmac.compare_digest(seal, self.seal(
            node_id, key, generation, size, checksum, term, flags, ttl_ms, soft_pin_ms, raw_size))


def for_secret(secret: str | None) -> PlacementSeal | None:
    """The seal of a cluster with this secret; None for a cluster without one."""
    return PlacementSeal(placement_key(secret)) if secret else None


def for_verifier(verifier) -> PlacementSeal | None:
    """The seal a server with this auth.Verifier checks; None for an open one."""
    return None if verifier.placement_key is None else PlacementSeal(verifier.placement_key)
