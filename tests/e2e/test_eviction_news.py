"""How fast evictions reach the master: a node answers a waiting EVICTIONS request as soon as it
drops an object, so lookups stop naming evicted objects long before the next REPORT. Real etcd,
master and storage node processes."""

import json
import os
import socket

from storenode_harness import call, put, read_reply, report, start_node

from kvpool import Client
from kvpool.protocol import wire
from kvpool.errors import Code
from kvpool.net.netutil import wait_until
from kvpool.protocol.wire import Op

KiB = 1024
BLOCK = 256 * KiB


def test_evictions_waits_for_the_next_drop_and_fences_older_terms(etcd, tmp_path):
    node = start_node(etcd, tmp_path, dram="4MiB")
    try:
        assert json.loads(call(node, wire.pack_request(Op.REPORT, 1, b"", arg=7))[4])["evicted"] == []
        with node.connect() as sock:
            sock.sendall(wire.pack_request(Op.EVICTIONS, 1, b"", arg=7))
            sock.settimeout(0.3)
            try:  # nothing dropped yet: no answer
                sock.recv(1)
                raise AssertionError("EVICTIONS answered with nothing to tell")
            except socket.timeout:
                pass
            for i in range(20):  # 5 MiB into 4 MiB: the oldest go
                put(node, f"o{i}".encode(), 1, os.urandom(BLOCK))
            sock.settimeout(10)
            _, req_id, status, _, body = read_reply(sock)
            assert (req_id, status) == (1, Code.OK)
            evicted = json.loads(body)["evicted"]
            assert evicted and evicted[0] == ["o0", 1]
        # A deposed leader's request is refused and takes nothing from the leader.
        put(node, b"more", 1, os.urandom(3 * BLOCK))
        _, _, status, _, _ = call(node, wire.pack_request(Op.EVICTIONS, 1, b"", arg=6))
        assert status == Code.NOT_LEADER
        later = wait_until(lambda: report(node)["evicted"], 10, what="the sweep's evictions in REPORT")
        assert not {tuple(e) for e in later} & {tuple(e) for e in evicted}  # each told once
    finally:
        node.stop()
    assert "Traceback" not in node.log()


def test_lookups_drop_evicted_objects_long_before_the_next_report(own_cluster):
    # REPORTs every 60 s: within this test only EVICTIONS can tell the master.
    cluster = own_cluster(nodes=1, dram_per_node="4MiB", master_args=["--report-interval", "60"])
    keys = [f"news/{i:02d}" for i in range(40)]  # 10 MiB through 4 MiB
    values = {key: os.urandom(BLOCK) for key in keys}
    with Client(cluster.master_address) as c:
        for key in keys:
            c.put(key, values[key])
        fits = 4 * 1024 * KiB // BLOCK

        def agreed():
            present = [k for k, there in zip(keys, c.batch_exists(keys)) if there]
            return len(present) < fits and present
        present = wait_until(agreed, 10, what="the master to learn of the evictions")
        assert present == keys[-len(present):]  # the newest stay
        for key in present:
            assert c.get(key) == values[key]
        gone = keys[0]
        c.put(gone, values[gone])  # no longer "exists": it can be stored again
        assert c.get(gone) == values[gone]
