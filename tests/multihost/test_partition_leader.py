"""The leading master cut off silently under load, then healed: a standby takes over, the old leader stops
claiming leadership (by its own clock) no later than the new one starts leading, clients made from the master
list and from etcd both put again within seconds of the cut, and no acknowledged put is lost or read missing.

etcd, two masters, three storage nodes and two client hosts each on a host of their own (netns_hosts.py); on
client0 a writer and a reader given the master list, on client1 a writer and a reader that find the leader
through etcd (register_check.py); the product's defaults (5 s election lease, 10 s RPC timeout). Each master's
kvpool_master_leader gauge is watched from its own host, where the cut leader is still reachable.
"""

import json
import time

from register_check import read_events, served, summarize
from spread_cluster import SpreadCluster, wait_for_exit

from kvpool.net.netutil import wait_until

CUT_S = 10.0
AFTER_S = 6.0  # load after the heal
SIZE = 32 * 1024
KEYS = {writer: [f"lead/{writer}/{i}" for i in range(10)] for writer in ("a", "b")}
# The bound from the cut to each client's first put: the 5 s lease runs out, the standby takes over,
# and a client that left the silent leader after its attempt timeout (2 s) finds it.
FIRST_PUT_S = 8.0


def test_a_silently_cut_leader_is_replaced_truthfully_and_clients_find_the_new_one_fast(network, tmp_path):
    with SpreadCluster(network, nodes=3, masters=2, clients=2, metrics=True, dram_per_node="64MiB",
                       data_dir=tmp_path / "cluster") as cluster:
        cluster.wait_for_nodes(3)
        old, new = cluster.masters
        assert cluster.wait_for_leader() == old.info["address"]
        clients = {"masters": {"masters": cluster.master_addresses, "cluster": cluster.cluster},
                   "etcd": {"etcd": cluster.etcd_endpoint, "cluster": cluster.cluster}}
        stop = tmp_path / "stop"
        procs, outs = [], []
        for host, writer, kind in zip(cluster.client_hosts, ("a", "b"), ("masters", "etcd")):
            for role, keys, rate in (("writer", KEYS[writer], 10), ("reader", KEYS["a"] + KEYS["b"], 20)):
                out = tmp_path / f"{role}-{kind}.jsonl"
                spec = {"name": f"{role}-{kind}", "role": role, "client": clients[kind], "keys": keys, "size": SIZE,
                        "replicas": 2, "threads": 2, "rate": rate, "out": str(out), "stop": str(stop),
                        "seconds": 180, "grace": 20}
                procs.append(cluster.run(host, "work", spec, f"{role}-{kind}"))
                outs.append(out)
        watches = {}
        for role, child in (("old", old), ("new", new)):
            watches[role] = tmp_path / f"watch-{role}.jsonl"
            spec = {"url": cluster.metrics_url(child.name), "interval": 0.1, "out": str(watches[role]),
                    "stop": str(stop), "seconds": 180}
            procs.append(cluster.run(cluster.host_of(child.name), "watch", spec, f"watch-{role}"))
        cut_host = cluster.host_of(old.name)
        try:
            wait_until(lambda: all(served(out, "put" if out.name.startswith("writer") else "get") for out in outs)
                       and read_events([watches["old"]]) and read_events([watches["new"]]),
                       60, interval=0.2, what="every writer and reader to be served, and both gauges watched")
            span = network.cut_for(cut_host, CUT_S)
            cut, heal = span.at, span.healed
            time.sleep(AFTER_S)  # the load goes on after the heal
        finally:
            stop.touch()
            killed = wait_for_exit(procs, timeout=60)
        events = read_events(outs)
        probe = cluster.probe
        assert probe.call("open", name="final", spec=clients["masters"]) == {}
        final = {}
        for key in KEYS["a"] + KEYS["b"]:
            got = probe.call("get", client="final", key=key)
            final[key] = got["version"] if got["ok"] else None
        result = summarize(events, final, cut, heal)
        gauges = {role: read_events([path]) for role, path in watches.items()}
        new_leads = next((w["t"] for w in gauges["new"] if w["t"] >= cut and w["leader"] == 1), None)
        old_stops = next((w["t"] for w in gauges["old"] if w["t"] >= cut and w["leader"] == 0), None)
        old_claims = [w["t"] for w in gauges["old"] if w["t"] >= cut and w["leader"] == 1]
        result["leadership"] = {
            "new_leads_after_cut_s": None if new_leads is None else round(new_leads - cut, 3),
            "old_stops_after_cut_s": None if old_stops is None else round(old_stops - cut, 3),
            "old_last_claim_after_cut_s": round(max(old_claims) - cut, 3) if old_claims else None}
        print(json.dumps(result))

        assert killed == 0, "a worker was still in a call long after the stop"
        assert new_leads is not None, result
        assert old_stops is not None and old_stops <= new_leads, result
        assert not old_claims or max(old_claims) < new_leads, result  # and it does not claim again
        firsts = result["first_put_after_cut_s_by_writer"]
        assert set(firsts) == {"writer-masters", "writer-etcd"}, result
        assert all(first is not None and first <= FIRST_PUT_S for first in firsts.values()), result
        assert result["acknowledged_puts_lost"] == 0, result
        assert result["wrong_bytes"] == 0, result
        assert result["missing_reads"] == 0, result
        assert result["stale_reads"] == 0, result
        assert all(final.values()), final  # every key reads back, at a version its checked bytes name
