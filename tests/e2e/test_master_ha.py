"""Master high availability: election, NOT_LEADER, leader failover under load and at 100,000
objects (the new leader rebuilds its table from the nodes), a full restart of masters and etcd,
fencing of a deposed leader, and an etcd that puts do not write to."""

import asyncio
import re
import threading
import time
import urllib.request

import grpc
import pytest
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc

from kvpool import Client
from kvpool.errors import KvpoolError, NotLeaderError
from kvpool.cluster.etcd_client import login_of
from kvpool.launch.etcd_server import EtcdServer
from kvpool.launch.local_cluster import stop_process
from kvpool.net.netutil import wait_until
from storenode_harness import master_channel, member_credential

FAST_ELECTION = ["--election-ttl", "2"]


def value_of(key: str) -> bytes:
    return (key.encode() * (4096 // len(key) + 1))[:4096]


def stats_of(address: str):
    with master_channel(address) as channel:
        return kvpool_pb2_grpc.MasterStub(channel).Stats(pb.StatsRequest(), timeout=5)


def test_follower_answers_not_leader_naming_the_leader(own_cluster):
    cluster = own_cluster(nodes=1, masters=2, master_args=FAST_ELECTION)
    leader, follower = (m.info["address"] for m in cluster.masters)
    with master_channel(follower) as channel:
        stub = kvpool_pb2_grpc.MasterStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.PutStart(pb.PutStartRequest(key="k", size=10, checksum=1), timeout=5)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(caught.value.trailing_metadata())["kvpool-leader"] == leader
        stats = stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.leader == leader and list(stats.followers) == [follower] and stats.term > 0
    # The leader learns of a new follower at its next lease refresh (every ttl/3).
    wait_until(lambda: list(stats_of(leader).followers) == [follower], 5, what="the leader to list the follower")
    leading = stats_of(leader)
    assert leading.leader == leader and leading.term == stats.term
    # A client given the follower first follows the leader.
    with Client(f"{follower},{leader}") as client:
        client.put("via-follower", b"abc")
        assert client.get("via-follower") == b"abc"


def test_leader_kill_under_load_loses_no_committed_object(own_cluster):
    cluster = own_cluster(nodes=2, masters=2, master_args=FAST_ELECTION)
    old_leader, follower = cluster.masters
    committed: list[str] = []
    failures: list[Exception] = []
    stop = threading.Event()

    def load():
        with Client(cluster.master_addresses, rpc_timeout=10, timeout=10) as client:
            i = 0
            while not stop.is_set():
                key = f"load-{i}"
                i += 1
                try:
                    client.put(key, value_of(key))
                    committed.append(key)
                except KvpoolError as exc:  # a put cut by the failover may fail; only returned ones count
                    failures.append(exc)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        wait_until(lambda: len(committed) >= 100, 30, what="100 puts before the kill")
        old_leader.kill()
        killed_at = time.monotonic()
        before_kill = len(committed)
        wait_until(lambda: stats_of(follower.info["address"]).leader == follower.info["address"], 5,
                   what="the follower to lead")
        took = time.monotonic() - killed_at
        assert took < 5
        wait_until(lambda: len(committed) >= before_kill + 100, 20, what="puts to go on after the failover")
    finally:
        stop.set()
        loader.join(30)
    assert not loader.is_alive()
    assert stats_of(follower.info["address"]).term > 0
    lost = []
    with Client(follower.info["address"]) as client:
        values = client.batch_get(committed)
    for key, got in zip(committed, values):
        if got != value_of(key):
            lost.append(key)
    assert lost == [], f"{len(lost)} of {len(committed)} committed objects lost (failover took {took:.2f}s)"
    assert len(failures) <= 5  # at most the puts in flight at the kill


def test_full_restart_of_masters_and_etcd_keeps_every_committed_object(own_cluster):
    cluster = own_cluster(nodes=2, masters=2, master_args=FAST_ELECTION)
    keys = [f"keep-{i}" for i in range(300)]
    with Client(cluster.master_addresses) as client:
        client.batch_put(keys[:200], [value_of(k) for k in keys[:200]])
        for key in keys[200:]:
            client.put(key, value_of(key))
        client.remove("keep-7")
    for master in cluster.masters:
        master.stop()
    port = cluster.etcd.client_port
    cluster.etcd.stop()
    cluster.etcd = EtcdServer(cluster.data_dir / "etcd", host=cluster.host, client_port=port,
                              log_path=cluster.log_dir / "etcd-2.log").start()
    for index in range(len(cluster.masters)):
        cluster.restart_master(index)
    cluster.wait_for_nodes(2)
    with Client(cluster.master_addresses) as client:
        values = client.batch_get(keys)
        assert client.stats().objects == len(keys) - 1
    missing = [k for k, v in zip(keys, values) if k != "keep-7" and v != value_of(k)]
    assert missing == []
    assert values[7] is None


def _etcd_revision(endpoint: str) -> int:
    import json as jsonlib

    user, password = login_of(member_credential())
    login = urllib.request.Request(f"http://{endpoint}/v3/auth/authenticate", method="POST",
                                   data=jsonlib.dumps({"name": user, "password": password}).encode())
    with urllib.request.urlopen(login, timeout=5) as reply:
        token = jsonlib.loads(reply.read())["token"]
    body = jsonlib.dumps({"key": "L2t2cG9vbC8="}).encode()  # "/kvpool/": the header carries the store's revision
    request = urllib.request.Request(f"http://{endpoint}/v3/kv/range", data=body, method="POST",
                                     headers={"Authorization": token})
    with urllib.request.urlopen(request, timeout=5) as reply:
        return int(jsonlib.loads(reply.read())["header"]["revision"])


def test_puts_and_removes_write_nothing_to_etcd(own_cluster):
    cluster = own_cluster(nodes=2)
    keys = [f"no-etcd-{i}" for i in range(300)]
    with Client(cluster.master_address) as client:
        client.put("warm-up", b"w")
        before = _etcd_revision(cluster.etcd_endpoint)
        client.batch_put(keys[:200], [value_of(k) for k in keys[:200]])
        for key in keys[200:]:
            client.put(key, value_of(key))
        client.remove_prefix("no-etcd-1")
        after = _etcd_revision(cluster.etcd_endpoint)
        assert client.exists("no-etcd-0") and not client.exists("no-etcd-1")
    assert after == before, f"{after - before} etcd revisions for 300 puts and a remove"


def test_a_hung_leader_serves_nothing_once_its_successor_leads(own_cluster):
    import signal

    cluster = own_cluster(nodes=1, masters=2, master_args=FAST_ELECTION)
    old, new = cluster.masters
    old_address, new_address = old.info["address"], new.info["address"]
    with Client(old_address) as client:
        client.put("before", b"v1")
    old.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: stats_of(new_address).leader == new_address, 15, what="the follower to lead")
        with Client(new_address) as client:
            client.put("before", b"v2", overwrite=True)
            client.put("after", b"new")
    finally:
        old.signal(signal.SIGCONT)
    # Woken up, the old leader knows its lease ran out: it answers NOT_LEADER, it never serves
    # its stale table (where "before" is still v1 and "after" does not exist).
    with master_channel(old_address) as channel:
        stub = kvpool_pb2_grpc.MasterStub(channel)
        for call, request in ((stub.GetReplicaList, pb.GetReplicaListRequest(key="before")),
                              (stub.Exists, pb.ExistsRequest(key="after")),
                              (stub.PutStart, pb.PutStartRequest(key="late", size=10, checksum=1))):
            with pytest.raises(grpc.RpcError) as caught:
                call(request, timeout=5)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with Client(new_address) as client:
        assert client.get("before") == b"v2" and client.get("after") == b"new"
        assert not client.exists("late")


def test_a_hundred_thousand_objects_survive_a_leader_kill(own_cluster):
    cluster = own_cluster(nodes=2, masters=2, dram_per_node="256MiB", master_args=FAST_ELECTION)
    old, new = cluster.masters
    count, batch = 100_000, 2000
    keys = [f"many/{i:06d}" for i in range(count)]

    def value(i: int) -> bytes:
        return i.to_bytes(8, "little") * 128  # 1 KiB, different for every key

    with Client(cluster.master_addresses) as client:
        for start in range(0, count, batch):
            client.batch_put(keys[start:start + batch], [value(i) for i in range(start, start + batch)])
        # Overwritten versions: the new leader must serve the acknowledged one, never the older.
        client.batch_put(keys[:500], [b"second" + value(i) for i in range(500)], overwrite=True)
    old.kill()
    wait_until(lambda: stats_of(new.info["address"]).leader == new.info["address"], 15, what="the follower to lead")
    with Client(new.info["address"], rpc_timeout=30, timeout=30) as client:
        wrong = []
        for start in range(0, count, batch):  # answered once the new leader has rebuilt its table
            got = client.batch_get(keys[start:start + batch])
            for i, data in enumerate(got, start):
                if data != (b"second" if i < 500 else b"") + value(i):
                    wrong.append(keys[i])
        assert client.stats().objects == count
    assert wrong == [], f"{len(wrong)} of {count} objects missing or wrong after the failover"


def test_nodes_refuse_writes_placed_by_an_older_term(own_cluster):
    from kvpool.net.tcp_link import TcpLink

    from kvpool.protocol.checksum import checksum

    cluster = own_cluster(nodes=1)
    address = cluster.nodes[0].info["address"]
    data = memoryview(b"fenced" * 100)

    async def scenario():
        transport = TcpLink(credential=member_credential())  # only a member may speak of terms
        try:
            await transport.report(address, term=10**9)  # a leader of a (very) new term spoke
            with pytest.raises(NotLeaderError):
                await transport.write(address, b"old", 1, data, checksum(data), term=10**9 - 1)
            await transport.write(address, b"new", 2, data, checksum(data), term=10**9)
            await transport.write(address, b"unfenced", 3, data, checksum(data))
        finally:
            await transport.close()

    asyncio.run(scenario())
    # The cluster's own (older-term) leader is now refused too: its puts fail, typed.
    with Client(cluster.master_address) as client, pytest.raises(NotLeaderError):
        client.put("from-old-leader", b"x" * 100)


def test_kvpool_up_with_two_masters(tmp_path):
    import re
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvpool.commands.cli", "up", "--masters", "2", "--nodes", "1",
                             "--dram-per-node", "32MiB", "--data-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvpool ready master="), line + proc.stderr.read()
        leader = re.search(r"master=(\S+)", line).group(1)

        def status_lists_the_follower():  # the leader learns of followers at its next lease refresh
            status = subprocess.run([sys.executable, "-m", "kvpool.commands.cli", "status", "--master", leader],
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 0, status.stderr
            assert f"leader {leader}" in status.stdout
            return re.search(r"followers: 127\.0\.0\.1:\d+", status.stdout)

        wait_until(status_lists_the_follower, timeout=20, interval=0.5, what="status to list the follower")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        stop_process(proc, 30)  # SIGTERM first: `kvpool up` then stops its children (own sessions)


def test_a_standby_takes_over_from_its_copy_of_the_inventories(own_cluster):
    """The standby keeps every node's inventory (master/leadership/inventory_mirror.py); at takeover it reads only
    what changed since, and serves exactly what the nodes hold: overwrites, removes and puts made after its copy."""
    cluster = own_cluster(nodes=2, masters=2, dram_per_node="64MiB", master_args=FAST_ELECTION)
    old, new = cluster.masters
    keys = [f"copy/{i:05d}" for i in range(3000)]
    with Client(cluster.master_addresses) as client:
        for start in range(0, len(keys), 1000):
            client.batch_put(keys[start:start + 1000], [value_of(k) for k in keys[start:start + 1000]])

        def copied() -> bool:  # both nodes read whole since the puts (the first read, at start, held nothing)
            counts = re.findall(r"node (\S+)'s inventory read whole for this standby's copy: (\d+) objects",
                                new.log_path.read_text())
            return {node for node, count in counts if int(count) > 0} == {"node-0", "node-1"}

        wait_until(copied, 20, what="the standby's copy of both nodes' inventories")
        client.batch_put(keys[:200], [b"again" + value_of(k) for k in keys[:200]], overwrite=True)
        for key in keys[200:300]:
            client.remove(key)
        later = [f"later/{i:04d}" for i in range(500)]
        client.batch_put(later, [value_of(k) for k in later])
    old.kill()
    wait_until(lambda: stats_of(new.info["address"]).leader == new.info["address"], 15, what="the follower to lead")
    took_over = new.log_path.read_text()
    assert took_over.count("the standby's copy of its inventory, and") == 2  # both nodes: only what changed
    with Client(new.info["address"], rpc_timeout=30, timeout=30) as client:
        every = keys + later
        got = {}
        for start in range(0, len(every), 1000):
            got.update(zip(every[start:start + 1000], client.batch_get(every[start:start + 1000])))
        assert client.stats().objects == 3000 - 100 + 500
    assert all(got[k] == b"again" + value_of(k) for k in keys[:200])
    assert all(got[k] is None for k in keys[200:300])
    assert all(got[k] == value_of(k) for k in keys[300:] + later)
