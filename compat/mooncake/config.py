"""Mooncake's configuration, read into kvpool's: setup()'s two forms (positional and one dict), the master address,
and ReplicateConfig as kvpool's put options."""

import dataclasses
import logging

log = logging.getLogger("kvpool.compat.mooncake")

# setup()'s positional parameters, in Mooncake 0.3's order (the first seven are required there).
POSITIONAL = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
              "rdma_devices", "master_server_addr", "engine", "enable_ssd_offload", "ssd_offload_path", "tenant_id",
              "enable_client_http_server", "client_http_port")
REQUIRED = 7
# Dict keys meaning the same as a positional parameter (LMCache and older Mooncake use these names).
ALIASES = {"master_server_address": "master_server_addr", "device_name": "rdma_devices"}
# What kvpool does not need: its nodes hold the data, its own transports move it.
IGNORED = ("metadata_server", "global_segment_size", "local_buffer_size", "protocol", "rdma_devices", "engine",
           "enable_ssd_offload", "ssd_offload_path", "enable_client_http_server", "client_http_port",
           "ipc_socket_path")
_said: set[str] = set()


def say_once(what: str) -> None:
    if what not in _said:
        _said.add(what)
        log.info("kvpool: %s", what)


@dataclasses.dataclass
class Setup:
    """What kvpool takes from setup(): where its cluster is, the tenant, and the rest kept for get_hostname."""

    local_hostname: str
    master: str | None  # a master's HOST:PORT (a comma list of them) ...
    etcd: str | None  # ... or the etcd endpoint masters are found through
    tenant_id: str
    token: str | None  # kvpool's client or tenant token: from the dict's "kvpool_token", else the environment


def parse(args: tuple, kwargs: dict) -> Setup:
    """setup(*args, **kwargs) in either of Mooncake's forms; ValueError naming what is wrong."""
    if len(args) == 1 and not kwargs and isinstance(args[0], dict):
        given = {ALIASES.get(str(k), str(k)): v for k, v in args[0].items()}
        token = given.pop("kvpool_token", None)
        unknown = sorted(set(given) - set(POSITIONAL) - set(IGNORED))
        if unknown:
            say_once(f"setup keys {', '.join(unknown)} mean nothing to kvpool and are ignored")
    else:
        if len(args) > len(POSITIONAL):
            raise ValueError(f"setup takes at most {len(POSITIONAL)} arguments, got {len(args)}")
        given = dict(zip(POSITIONAL, args))
        for name, value in kwargs.items():
            if name not in POSITIONAL:
                raise TypeError(f"setup() got an unexpected keyword argument {name!r}")
            if name in given:
                raise TypeError(f"setup() got multiple values for argument {name!r}")
            given[name] = value
        missing = [name for name in POSITIONAL[:REQUIRED] if name not in given]
        if missing:
            raise TypeError(f"setup() is missing {', '.join(missing)}")
        token = None
    ignored = sorted(name for name in IGNORED if given.get(name) not in (None, "", 0, False))
    if ignored:
        say_once(f"setup's {', '.join(ignored)} are accepted and ignored: kvpool's storage nodes hold the data "
                 "(their --dram/--ssd sizes) and its own transports move it")
    master, etcd = master_address(str(given.get("master_server_addr") or ""))
    tenant = str(given.get("tenant_id") or "default").strip() or "default"
    return Setup(str(given.get("local_hostname") or ""), master, etcd, tenant, token)


def master_address(address: str) -> tuple[str | None, str | None]:
    """(masters, etcd) for Mooncake's master_server_addr: HOST:PORT[,HOST:PORT...] names kvpool masters,
    etcd://HOST:PORT[;HOST:PORT...] the etcd they are found through."""
    address = address.strip()
    if not address:
        raise ValueError("no master_server_addr: name a kvpool master (HOST:PORT) or its etcd (etcd://HOST:PORT)")
    if address.startswith("etcd://"):
        endpoints = [e.strip() for e in address[len("etcd://"):].replace(";", ",").split(",") if e.strip()]
        if not endpoints:
            raise ValueError(f"no etcd endpoint in {address!r}")
        if len(endpoints) > 1:
            say_once(f"masters are found through etcd at {endpoints[0]} (kvpool's client follows one endpoint)")
        return None, endpoints[0]
    return address.replace(";", ","), None


class ReplicateConfig:
    """Mooncake 0.3's ReplicateConfig: the same fields and defaults (an unknown one raises AttributeError, as
    there). put_options() is what kvpool honours of it."""

    __slots__ = ("replica_num", "with_hard_pin", "soft_pin_action", "soft_pin_ttl_ms", "preferred_segment",
                 "preferred_segments", "prefer_alloc_in_same_node", "preferred_nof_segments", "nof_replica_num",
                 "dfs_replica_num", "data_type", "group_ids")

    def __init__(self):
        self.replica_num = 1
        self.with_hard_pin = False
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms = None
        self.preferred_segment = ""
        self.preferred_segments = []
        self.prefer_alloc_in_same_node = False
        self.preferred_nof_segments = []
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.data_type = 0
        self.group_ids = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}: {getattr(self, name)!r}" for name in self.__slots__)
        return f"ReplicateConfig: {{ {fields} }}"

    def put_options(self) -> dict:
        """kvpool put keywords: replicas, and a hard or soft pin (soft_pin_ttl_ms its pin_ttl)."""
        options = {}
        if self.replica_num != 1:
            options["replicas"] = self.replica_num
        if self.with_hard_pin:
            options["pin"] = "hard"
        elif self.soft_pin_action == SoftPinAction.ENABLE:
            options["pin"] = "soft"
            if self.soft_pin_ttl_ms:
                options["pin_ttl"] = self.soft_pin_ttl_ms / 1000
        if self.preferred_segment or self.preferred_segments or self.prefer_alloc_in_same_node:
            say_once("ReplicateConfig's preferred segments are ignored: kvpool's leader places every copy")
        return options


class SoftPinAction:
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


DEFAULT = ReplicateConfig()
