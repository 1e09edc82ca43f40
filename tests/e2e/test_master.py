"""A real master process against a real etcd, driven over gRPC.

Storage nodes are stood in for by their registration alone (a NodeRecord under a
lease, written here): the master only ever sees nodes through etcd, and no bytes
move in these tests.
"""

import asyncio
import json
import queue
import signal
import subprocess
import sys
import threading
import urllib.request

import aetcd
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool import cluster_layout
from kvpool.cluster_layout import NodeRecord, TierRecord
from kvpool.netutil import free_port, wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc

CAPACITY = 1 << 20
PUT_TIMEOUT = 1.0


class EtcdOps:
    """Blocking access to etcd for the test, on a private event loop."""

    def __init__(self, endpoint: str):
        self._loop = asyncio.new_event_loop()
        host, port = cluster_layout.parse_hostport(endpoint)
        self.client = self._run(self._connect(host, port))

    async def _connect(self, host, port):
        client = aetcd.Client(host=host, port=port)
        await client.connect()
        return client

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def register_node(self, node_id: str, instance: str = "i1", capacity: int = CAPACITY) -> int:
        """What a storage node does on start; returns the lease id."""
        record = NodeRecord(node_id=node_id, instance=instance, host="127.0.0.1", data_port=free_port(),
                            tiers={"dram": TierRecord(capacity=capacity)})

        async def register():
            lease = await self.client.lease(30)  # outlives the test; revoked explicitly
            await self.client.put(cluster_layout.node_key("default", node_id), record.to_json(), lease=lease)
            return lease.id

        return self._run(register())

    def revoke(self, lease_id: int) -> None:
        self._run(self.client.revoke_lease(lease_id))

    def get(self, key: bytes) -> bytes | None:
        result = self._run(self.client.get(key))
        return result.value if result is not None else None

    def close(self) -> None:
        self._run(self.client.close())
        self._loop.close()


class MasterProcess:
    def __init__(self, etcd_endpoint: str, log_path, *extra_args: str):
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.master", "--etcd", etcd_endpoint, "--put-timeout", str(PUT_TIMEOUT),
             "--master-id", "m-test", *extra_args],
            stdout=subprocess.PIPE, stderr=self.log, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=30)
        except queue.Empty:
            line = ""
        assert line.startswith("kvpool-master ready address="), f"no ready line (got {line!r}); see {log_path}"
        self.address = line.split("address=", 1)[1].strip()
        self.channel = grpc.insecure_channel(self.address)
        self.stub = kvpool_pb2_grpc.MasterStub(self.channel)

    def stop(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def etcd_ops(etcd):
    ops = EtcdOps(etcd)
    yield ops
    ops.close()


@pytest.fixture
def master(etcd, tmp_path):
    m = MasterProcess(etcd, tmp_path / "master.log")
    yield m
    m.stop()


@pytest.fixture
def node(master, etcd_ops):
    """One registered node, already known to the master; yields its lease id."""
    lease_id = etcd_ops.register_node("n1")
    wait_until(lambda: len(master.stub.Stats(pb.StatsRequest()).nodes) == 1, 10, what="node n1 in Stats")
    return lease_id


def put(stub, key, size=1000, overwrite=False):
    started = stub.PutStart(pb.PutStartRequest(key=key, size=size, checksum=42, overwrite=overwrite))
    assert started.status == pb.OK, started.message
    ended = stub.PutEnd(pb.PutEndRequest(key=key, generation=started.object.generation))
    assert ended.status == pb.OK, ended.message
    return started.object


def test_registered_node_and_master_record(master, etcd_ops):
    assert master.stub.Stats(pb.StatsRequest()).nodes == []
    etcd_ops.register_node("n1")
    stats = wait_until(lambda: (s := master.stub.Stats(pb.StatsRequest())).nodes and s, 10, what="node in Stats")
    assert stats.master_id == "m-test" and stats.address == master.address
    (n1,) = stats.nodes
    assert n1.node_id == "n1" and list(n1.transports) == ["tcp"]
    assert [(t.tier, t.capacity, t.used) for t in n1.tiers] == [(pb.DRAM, CAPACITY, 0)]
    record = json.loads(etcd_ops.get(cluster_layout.master_key("default")))
    assert record == {"address": master.address, "master_id": "m-test"}


def test_put_lifecycle_and_typed_errors(master, node):
    stub = master.stub
    started = stub.PutStart(pb.PutStartRequest(key="k", size=1000, checksum=42))
    assert started.status == pb.OK
    (replica,) = started.object.replicas
    assert replica.node_id == "n1" and replica.tier == pb.DRAM and replica.length == 1000
    assert stub.GetReplicaList(pb.GetReplicaListRequest(key="k")).status == pb.NOT_FOUND
    assert not stub.Exists(pb.ExistsRequest(key="k")).exists
    again = stub.PutStart(pb.PutStartRequest(key="k", size=10, overwrite=True))
    assert again.status == pb.EXISTS and "in progress" in again.message

    assert stub.PutEnd(pb.PutEndRequest(key="k", generation=started.object.generation)).status == pb.OK
    found = stub.GetReplicaList(pb.GetReplicaListRequest(key="k"))
    assert found.status == pb.OK and found.object == started.object
    assert stub.Exists(pb.ExistsRequest(key="k")).exists
    assert stub.PutStart(pb.PutStartRequest(key="k", size=10)).status == pb.EXISTS
    late = stub.PutEnd(pb.PutEndRequest(key="k", generation=started.object.generation))
    assert late.status == pb.PUT_EXPIRED

    too_large = stub.PutStart(pb.PutStartRequest(key="big", size=CAPACITY + 1))
    assert too_large.status == pb.TOO_LARGE and str(CAPACITY) in too_large.message
    for bad in ("", "x" * 2000):
        reply = stub.PutStart(pb.PutStartRequest(key=bad, size=10))
        assert reply.status == pb.INVALID_KEY and reply.message
        assert stub.GetReplicaList(pb.GetReplicaListRequest(key=bad)).status == pb.INVALID_KEY
    assert stub.RemoveByPrefix(pb.RemoveByPrefixRequest(prefix="")).status == pb.INVALID_ARGUMENT

    # Overwrite: the new version replaces the old one and the old extent is given back.
    newer = put(stub, "k", size=2000, overwrite=True)
    assert newer.generation > started.object.generation
    stats = stub.Stats(pb.StatsRequest())
    assert stats.objects == 1 and stats.bytes == 2000 and stats.nodes[0].tiers[0].used == 2048

    assert stub.Remove(pb.RemoveRequest(key="k")) == pb.RemoveResponse(status=pb.OK, removed=1)
    assert stub.Remove(pb.RemoveRequest(key="k")).status == pb.NOT_FOUND
    assert stub.Stats(pb.StatsRequest()).nodes[0].tiers[0].used == 0
    assert master.proc.poll() is None


def test_batch_rpcs_answer_per_item(master, node):
    stub = master.stub
    started = stub.BatchPutStart(pb.BatchPutStartRequest(items=[
        pb.PutStartRequest(key="b/1", size=100), pb.PutStartRequest(key="", size=100),
        pb.PutStartRequest(key="b/2", size=0), pb.PutStartRequest(key="b/3", size=CAPACITY * 2)]))
    assert [i.status for i in started.items] == [pb.OK, pb.INVALID_KEY, pb.OK, pb.TOO_LARGE]
    assert started.items[2].object.replicas == []  # size 0: nothing to store

    ended = stub.BatchPutEnd(pb.BatchPutEndRequest(items=[
        pb.PutEndRequest(key="b/1", generation=started.items[0].object.generation),
        pb.PutEndRequest(key="b/2", generation=started.items[2].object.generation),
        pb.PutEndRequest(key="b/3", generation=1)]))
    assert [i.status for i in ended.items] == [pb.OK, pb.OK, pb.PUT_EXPIRED]

    got = stub.BatchGetReplicaList(pb.BatchGetReplicaListRequest(keys=["b/1", "b/2", "b/missing", ""]))
    assert [i.status for i in got.items] == [pb.OK, pb.OK, pb.NOT_FOUND, pb.INVALID_KEY]
    assert got.items[0].object.size == 100 and got.items[1].object.size == 0

    exists = stub.BatchExists(pb.BatchExistsRequest(keys=["b/1", "b/missing", "b/2"]))
    assert exists.status == pb.OK and list(exists.exists) == [True, False, True]
    assert stub.BatchExists(pb.BatchExistsRequest(keys=["b/1", ""])).status == pb.INVALID_KEY

    pending = stub.BatchPutStart(pb.BatchPutStartRequest(items=[pb.PutStartRequest(key="b/4", size=10)]))
    revoked = stub.BatchPutRevoke(pb.BatchPutRevokeRequest(items=[
        pb.PutRevokeRequest(key="b/4", generation=pending.items[0].object.generation),
        pb.PutRevokeRequest(key="b/4", generation=pending.items[0].object.generation)]))
    assert [i.status for i in revoked.items] == [pb.OK, pb.PUT_EXPIRED]

    assert stub.RemoveByPrefix(pb.RemoveByPrefixRequest(prefix="b/")).removed == 2
    stats = stub.Stats(pb.StatsRequest())
    assert stats.objects == 0 and stats.pending_puts == 0 and stats.nodes[0].tiers[0].used == 0
    assert stats.hits == 2 and stats.misses == 1


def test_put_never_ended_is_reclaimed(master, node):
    stub = master.stub
    started = stub.PutStart(pb.PutStartRequest(key="stuck", size=4096))
    assert started.status == pb.OK
    assert stub.Stats(pb.StatsRequest()).pending_puts == 1

    def reclaimed():
        s = stub.Stats(pb.StatsRequest())
        return s.reclaimed_puts == 1 and s.pending_puts == 0 and s.nodes[0].tiers[0].used == 0

    wait_until(reclaimed, timeout=PUT_TIMEOUT + 5, what="the abandoned put to be reclaimed")
    late = stub.PutEnd(pb.PutEndRequest(key="stuck", generation=started.object.generation))
    assert late.status == pb.PUT_EXPIRED
    put(stub, "stuck")  # the key is free again


def test_node_lease_revoked_drops_node_and_objects(master, etcd_ops, node):
    stub = master.stub
    for i in range(5):
        put(stub, f"gone/{i}")
    assert stub.GetReplicaList(pb.GetReplicaListRequest(key="gone/0")).status == pb.OK
    etcd_ops.revoke(node)

    def all_gone():
        replies = stub.BatchGetReplicaList(pb.BatchGetReplicaListRequest(keys=[f"gone/{i}" for i in range(5)]))
        return all(r.status == pb.NOT_FOUND for r in replies.items)

    wait_until(all_gone, timeout=5, what="objects of the dropped node to disappear")
    stats = stub.Stats(pb.StatsRequest())
    assert stats.nodes == [] and stats.objects == 0
    reply = stub.PutStart(pb.PutStartRequest(key="after", size=10))
    assert reply.status == pb.NO_SPACE and reply.message == "no storage nodes"


def test_restarted_node_loses_its_objects(master, etcd_ops, node):
    stub = master.stub
    put(stub, "old")
    etcd_ops.register_node("n1", instance="i2")  # same node id, new process
    wait_until(lambda: stub.GetReplicaList(pb.GetReplicaListRequest(key="old")).status == pb.NOT_FOUND, 5,
               what="the restarted node's old object to disappear")
    (n1,) = stub.Stats(pb.StatsRequest()).nodes
    assert n1.tiers[0].used == 0
    put(stub, "new")  # its fresh segment takes new puts


def test_sigterm_exits_cleanly_and_unregisters(master, etcd_ops):
    key = cluster_layout.master_key("default")
    assert etcd_ops.get(key) is not None
    assert master.stop() == 0
    assert etcd_ops.get(key) is None  # lease revoked on the way out, not left to expire


def test_max_object_size_option_and_metrics(etcd, etcd_ops, tmp_path):
    metrics_port = free_port()
    m = MasterProcess(etcd, tmp_path / "master.log", "--max-object-size", "4KiB",
                      "--metrics-port", str(metrics_port))
    try:
        etcd_ops.register_node("n1")
        wait_until(lambda: m.stub.Stats(pb.StatsRequest()).nodes, 10, what="node in Stats")
        assert m.stub.PutStart(pb.PutStartRequest(key="k", size=4097)).status == pb.TOO_LARGE
        put(m.stub, "k", size=4096)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for family in text_string_to_metric_families(resp.read().decode()) for s in family.samples}
        assert samples[("kvpool_master_objects", ())] == 1
        assert samples[("kvpool_master_tier_capacity_bytes", (("node", "n1"), ("tier", "dram")))] == CAPACITY
        assert samples[("kvpool_master_tier_used_bytes", (("node", "n1"), ("tier", "dram")))] == 4096
        assert samples[("kvpool_master_rpcs_total", (("method", "PutStart"),))] == 2
        assert samples[("kvpool_master_rpc_errors_total", (("method", "PutStart"), ("status", "TOO_LARGE")))] == 1
    finally:
        assert m.stop() == 0
