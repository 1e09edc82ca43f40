"""A cold restart over the shared tier: how fast a whole new cluster adopts what the directory holds.

Real mode (default): a cluster whose nodes have a small DRAM and no SSD writes `--objects` objects through it,
so all but what DRAM keeps move to the shared directory; every node and master is killed, a new cluster (new
etcd, master and nodes, only the directory the same) starts over it, and the time until its leader lists every
shared object is measured, then every one is read back and compared.

Synthetic mode (`--records N`): a manifest of N objects is written straight into an empty directory (no object
files: adoption never opens one) and a new cluster adopts it: the cost of adoption per million entries.

Prints one JSON line: objects adopted; seconds to start etcd and a master, then the first node, and from then
until the leader listed every shared object; objects adopted per second from that node's start (its start
included); and (real mode) the reads that came back byte-exact.

    python benchmarks/shared_restart.py --objects 3000
    python benchmarks/shared_restart.py --records 1000000
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from kvpool import Client
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.protocol.units import parse_size
from kvpool.sharedfs.layout import ADDED, MANIFEST_SUFFIX, MANIFESTS_DIR, SharedObject, pack_record

NODE_ARGS = ["--high-watermark", "0.7", "--low-watermark", "0.4"]  # room for a batch of puts between sweeps


def value_of(key: str, size: int) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (size // len(seed) + 1))[:size]


def shared_objects(cluster: LocalCluster) -> int:
    stats = cluster.master_stats()
    return stats.shared.objects if stats.HasField("shared") else 0


def write_through(shared_dir: Path, data_dir: Path, count: int, size: int) -> list[str]:
    """Put `count` objects through a cluster that moves them to `shared_dir`; every process killed at the end."""
    cluster = LocalCluster(nodes=2, dram_per_node="8MiB", data_dir=data_dir, shared_dir=shared_dir,
                           node_args=NODE_ARGS).start()
    keys = [f"restart/{i:08d}" for i in range(count)]
    try:
        with Client(cluster.master_address) as client:
            for start in range(0, count, 64):
                batch = keys[start:start + 64]
                client.batch_put(batch, [value_of(k, size) for k in batch])
                wait_until(lambda: all(t.used <= 0.7 * t.capacity for n in cluster.master_stats().nodes
                                       for t in n.tiers), 30, what="the nodes' DRAM back under its high watermark")
        for child in (*cluster.nodes, *cluster.masters):
            child.kill()
    finally:
        cluster.stop()
    return keys


def write_manifest(shared_dir: Path, records: int) -> None:
    """A manifest of `records` objects, as one writer would have appended it (no object files)."""
    directory = shared_dir / "default" / MANIFESTS_DIR
    directory.mkdir(parents=True)
    generation = time.time_ns()
    with open(directory / f"synthetic-0{MANIFEST_SUFFIX}", "wb") as out:
        chunk = []
        for i in range(records):
            key = f"synthetic/{i:010d}".encode()
            chunk.append(pack_record(ADDED, SharedObject(key, generation + i, 32768, i, 0, 32768, 0)))
            if len(chunk) == 65536:
                out.write(b"".join(chunk))
                chunk = []
        out.write(b"".join(chunk))


def adopt(shared_dir: Path, data_dir: Path, expected: int, timeout: float) -> tuple[LocalCluster, dict]:
    """A new cluster: etcd and a master first, then the nodes; the tier is adopted once the first node that
    mounts it registers (the leader reads the manifests through it)."""
    started = time.monotonic()
    cluster = LocalCluster(nodes=0, dram_per_node="64MiB", data_dir=data_dir, shared_dir=shared_dir,
                           node_args=NODE_ARGS).start()
    master_up = time.monotonic()
    cluster.add_node("127.0.0.1")
    node_up = time.monotonic()
    wait_until(lambda: shared_objects(cluster) >= expected, timeout, interval=0.01,
               what=f"the new leader to adopt {expected} shared objects")
    adopted = time.monotonic()
    cluster.add_node("127.0.0.1")
    return cluster, {"objects_adopted": shared_objects(cluster),
                     "etcd_and_master_start_s": round(master_up - started, 3),
                     "node_start_s": round(node_up - master_up, 3),
                     "adopted_after_node_ready_s": round(adopted - node_up, 3),
                     "restart_to_adopted_s": round(adopted - started, 3),
                     "adopted_per_s_from_node_start": round(expected / max(adopted - master_up, 1e-6))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=3000, help="objects written through a first cluster")
    parser.add_argument("--size", type=parse_size, default="16KiB", help="bytes of each (real mode)")
    parser.add_argument("--records", type=int, default=0, help="synthetic mode: a manifest of this many objects")
    parser.add_argument("--dir", type=Path, default=None, help="where the shared directory goes (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpool-restart-", dir=args.dir) as work:
        work = Path(work)
        shared_dir = work / "shared"
        shared_dir.mkdir()
        report = {"mode": "synthetic" if args.records else "real"}
        if args.records:
            write_manifest(shared_dir, args.records)
            expected = args.records
        else:
            keys = write_through(shared_dir, work / "first", args.objects, args.size)
            expected = sum(len(names) for _, _, names in os.walk(shared_dir / "default" / "objects"))
            report.update(objects_written=len(keys), object_bytes=args.size)
        cluster, figures = adopt(shared_dir, work / "second", expected, timeout=600)
        report.update(figures)
        try:
            if not args.records:
                exact = missing = wrong = 0
                with Client(cluster.master_address) as client:
                    for key in keys:
                        try:
                            value = client.get(key)
                        except KeyError:
                            missing += 1  # it was in a killed node's DRAM
                            continue
                        if value == value_of(key, args.size):
                            exact += 1
                        else:
                            wrong += 1
                report.update(read_back_exact=exact, lost_with_the_nodes=missing, wrong=wrong)
        finally:
            cluster.stop()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
