"""End-to-end checksum of object values: xxh3_64, fast enough to run on every put and get.

`checksum` hashes a whole buffer; `Digest` hashes one arriving in pieces and gives the same value.
"""

import xxhash

Digest = xxhash.xxh3_64  # Digest(first_piece).update(piece)...; .intdigest() == checksum(whole)


def checksum(data) -> int:
    """xxh3_64 of any C-contiguous buffer (bytes, memoryview, numpy array)."""
    return xxhash.xxh3_64_intdigest(data)
