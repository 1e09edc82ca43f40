"""The data protocol between clients (and the master) and storage nodes.

Binary, little-endian frames over one persistent stream. A connection carries
requests and replies strictly in order, so a client may pipeline: send many
requests, then read the replies in the same order (req_id is echoed to check).
A batch is such a pipelined run of frames, sent in one sendmsg.

A connection opens with the server's challenge and the peer's answer (op AUTH; see
kvpool/security/auth.py): until the peer proved the client or the member role, nothing else is served.

Request:  REQUEST header | key (key_len bytes) | WRITE only: WRITE_OPTIONS, then payload (length bytes)
          | COPY only: the destination "HOST:PORT" (length bytes)
Reply:    REPLY header   | payload (length bytes): the value for a READ that
          succeeded, JSON for REPORT and INVENTORY, or a UTF-8 error message
          when status != OK.

Objects on a node are addressed by (key, generation); the node decides where
in its DRAM and SSD tiers the bytes live and may move them between tiers, so
nobody else ever names an offset.

A frame with a wrong magic or version, or a key longer than MAX_KEY_BYTES,
cannot be resynchronised: the node closes the connection (at a frame of another
version after one refusal naming both versions, TURNED_AWAY with status PROTOCOL).
Every version keeps magic and version as the first three bytes of both headers, so
peers of any two versions tell each other apart (VersionMismatchError) instead of
misreading a frame. A WRITE it cannot
take (no space, bad length) gets an error reply and, as its payload cannot be
skipped safely, a closed connection.

The master's control port (master/serving/control_port.py, client/control_link.py)
speaks the same frames with the ops from 32 up, one per Master RPC (named in
kvpool/protocol/control.py): the request's body (`length` bytes, no key) is the
serialized protobuf request, the OK reply's body the serialized response,
whose own status says how the call went (LOOKUP alone has a leaner body: see
Op). Replies come as each call finishes,
not in request order: req_id matches them. A reply status other than OK is
about the frame: NOT_LEADER (body: JSON {"leader", "control_address"} of the
leader, "" while none is known), INVALID_ARGUMENT (a body that is not the
op's request), PROTOCOL (an unknown op, or a key) or TOO_LARGE (a body over
control.MAX_BODY; the connection then closes). A bad magic, or a frame
stalled half-received, closes the connection without a reply; another
version gets the refusal naming both first.
"""

import struct
from enum import IntEnum, IntFlag

from ..errors import Code, VersionMismatchError
from . import release
from .keys import MAX_KEY_BYTES

MAGIC = b"KV"
VERSION = 3  # 2: connections open with the AUTH handshake; 3: WRITE_OPTIONS carry the placement's seal

# magic, version, op, req_id, key_len, flags, generation, arg, length, checksum
# arg: HOLD: milliseconds to hold the object; WRITE, REPORT, INVENTORY and EVICTIONS: the leading master's term (0 = none),
#      so a node refuses WRITEs placed by a master deposed since (NOT_LEADER); otherwise 0.
REQUEST = struct.Struct("<2sBBIHHQQQQ")
# After a WRITE's or ALLOCATE's key: ttl_ms (0 = none), soft_pin_ms (0 = not pinned), raw_size (size before
# compression), and the leader's seal over this copy's placement (kvpool/security/placement_seal.py; zeros: none,
# which a node takes from a member only).
WRITE_OPTIONS = struct.Struct("<QQQ16s")
SEAL = 16  # bytes of a placement's seal
NO_SEAL = bytes(SEAL)
# Highest generation a node stores: the master's next one (the highest seen + 1) must still fit 64 bits,
# whatever a peer or an old SSD offers.
MAX_GENERATION = (1 << 63) - 1
# magic, version, op, req_id, status, flags (ReplyFlag), (2 pad), length, checksum
REPLY = struct.Struct("<2sBBIBB2xQQ")


# A reply with op 0 answers no request: the node turned the connection away (an error status and its
# message, e.g. UNAVAILABLE at --max-connections) and closes it.
TURNED_AWAY = 0


class Op(IntEnum):
    WRITE = 1      # store payload (length bytes) as (key, generation); checksum must match
    READ = 2       # reply with the bytes of (key, generation); length must equal its size
    FREE = 3       # forget (key, generation) (once no transfer uses it); sent by the master
    PING = 4       # liveness; reply payload is the node id
    HOLD = 5       # keep (key, generation) from eviction for `arg` ms (capped by the node)
    REPORT = 6     # reply JSON: per-tier usage and counters, and the objects evicted since the last REPORT
    INVENTORY = 7  # reply JSON: every object the node holds (after a restart: what its SSD kept)
    # Push (key, generation) to another node: the request's payload (length bytes, at most
    # MAX_COPY_TARGET) is the destination's UTF-8 "HOST:PORT"; the node WRITEs the object there
    # with its own checksum and options and replies OK once the destination stored it (else
    # the destination's error, or NOT_FOUND / STALE when it does not hold that version). Sent
    # by the master to repair replicas.
    COPY = 8
    # Reply JSON: the node id, instance, host id and the transports it offers besides this one
    # (see kvpool/protocol/transports.py), so a client can pick the best path to it.
    HELLO = 9
    # Same-host shared memory (client/shm.py). The bytes move through the node's DRAM mapping;
    # these small messages keep the node the authority on placement and in-flight references.
    # A reference a connection took is given back when it closes, whatever the client did.
    ATTACH = 10    # no payload; reply JSON {"path", "size", "instance"}, or FORBIDDEN when not offered
    # READ, but a DRAM object is answered MAPPED (`length` is its offset) and pinned until RELEASE
    # or for LOCATE_LEASE seconds, whichever comes first: a client may send its RELEASEs late,
    # together with its next requests, and one that never does holds nothing for long.
    LOCATE = 11
    RELEASE = 12   # drop the reference LOCATE took on (key, generation); never answered
    ALLOCATE = 13  # WRITE without the payload: reserve a DRAM extent, answered MAPPED
    COMMIT = 14    # the ALLOCATEd extent of (key, generation) is filled: verify checksum and keep it
    # Reply JSON {"evicted": [[key, generation], ...]}: the objects dropped since the last REPORT or
    # EVICTIONS, answered as soon as there is one, or empty after EVICTIONS_WAIT seconds. The master
    # keeps one outstanding per node, on a connection of its own (the node answers in order).
    EVICTIONS = 15
    # The handshake every connection opens with (kvpool/security/auth.py): the server's challenge is a REPLY of
    # this op (payload: its nonce); the peer's answer a REQUEST (flags: its role; payload: its nonce and
    # proof), answered with the server's proof or FORBIDDEN.
    AUTH = 16
    # The shared tier (kvpool/sharedfs), on a node that mounts it; sent by the master. FREE_SHARED: unlink
    # the file of (key, generation) (OK when it was there, NOT_FOUND when not). SHARED_SCAN: reply, in the
    # INVENTORY reply's format, every object the directory's manifests hold (tiers: inventory.SHARED_BIT).
    FREE_SHARED = 17
    SHARED_SCAN = 18
    # Reply (kvpool/protocol/inventory.py, encode_changes): the slots of the node's inventory changed after
    # change number `generation` (0: all), so a standby master keeps its copy of the inventory current and a
    # new leader reads only what changed. `arg`: as INVENTORY's (0 from a standby: nothing is fenced).
    INVENTORY_CHANGES = 19
    # The master's control port: one op per Master RPC (see the module docstring).
    PUT_START = 32
    PUT_END = 33
    PUT_REVOKE = 34
    BATCH_PUT_START = 35
    BATCH_PUT_END = 36
    BATCH_PUT_REVOKE = 37
    GET_REPLICA_LIST = 38
    BATCH_GET_REPLICA_LIST = 39
    EXISTS = 40
    BATCH_EXISTS = 41
    REMOVE = 42
    REMOVE_BY_PREFIX = 43
    DRAIN = 44
    STATS = 45
    # A lookup without protobuf (control.LOOKUP): what BatchExists without a hold answers, for a body of
    # the keys in UTF-8 joined by NUL (a key never holds one), answered with one byte per key, 1 where it
    # exists, 0 where not; a bad key is refused whole (its error status). A master older than this op
    # answers PROTOCOL (unknown op), and the caller asks BatchExists instead.
    LOOKUP = 46
    LIST_KEYS = 47  # ListKeys (added after LOOKUP, so numbered after it)
    TENANTS = 48  # an operator's Tenants RPC


# An EVICTIONS (or REPORT) entry [key, generation, how] says the node moved the object rather than lost it.
MOVED_TO_SHARED = "shared"  # written to the shared tier (kvpool/sharedfs); the node's own copy is gone
PROMOTED_FROM_SHARED = "promoted"  # a shared object copied into the node's DRAM: a copy more

MAX_COPY_TARGET = 1024  # longest destination address a COPY may carry

LOCATE_LEASE = 2.0  # seconds; a client copying for longer reads over the socket instead
EVICTIONS_WAIT = 5.0  # seconds a node keeps an EVICTIONS request when it has nothing to tell
# Seconds a node serves reads after the leader's last REPORT reached it (storenode/serving/read_grant.py); a leader
# whose FREE a node did not confirm lets the overwrite return only once that much has passed (master/nodes/node_io.py).
READ_GRANT = 3.0



class ReplyFlag(IntFlag):
    """Reply `flags`."""

    # LOCATE / ALLOCATE: no body; `length` is the offset of the object's bytes in the DRAM
    # segment (their size is the request's length), `checksum` the object's.
    MAPPED = 1


class WriteFlag(IntFlag):
    """Request `flags` of a WRITE."""

    HARD_PIN = 1    # never evicted; counted against the node's hard-pin quota
    PREFER_SSD = 2  # place in the SSD tier rather than DRAM
    COMPRESSED = 4  # the payload is lz4-compressed (the node stores it as is)
    TO_SHARED = 8   # put(tier="shared"): the node moves it on to the shared tier as soon as it is stored


def pack_request(op: Op, req_id: int, key: bytes, generation: int = 0, arg: int = 0,
                 length: int = 0, checksum: int = 0, flags: int = 0) -> bytes:
    """Header and key of one request (a WRITE's options and payload are sent after it)."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
    return REQUEST.pack(MAGIC, VERSION, op, req_id & 0xFFFFFFFF, len(key), flags,
                        generation, arg, length, checksum) + key


def pack_with_options(op: Op, req_id: int, key: bytes, generation: int, term: int, size: int, checksum: int,
                      options=None) -> bytes:
    """What precedes a WRITE's payload (or makes an ALLOCATE): header, key and the WRITE_OPTIONS block.
    options: a kvpool.protocol.write_options.WriteOptions (with the leader's seal), None for none;
    term: the placing leader's (the arg)."""
    if options is None:
        return pack_request(op, req_id, key, generation, term, size, checksum) + WRITE_OPTIONS.pack(
            0, 0, size, NO_SEAL)
    return pack_request(op, req_id, key, generation, term, size, checksum, options.flags) + options.pack(size)


def pack_reply(op: int, req_id: int, status: int, length: int = 0, checksum: int = 0, flags: int = 0) -> bytes:
    return REPLY.pack(MAGIC, VERSION, op, req_id, status, flags, length, checksum)


def pack_error(op: int, req_id: int, status: int, message: str) -> bytes:
    """A complete error reply: header plus message."""
    body = message.encode("utf-8", "replace")[:4096]
    return REPLY.pack(MAGIC, VERSION, op, req_id, status, 0, len(body), 0) + body


def version_mismatch(peer: str, version: int) -> VersionMismatchError:
    """The error for a frame from `peer` that carries our magic and another wire protocol `version`."""
    return VersionMismatchError(
        f"{peer} speaks wire protocol {version}, this process wire protocol {VERSION} (kvpool {release.VERSION}): "
        "clients, nodes and masters must share one; across a wire change stop the cluster cleanly and start it "
        "on the new release (docs/upgrades.md)", ours=VERSION, theirs=version)


def version_refusal(peer: str, version: int) -> bytes:
    """What a server sends a peer of another wire protocol before it closes the connection: a TURNED_AWAY
    reply (in this version's framing, which the peer tells apart by its version byte) naming both versions."""
    return pack_error(TURNED_AWAY, 0, Code.PROTOCOL, str(version_mismatch(peer, version)))
