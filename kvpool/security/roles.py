"""What each role may ask: the one table every plane checks where it dispatches.

A client (the client token every engine holds, or a tenant's token: kvpool/protocol/tenants.py) puts, gets, looks up and removes objects through the
master, and writes and reads them on nodes. Only a member (the cluster secret: masters, nodes and an
operator's commands) may send what drops or moves other clients' data, or carries a term: the node
operations below, and the master RPCs below. A server without a secret takes every peer as a member.
The master checks MEMBER_RPCS in MasterService.serve_now (control port and gRPC alike), a node
MEMBER_OPS in storenode/serving/ops.py NodeOps.members, and the leader's seal on what stores data (WRITE,
ALLOCATE) in NodeOps.admit_write (TCP, shared memory and UCX alike).
"""

from enum import IntEnum
from typing import NamedTuple

from ..errors import ForbiddenError
from ..protocol import wire
from ..protocol.tenants import CLIENT_SCOPE, Scope


class Role(IntEnum):
    CLIENT = 1
    MEMBER = 2
    TENANT = 3  # a client confined to its tenant's keys (kvpool/protocol/tenants.py): a client otherwise


class Caller(NamedTuple):
    """Who a connection or call proved to be: its role, the keys it may name (None: every key, a member's)
    and, for a tenant, the version of the tenant's token it proved (a rotation ends it)."""

    role: Role
    scope: Scope | None
    version: int = 0

    @property
    def tenant(self) -> str:
        return self.scope.tenant if self.scope is not None else ""


MEMBER = Caller(Role.MEMBER, None)
CLIENT = Caller(Role.CLIENT, CLIENT_SCOPE)


# Ops on a node that only a member may send: they drop or move data, or carry a term.
MEMBER_OPS = frozenset({wire.Op.FREE, wire.Op.HOLD, wire.Op.REPORT, wire.Op.INVENTORY,
                        wire.Op.COPY, wire.Op.EVICTIONS, wire.Op.FREE_SHARED, wire.Op.SHARED_SCAN,
                        wire.Op.INVENTORY_CHANGES})

# Ops on a node a tenant may not send: shared memory's (the node's DRAM mapping holds every tenant's bytes).
TENANT_REFUSED_OPS = frozenset({wire.Op.ATTACH, wire.Op.LOCATE, wire.Op.RELEASE, wire.Op.ALLOCATE,
                                wire.Op.COMMIT})

# Master RPCs only a member may call: an operator's, which move every client's data.
MEMBER_RPCS = frozenset({"Drain", "Tenants"})


def check_scope(caller: Caller, keys, what: str) -> None:
    """ForbiddenError unless every stored key of `keys` (strs) lies in the caller's scope: a tenant names only
    its own keys, the client token no tenant's (the client library adds the scope; only a hostile or broken
    client sends another). The refusal says nothing of whether such a key exists."""
    scope = caller.scope
    if scope is not None and not scope.holds_all(keys):
        raise ForbiddenError(f"{what} names a key outside this credential's key space"
                             + (f" (tenant {scope.tenant})" if scope.tenant else " (the keys of no tenant)"))


def check_rpc(role: Role, name: str) -> None:
    """ForbiddenError unless `role` may call the master RPC `name`."""
    if name in MEMBER_RPCS and role is not Role.MEMBER:
        raise ForbiddenError(f"{name} is an operator's call: give it the cluster secret (KVPOOL_TOKEN_FILE naming "
                             f"the secret file, e.g. DATA_DIR/secret of `kvpool up`), not the client token")
