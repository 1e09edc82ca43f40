"""Replay shared-prefix KV traffic with Zipf popularity over more data than DRAM holds.

Each request picks a prompt prefix by Zipf popularity; its KV is a chain of
blocks. The request asks how long a prefix is stored (batch_exists), loads those
blocks (batch_get_into) and stores the blocks it had to compute (batch_put), as
an engine with a prefix cache does. The pool is a real local cluster with a small
DRAM tier and a larger SSD tier, so the hot prefixes stay in DRAM, the warm ones
on SSD, and the cold ones get evicted.

Prints one JSON line: block hit rate overall and by tier (from the nodes' own
counters), then get throughput of blocks that sit in DRAM and of blocks that
sit only on SSD (found through the nodes' INVENTORY, read once each).

    python benchmarks/zipf_prefix.py                       # starts its own cluster
    python benchmarks/zipf_prefix.py --dram 64MiB --ssd 512MiB --data-factor 10
"""

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

from kvpool import Client
from kvpool.security import auth
from kvpool.errors import KeyNotFoundError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2
from kvpool.protocol.units import parse_size


def tier_counters(client) -> dict:
    """Summed hits/misses/bytes per tier over all nodes: {'DRAM': {...}, 'SSD': {...}}."""
    totals = {}
    for node in client.stats().nodes:
        for tier in node.tiers:
            name = kvpool_pb2.Tier.Name(tier.tier)
            row = totals.setdefault(name, {"hits": 0, "misses": 0, "used": 0, "capacity": 0, "evictions": 0,
                                           "demotions": 0, "promotions": 0})
            for field in row:
                row[field] += getattr(tier, field)
    return totals


def replay(client, args, rng) -> dict:
    block = parse_size(args.block)
    dram_total = parse_size(args.dram) * args.nodes
    unique_bytes = dram_total * args.data_factor
    prefixes = max(1, int(unique_bytes // (block * args.blocks_per_prefix)))
    popularity = rng.zipf(args.zipf, size=args.requests) % prefixes  # rank -> prefix id, skewed to low ids
    payload = os.urandom(block)
    buffers = np.empty((args.blocks_per_prefix, block), dtype=np.uint8)
    requested = found = 0
    started = time.perf_counter()
    for prefix in popularity:
        keys = [f"zipf/p{prefix}/b{i}" for i in range(args.blocks_per_prefix)]
        present = client.batch_exists(keys)
        hit = next((i for i, p in enumerate(present) if not p), len(keys))  # longest stored prefix
        if hit:
            sizes = client.batch_get_into(keys[:hit], list(buffers[:hit]))
            hit = next((i for i, s in enumerate(sizes) if s is None), hit)  # evicted since exists()
        requested += len(keys)
        found += hit
        if hit < len(keys):
            client.batch_put(keys[hit:], [payload] * (len(keys) - hit), overwrite=True)
    return {"requests": int(args.requests), "prefixes": prefixes, "unique_MiB": round(unique_bytes / 2**20),
            "blocks_found": found, "block_hit_rate": round(found / requested, 3), "replay_s": round(time.perf_counter() - started, 1)}


def blocks_by_tier(client, secret: str | None) -> dict:
    """{'dram': [...keys], 'ssd': [...keys]} of stored zipf blocks, from every node's INVENTORY;
    an object in both tiers counts as DRAM (that is where it is served from). INVENTORY is a master's
    request: it is asked with the member credential of the cluster secret."""
    from kvpool.net.tcp_link import TcpLink

    async def inventories():
        transport = TcpLink(credential=auth.Credential.for_member(secret) if secret else None)
        try:
            return [await transport.inventory(node.address) for node in client.stats().nodes]
        finally:
            await transport.close()

    found = {"dram": [], "ssd": []}
    for inventory in asyncio.run(inventories()):
        for item in inventory:
            if item.key.startswith("zipf/"):
                found["dram" if item.in_dram else "ssd"].append(item.key)
    return found


def settled_counters(client, before: dict, reads: int, timeout: float = 10.0) -> dict:
    """Tier counters once the nodes' reports include `reads` more hits than `before` (or at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        after = tier_counters(client)
        gained = sum(after[t]["hits"] - before.get(t, {}).get("hits", 0) for t in after)
        if gained >= reads or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def reported_after_now(client, timeout: float) -> None:
    """Wait until the master holds, for every node, a REPORT asked after this call and showing no tier
    above its high watermark (the sweeps that writes set off have made room). A node's `reports` counts
    the REPORTs the master took in from it; the master polls a node one REPORT at a time, so the second
    one taken in after now was asked after now (the first may have been in flight already)."""
    marks = {node.node_id: node.reports for node in client.stats().nodes}

    def settled() -> bool:
        nodes = client.stats().nodes
        return all(node.reports >= marks.get(node.node_id, 0) + 2 and
                   all(tier.watermark != "high" for tier in node.tiers) for node in nodes)

    wait_until(settled, timeout, what="a report of every node asked after the replay, no tier above its high "
                                      "watermark")


def tier_throughput(client, args, keys: list) -> dict:
    """One pass of get_into over `keys` (one read each, so no promotion happens meanwhile)."""
    block = parse_size(args.block)
    buf = np.empty(block, dtype=np.uint8)
    keys = keys[:args.max_blocks]
    before = tier_counters(client)
    moved, lost, started = 0, 0, time.perf_counter()
    for key in keys:
        try:
            moved += client.get_into(key, buf)
        except KeyNotFoundError:  # evicted since the inventory was taken
            lost += 1
    elapsed = time.perf_counter() - started
    after = settled_counters(client, before, len(keys) - lost)
    served = {t: after[t]["hits"] - before.get(t, {}).get("hits", 0) for t in after}
    total = sum(served.values()) or 1
    return {"blocks": len(keys) - lost, "MBps": round(moved / elapsed / 1e6, 1) if moved else 0.0,
            "served_by": {t: round(n / total, 3) for t, n in served.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", help="use a running cluster instead of starting one (its secret in "
                                         "$KVPOOL_TOKEN_FILE or $KVPOOL_TOKEN: the nodes' inventories are read)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--dram", default="48MiB", help="DRAM per node of the cluster this starts")
    parser.add_argument("--ssd", default="256MiB", help="SSD per node of the cluster this starts")
    parser.add_argument("--data-factor", type=float, default=10, help="unique data / total DRAM")
    parser.add_argument("--block", default="256KiB")
    parser.add_argument("--blocks-per-prefix", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent (> 1)")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--max-blocks", type=int, default=400, help="blocks read per throughput phase")
    parser.add_argument("--settle-timeout", type=float, default=60.0,
                        help="seconds to wait after the replay for the nodes' reports to show it")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    cluster = None
    if not args.master:
        cluster = LocalCluster(nodes=args.nodes, dram_per_node=args.dram, ssd_per_node=args.ssd).start()
        args.master = cluster.master_address
    try:
        with Client(args.master) as client:
            report = {"workload": replay(client, args, rng)}
            # The master learns the tiers from the nodes' REPORTs (every --report-interval, 0.5 s by default):
            # read them once a report asked after the replay, with the sweeps it set off done, is in.
            reported_after_now(client, args.settle_timeout)
            report["tiers_after_replay"] = tier_counters(client)
            by_tier = blocks_by_tier(client, cluster.secret if cluster is not None else auth.read_token())
            report["get_from_dram"] = tier_throughput(client, args, by_tier["dram"])
            report["get_from_ssd"] = tier_throughput(client, args, by_tier["ssd"])
            client.remove_prefix("zipf/")
    finally:
        if cluster is not None:
            cluster.stop()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
