"""What a tenant is to every component, with no I/O: its name, its key space, its record in etcd, and
the share of its limits a node enforces.

A tenant's objects are stored under its *scope*: the key an engine names, `k`, is stored as
`SCOPE_MARK + name + SCOPE_MARK + k`. The client adds and strips the scope; masters and nodes only
check that every key a tenant's call names lies in its scope (`Scope.holds`), so two tenants' equal key
names are two objects and no key of another tenant can even be named. The client token (no tenant) has
the keys that do not begin with SCOPE_MARK; members (the cluster secret) have every key.

Records live in etcd under cluster_layout.tenants_prefix: a few per cluster, nothing per object. A
record's `version` is part of the tenant's token: rotating the token bumps it, so the old token stops.
"""

import json
import re
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

SCOPE_MARK = "\x01"  # begins a tenant's scope: a byte no engine's key begins with
SCOPE_MARK_BYTE = SCOPE_MARK.encode()
MAX_NAME = 63
MAX_TENANTS = 256  # records a cluster may hold: bounds the servers' tables and the metrics' label values
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,%d}\Z" % (MAX_NAME - 1))
LIMITS = ("quota", "quota_dram", "quota_ssd", "quota_objects", "reserve")  # a record's limits, by name


def name_problem(name: str) -> str | None:
    """Why `name` may not name a tenant, or None."""
    if not isinstance(name, str) or not _NAME.match(name):
        return (f"tenant name {name!r}: 1 to {MAX_NAME} characters of a-z, 0-9, '_', '-', "
                "beginning with a letter or digit")
    return None


class Scope(NamedTuple):
    """The keys a caller may name: a tenant's (its prefix), or the client token's (tenant "")."""

    tenant: str
    prefix: str  # SCOPE_MARK name SCOPE_MARK, or "" for the client token
    prefix_bytes: bytes

    def key(self, key: str) -> str:
        """The stored key of a key the caller names."""
        return self.prefix + key

    def holds(self, stored: str) -> bool:
        """Whether the stored key `stored` is in this scope."""
        return stored.startswith(self.prefix) if self.prefix else not stored.startswith(SCOPE_MARK)

    def holds_bytes(self, stored: bytes) -> bool:
        prefix = self.prefix_bytes
        return stored.startswith(prefix) if prefix else not stored.startswith(SCOPE_MARK_BYTE)

    def holds_all(self, stored) -> bool:
        """Whether every stored key of `stored` (strs) is in this scope (the client token's: in two passes in
        C, as lookups of many keys are every engine's hot path)."""
        prefix = self.prefix
        if prefix:
            return all(k.startswith(prefix) for k in stored)
        joined = "\x00".join(stored)
        return not joined.startswith(SCOPE_MARK) and "\x00" + SCOPE_MARK not in joined


def scope_of(tenant: str) -> Scope:
    prefix = f"{SCOPE_MARK}{tenant}{SCOPE_MARK}" if tenant else ""
    return Scope(tenant, prefix, prefix.encode())


CLIENT_SCOPE = scope_of("")  # the client token's


def tenant_of(stored: bytes) -> str:
    """The tenant whose scope holds the stored key `stored` ("" for the client token's keys)."""
    if not stored.startswith(SCOPE_MARK_BYTE):
        return ""
    end = stored.find(SCOPE_MARK_BYTE, 1)
    return stored[1:end].decode() if end > 1 else ""


@dataclass
class TenantRecord:
    """A tenant as etcd holds it. Sizes in bytes; 0 means no limit (no reserve)."""

    name: str
    version: int = 1  # part of its token: a rotation bumps it
    quota: int = 0  # bytes it may hold in the pool, every tier together
    quota_dram: int = 0
    quota_ssd: int = 0
    quota_objects: int = 0
    reserve: int = 0  # bytes other tenants' puts never evict while it holds less
    created: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "TenantRecord":
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in known})
        problem = name_problem(record.name) or record_problem(record)
        if problem:
            raise ValueError(problem)
        return record

    def limits(self) -> dict:
        return {name: getattr(self, name) for name in LIMITS}


def record_problem(record: TenantRecord) -> str | None:
    """Why a record's limits cannot be kept, or None."""
    for name, value in record.limits().items():
        if not isinstance(value, int) or value < 0:
            return f"tenant {record.name}: {name} must be a whole number of bytes >= 0, not {value!r}"
    if not isinstance(record.version, int) or record.version < 1:
        return f"tenant {record.name}: version must be >= 1"
    if record.quota and record.reserve > record.quota:
        return f"tenant {record.name}: its reserve ({record.reserve}) exceeds its quota ({record.quota})"
    return None


class NodeShare(NamedTuple):
    """The part of a tenant's limits one node keeps (0: none): its limits times the node's part of the
    pool's capacity, so the shares of every node add up to the tenant's limits."""

    quota: int
    quota_dram: int
    quota_ssd: int
    quota_objects: int
    reserve: int


def node_share(record: TenantRecord, node_capacity: tuple[int, int], pool_capacity: tuple[int, int]) -> NodeShare:
    """`record`'s limits for a node holding (DRAM, SSD) bytes `node_capacity` of the pool's
    `pool_capacity`: each tier's quota split by that tier's capacity, the rest by the total.
    A limit that is set never rounds down to none: at least one byte (one object)."""

    def share(limit: int, node: int, pool: int) -> int:
        if not limit:
            return 0
        return max(1, int(limit * node / pool)) if pool > 0 else limit

    node_total, pool_total = sum(node_capacity), sum(pool_capacity)
    return NodeShare(share(record.quota, node_total, pool_total),
                     share(record.quota_dram, node_capacity[0], pool_capacity[0]),
                     share(record.quota_ssd, node_capacity[1], pool_capacity[1]),
                     share(record.quota_objects, node_total, pool_total),
                     share(record.reserve, node_total, pool_total))
