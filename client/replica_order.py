"""The replica list of a placement as the client keeps it: the copies written, nearest first."""

import socket

from kvpool.proto import kvpool_pb2 as pb

_LOCAL_HOSTS = frozenset({"127.0.0.1", "::1", "localhost", socket.gethostname()})


def set_replicas(info, replicas: list) -> None:
    clones = []
    for replica in replicas:
        clone = pb.Replica()
        clone.CopyFrom(replica)
        clones.append(clone)
    del info.replicas[:]
    info.replicas.extend(clones)


def drop_replicas(info, failed) -> None:
    """Forget the copies that were never written, so reads do not try them."""
    if failed:
        set_replicas(info, [r for r in info.replicas if r.node_id not in failed])


def nearest_first(info) -> None:
    """Order replicas for reading: nodes on this host first (cheapest to reach), the rest as
    the master listed them. Reads fail over down this list."""
    if len(info.replicas) < 2:
        return
    replicas = list(info.replicas)
    # The shared tier's copy last: a node's DRAM or SSD answers sooner than a file on a shared mount.
    ordered = sorted(replicas, key=lambda r: (r.tier == pb.SHARED,
                                              r.address.rpartition(":")[0].strip("[]") not in _LOCAL_HOSTS))
    if ordered != replicas:
        set_replicas(info, ordered)
