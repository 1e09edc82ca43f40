"""Kill parts of a live cluster under load and count what the clients saw.

Starts a local cluster (3 storage nodes, 2 masters), runs client processes doing
mixed puts (replicas=2) and gets of their own committed keys, then:
  1. kills -9 a storage node: counts failed and wrong gets, and times the repair
     back to two copies of everything;
  2. kills -9 the leading master: times until a follower leads, counts failed
     operations meanwhile, and at the end reads back every object whose put had
     returned (a lost one is one that cannot be read back with the right bytes).
Prints one JSON line.

    python benchmarks/chaos.py [--clients 4] [--phase-seconds 6]
"""

import argparse
import hashlib
import json
import multiprocessing
import random
import signal
import sys
import time

from kvpool.launch.local_cluster import LocalCluster


def value_for(key: str) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    size = 1024 + seed[0] * 256
    return (seed * (size // len(seed) + 1))[:size]


def load(masters: str, index: int, stop, marks, served, results) -> None:
    """Client process: put and get until `stop`; failures are tallied per phase mark, and puts served
    are counted in the shared `served` (one slot per phase) as they happen, for the parent to wait on."""
    from kvpool import Client
    from kvpool.errors import KvpoolError

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rng = random.Random(index)
    committed, tally = [], {}
    with Client(masters, rpc_timeout=10, timeout=10) as client:
        n = 0
        while not stop.is_set():
            phase = str(marks.value)
            row = tally.setdefault(phase, {"puts": 0, "put_failed": 0, "gets": 0, "get_failed": 0, "wrong": 0})
            if not committed or rng.random() < 0.3:
                key = f"chaos/{index}/{n}"
                n += 1
                try:
                    client.put(key, value_for(key), replicas=2)
                    committed.append(key)
                    row["puts"] += 1
                    with served.get_lock():
                        served[int(phase)] += 1
                except KvpoolError as exc:
                    row["put_failed"] += 1
                    name = f"put {type(exc).__name__}"
                    row[name] = row.get(name, 0) + 1
            else:
                key = rng.choice(committed)
                row["gets"] += 1
                try:
                    row["wrong"] += client.get(key) != value_for(key)
                except KvpoolError as exc:
                    row["get_failed"] += 1
                    name = f"get {type(exc).__name__}"
                    row[name] = row.get(name, 0) + 1
    results.put((index, committed, tally))


def wait_for(predicate, timeout: float, step: float = 0.05) -> float | None:
    """Seconds until predicate() held, or None if it never did within timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if predicate():
                return time.monotonic() - started
        except Exception:  # a master being replaced answers nothing for a moment
            pass
        time.sleep(step)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--phase-seconds", type=float, default=6.0)
    args = parser.parse_args()
    cluster = LocalCluster(nodes=3, masters=2, dram_per_node="256MiB", lease_ttl=2,
                           master_args=["--election-ttl", "2"]).start()
    report = {}
    try:
        ctx = multiprocessing.get_context("spawn")
        stop, marks, served, results = ctx.Event(), ctx.Value("i", 0), ctx.Array("i", 3), ctx.Queue()
        masters = cluster.master_addresses
        procs = [ctx.Process(target=load, args=(masters, i, stop, marks, served, results))
                 for i in range(args.clients)]
        for p in procs:
            p.start()
        # Phase 0, steady load: the window starts once the clients (spawned, so slow to start) are putting.
        report["clients_up_after_s"] = _round(wait_for(lambda: served[0] >= args.clients, 120))
        time.sleep(args.phase_seconds)

        marks.value = 1
        victim = cluster.nodes[0]
        victim.kill()
        killed_at = time.monotonic()
        dropped = wait_for(lambda: len(cluster.master_stats().nodes) == 2, 30)
        repaired = wait_for(lambda: cluster.master_stats().under_replicated == 0, 60)
        report["node_kill"] = {"dropped_after_s": _round(dropped),
                               "repaired_after_s": _round(None if repaired is None else
                                                          time.monotonic() - killed_at)}
        time.sleep(args.phase_seconds / 2)

        marks.value = 2
        old_leader = cluster.leader_address()
        next(m for m in cluster.masters if m.info["address"] == old_leader).kill()
        leader_killed_at = time.monotonic()
        failover = wait_for(lambda: cluster.leader_address() not in ("", old_leader), 30)
        # The window after the failover starts once the new leader served the clients a put.
        served_again = wait_for(lambda: served[2] > 0, 30)
        report["leader_kill"] = {"new_leader_after_s": _round(failover),
                                 "puts_served_after_s": _round(None if served_again is None else
                                                               time.monotonic() - leader_killed_at)}
        time.sleep(args.phase_seconds)

        stop.set()
        collected = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        phases = {}
        for _, _, tally in collected:
            for phase, row in tally.items():
                total = phases.setdefault({"0": "steady", "1": "after_node_kill", "2": "after_leader_kill"}[phase], {})
                for k, v in row.items():
                    total[k] = total.get(k, 0) + v
        report["phases"] = phases
        from kvpool import Client

        committed = [key for _, keys, _ in collected for key in keys]
        lost = 0
        with Client(cluster.master_addresses) as client:
            for key in committed:
                try:
                    lost += client.get(key) != value_for(key)
                except Exception:
                    lost += 1
        report["committed"] = len(committed)
        report["lost"] = lost
    finally:
        cluster.stop()
    print(json.dumps(report), flush=True)
    return 0


def _round(value):
    return None if value is None else round(value, 2)


if __name__ == "__main__":
    sys.exit(main())
