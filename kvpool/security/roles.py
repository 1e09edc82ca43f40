"""What each role may ask: the one table every plane checks where it dispatches.

A client (the client token every engine holds) puts, gets, looks up and removes objects through the
master, and writes and reads them on nodes. Only a member (the cluster secret: masters, nodes and an
operator's commands) may send what drops or moves other clients' data, or carries a term: the node
operations below, and the master RPCs below. A server without a secret takes every peer as a member.
The master checks MEMBER_RPCS in MasterService.serve_now (control port and gRPC alike), a node
MEMBER_OPS in storenode/ops.py NodeOps.members and SEALED_OPS in NodeOps.admit_write (TCP, shared memory
and UCX alike).
"""

from enum import IntEnum

from ..errors import ForbiddenError
from ..protocol import wire


class Role(IntEnum):
    CLIENT = 1
    MEMBER = 2


# Ops on a node that only a member may send: they drop or move data, or carry a term.
MEMBER_OPS = frozenset({wire.Op.FREE, wire.Op.HOLD, wire.Op.REPORT, wire.Op.INVENTORY,
                        wire.Op.COPY, wire.Op.EVICTIONS})

# Ops on a node a client may send only under the leader's seal over exactly that copy
# (kvpool/security/placement_seal.py): they store data. Checked in storenode/ops.py NodeOps.admit_write.
SEALED_OPS = frozenset({wire.Op.WRITE, wire.Op.ALLOCATE})

# Master RPCs only a member may call: an operator's, which move every client's data.
MEMBER_RPCS = frozenset({"Drain"})


def check_rpc(role: Role, name: str) -> None:
    """ForbiddenError unless `role` may call the master RPC `name`."""
    if name in MEMBER_RPCS and role is not Role.MEMBER:
        raise ForbiddenError(f"{name} is an operator's call: give it the cluster secret (KVPOOL_TOKEN_FILE naming "
                             f"the secret file, e.g. DATA_DIR/secret of `kvpool up`), not the client token")
