"""The S3 gateway under a cluster's shared tier stopped while the cluster works: puts and gets of what the nodes
hold go on, every call ends by its deadline, what only the bucket holds fails (never wrong bytes), and once the
gateway is back the bucket's objects are served again."""

import hashlib
import time

from kvpool import Client
from kvpool.errors import KvpoolError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until

SIZE = 256 * 1024
DEADLINE = 5.0  # the client's call timeout (its default)


def value_of(key: str) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (SIZE // len(seed) + 1))[:SIZE]


def shared_objects(cluster) -> int:
    stats = cluster.master_stats()
    return stats.shared.objects if stats.HasField("shared") else 0


def timed(call):
    started = time.monotonic()
    try:
        return call(), time.monotonic() - started
    except KvpoolError as exc:
        return exc, time.monotonic() - started


def test_a_stopped_gateway_leaves_node_held_objects_served_and_calls_bounded(tmp_path):
    cluster = LocalCluster(nodes=2, dram_per_node="8MiB", data_dir=tmp_path / "cluster", lease_ttl=2, put_timeout=3,
                           object_store="local", node_args=["--high-watermark", "0.8", "--low-watermark", "0.6"])
    with cluster, Client(cluster.master_address, timeout=DEADLINE) as client:
        keys = [f"k{i:04d}" for i in range(96)]  # 24 MiB through 16 MiB of DRAM: the oldest move to the bucket
        for start in range(0, len(keys), 8):
            client.batch_put(keys[start:start + 8], [value_of(k) for k in keys[start:start + 8]])
            wait_until(lambda: all(t.used <= 0.8 * t.capacity for n in cluster.master_stats().nodes
                                   for t in n.tiers), 20, what="the nodes' DRAM back under its watermark")
        wait_until(lambda: shared_objects(cluster) >= 16, 30, what="objects moved to the bucket")
        in_bucket = set()

        cluster.s3_server.stop()
        newest = keys[-4:]  # put last: in a node's DRAM
        wrong, slowest = [], 0.0
        for round_ in range(3):
            fresh = [f"during-{round_}-{i}" for i in range(4)]
            result, took = timed(lambda: client.batch_put(fresh, [value_of(k) for k in fresh]))
            slowest = max(slowest, took)
            assert not isinstance(result, KvpoolError), result
            for key in newest + fresh:
                value, took = timed(lambda: client.get(key))
                slowest = max(slowest, took)
                assert value == value_of(key), key
            for key in keys[:16]:  # the oldest: in the bucket only (or evicted): an error, never wrong bytes
                value, took = timed(lambda: client.get(key))
                slowest = max(slowest, took)
                if isinstance(value, KvpoolError):
                    in_bucket.add(key)
                elif value != value_of(key):
                    wrong.append(key)
        assert not wrong and slowest < DEADLINE + 1.5, (wrong, slowest)
        assert in_bucket, "no read reached the stopped gateway"

        cluster.s3_server.start()  # the same directory and key: what it kept
        wait_until(lambda: all(not isinstance(timed(lambda: client.get(k))[0], KvpoolError) for k in
                               sorted(in_bucket)[:4]), 30, what="the bucket's objects served again")
        for key in sorted(in_bucket):
            value, _ = timed(lambda: client.get(key))
            assert isinstance(value, KvpoolError) or value == value_of(key), key
