"""lz4 compression of whole values, and the policy deciding which values get it.

lz4 block format without a size prefix: the raw size travels in the object's
metadata (ObjectInfo.raw_size, the WRITE_OPTIONS block), where it also bounds
what decompression may produce. The stored, checksummed and transferred bytes
are the compressed ones; callers only ever see raw bytes.
"""

import lz4.block

from kvpool.errors import ChecksumMismatchError, InvalidArgumentError
from kvpool.protocol.parts import Parts
from kvpool.protocol.write_options import raw_size_problem

# lz4's LZ4_MAX_INPUT_SIZE: a single block cannot hold more.
MAX_INPUT = 0x7E000000


def check_threshold(compress_above) -> int | None:
    """A valid compress_above setting (None = no policy), or InvalidArgumentError."""
    if compress_above is None:
        return None
    if isinstance(compress_above, bool) or not isinstance(compress_above, int) or compress_above < 0:
        raise InvalidArgumentError(f"compress_above must be None or a byte count >= 0, got {compress_above!r}")
    return compress_above


def encode(view: memoryview, compress: bool | None, compress_above: int | None) -> memoryview | None:
    """The compressed bytes to store instead of `view`, or None to store it as it is.

    compress=True always compresses; False never does; None leaves it to the policy:
    values larger than compress_above, and only when that makes them smaller.
    """
    if compress is not None and not isinstance(compress, bool):
        raise InvalidArgumentError(f"compress must be True, False or None, got {compress!r}")
    size = len(view)
    if compress is False or size == 0:
        return None
    if compress is None and (compress_above is None or size <= compress_above):
        return None
    if size > MAX_INPUT:
        if compress:
            raise InvalidArgumentError(f"a value of {size} bytes is too large to compress (limit {MAX_INPUT})")
        return None
    packed = lz4.block.compress(view.gather() if isinstance(view, Parts) else view, store_size=False)
    if compress is None and len(packed) >= size:
        return None  # incompressible: the policy is there to save bytes, not to spend time
    return memoryview(packed)


def decode(stored: memoryview, raw_size: int, what: str) -> bytes:
    """The raw value of `stored` (lz4 bytes whose checksum already matched)."""
    problem = raw_size_problem(len(stored), raw_size, True)
    if problem:  # refused before anything that size is allocated
        raise ChecksumMismatchError(f"{what}: {problem}")
    try:
        raw = lz4.block.decompress(stored, uncompressed_size=raw_size)
    except lz4.block.LZ4BlockError as exc:
        raise ChecksumMismatchError(f"{what}: stored bytes do not decompress to {raw_size} bytes: {exc}") from None
    if len(raw) != raw_size:
        raise ChecksumMismatchError(f"{what}: stored bytes decompress to {len(raw)} bytes, not {raw_size}")
    return raw
