"""A master holding many objects: put rate, leader memory and etcd size per object, and failover time.

Starts etcd, two masters and storage nodes as processes, writes `--objects`
values of `--value-bytes` through batched puts (several batches in flight),
then kill -9s the leader and measures how long until a new put succeeds and
until every key written exists again, and how many were lost. Values carry
their key's index, so a sample is checked byte for byte after the failover.
Prints one JSON line.

    python benchmarks/scale.py                       # 1,000,000 objects of 1 KiB
    python benchmarks/scale.py --objects 100000
"""

import argparse
import asyncio
import json
import signal
import sys
import time
import urllib.request

from kvpool import AsyncClient
from kvpool.launch.local_cluster import LocalCluster
from kvpool.protocol.units import format_size, parse_size


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def etcd_status(endpoint: str) -> dict:
    request = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        status = json.load(answer)
    return {"db_bytes": int(status.get("dbSize", 0)), "revision": int(status["header"]["revision"])}


def key_of(i: int) -> str:
    return f"scale/{i:08d}"


def value_of(i: int, size: int) -> bytes:
    stamp = i.to_bytes(8, "little")
    return (stamp * (size // 8 + 1))[:size]


async def put_all(client: AsyncClient, count: int, size: int, batch: int, in_flight: int) -> float:
    """Writes every object; returns the seconds it took."""
    starts = iter(range(0, count, batch))

    async def worker():
        for start in starts:
            stop = min(start + batch, count)
            await client.batch_put([key_of(i) for i in range(start, stop)],
                                   [value_of(i, size) for i in range(start, stop)])

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return time.perf_counter() - began


async def missing_keys(client: AsyncClient, count: int, chunk: int = 5000) -> int:
    missing = 0
    for start in range(0, count, chunk):
        found = await client.batch_exists([key_of(i) for i in range(start, min(start + chunk, count))])
        missing += found.count(False)
    return missing


async def failover(cluster: LocalCluster, args, leader) -> dict:
    """Kill -9 the leader; time the first successful put and the return of every key."""
    leader.signal(signal.SIGKILL)
    killed = time.perf_counter()
    deadline = killed + args.deadline
    out = {}
    async with AsyncClient(cluster.master_addresses, rpc_timeout=2) as client:
        probe = 0
        while "first_put_s" not in out:
            try:
                await client.put(f"scale-probe/{probe}", b"x")
                out["first_put_s"] = round(time.perf_counter() - killed, 3)
            except Exception:  # noqa: BLE001 - not served yet: try again until the deadline
                probe += 1
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"no put served {args.deadline}s after the leader's kill")
                await asyncio.sleep(0.02)
        while "all_keys_back_s" not in out:
            try:
                stats = await client.stats()
                if stats.objects >= args.objects:
                    out["all_keys_back_s"] = round(time.perf_counter() - killed, 3)
                    break
            except Exception:  # noqa: BLE001 - mid-takeover: ask again
                pass
            if time.perf_counter() > deadline:
                raise TimeoutError(f"keys not all back {args.deadline}s after the leader's kill")
            await asyncio.sleep(0.02)
        out["lost"] = await missing_keys(client, args.objects)
        step = max(1, args.objects // 1000)
        sample = list(range(0, args.objects, step))
        got = await client.batch_get([key_of(i) for i in sample])
        out["sample_wrong"] = sum(1 for i, data in zip(sample, got) if data != value_of(i, args.value_bytes))
    return out


async def run(args) -> dict:
    per_node = int(args.objects * args.value_bytes * 1.5 / args.nodes) + (64 << 20)
    with LocalCluster(nodes=args.nodes, masters=2, dram_per_node=str(per_node), data_dir=args.data_dir,
                      master_args=["--election-ttl", str(args.election_ttl)]) as cluster:
        leader = next(m for m in cluster.masters if m.info["address"] == cluster.leader_address())
        rss_before = rss_bytes(leader.proc.pid)
        etcd_before = etcd_status(cluster.etcd_endpoint)
        async with AsyncClient(cluster.master_addresses) as client:
            seconds = await put_all(client, args.objects, args.value_bytes, args.batch, args.in_flight)
            objects = (await client.stats()).objects
        rss_after = rss_bytes(leader.proc.pid)
        etcd_after = etcd_status(cluster.etcd_endpoint)
        result = {
            "bench": "scale", "objects": args.objects, "value_bytes": args.value_bytes, "nodes": args.nodes,
            "batch": args.batch, "in_flight": args.in_flight, "objects_counted": objects,
            "put_objects_per_s": round(args.objects / seconds),
            "put_MBps": round(args.objects * args.value_bytes / seconds / 1e6, 1),
            "leader_rss_bytes_per_object": round((rss_after - rss_before) / args.objects, 1),
            "leader_rss_before": format_size(rss_before), "leader_rss_after": format_size(rss_after),
            "etcd_db_bytes_before": etcd_before["db_bytes"], "etcd_db_bytes_after": etcd_after["db_bytes"],
            "etcd_revisions_during_puts": etcd_after["revision"] - etcd_before["revision"],
        }
        print(f"{args.objects} puts in {seconds:.1f}s; killing the leader", file=sys.stderr)
        result.update(await failover(cluster, args, leader))
        return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--value-bytes", type=parse_size, default=1024)
    parser.add_argument("--batch", type=int, default=1000, help="keys per batch_put")
    parser.add_argument("--in-flight", type=int, default=4, help="batches written at once")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--election-ttl", type=float, default=2.0,
                        help="the masters' election lease (s): how soon a standby notices the leader is gone")
    parser.add_argument("--deadline", type=float, default=300.0, help="give up on the failover after this long (s)")
    parser.add_argument("--data-dir", default=None, help="keep the cluster's files (and logs) here")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
