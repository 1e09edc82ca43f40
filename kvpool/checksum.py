"""End-to-end checksum of object values: xxh3_64, fast enough to run on every put and get."""

import xxhash


def checksum(data) -> int:
    """xxh3_64 of any C-contiguous buffer (bytes, memoryview, numpy array)."""
    return xxhash.xxh3_64_intdigest(data)
