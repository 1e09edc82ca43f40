"""The data protocol between clients (and the master) and storage nodes.

Binary, little-endian frames over one persistent stream. A connection carries
requests and replies strictly in order, so a client may pipeline: send many
requests, then read the replies in the same order (req_id is echoed to check).

Request:  REQUEST header | key (key_len bytes) | payload (WRITE only: length bytes)
Reply:    REPLY header   | payload (length bytes): the value for a READ that
          succeeded, or a UTF-8 error message when status != OK.

A frame with a wrong magic or version, or a key longer than MAX_KEY_BYTES,
cannot be resynchronised: the node closes the connection. An out-of-range
extent gets an error reply (and, for a WRITE whose payload cannot be trusted,
a closed connection). The node never writes outside the segment.
"""

import struct
from enum import IntEnum

from .keys import MAX_KEY_BYTES

MAGIC = b"KV"
VERSION = 1

# magic, version, op, req_id, key_len, flags, generation, offset, length, checksum
REQUEST = struct.Struct("<2sBBIHHQQQQ")
# magic, version, op, req_id, status, (3 pad), length, checksum
REPLY = struct.Struct("<2sBBIB3xQQ")


class Op(IntEnum):
    WRITE = 1  # store payload at [offset, offset+length) as (key, generation); checksum must match
    READ = 2   # reply with [offset, offset+length) if it still holds (key, generation)
    FREE = 3   # forget the extent at offset if it holds (key, generation); sent by the master
    PING = 4   # liveness; reply payload is the node id


def pack_request(op: Op, req_id: int, key: bytes, generation: int = 0, offset: int = 0,
                 length: int = 0, checksum: int = 0, flags: int = 0) -> bytes:
    """Header and key of one request (a WRITE's payload is sent after it)."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
    return REQUEST.pack(MAGIC, VERSION, op, req_id & 0xFFFFFFFF, len(key), flags,
                        generation, offset, length, checksum) + key


def pack_reply(op: int, req_id: int, status: int, length: int = 0, checksum: int = 0) -> bytes:
    return REPLY.pack(MAGIC, VERSION, op, req_id, status, length, checksum)


def pack_error(op: int, req_id: int, status: int, message: str) -> bytes:
    """A complete error reply: header plus message."""
    body = message.encode("utf-8", "replace")[:4096]
    return REPLY.pack(MAGIC, VERSION, op, req_id, status, len(body), 0) + body
