"""Where a cluster keeps its records in etcd, and what they hold.

Every key lives under /kvpool/<cluster>/ so clusters can share one etcd.
  nodes/<node_id>  JSON NodeRecord, attached to the node's lease (gone when the node is)
  master           JSON {"address": "HOST:PORT", "master_id": ..., "control_address": "HOST:PORT"},
                   attached to the leading master's lease
                   (created only if absent: it is the election key; its create revision is the term)
  masters/<id>     same JSON, one per running master (leader and followers), under its lease
  tenants/<name>   JSON TenantRecord (kvpool/protocol/tenants.py): a tenant's token version and limits
"""

import json
from dataclasses import asdict, dataclass, field, fields

DEFAULT_CLUSTER = "default"


def prefix(cluster: str) -> bytes:
    return f"/kvpool/{cluster}/".encode()


def nodes_prefix(cluster: str) -> bytes:
    return prefix(cluster) + b"nodes/"


def node_key(cluster: str, node_id: str) -> bytes:
    return nodes_prefix(cluster) + node_id.encode()


def master_key(cluster: str) -> bytes:
    return prefix(cluster) + b"master"


def masters_prefix(cluster: str) -> bytes:
    """Every running master (leader or follower) registers here under its lease."""
    return prefix(cluster) + b"masters/"


def tenants_prefix(cluster: str) -> bytes:
    return prefix(cluster) + b"tenants/"


def tenant_key(cluster: str, name: str) -> bytes:
    return tenants_prefix(cluster) + name.encode()


SHARED_TIER = "shared"  # a node's tier that is the cluster's shared directory (its --shared-dir), not its own


@dataclass
class TierRecord:
    capacity: int
    path: str = ""  # backing file, so a same-host client could map it later


@dataclass
class NodeRecord:
    node_id: str
    instance: str  # new on every start: a restarted node's old replicas are gone
    host: str
    data_port: int
    transports: list = field(default_factory=lambda: ["tcp"])  # names, best first (kvpool/protocol/transports.py)
    transport_info: dict = field(default_factory=dict)  # name -> what a client needs to use it (as in HELLO)
    tiers: dict = field(default_factory=dict)  # "dram" -> TierRecord
    metrics_port: int = 0
    pid: int = 0
    zone: str = ""  # failure domain (rack, host, AZ); replicas of an object go to distinct zones first

    @property
    def address(self) -> str:
        return f"{self.host}:{self.data_port}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "NodeRecord":
        """The record a node registered. Fields this release does not know are left out, not refused: a node of
        a newer release may add some, and a master of this one must still take its record (docs/upgrades.md)."""
        data = _known(cls, json.loads(raw))
        data["tiers"] = {name: TierRecord(**_known(TierRecord, tier)) for name, tier in data.get("tiers", {}).items()}
        return cls(**data)


def _known(record_class, data: dict) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"a {record_class.__name__} is a JSON object, not {type(data).__name__}")
    names = {f.name for f in fields(record_class)}
    return {name: value for name, value in data.items() if name in names}


def parse_hostport(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """('host', port) from 'host:port' or ':port'; ValueError on anything else."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return (host.strip("[]") or default_host), int(port)
