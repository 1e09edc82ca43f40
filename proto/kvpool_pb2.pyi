from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[Status]
    NOT_FOUND: _ClassVar[Status]
    EXISTS: _ClassVar[Status]
    NO_SPACE: _ClassVar[Status]
    TOO_LARGE: _ClassVar[Status]
    INVALID_KEY: _ClassVar[Status]
    INVALID_ARGUMENT: _ClassVar[Status]
    UNAVAILABLE: _ClassVar[Status]
    STALE: _ClassVar[Status]
    CHECKSUM_MISMATCH: _ClassVar[Status]
    PUT_EXPIRED: _ClassVar[Status]
    INTERNAL: _ClassVar[Status]
    NOT_LEADER: _ClassVar[Status]
    QUOTA_EXCEEDED: _ClassVar[Status]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    DRAM: _ClassVar[Tier]
    SSD: _ClassVar[Tier]
    SHARED: _ClassVar[Tier]

class Pin(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIN_NONE: _ClassVar[Pin]
    PIN_SOFT: _ClassVar[Pin]
    PIN_HARD: _ClassVar[Pin]

class KeyChangeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_CHANGE_UNSPECIFIED: _ClassVar[KeyChangeKind]
    KEY_STORED: _ClassVar[KeyChangeKind]
    KEY_REMOVED: _ClassVar[KeyChangeKind]
OK: Status
NOT_FOUND: Status
EXISTS: Status
NO_SPACE: Status
TOO_LARGE: Status
INVALID_KEY: Status
INVALID_ARGUMENT: Status
UNAVAILABLE: Status
STALE: Status
CHECKSUM_MISMATCH: Status
PUT_EXPIRED: Status
INTERNAL: Status
NOT_LEADER: Status
QUOTA_EXCEEDED: Status
TIER_UNSPECIFIED: Tier
DRAM: Tier
SSD: Tier
SHARED: Tier
PIN_NONE: Pin
PIN_SOFT: Pin
PIN_HARD: Pin
KEY_CHANGE_UNSPECIFIED: KeyChangeKind
KEY_STORED: KeyChangeKind
KEY_REMOVED: KeyChangeKind

class Replica(_message.Message):
    __slots__ = ("node_id", "address", "tier", "offset", "length", "seal")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    tier: Tier
    offset: int
    length: int
    seal: bytes
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., seal: _Optional[bytes] = ...) -> None: ...

class PutOptions(_message.Message):
    __slots__ = ("tier", "pin", "pin_ttl_seconds", "ttl_seconds")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    pin: Pin
    pin_ttl_seconds: float
    ttl_seconds: float
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., pin: _Optional[_Union[Pin, str]] = ..., pin_ttl_seconds: _Optional[float] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class ObjectInfo(_message.Message):
    __slots__ = ("key", "size", "checksum", "generation", "replicas", "compressed", "raw_size", "options", "target_replicas", "term")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    checksum: int
    generation: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    compressed: bool
    raw_size: int
    options: PutOptions
    target_replicas: int
    term: int
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., generation: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., compressed: _Optional[bool] = ..., raw_size: _Optional[int] = ..., options: _Optional[_Union[PutOptions, _Mapping]] = ..., target_replicas: _Optional[int] = ..., term: _Optional[int] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("key", "size", "checksum", "overwrite", "replicas", "options", "compressed", "raw_size", "min_replicas")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    checksum: int
    overwrite: bool
    replicas: int
    options: PutOptions
    compressed: bool
    raw_size: int
    min_replicas: int
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., overwrite: _Optional[bool] = ..., replicas: _Optional[int] = ..., options: _Optional[_Union[PutOptions, _Mapping]] = ..., compressed: _Optional[bool] = ..., raw_size: _Optional[int] = ..., min_replicas: _Optional[int] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("status", "message", "object")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    object: ObjectInfo
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., object: _Optional[_Union[ObjectInfo, _Mapping]] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("key", "generation", "failed_nodes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODES_FIELD_NUMBER: _ClassVar[int]
    key: str
    generation: int
    failed_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., generation: _Optional[int] = ..., failed_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class PutRevokeRequest(_message.Message):
    __slots__ = ("key", "generation")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    key: str
    generation: int
    def __init__(self, key: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("status", "message")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ...) -> None: ...

class BatchPutStartRequest(_message.Message):
    __slots__ = ("common", "keys", "sizes", "checksums", "compressed", "raw_sizes")
    COMMON_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZES_FIELD_NUMBER: _ClassVar[int]
    common: PutStartRequest
    keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    compressed: _containers.RepeatedScalarFieldContainer[bool]
    raw_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, common: _Optional[_Union[PutStartRequest, _Mapping]] = ..., keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., compressed: _Optional[_Iterable[bool]] = ..., raw_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchPutStartResponse(_message.Message):
    __slots__ = ("generations", "placement", "placements", "refused", "errors", "seals")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    SEALS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    placement: _containers.RepeatedScalarFieldContainer[int]
    placements: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    refused: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.RepeatedCompositeFieldContainer[StatusResponse]
    seals: bytes
    def __init__(self, generations: _Optional[_Iterable[int]] = ..., placement: _Optional[_Iterable[int]] = ..., placements: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ..., refused: _Optional[_Iterable[int]] = ..., errors: _Optional[_Iterable[_Union[StatusResponse, _Mapping]]] = ..., seals: _Optional[bytes] = ...) -> None: ...

class BatchPutEndRequest(_message.Message):
    __slots__ = ("items", "keys", "generations")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutEndRequest]
    keys: _containers.RepeatedScalarFieldContainer[str]
    generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, items: _Optional[_Iterable[_Union[PutEndRequest, _Mapping]]] = ..., keys: _Optional[_Iterable[str]] = ..., generations: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchPutRevokeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutRevokeRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutRevokeRequest, _Mapping]]] = ...) -> None: ...

class BatchStatusResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StatusResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[StatusResponse, _Mapping]]] = ...) -> None: ...

class GetReplicaListRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetReplicaListResponse(_message.Message):
    __slots__ = ("status", "message", "object")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    object: ObjectInfo
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., object: _Optional[_Union[ObjectInfo, _Mapping]] = ...) -> None: ...

class BatchGetReplicaListRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchGetReplicaListResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GetReplicaListResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[GetReplicaListResponse, _Mapping]]] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("key", "hold_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    hold_seconds: float
    def __init__(self, key: _Optional[str] = ..., hold_seconds: _Optional[float] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("status", "message", "exists")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    exists: bool
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., exists: _Optional[bool] = ...) -> None: ...

class BatchExistsRequest(_message.Message):
    __slots__ = ("keys", "hold_seconds")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    hold_seconds: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., hold_seconds: _Optional[float] = ...) -> None: ...

class BatchExistsResponse(_message.Message):
    __slots__ = ("status", "message", "exists")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class RemoveByPrefixRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("status", "message", "removed")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    removed: int
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., removed: _Optional[int] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("prefix", "limit", "cursor")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    limit: int
    cursor: str
    def __init__(self, prefix: _Optional[str] = ..., limit: _Optional[int] = ..., cursor: _Optional[str] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("status", "message", "keys", "next_cursor")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    next_cursor: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., next_cursor: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity", "used", "objects", "hits", "misses", "demotions", "promotions", "evictions", "evicted_bytes", "watermark", "pinned_bytes", "fault")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity: int
    used: int
    objects: int
    hits: int
    misses: int
    demotions: int
    promotions: int
    evictions: int
    evicted_bytes: int
    watermark: str
    pinned_bytes: int
    fault: str
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., objects: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., evictions: _Optional[int] = ..., evicted_bytes: _Optional[int] = ..., watermark: _Optional[str] = ..., pinned_bytes: _Optional[int] = ..., fault: _Optional[str] = ...) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("node_id", "address", "tiers", "objects", "transports", "zone", "draining", "reports", "shared_fault", "version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FAULT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    objects: int
    transports: _containers.RepeatedScalarFieldContainer[str]
    zone: str
    draining: bool
    reports: int
    shared_fault: str
    version: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., objects: _Optional[int] = ..., transports: _Optional[_Iterable[str]] = ..., zone: _Optional[str] = ..., draining: _Optional[bool] = ..., reports: _Optional[int] = ..., shared_fault: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("master_id", "address", "nodes", "objects", "bytes", "pending_puts", "hits", "misses", "puts", "removes", "reclaimed_puts", "leader", "followers", "term", "under_replicated", "repairs_done", "repair_bytes", "control_address", "tenants", "shared", "version", "wire_protocol")
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    REMOVES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_PUTS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    UNDER_REPLICATED_FIELD_NUMBER: _ClassVar[int]
    REPAIRS_DONE_FIELD_NUMBER: _ClassVar[int]
    REPAIR_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WIRE_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    master_id: str
    address: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStats]
    objects: int
    bytes: int
    pending_puts: int
    hits: int
    misses: int
    puts: int
    removes: int
    reclaimed_puts: int
    leader: str
    followers: _containers.RepeatedScalarFieldContainer[str]
    term: int
    under_replicated: int
    repairs_done: int
    repair_bytes: int
    control_address: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    shared: SharedTierStats
    version: str
    wire_protocol: int
    def __init__(self, master_id: _Optional[str] = ..., address: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeStats, _Mapping]]] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., pending_puts: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., removes: _Optional[int] = ..., reclaimed_puts: _Optional[int] = ..., leader: _Optional[str] = ..., followers: _Optional[_Iterable[str]] = ..., term: _Optional[int] = ..., under_replicated: _Optional[int] = ..., repairs_done: _Optional[int] = ..., repair_bytes: _Optional[int] = ..., control_address: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., shared: _Optional[_Union[SharedTierStats, _Mapping]] = ..., version: _Optional[str] = ..., wire_protocol: _Optional[int] = ...) -> None: ...

class SharedTierStats(_message.Message):
    __slots__ = ("capacity", "used", "objects", "servers")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    used: int
    objects: int
    servers: int
    def __init__(self, capacity: _Optional[int] = ..., used: _Optional[int] = ..., objects: _Optional[int] = ..., servers: _Optional[int] = ...) -> None: ...

class TenantLimits(_message.Message):
    __slots__ = ("quota", "quota_dram", "quota_ssd", "quota_objects", "reserve")
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    QUOTA_DRAM_FIELD_NUMBER: _ClassVar[int]
    QUOTA_SSD_FIELD_NUMBER: _ClassVar[int]
    QUOTA_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    quota: int
    quota_dram: int
    quota_ssd: int
    quota_objects: int
    reserve: int
    def __init__(self, quota: _Optional[int] = ..., quota_dram: _Optional[int] = ..., quota_ssd: _Optional[int] = ..., quota_objects: _Optional[int] = ..., reserve: _Optional[int] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("name", "version", "limits", "objects", "dram_bytes", "ssd_bytes", "hits", "misses", "evicted_quota", "evicted_pressure", "refused")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_QUOTA_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    limits: TenantLimits
    objects: int
    dram_bytes: int
    ssd_bytes: int
    hits: int
    misses: int
    evicted_quota: int
    evicted_pressure: int
    refused: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., limits: _Optional[_Union[TenantLimits, _Mapping]] = ..., objects: _Optional[int] = ..., dram_bytes: _Optional[int] = ..., ssd_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evicted_quota: _Optional[int] = ..., evicted_pressure: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class TenantsRequest(_message.Message):
    __slots__ = ("action", "name", "limits", "given")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    GIVEN_FIELD_NUMBER: _ClassVar[int]
    action: str
    name: str
    limits: TenantLimits
    given: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, action: _Optional[str] = ..., name: _Optional[str] = ..., limits: _Optional[_Union[TenantLimits, _Mapping]] = ..., given: _Optional[_Iterable[str]] = ...) -> None: ...

class TenantsResponse(_message.Message):
    __slots__ = ("status", "message", "tenants")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("status", "message", "objects")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    objects: int
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., objects: _Optional[int] = ...) -> None: ...

class WatchKeysRequest(_message.Message):
    __slots__ = ("prefix", "feed_id", "after_sequence")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    feed_id: str
    after_sequence: int
    def __init__(self, prefix: _Optional[str] = ..., feed_id: _Optional[str] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class KeyChange(_message.Message):
    __slots__ = ("kind", "key")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    kind: KeyChangeKind
    key: str
    def __init__(self, kind: _Optional[_Union[KeyChangeKind, str]] = ..., key: _Optional[str] = ...) -> None: ...

class KeyEvents(_message.Message):
    __slots__ = ("feed_id", "sequence", "snapshot", "snapshot_done", "present", "changes")
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    feed_id: str
    sequence: int
    snapshot: bool
    snapshot_done: bool
    present: _containers.RepeatedScalarFieldContainer[str]
    changes: _containers.RepeatedCompositeFieldContainer[KeyChange]
    def __init__(self, feed_id: _Optional[str] = ..., sequence: _Optional[int] = ..., snapshot: _Optional[bool] = ..., snapshot_done: _Optional[bool] = ..., present: _Optional[_Iterable[str]] = ..., changes: _Optional[_Iterable[_Union[KeyChange, _Mapping]]] = ...) -> None: ...
