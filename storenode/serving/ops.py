"""What a storage node does for each request, written once for every transport (TCP, shared memory, UCX).

The servers (tcp_session.py and its tcp_members.py / tcp_shm.py, ucx_session.py) parse frames and move
bytes; the decisions are here: whether a caller may still send a request (its tenant token current, the
key in its scope), whether a write is admitted (term fence, options, room in a tier) and how it is
committed, which record a READ or LOCATE pins or whether the shared tier answers it, and the operations
only a member may send, behind one role check (`NodeOps.members`).

A term is believed only from a member: a WRITE's or ALLOCATE's term only fences (refused when older than
the node's), and only REPORT, INVENTORY and EVICTIONS, reachable through `members` alone, raise it.
"""

import asyncio
import struct
from typing import NamedTuple

from kvpool.protocol import release, wire
from kvpool.security.roles import MEMBER_OPS, TENANT_REFUSED_OPS, Caller, Role
from kvpool.errors import (ChecksumMismatchError, ForbiddenError, InternalError, KeyExistsError,
                           InvalidArgumentError, KeyNotFoundError, NotLeaderError, StaleReplicaError)
from kvpool.protocol.wire import MAX_GENERATION, NO_SEAL
from kvpool.security import placement_seal
from kvpool.security.auth import Verifier
from kvpool.protocol.write_options import lifetime_problem, raw_size_problem
from kvpool.sharedfs.layout import SharedObject

from kvpool.storenode.background.replica_push import Copier
from kvpool.storenode.background.shared_tier import SharedTier
from kvpool.storenode.storage.index import ObjectRecord
from kvpool.storenode.background.maintenance import Maintenance
from kvpool.storenode.serving.read_grant import ReadGrant
from kvpool.storenode.storage.store import ObjectStore, Reservation

_COMPRESSED = int(wire.WriteFlag.COMPRESSED)
OP_NAMES = {op.value: op.name.lower() for op in wire.Op}  # metric label of each op


def op_name(op: int) -> str:
    """The op's name as errors say it (e.g. WRITE), or its number when it names none."""
    return OP_NAMES.get(op, str(op)).upper()


class Request(NamedTuple):
    """One data-protocol request: its header's fields (kvpool/protocol/wire.py REQUEST) and its key."""

    op: int
    req_id: int
    key: bytes
    generation: int
    flags: int
    arg: int  # the term of WRITE, ALLOCATE, REPORT, INVENTORY and EVICTIONS; HOLD's milliseconds
    length: int  # bytes of payload (WRITE, ALLOCATE, COPY, ATTACH) or of the value read (READ, LOCATE)
    checksum: int  # the value's xxh3 (WRITE, ALLOCATE)

    @property
    def term(self) -> int:
        return self.arg

    @property
    def name(self) -> str:
        """The op's name as errors say it (e.g. WRITE)."""
        return op_name(self.op)


class StoredOptions(NamedTuple):
    """The WRITE_OPTIONS block after a WRITE's or ALLOCATE's key: kept with the object, but for the seal."""

    ttl_ms: int
    soft_pin_ms: int
    raw_size: int
    seal: bytes  # the leader's over this copy's placement (kvpool/security/placement_seal.py)


class NodeOps:
    """The node's operations on its store, for any transport; holds the node's term.
    verifier: the cluster's keys and the tenants' current tokens; shared: the shared tier, if mounted."""

    def __init__(self, store: ObjectStore, maintenance: Maintenance, node_id: str, copier: Copier,
                 verifier: Verifier, shared: SharedTier | None = None):
        self.store = store
        self.maintenance = maintenance
        self.node_id = node_id
        self._node_id_bytes = node_id.encode()
        self.copier = copier
        self.verifier = verifier
        self.shared = shared
        self.term = 0  # highest term a member's REPORT, INVENTORY or EVICTIONS carried: older writes are refused
        self.grant = ReadGrant()  # reads are served only while the leader's grant holds (read_grant.py)
        self.dropped = asyncio.Event()  # set when the store lists a dropped object: EVICTIONS answers
        store.on_dropped = self.dropped.set
        self._members = MemberOps(self)
        # checks the leader's seals (None: a cluster without a secret)
        self.sealer: placement_seal.PlacementSeal | None = placement_seal.for_verifier(verifier)

    # -- the role check: the one way to the member-only operations

    def members(self, role: Role, op: int) -> "MemberOps":
        """The member-only operations, for a request `op` from a peer that proved `role`;
        ForbiddenError unless that is the member role (kvpool/security/roles.py MEMBER_OPS)."""
        if role is not Role.MEMBER:
            raise ForbiddenError(f"{op_name(op)} may be sent by a master only")
        return self._members

    @staticmethod
    def member_only(op: int) -> bool:
        return op in MEMBER_OPS

    # -- the caller's check, every request on every transport: its token, the keys it may name

    def lapsed(self, caller: Caller) -> bool:
        """Whether `caller` proved a tenant token since rotated or deleted (Verifier.current): its requests are
        refused from then on; TCP also closes its connections at once (DataServer.end_lapsed_tenants)."""
        return caller.role is Role.TENANT and not self.verifier.current(caller)

    def refusal(self, caller: Caller, op: int, key: bytes) -> ForbiddenError | None:
        """Why `caller` may not send `op` naming `key`, or None: a lapsed tenant token sends nothing; a tenant
        names only its own keys (kvpool/protocol/tenants.py) and is never given shared memory (a mapping of
        every tenant's bytes); the client token names no tenant's key. The refusal says nothing of whether
        such a key is stored."""
        scope = caller.scope
        if scope is None:
            return None
        if self.lapsed(caller):
            return ForbiddenError("wrong tenant token (rotated or deleted)")
        if key and not scope.holds_bytes(key):
            return ForbiddenError(f"{op_name(op)} names a key outside this credential's "
                                  "key space")
        if caller.role is Role.TENANT and op in TENANT_REFUSED_OPS:
            return ForbiddenError(f"{op_name(op)}: shared memory is not offered to a "
                                  "tenant (its mapping holds every tenant's bytes); use TCP")
        return None

    # -- writes: WRITE (TCP, UCX) and ALLOCATE (shared memory)

    def admit_write(self, req: Request, options: StoredOptions, role: Role, dram_only: bool = False) -> Reservation:
        """Room for the write's bytes in a tier (evicting to make it), or the typed error why not.
        Its term only fences: a master that no longer leads cannot place it; the node's term stays.
        A client's write needs the leader's seal over exactly it (a member's is checked when it sends one)."""
        term = req.arg
        if term and term < self.term:
            raise NotLeaderError(f"{req.name} placed in term {term}; a master of term {self.term} leads")
        length = req.length
        if length == 0:
            raise InvalidArgumentError(f"{req.name} of an empty payload")
        sealer = self.sealer
        if sealer is not None and (role is not Role.MEMBER or options[3] != NO_SEAL) and not sealer.valid(
                options[3], self._node_id_bytes, req.key, req.generation, length, req.checksum, term, req.flags,
                options[0], options[1], options[2] or length):
            raise ForbiddenError(f"{req.name} not placed here by the leader (its seal does not match): "
                                 "a client stores only what PutStart placed")
        if not 0 < req.generation <= MAX_GENERATION:
            raise InvalidArgumentError(f"{req.name} of generation {req.generation}: 1 to {MAX_GENERATION}")
        self._never_replaced(req)
        problem = raw_size_problem(length, options[2], bool(req.flags & _COMPRESSED))
        if problem:  # a reader would believe it (and allocate it)
            raise InvalidArgumentError(problem)
        problem = lifetime_problem("ttl", options[0] / 1000) or lifetime_problem("pin", options[1] / 1000)
        if problem:  # would not fit the SSD header
            raise InvalidArgumentError(f"{req.name}: {problem}")
        return self.store.reserve(req.key, length, req.flags, dram_only=dram_only)

    def _never_replaced(self, req: Request) -> None:
        """KeyExistsError when this version is stored with other bytes: a stored (key, generation) is final (the
        same bytes again, a retried write, may land and changes nothing)."""
        stored = self.store.index.get(req.key, req.generation)
        if stored is not None and (stored.checksum != req.checksum or stored.size != req.length):
            raise KeyExistsError(f"generation {req.generation} of this key is stored with other bytes; "
                                 "a stored version is never replaced")

    def commit_write(self, res: Reservation, req: Request, options: StoredOptions, digest: int) -> None:
        """Store a write (WRITE, or COMMIT of an ALLOCATE) whose bytes are in its extent (an SSD one's key and
        payload written): once they match its checksum and no other bytes of the version were stored
        meanwhile, its record is made, an SSD object's header written (last: what makes the extent an
        object, on a restart too) and the record committed, all in this turn of the loop; else the extent
        is given back and the typed error raised. The caller replies."""
        store = self.store
        if digest != req.checksum:
            store.abort(res)
            raise ChecksumMismatchError(f"payload checksum differs from {req.checksum:#x}; object not stored")
        try:
            self._never_replaced(req)
        except KeyExistsError:
            store.abort(res)
            raise
        ttl_ms, soft_pin_ms, raw_size = options[:3]
        rec = store.new_record(req.key, req.generation, req.length, req.checksum, req.flags, raw_size, ttl_ms,
                               soft_pin_ms)
        if res.tier is not store.dram:
            try:
                res.tier.segment.write_header(res.offset, store.stored_object(rec))
            except (OSError, struct.error, OverflowError) as exc:  # the extent goes back; the connection stays
                store.abort(res)
                raise InternalError(f"SSD header not written: {exc}") from None
        store.commit(res, rec)

    # -- reads: READ (TCP, UCX) and LOCATE (shared memory)

    def readable(self, req: Request) -> ObjectRecord | None:
        """The record a READ or LOCATE asks for, or None: this node holds no copy of that version (none of its
        key, or another generation, older or newer) but mounts the shared tier, whose file of it answers
        (read_shared, at once). Whatever generation is held here, the file is what says the version stands:
        the leader has every node mounting the tier unlink a replaced version before the overwrite returns,
        and a newer one held here may be a put not yet ended. Raises StaleReplicaError (the read grant
        lapsed, the version held has another size, or another generation is held and no shared tier)
        or KeyNotFoundError."""
        self.grant.check()
        generation = req.generation
        rec, why = self.store.lookup(req.key, generation)
        if rec is None:
            self.store.count_miss(req.key)
            if self.shared is not None:
                return None
            if why == "stale":
                raise StaleReplicaError(f"this node no longer holds generation {generation} of the key")
            raise KeyNotFoundError(f"no generation {generation} of this key here")
        if req.length != rec.size:
            raise StaleReplicaError(f"generation {generation} has {rec.size} bytes, not {req.length}")
        return rec

    async def read_shared(self, req: Request) -> tuple[SharedObject, bytes]:
        """The bytes of a version readable() left to the shared tier (its read grant check covers this), the
        file checked whole before a byte leaves (storenode/background/shared_tier.py); KeyNotFoundError if the
        tier has no such file, StaleReplicaError if it has another size."""
        return await self.shared.read(req.key, req.generation, req.length)

    def note_read(self, rec: ObjectRecord) -> None:
        """Count a read about to be served; an SSD object read often enough is promoted to DRAM."""
        if rec.dram is not None:
            self.store.count_read(rec, from_dram=True)
        elif self.store.count_read(rec, from_dram=False):
            self.maintenance.promote(rec)


class MemberOps:
    """What only a master may ask of a node (FREE, HOLD, REPORT, INVENTORY, INVENTORY_CHANGES, EVICTIONS, COPY).
    Reached through NodeOps.members; the only code that raises the node's term."""

    def __init__(self, node: NodeOps):
        self.node = node
        self.store = node.store

    def _believe(self, term: int) -> bool:
        """Raise the node's term to `term`; whether `term` is the current one (not an older leader's)."""
        node = self.node
        if term > node.term:
            node.term = term
        return term == node.term

    def free(self, req: Request) -> None:
        if not self.store.free(req.key, req.generation):
            raise KeyNotFoundError(f"no generation {req.generation} of this key here")

    def hold(self, req: Request) -> None:
        if not self.store.hold(req.key, req.generation, req.arg):
            raise KeyNotFoundError(f"no generation {req.generation} of this key here")

    def report(self, term: int) -> dict:
        current = self._believe(term)
        report = self.store.report(self.node.node_id)
        report["version"] = release.VERSION
        shared = self.node.shared
        if shared is not None and shared.gate.fault:
            report["shared_fault"] = shared.gate.fault
        if current and not self.node.grant.reported():
            report["lapsed"] = True  # the leader reconciles this node before it serves reads again
        return report

    def inventory(self, term: int) -> list:
        self._inventoried(term)
        return self.store.inventory_reply()

    def inventory_changes(self, term: int, since: int) -> list:
        """A new leader's (term) or a standby's (0: nothing fenced) read of what changed after `since`."""
        if term:
            self._inventoried(term)
        return self.store.index.columns.changes_parts(self.store.clock(), since)

    def _inventoried(self, term: int) -> None:
        newer = term > self.node.term
        if self._believe(term):  # a new leader asks this first: older writes end here
            self.node.grant.inventoried(newer)

    def _check_leads(self, term: int) -> None:
        if term and term < self.node.term:
            raise NotLeaderError(f"term {term} is older than {self.node.term}")

    async def evictions(self, term: int, before_waiting) -> list:
        """The objects dropped since the last EVICTIONS, once there is one (or empty after EVICTIONS_WAIT),
        so the master's table loses an evicted copy a round trip after the eviction, not at its next REPORT.
        before_waiting(): awaited once the term is checked (e.g. send the replies owed before this one)."""
        self._check_leads(term)
        self._believe(term)
        await before_waiting()
        store, dropped = self.store, self.node.dropped
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wire.EVICTIONS_WAIT
        while not store.has_dropped() and (left := deadline - loop.time()) > 0:
            dropped.clear()
            try:
                await asyncio.wait_for(dropped.wait(), left)
            except TimeoutError:
                break
        self._check_leads(term)  # deposed (maybe while waiting): leave them to the leader
        return store.take_dropped()

    async def copy(self, req: Request, destination: str) -> int:
        """WRITE the object to the node at `destination`; the bytes sent."""
        return await self.node.copier.copy(req.key, req.generation, destination)
