"""etcd cut off silently for longer than the leases, under load (a register check: writers overwrite keys with
increasing versions, readers check every value's bytes and version), then healed.

Every lease expires in etcd meanwhile (the nodes' and the leader's). What must hold: no acknowledged put is lost,
no read gets wrong bytes or "no such key" for a key whose put had returned (no leader serves from a table the
nodes have not reported to yet), no call outlasts its deadline, and puts are served again soon after the heal
(the nodes register again at once, the leader that takes over waits for them).
"""

import re
import sys
import time
from datetime import datetime
from pathlib import Path

from register_check import summarize
from spread_cluster import SpreadCluster, wait_for_exit

from kvpool.net.netutil import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from partition import final_versions, read_events, served  # noqa: E402

CUT = 15.0         # seconds etcd is cut off: three times the leases (5 s, the product's default)
AFTER = 12.0       # seconds of load after the heal
DEADLINE = 3.0     # the clients' rpc_timeout: every master call's deadline
CALL_MARGIN = 2.0  # a put is two master calls and a node write; a busy shared machine
PUT_AFTER_HEAL = 3.0 + 2.0  # the aim, and a margin for a shared machine under load


def objects_counted_lost(log_dir: Path, since: float, until: float) -> list:
    """The masters' log lines, from wall-clock `since` to `until`, that count objects lost with a node."""
    found = []
    for log in log_dir.glob("master*.log"):
        for line in log.read_text(errors="replace").splitlines():
            lost = re.search(r"(\d+) objects lost their last replica", line)
            if lost and int(lost.group(1)) > 0:
                when = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if since <= when <= until:
                    found.append(line)
    return found


def test_etcd_cut_off_longer_than_the_leases_loses_nothing_and_puts_return_soon_after_the_heal(network, tmp_path):
    with SpreadCluster(network, nodes=3, masters=2, clients=1, dram_per_node="64MiB",
                       data_dir=tmp_path / "cluster") as cluster:
        cluster.wait_for_leader()
        stop = tmp_path / "stop"
        keys = [f"etcdcut/{i}" for i in range(12)]
        client = {"masters": cluster.master_addresses, "cluster": cluster.cluster, "rpc_timeout": DEADLINE}
        outs, procs = [], []
        for role, rate in (("writer", 15.0), ("reader", 30.0)):
            out = tmp_path / f"{role}.jsonl"
            spec = {"name": role, "role": role, "client": client, "keys": keys, "size": 16 * 1024, "replicas": 2,
                    "threads": 2, "rate": rate, "out": str(out), "stop": str(stop), "seconds": 120, "grace": 30}
            procs.append(cluster.run(cluster.client_hosts[0], "work", spec, role))
            outs.append(out)
        try:
            wait_until(lambda: all(served(out, "put" if out.name.startswith("writer") else "get") for out in outs),
                       60, interval=0.2, what="the writer and the reader to be served once")
            etcd = cluster.host_of("etcd")
            cut_wall = time.time()
            span = network.cut_for(etcd, CUT)
            cut, heal = span.at, span.healed
            time.sleep(AFTER)  # load after the heal
        finally:
            stop.touch()
            stopped_wall = time.time()
            killed = wait_for_exit(procs, timeout=60)
        events = read_events(outs)
        figures = summarize(events, final_versions(cluster, keys), cut, heal)
        # No node dropped, its objects counted lost, for etcd's silence alone (the cluster's stop comes later).
        counted_lost = objects_counted_lost(cluster.log_dir, cut_wall, stopped_wall)
    print(figures)
    assert killed == 0, figures
    assert counted_lost == [], counted_lost
    assert figures["acknowledged_puts_lost"] == 0, figures
    assert figures["wrong_bytes"] == 0, figures
    assert figures["missing_reads"] == 0, figures  # no "no such key" for a key whose put had returned
    assert "NoSpaceError" not in figures["errors"], figures  # no put refused by a table without its nodes
    assert figures["longest_call_s"] <= 2 * DEADLINE + CALL_MARGIN, figures
    assert figures["first_put_after_heal_s"] is not None, figures
    assert figures["first_put_after_heal_s"] <= PUT_AFTER_HEAL, figures
    puts_after = [e for e in events if e["op"] == "put" and e["t0"] >= heal + PUT_AFTER_HEAL]
    assert puts_after and all(e["ok"] for e in puts_after), figures  # and stay served
