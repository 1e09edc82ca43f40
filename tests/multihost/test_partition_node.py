"""A storage node cut off silently under load (replicas=2), then healed: no call blocks past its deadline, no
acknowledged put is lost, no bytes are wrong, and the node takes writes again within seconds of the heal.

etcd, the master, three storage nodes and a client host each on a host of their own (netns_hosts.py); on the
client host a writer overwrites its keys with increasing versions and a reader checks every value it reads
(register_check.py), with the product's defaults (leases, timeouts). Stale reads are counted and printed, not
asserted here.
"""

import json
import time

from register_check import read_events, served, summarize
from spread_cluster import SpreadCluster, wait_for_exit

from kvpool.net.netutil import wait_until

# Shorter than benchmarks/partition.py's 15 s, yet long enough that TCP's back-off alone (retries 0.2 s, 0.4 s,
# ... apart) would next retry a connection cut at its start 12 s after the heal: the node serving again soon
# after the heal shows a silent connection is dropped by the clock and reopened.
CUT_S = 13.0
AFTER_S = 6.0  # load after the heal
SIZE = 32 * 1024
KEYS = [f"cut/{i}" for i in range(12)]
DEADLINE_S = 5.0  # a call's deadline (the client's default timeout); a node request's is shorter (3 s), so a put
# needing two of three copies returns without the silent one's, and a get moves on to another replica, within it.
# What a call may take beyond its deadline on two cores shared with other runs:
CALL_MARGIN_S = 3.0
SERVING_AGAIN_S = 5.0  # the bound from the heal to the node taking writes again ...
SERVING_MARGIN_S = 3.0  # ... and what load on two shared cores adds to it


def test_a_silently_cut_node_stalls_no_call_past_its_deadline_and_serves_again_soon_after_the_heal(
        network, tmp_path):
    with SpreadCluster(network, nodes=3, clients=1, dram_per_node="64MiB", data_dir=tmp_path / "cluster") as cluster:
        cluster.wait_for_nodes(3)
        host = cluster.client_hosts[0]
        client = {"masters": cluster.master_address, "cluster": cluster.cluster}
        stop = tmp_path / "stop"
        procs, outs = [], []
        for role, rate in (("writer", 10), ("reader", 20)):
            out = tmp_path / f"{role}.jsonl"
            spec = {"name": role, "role": role, "client": client, "keys": KEYS, "size": SIZE, "replicas": 2,
                    "threads": 2, "rate": rate, "out": str(out), "stop": str(stop), "seconds": 180, "grace": 20}
            procs.append(cluster.run(host, "work", spec, role))
            outs.append(out)
        probe = cluster.probe
        assert probe.call("open", name="p", spec=client) == {}
        version = 0

        def put_on_every_node():
            """A put that must be written on all three nodes (min_replicas=3: the master places it only while
            it lists all three, and it returns only once each has stored it): the answer if it succeeded."""
            nonlocal version
            version += 1
            answer = probe.call("put", client="p", key="cut/probe", version=version, size=SIZE, replicas=3,
                                min_replicas=3)
            return answer if answer.get("ok") else None

        cut_node = cluster.host_of("node-0")
        try:
            wait_until(lambda: all(served(out, "put" if out.name.startswith("writer") else "get") for out in outs),
                       60, interval=0.2, what="the writer and the reader to be served")
            assert put_on_every_node()
            with network.cut(cut_node) as span:
                # A put on all three nodes that needs two: the silent one fails by the write deadline, the
                # put returns (the master told which node failed) and reads back later. Small enough that its
                # WRITE leaves whole: the probe's connection to the cut node is left waiting for an answer.
                partial = probe.call("put", client="p", key="cut/partial", version=1, size=1024, replicas=3,
                                     min_replicas=2)
                cluster.wait_for_nodes(2, timeout=CUT_S + 20)  # its lease expired: the master dropped it
                time.sleep(max(0.0, span.at + CUT_S - time.monotonic()))  # the partition's length: the experiment
            cut, heal = span.at, span.healed
            placed = wait_until(put_on_every_node, 30, interval=0.1, what="a put written on the healed node")
            serving_after = placed["t1"] - heal
            time.sleep(max(0.0, heal + AFTER_S - time.monotonic()))  # the load goes on after the heal
        finally:
            stop.touch()
            killed = wait_for_exit(procs, timeout=60)
        events = read_events(outs)
        assert probe.call("open", name="final", spec=client) == {}
        final = {}
        for key in KEYS:
            got = probe.call("get", client="final", key=key)
            final[key] = got["version"] if got["ok"] else None
        result = summarize(events, final, cut, heal)
        result["serving_again_after_heal_s"] = round(serving_after, 3)
        print(json.dumps(result))

        assert partial["ok"], json.dumps(partial)
        assert partial["t1"] - partial["t0"] <= DEADLINE_S + CALL_MARGIN_S, partial
        got = probe.call("get", client="final", key="cut/partial")
        assert got["ok"] and got["version"] == 1, got
        assert killed == 0, "a worker was still in a call long after the stop"
        cut_puts = [e for e in events if e["op"] == "put" and cut <= e["t0"] < heal]
        assert any(e["ok"] for e in cut_puts), "no put succeeded during the cut"
        assert result["longest_call_s"] <= DEADLINE_S + CALL_MARGIN_S, result
        assert result["acknowledged_puts_lost"] == 0, result
        assert result["wrong_bytes"] == 0, result
        assert all(final[key] for key in KEYS), final  # every key reads back, at a version its checked bytes name
        assert serving_after <= SERVING_AGAIN_S + SERVING_MARGIN_S, result
