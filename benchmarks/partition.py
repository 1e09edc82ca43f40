"""Silent partitions between hosts under load: what a writer and a reader see while a storage node, the
leading master or etcd is cut off, and after it heals.

Every component runs on a host of its own (network namespaces joined by a bridge: tests/multihost), two
masters (one standby), three storage nodes, and two client hosts, each with a writer and a reader: the writers
overwrite their keys with increasing versions (replicas=2), the readers read every writer's keys and check each
value's bytes and version (tests/multihost/register_check.py). One client host's clients are given the master
list, the other's find the leader through etcd. Once every writer and reader has been served, one host's port
on the bridge goes down for --cut seconds (packets vanish; nobody is told), then comes up; the load runs
--after seconds more, and a fresh client reads every key back. Product defaults throughout (leases, timeouts):
this measures the code as it is.

Prints ONE JSON line per scenario: longest call, failed calls, acknowledged puts lost, wrong bytes, stale reads
(a version older than one whose put had returned before the read began), time from the cut and from the heal
to the first put that succeeded, and for the leader: when the standby took over and how long the old leader
still claimed leadership (its kvpool_master_leader gauge, watched from its own host) after that.

Needs root (network namespaces).

    python benchmarks/partition.py                    # the three scenarios, 15 s cuts
    python benchmarks/partition.py --scenarios node --cut 5
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "multihost"))

from netns_hosts import Network, unavailable  # noqa: E402
from register_check import read_events, served, summarize  # noqa: E402
from spread_cluster import SpreadCluster, wait_for_exit  # noqa: E402

from kvpool.net.netutil import wait_until  # noqa: E402
from kvpool.protocol.units import parse_size  # noqa: E402

SCENARIOS = {"node": "node-0", "leader": "master", "etcd": "etcd"}  # scenario -> the component cut off



def final_versions(cluster: SpreadCluster, keys: list) -> dict:
    """key -> version a fresh client reads now (None: absent, wrong or unanswered)."""
    agent = cluster.agent(cluster.client_hosts[0])
    versions = dict.fromkeys(keys)
    answer = agent.call("open", name="final", spec={"masters": cluster.master_addresses, "cluster": cluster.cluster})
    if "error" in answer:
        return versions
    for key in keys:
        try:
            got = agent.call("get", deadline=60, client="final", key=key)
        except TimeoutError:  # the agent is stopped with its stuck call: the rest stay unknown
            break
        versions[key] = got.get("version") if got.get("ok") else None
    return versions


def leadership(watch_paths: dict, cut: float, heal: float) -> dict:
    """From the gauges watched on each master's own host: when the standby led, and how long the old leader
    claimed to lead after that."""
    old = read_events([watch_paths["old"]])
    new = read_events([watch_paths["new"]])
    new_start = next((w["t"] for w in new if w["t"] >= cut and w["leader"] == 1), None)
    old_claims = [w["t"] for w in old if w["t"] >= cut and w["leader"] == 1]
    old_stops = next((w["t"] for w in old if w["t"] >= cut and w["leader"] == 0), None)
    return {
        "standby_leads_after_cut_s": round(new_start - cut, 3) if new_start else None,
        "old_leader_claims_after_new_started_s":
            round(max(old_claims) - new_start, 3) if new_start and old_claims and max(old_claims) > new_start
            else 0.0 if new_start else None,
        "old_leader_last_claim_after_heal_s":
            round(max(old_claims) - heal, 3) if old_claims and max(old_claims) > heal else None,
        "old_leader_stopped_claiming_after_cut_s": round(old_stops - cut, 3) if old_stops else None,
    }


def run_scenario(name: str, args, work_dir: Path) -> dict:
    component = SCENARIOS[name]
    with Network() as network, SpreadCluster(network, nodes=3, masters=2, clients=2, metrics=True,
                                             dram_per_node=args.dram, data_dir=work_dir / "cluster") as cluster:
        leader = cluster.wait_for_leader()
        if leader != cluster.master.info["address"]:
            raise RuntimeError(f"master 0 should lead at first, {leader} does")
        stop = work_dir / "stop"
        seconds = args.warmup + args.cut + args.after + 120  # an upper bound only: the stop file ends the work
        keys = {w: [f"reg/{w}/{i}" for i in range(args.keys)] for w in ("a", "b")}
        clients = [{"masters": cluster.master_addresses, "cluster": cluster.cluster},
                   {"etcd": cluster.etcd_endpoint, "cluster": cluster.cluster}]
        procs, outs = [], []
        for index, (host, writer) in enumerate(zip(cluster.client_hosts, ("a", "b"))):
            kind = "masters" if index == 0 else "etcd"
            for role, role_keys, rate in (("writer", keys[writer], args.put_rate),
                                          ("reader", keys["a"] + keys["b"], args.get_rate)):
                out = work_dir / f"{role}-{kind}.jsonl"
                spec = {"name": f"{role}-{kind}", "role": role, "client": clients[index], "keys": role_keys,
                        "size": args.size, "replicas": 2, "threads": 2, "rate": rate, "out": str(out),
                        "stop": str(stop), "seconds": seconds, "grace": 45}
                procs.append(cluster.run(host, "work", spec, f"{role}-{kind}"))
                outs.append(out)
        watches = {}
        if name == "leader":
            for role, child in (("old", cluster.masters[0]), ("new", cluster.masters[1])):
                watches[role] = work_dir / f"watch-{role}.jsonl"
                spec = {"url": cluster.metrics_url(child.name), "interval": 0.1, "out": str(watches[role]),
                        "stop": str(stop), "seconds": seconds}
                procs.append(cluster.run(cluster.host_of(child.name), "watch", spec, f"watch-{role}"))
        try:
            wait_until(lambda: all(served(out, "put" if "writer" in out.name else "get") for out in outs),
                       args.warmup + 60, interval=0.2, what="every writer and reader to be served once")
            target = cluster.host_of(component)
            cut = time.monotonic()
            network.partition(target)
            try:
                time.sleep(args.cut)  # the length of the partition: the experiment, not a wait for anything
            finally:
                network.heal(target)
                heal = time.monotonic()
            time.sleep(args.after)  # the load goes on after the heal for this long
        finally:
            stop.touch()
            killed = wait_for_exit(procs, timeout=90)
        events = read_events(outs)
        final = final_versions(cluster, keys["a"] + keys["b"])
        result = {"scenario": name, "cut": component, "cut_s": args.cut, "after_s": args.after,
                  **summarize(events, final, cut, heal), "workers_killed": killed}
        if watches:
            result["leadership"] = leadership(watches, cut, heal)
        return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="node,leader,etcd", help="comma-separated: node, leader, etcd")
    p.add_argument("--cut", type=float, default=15.0, help="seconds the host stays cut off (default 15)")
    p.add_argument("--after", type=float, default=20.0, help="seconds of load after the heal (default 20)")
    p.add_argument("--warmup", type=float, default=30.0, help="longest wait for the load to be served")
    p.add_argument("--keys", type=int, default=20, help="keys per writer (default 20)")
    p.add_argument("--size", type=parse_size, default="32KiB", help="value size (default 32KiB)")
    p.add_argument("--put-rate", type=float, default=20.0, help="puts/s per writer thread (default 20)")
    p.add_argument("--get-rate", type=float, default=40.0, help="gets/s per reader thread (default 40)")
    p.add_argument("--dram", default="128MiB", help="DRAM per storage node (default 128MiB)")
    p.add_argument("--keep", default=None, help="keep logs and events in this directory")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"partition.py: {why}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    with tempfile.TemporaryDirectory(prefix="kvpool-partition-") as tmp:
        base = Path(args.keep or tmp)
        for name in names:
            work_dir = base / name
            work_dir.mkdir(parents=True, exist_ok=True)
            try:
                result = run_scenario(name, args, work_dir)
            except Exception as exc:  # one scenario's failure is reported, the others still run
                result = {"scenario": name, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
