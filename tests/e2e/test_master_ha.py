"""Master high availability: election, NOT_LEADER, leader failover under load, the placement
record surviving a full restart, fencing of a deposed leader, and group commit."""

import asyncio
import threading
import time
import urllib.error
import urllib.request

import aetcd
import grpc
import pytest
from kvpool.client.aio import AsyncClient
from kvpool.master.election import Election
from kvpool.master.objects import ObjectTable
from kvpool.master.placement_record import Fence, PlacementRecord
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc

from kvpool import Client, cluster_layout
from kvpool.errors import KvpoolError, NotLeaderError
from kvpool.etcd_server import EtcdServer
from kvpool.local_cluster import stop_process
from kvpool.netutil import wait_until

FAST_ELECTION = ["--election-ttl", "2"]


def value_of(key: str) -> bytes:
    return (key.encode() * (4096 // len(key) + 1))[:4096]


def stats_of(address: str):
    with grpc.insecure_channel(address) as channel:
        return kvpool_pb2_grpc.MasterStub(channel).Stats(pb.StatsRequest(), timeout=5)


def test_follower_answers_not_leader_naming_the_leader(own_cluster):
    cluster = own_cluster(nodes=1, masters=2, master_args=FAST_ELECTION)
    leader, follower = (m.info["address"] for m in cluster.masters)
    with grpc.insecure_channel(follower) as channel:
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
        with Client(cluster.master_addresses, rpc_timeout=10) as client:
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


def test_deposed_leader_record_writes_are_refused(etcd):
    host, port = cluster_layout.parse_hostport(etcd)

    async def scenario():
        async with aetcd.Client(host=host, port=port) as one, aetcd.Client(host=host, port=port) as two:
            first = Election(one, "fence", "a", "127.0.0.1:1", ttl=2)
            second = Election(two, "fence", "b", "127.0.0.1:2", ttl=2)
            await first.start()
            await second.start()
            assert await first.campaign(give_up_after=0)
            assert not await second.campaign(give_up_after=0)
            assert second.leader_address == "127.0.0.1:1"
            table = ObjectTable()
            record = PlacementRecord(one, "fence", table, Fence(first.key, first.term))
            writer = asyncio.create_task(record.run())
            _commit_size0(table, "before")
            await record.sync()
            # The first leader's lease ends (as when it hangs past its ttl); the second takes over.
            await one.revoke_lease(first._lease.id)
            assert await second.campaign(give_up_after=5)
            assert second.term > first.term
            _commit_size0(table, "after")
            with pytest.raises(NotLeaderError):
                await record.sync()
            assert record.lost.is_set()
            await writer
            prefix = cluster_layout.objects_prefix("fence")
            stored = {kv.key for kv in await two.get_prefix(prefix)}
            assert stored == {prefix + b"before"}
            await second.resign()

    asyncio.run(scenario())


def _commit_size0(table: ObjectTable, key: str) -> None:
    version = table.put_start(key, 0, 0)
    table.put_end(key, version.generation)


def _record_txns(url: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(("kvpool_master_record_txns_total", "kvpool_master_record_txns ")):
                return float(line.split()[-1])
    raise AssertionError("no kvpool_master_record_txns metric")


def test_group_commit_uses_far_fewer_transactions_than_puts(own_cluster):
    cluster = own_cluster(nodes=2, metrics=True)
    url = cluster.metrics_urls["master"]
    count = 200

    async def puts():
        async with AsyncClient(cluster.master_address) as client:
            await asyncio.gather(*(client.put(f"gc-{i}", value_of(f"gc-{i}")) for i in range(count)))
            return await client.batch_get([f"gc-{i}" for i in range(count)])

    before = _record_txns(url)
    values = asyncio.run(puts())
    used = _record_txns(url) - before
    assert values == [value_of(f"gc-{i}") for i in range(count)]
    assert 1 <= used <= count / 4, f"{used} transactions for {count} concurrent puts"


def test_nodes_refuse_writes_placed_by_an_older_term(own_cluster):
    from kvpool.client.tcp import TcpTransport

    from kvpool.checksum import checksum

    cluster = own_cluster(nodes=1)
    address = cluster.nodes[0].info["address"]
    data = memoryview(b"fenced" * 100)

    async def scenario():
        transport = TcpTransport()
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


def test_the_leader_compacts_etcd_history(own_cluster):
    import base64
    import json as jsonlib

    cluster = own_cluster(nodes=1, master_args=["--compact-interval", "0.5"])
    with Client(cluster.master_address) as client:
        for i in range(20):
            client.put(f"compact/{i}", b"x" * 100)  # each PutEnd writes the placement record

    def first_revision_compacted() -> bool:
        body = jsonlib.dumps({"key": base64.b64encode(b"/").decode(), "revision": 2}).encode()
        request = urllib.request.Request(f"http://{cluster.etcd_endpoint}/v3/kv/range", data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5):
                return False  # revision 2 still readable: not compacted yet
        except urllib.error.HTTPError as exc:
            return b"compacted" in exc.read()

    wait_until(first_revision_compacted, timeout=15, what="the leader to compact etcd's history")


def test_kvpool_up_with_two_masters(tmp_path):
    import re
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "up", "--masters", "2", "--nodes", "1",
                             "--dram-per-node", "32MiB", "--data-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvpool ready master="), line + proc.stderr.read()
        leader = re.search(r"master=(\S+)", line).group(1)

        def status_lists_the_follower():  # the leader learns of followers at its next lease refresh
            status = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", leader],
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 0, status.stderr
            assert f"leader {leader}" in status.stdout
            return re.search(r"followers: 127\.0\.0\.1:\d+", status.stdout)

        wait_until(status_lists_the_follower, timeout=20, interval=0.5, what="status to list the follower")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        stop_process(proc, 30)  # SIGTERM first: `kvpool up` then stops its children (own sessions)
