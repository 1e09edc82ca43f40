"""Two tenants in one pool: B replays the conversation trace (as trace_replay.py does: lookup, load the leading
run, save the rest, every block checked byte for byte) while A floods the pool with random blocks, 10 times the
pool's size over the replay, interleaved with B's requests.

Three runs on one cluster, each B in a tenant of its own (so each starts cold), A in a fresh one each time:
B alone; B with a reserve covering its working set under A's flood; and B without a reserve under the same flood
(what the reserve saves). A's quota is most of the pool, so A and B together overflow it and the nodes must
choose whom to evict. Reported: B's hit ratio in each run and its ratio to B alone (aim: >= 0.9 with the
reserve), the most bytes A held at any sample (never above its quota), evictions by quota and by pressure, wrong
blocks (0). Prints one JSON line.

    python benchmarks/tenants.py                   # 1000 requests, 4 KiB blocks, 2 nodes of 96 MiB
"""

import argparse
import json
import os
import sys
import threading
import time

from trace_replay import DEFAULT_TRACE, load_trace, replay

from kvpool import Client
from kvpool.errors import KvpoolError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.protocol.units import format_size, parse_size

AIM_HIT_WITH_FLOOD = 0.9  # B's hit ratio under the flood, as a part of B's alone, with a reserve


class Flood:
    """A's puts of random blocks: `total` bytes spread over `steps` calls of step()."""

    def __init__(self, client, block: int, total: int, steps: int):
        self.client = client
        self.block = block
        self.per_step = max(1, -(-total // (block * max(1, steps))))  # rounded up: at least `total` in all
        self.payload = os.urandom(block)
        self.sent = self.refused = 0
        self.count = 0

    def step(self) -> None:
        keys = [f"flood/{self.count + i}" for i in range(self.per_step)]
        self.count += self.per_step
        try:
            self.client.batch_put(keys, [self.payload] * len(keys))
            self.sent += len(keys) * self.block
        except KvpoolError as exc:  # QuotaExceededError or NoSpaceError for some: counted, the flood goes on
            failed = len(getattr(exc, "errors", keys))
            self.refused += failed
            self.sent += (len(keys) - failed) * self.block


class UsageWatch:
    """Samples a tenant's bytes (summed from the nodes' REPORTs) while a run goes; the most it saw."""

    def __init__(self, operator, tenant: str, interval: float = 0.2):
        self.operator, self.tenant, self.interval = operator, tenant, interval
        self.most = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        for usage in self.operator.tenants("usage", self.tenant):
            self.most = max(self.most, usage.dram_bytes + usage.ssd_bytes)
            self.samples += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def figures(operator, tenant: str) -> dict:
    [usage] = operator.tenants("usage", tenant)
    return {"objects": usage.objects, "bytes": usage.dram_bytes + usage.ssd_bytes, "hits": usage.hits,
            "misses": usage.misses, "evicted_quota": usage.evicted_quota, "evicted_pressure": usage.evicted_pressure,
            "refused": usage.refused}


def run(cluster, operator, chains, args, run_name: str, flood: bool, reserve: int) -> dict:
    b_name, a_name = f"b-{run_name}", f"a-{run_name}"
    b_token = cluster.add_tenant(b_name, reserve=reserve) if reserve else cluster.add_tenant(b_name)
    between = watch = None
    result = {}
    with Client(cluster.master_address, token=b_token, transports="tcp") as b:
        if flood:
            a_token = cluster.add_tenant(a_name, quota=args.a_quota)
            with Client(cluster.master_address, token=a_token, transports="tcp") as a:
                flooding = Flood(a, args.flood_block, args.flood_factor * args.pool, len(chains))
                with UsageWatch(operator, a_name) as watch:
                    report = replay(b, chains, args.block_bytes, "trace/", between=flooding.step)
                result["a"] = {"flooded": format_size(flooding.sent), "flooded_bytes": flooding.sent,
                               "puts_refused": flooding.refused, "most_bytes_seen": watch.most,
                               "samples": watch.samples, "quota": args.a_quota,
                               "within_quota": watch.most <= args.a_quota, **figures(operator, a_name)}
        else:
            report = replay(b, chains, args.block_bytes, "trace/", between=between)
    result["b"] = {"hit_ratio": report["hit_ratio"], "wrong_blocks": report["wrong_blocks"],
                   "lost_hits": report["lost_hits"], "failed_saves": report["failed_saves"],
                   "requests_per_s": report["requests_per_s"], "reserve": reserve, **figures(operator, b_name)}
    for name in (b_name, a_name) if flood else (b_name,):
        operator.tenants("delete", name)  # frees its objects: the next run starts from an empty pool
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="JSON lines with hash_ids")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--block-bytes", type=parse_size, default="4KiB", help="B's blocks")
    parser.add_argument("--flood-block", type=parse_size, default="256KiB", help="A's blocks")
    parser.add_argument("--flood-factor", type=int, default=10, help="A puts this many times the pool's size")
    parser.add_argument("--pool", type=parse_size, default="192MiB", help="DRAM of the cluster, split over nodes")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--a-quota", type=parse_size, default=None, help="A's quota (default: 3/4 of the pool)")
    parser.add_argument("--runs", type=int, default=2, help="repeat the three runs this many times")
    args = parser.parse_args()
    chains = load_trace(args.trace, args.requests)
    if not chains:
        parser.error(f"no requests in {args.trace}")
    distinct = len({block for chain in chains for block in chain})
    working_set = distinct * args.block_bytes
    if args.a_quota is None:
        args.a_quota = args.pool * 3 // 4
    if working_set * 1.2 + args.a_quota <= args.pool:
        parser.error("A's quota and B's working set fit in the pool together: nothing would be evicted")
    reserve = int(working_set * 1.2)  # its blocks' bytes, with room for each object's extent rounding
    report = {"settings": {"requests": len(chains), "distinct_blocks": distinct, "block_bytes": args.block_bytes,
                           "working_set": format_size(working_set), "b_reserve": format_size(reserve),
                           "pool": format_size(args.pool), "nodes": args.nodes,
                           "a_quota": format_size(args.a_quota), "flood": f"{args.flood_factor}x the pool",
                           "flood_block": format_size(args.flood_block)},
               "runs": []}
    with LocalCluster(nodes=args.nodes, dram_per_node=str(args.pool // args.nodes)) as cluster, \
            Client(cluster.master_address, token=cluster.secret) as operator:
        for n in range(args.runs):
            started = time.perf_counter()
            alone = run(cluster, operator, chains, args, f"{n}-alone", flood=False, reserve=reserve)
            reserved = run(cluster, operator, chains, args, f"{n}-reserved", flood=True, reserve=reserve)
            unreserved = run(cluster, operator, chains, args, f"{n}-unreserved", flood=True, reserve=0)
            base = alone["b"]["hit_ratio"]
            report["runs"].append({
                "alone": alone, "flood_with_reserve": reserved, "flood_without_reserve": unreserved,
                "b_hit_vs_alone_with_reserve": round(reserved["b"]["hit_ratio"] / base, 3) if base else None,
                "b_hit_vs_alone_without_reserve": round(unreserved["b"]["hit_ratio"] / base, 3) if base else None,
                "seconds": round(time.perf_counter() - started, 1)})
    runs = report["runs"]
    report["ok"] = all(
        r["b_hit_vs_alone_with_reserve"] is not None and r["b_hit_vs_alone_with_reserve"] >= AIM_HIT_WITH_FLOOD
        and r["flood_with_reserve"]["a"]["within_quota"] and r["flood_without_reserve"]["a"]["within_quota"]
        and all(r[k]["b"]["wrong_blocks"] == 0 for k in ("alone", "flood_with_reserve", "flood_without_reserve"))
        for r in runs)
    report["aim_b_hit_vs_alone"] = AIM_HIT_WITH_FLOOD
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
