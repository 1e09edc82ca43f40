"""The shared tier in a bucket, against the S3 client library it runs on used directly, in the same run.

A cluster of one node over a local S3 server (SeaweedFS's gateway, `--object-store local`). Per object size
(32 KiB, 1 MiB, 32 MiB), rounds alternate two sides on the same gateway:
  obstore    PUT then GET of each object straight to the bucket (one at a time, as kvpool's reader does)
  kvpool     put(tier="object") of each object until the leader lists every one in the tier (the node writes
             them on, 16 at a time); then each read once through the node (the bucket read, checked, sent on) and
             once directly by a client given object_store= (checked against the placement)
Reported: MB/s per side and operation (medians), and kvpool's over obstore's per round (median). One JSON line.

    python benchmarks/object_tier.py --rounds 2
    python benchmarks/object_tier.py --rounds 2 --encryption     # kvpool's side over an encrypted tier
"""

import argparse
import json
import os
import statistics
import tempfile
import time

from kvpool import Client
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.objectstore.bucket import Bucket
from kvpool.objectstore.settings import settings_for

SIZES = {"32KiB": (32 << 10, 256), "1MiB": (1 << 20, 64), "32MiB": (32 << 20, 4)}


def mb_s(count: int, size: int, seconds: float) -> float:
    return round(count * size / seconds / 1e6, 1)


def direct_round(bucket: Bucket, tag: str, size: int, count: int) -> dict:
    value = os.urandom(size)
    names = [f"bench/{tag}/{i}" for i in range(count)]
    started = time.perf_counter()
    for name in names:
        bucket.put(name, value)
    put = mb_s(count, size, time.perf_counter() - started)
    started = time.perf_counter()
    for name in names:
        assert len(bucket.get(name)) == size
    get = mb_s(count, size, time.perf_counter() - started)
    for name in names:
        bucket.delete(name)
    return {"put": put, "get": get}


def kvpool_round(cluster, tag: str, size: int, count: int) -> dict:
    value = os.urandom(size)
    keys = [f"bench/{tag}/{i}" for i in range(count)]
    with Client(cluster.master_address) as client, \
            Client(cluster.master_address, object_store=cluster.object_store) as direct:
        before = cluster.master_stats().shared.objects
        started = time.perf_counter()
        for key in keys:
            client.put(key, value, tier="object")
        wait_until(lambda: cluster.master_stats().shared.objects >= before + count, 120, interval=0.01,
                   what="the puts to reach the bucket")
        put = mb_s(count, size, time.perf_counter() - started)
        started = time.perf_counter()
        for key in keys:
            assert client.get(key) == value
        through_node = mb_s(count, size, time.perf_counter() - started)
        started = time.perf_counter()
        for key in keys:
            assert direct.get(key) == value
        read_direct = mb_s(count, size, time.perf_counter() - started)
        assert direct.bytes_by_transport().get("shared", 0) == count * size
        for key in keys:
            client.remove(key)
        wait_until(lambda: cluster.master_stats().shared.objects <= before, 60, interval=0.05,
                   what="the removed objects to leave the tier")
    return {"put": put, "get_through_node": through_node, "get_direct": read_direct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="objects per size, as a part of the default")
    parser.add_argument("--encryption", action="store_true",
                        help="the tier encrypted (?encryption=aes-gcm): what sealing every object costs")
    args = parser.parse_args()
    rounds = {name: {"obstore": [], "kvpool": []} for name in SIZES}
    with tempfile.TemporaryDirectory() as scratch, \
            LocalCluster(nodes=1, dram_per_node="256MiB", data_dir=os.path.join(scratch, "cluster"),
                         object_store="local?encryption=aes-gcm" if args.encryption else "local",
                         shared_capacity="8GiB") as cluster:
        bucket = Bucket(settings_for(f"s3://{cluster.s3_server.bucket}/direct/"))
        for r in range(args.rounds):
            for name, (size, count) in SIZES.items():
                count = max(1, round(count * args.scale))
                rounds[name]["obstore"].append(direct_round(bucket, f"{r}-{name}", size, count))
                rounds[name]["kvpool"].append(kvpool_round(cluster, f"{r}-{name}", size, count))
    report = {"bench": "object_tier", "rounds": args.rounds, "units": "MB/s", "encryption": args.encryption,
              "sizes": {}}
    for name, sides in rounds.items():
        medians = {side: {op: statistics.median(r[op] for r in results) for op in results[0]}
                   for side, results in sides.items()}
        ratios = {f"{op}_vs_obstore_{base}": round(statistics.median(k[op] / o[base] for k, o in
                                                                     zip(sides["kvpool"], sides["obstore"])), 3)
                  for op, base in (("put", "put"), ("get_through_node", "get"), ("get_direct", "get"))}
        report["sizes"][name] = {"median": medians, "ratio_median": ratios}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
