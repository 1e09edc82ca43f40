"""No stale version across a storage node's partition: writers overwrite keys (replicas=2) while readers
with warm placement caches read them; one node's host is cut off silently and healed. The cut node still
holds versions overwritten meanwhile (the leader could not FREE them there): no reader may get one.
"""

import sys
import time
from pathlib import Path

from register_check import summarize
from spread_cluster import SpreadCluster, wait_for_exit

from kvpool.net.netutil import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from partition import final_versions, read_events, served  # noqa: E402

CUT_S = 9.0
AFTER_S = 12.0
KEYS = [f"stale/{i}" for i in range(12)]


def test_no_reader_gets_a_version_overwritten_while_a_node_was_cut_off(network, tmp_path):
    with SpreadCluster(network, nodes=3, clients=2, dram_per_node="64MiB", data_dir=tmp_path / "cluster") as cluster:
        client = {"masters": cluster.master_addresses, "cluster": cluster.cluster}
        stop = tmp_path / "stop"
        procs, outs = [], []
        for host, role, rate in ((cluster.client_hosts[0], "writer", 20.0), (cluster.client_hosts[1], "reader", 40.0)):
            out = tmp_path / f"{role}.jsonl"
            spec = {"name": role, "role": role, "client": client, "keys": KEYS, "size": 16 * 1024, "replicas": 2,
                    "threads": 2, "rate": rate, "out": str(out), "stop": str(stop), "seconds": 150, "grace": 30}
            procs.append(cluster.run(host, "work", spec, role))
            outs.append(out)
        try:
            wait_until(lambda: served(outs[0], "put") and served(outs[1], "get"), 60, interval=0.2,
                       what="the writer and the reader to be served once")
            cut_host = cluster.host_of("node-0")
            span = network.cut_for(cut_host, CUT_S)
            cut, heal = span.at, span.healed
            time.sleep(AFTER_S)  # readers keep reading, with their warm caches, after the heal
        finally:
            stop.touch()
            killed = wait_for_exit(procs, timeout=60)
        events = read_events(outs)
        result = summarize(events, final_versions(cluster, KEYS), cut, heal)
        gets_after_heal = [e for e in events if e["op"] == "get" and e["ok"] and e["t0"] > heal]

    assert killed == 0, result
    assert result["puts"] > 50 and len(gets_after_heal) > 50, result  # load went on around the cut and after
    assert result["stale_reads"] == 0, result
    assert result["wrong_bytes"] == 0, result
    assert result["acknowledged_puts_lost"] == 0, result
